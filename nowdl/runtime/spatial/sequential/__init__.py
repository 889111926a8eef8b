"""Sequential tiles: a spatial stage runs T tiles one after another on each GPU, exactly.

``tiles`` cuts each GPU's region into sub-tiles and their windows ([Note: sequential tiles]);
``step`` is the autograd step that runs them without saved activations and recomputes them in
the backward.
"""

from nowdl.runtime.spatial.sequential.tiles import SequentialTiles, grid_index, sub_grid

__all__ = ["SequentialTiles", "grid_index", "sub_grid"]
