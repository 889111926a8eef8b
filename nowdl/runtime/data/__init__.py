"""The data path: large images read by region, crops, and batches every rank agrees on.

``readers`` opens zarr, TIFF and HDF5 arrays lazily; ``datasets`` makes seeded crops;
``loader`` is a DataLoader whose step ``s`` batch is the same on every rank; ``prefetch``
reads a rank's next tile windows ahead; ``batches`` and ``feed`` are what ``nowdl run`` feeds.
"""

from typing import TYPE_CHECKING

from nowdl.lazy import lazy_exports

if TYPE_CHECKING:
    from nowdl.runtime.data.datasets import CropDataset
    from nowdl.runtime.data.loader import StepSampler
    from nowdl.runtime.data.prefetch import TileReadAhead
    from nowdl.runtime.data.readers import ImageArray, open_images

__all__ = ["ImageArray", "open_images", "CropDataset", "StepSampler", "TileReadAhead"]

__getattr__ = lazy_exports(__name__, {
    "ImageArray": "readers", "open_images": "readers", "CropDataset": "datasets",
    "StepSampler": "loader", "TileReadAhead": "prefetch",
})
