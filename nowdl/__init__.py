"""nowdl: train CNNs on images larger than one GPU holds, planned automatically.

Example:
    >>> import nowdl, torch
    >>> cm = nowdl.compile(nowdl.models.unet(), gpus=8, balance="memory")
    >>> print(cm.plan(torch.empty(1, 3, 2048, 2048, device="meta")))
"""

from nowdl import data, models
from nowdl.api import CompiledModel, compile
from nowdl.api import profile_model as profile
from nowdl.errors import InfeasibleError, NowdlError, PlanError, ProfileError, TraceError
from nowdl.partitioner.plan import Plan
from nowdl.runtime.tiles import TiledInput

__version__ = "0.1.0"

__all__ = [
    "compile", "CompiledModel", "Plan", "TiledInput", "profile", "models", "data",
    "NowdlError", "TraceError", "ProfileError", "PlanError", "InfeasibleError", "__version__",
]
