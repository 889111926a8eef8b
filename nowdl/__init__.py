"""nowdl: train CNNs on images larger than one GPU holds, planned automatically.

Example:
    >>> import nowdl, torch
    >>> cm = nowdl.compile(nowdl.models.unet(), gpus=8, balance="memory")
    >>> print(cm.plan(torch.empty(1, 3, 2048, 2048, device="meta")))

``import nowdl`` loads the planner's entry points only; the distributed runtime, the data
readers and matplotlib load on first use.
"""

from typing import TYPE_CHECKING

from nowdl import models
from nowdl.errors import (
    InfeasibleError,
    NowdlError,
    OneSampleNormError,
    PlanError,
    ProfileError,
    TileHaloError,
    TraceError,
)
from nowdl.lazy import lazy_exports

if TYPE_CHECKING:
    from nowdl import data
    from nowdl.api import compile
    from nowdl.api import profile_model as profile
    from nowdl.compiled import CompiledModel
    from nowdl.options import PlannerOptions
    from nowdl.plan.plan import Plan
    from nowdl.runtime.spatial.tiles import TiledInput

__version__ = "0.1.0"

__all__ = [
    "compile", "CompiledModel", "PlannerOptions", "Plan", "TiledInput", "profile", "models", "data",
    "NowdlError", "TraceError", "OneSampleNormError", "ProfileError", "PlanError", "InfeasibleError",
    "TileHaloError", "__version__",
]

__getattr__ = lazy_exports(__name__, {
    "compile": "api", "CompiledModel": "compiled", "profile": "api:profile_model", "data": "data",
    "Plan": "plan.plan", "TiledInput": "runtime.spatial.tiles", "PlannerOptions": "options",
})
