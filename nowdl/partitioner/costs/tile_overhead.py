"""What the spatial runtime spends per tiled op beyond the op itself ([Note: tiled runtime overhead]).

[Note: tiled runtime overhead] A profile times each op untiled (measure mode) or by its FLOPs and
bytes (estimate mode), and a P-part stage charges ``1/P`` of it per tile ([Note: spatial cost]
in costmodel.py). The runtime does more per tiled op (``runtime/spatial``): Python dispatch of
the node to its tiled implementation, the custom autograd Function around it, planning and
posting the halo messages, slicing the border frame and assembling the padded window, and for a
norm the statistics arithmetic around its all-reduce. On a CPU, where the host runs the ops
one after another, that work adds to the step (bench_recompute_planned Table 2, spatial row:
the recomputed forward of a UNet stage on 2 tiles cost about 4x the profile's ``fwd_s / 2``;
one tiled 3x3 conv, norm or pool on a 64x128 tile costs 0.1-0.6 ms of thread CPU time more
than half the untiled op).

It is charged per tiled op (a node whose ``SpatialRule.kind`` is conv, pool, upsample or norm on
a stage of more than one part) as a fixed time per kind, ``tile_op_s[kind]`` in the forward and
``tile_op_bwd_s[kind]`` in the backward, the DeviceSpec fields of the same names, measured on the
machine by running the runtime's tiled ops against the untiled ones on the same ranks
(``benchmarks/bench_recompute_planned.py``'s calibration: the least of the runs, tiled minus
untiled / P, never below 0). Fixed, not per byte: from 32² to 128² tiles of 8 to 32 channels the
extra stayed within the run-to-run spread of the probes. It is added to the node's time, and its forward part to the node's forward time,
so a recomputed spatial stage pays it again ([Note: recompute cost] in levers.py). Elementwise
ops and concatenations run as plain torch calls on the tile (about 10-20 us each here): not
charged. Unset (every built-in spec: nothing was measured on a GPU, where the host's work
overlaps with the kernels it queued), nothing is charged.

[Note: tiled upsampling bytes] A tiled upsampling selects its source rows one spatial dim at a
time (``upsample_tile`` in runtime/spatial/tiled_ops.py, ATen's indices and weights): beside its
output tile, the last dim's input (the output divided by that dim's scale) is live and, for a
(bi/tri)linear mode (the kind with a halo), the second selection of the output's size before it
is added in place. :func:`tile_op_bytes` charges these as the node's workspace on a tile of a
stage of more than one part, where the profile's untiled op (ATen's kernel) holds only its
output; a transposed convolution, also of kind upsample, runs as a convolution and is not
charged. Measured (``AllocTracker``): 2.5 output tiles at the peak of a bilinear tile, 1.5 of
a nearest one, against the 1 the profile sees.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from nowdl.partitioner.spatial.tileable import SpatialRule

__all__ = ["tile_op_seconds", "tile_op_bytes"]


def tile_op_seconds(rule: SpatialRule | None, parts: int, fwd_s: Mapping[str, float] | None,
                    bwd_s: Mapping[str, float] | None, inference: bool = False) -> tuple[float, float]:
    """(seconds added to the node's time, of which forward) for one tile of a ``parts``-part
    stage: ``fwd_s``/``bwd_s`` are the spec's ``tile_op_s``/``tile_op_bwd_s`` by kind; none for
    an untiled node, a one-part stage or a kind the runtime runs as a plain call (absent from
    the maps); no backward share for an inference plan."""
    if parts <= 1 or rule is None or not rule.tileable:
        return 0.0, 0.0
    f = (fwd_s or {}).get(rule.kind, 0.0)
    b = 0.0 if inference else (bwd_s or {}).get(rule.kind, 0.0)
    return f + b, f


def tile_op_bytes(rule: SpatialRule | None, parts: int, target: str, out_bytes: float,
                  in_shape: Sequence[int] | None, out_shape: Sequence[int] | None) -> float:
    """Bytes a tile of a ``parts``-part stage holds beyond the untiled op's workspace, for an
    upsampling (``target``: not a transposed convolution, which runs as a convolution) of
    ``in_shape`` to ``out_shape`` whose whole output is ``out_bytes`` ([Note: tiled upsampling
    bytes]); 0 for every other node."""
    if (parts <= 1 or rule is None or not rule.tileable or rule.kind != "upsample" or "conv" in target.lower()
            or not in_shape or not out_shape):
        return 0.0
    scale = out_shape[-1] / in_shape[-1] if in_shape[-1] else 1.0
    tile = out_bytes / parts
    return tile / max(scale, 1.0) + (tile if any(rule.halo) else 0.0)
