"""Prediction on a plan: whole images and volumes larger than the job, streamed in exact windows.

``windows`` finds the network's receptive field and lays out windows whose centres are exact;
``runner`` runs them on the plan's ranks and writes each rank's share; ``writers`` and
``export`` make the OME-Zarr, TIFF and NIfTI outputs; ``agreement`` keeps the ranks in step on
writes (in the background) and errors; ``weights`` loads checkpoints and
state_dicts; ``job`` ties them into ``predict(cm, source, out)``; ``summary`` is its report.
"""

from typing import TYPE_CHECKING

from nowdl.lazy import lazy_exports

if TYPE_CHECKING:
    from nowdl.runtime.predict.job import predict
    from nowdl.runtime.predict.summary import PredictSummary
    from nowdl.runtime.predict.weights import load_weights
    from nowdl.runtime.predict.windows import Reach, Window, layout_windows, network_reach

__all__ = ["predict", "PredictSummary", "load_weights", "Reach", "Window", "layout_windows", "network_reach"]

__getattr__ = lazy_exports(__name__, {
    "predict": "job", "PredictSummary": "summary", "load_weights": "weights", "Reach": "windows",
    "Window": "windows", "layout_windows": "windows", "network_reach": "windows",
})
