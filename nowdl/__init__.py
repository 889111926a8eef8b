"""nowdl: train CNNs on images larger than one GPU holds, planned automatically."""

from nowdl.errors import InfeasibleError, NowdlError, PlanError, TraceError

__version__ = "0.1.0"

__all__ = ["NowdlError", "TraceError", "PlanError", "InfeasibleError", "__version__"]
