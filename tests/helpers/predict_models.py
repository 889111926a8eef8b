"""Test helper (not a test module): small segmentation nets and a predict worker for the predict tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

__all__ = ["SegNet", "seg_net", "reference", "predict_worker", "train_then_predict_worker", "predict_twice_worker", "write_slide"]


class SegNet(nn.Module):
    """conv -> pool -> conv -> upsample -> concat -> conv: a two-level UNet of 2D or 3D convs."""

    def __init__(self, in_ch: int = 1, classes: int = 3, dims: int = 2, norm: str = "batch") -> None:
        super().__init__()
        conv = {2: nn.Conv2d, 3: nn.Conv3d}[dims]
        bn: Any = {2: nn.BatchNorm2d, 3: nn.BatchNorm3d}[dims] if norm == "batch" else (
            {2: nn.InstanceNorm2d, 3: nn.InstanceNorm3d}[dims])
        self.c1 = conv(in_ch, 8, 3, padding=1)
        self.n1 = bn(8)
        self.pool = {2: nn.MaxPool2d, 3: nn.MaxPool3d}[dims](2)
        self.c2 = conv(8, 8, 3, padding=1)
        self.up = nn.Upsample(scale_factor=2)
        self.c3 = conv(16, classes, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.relu(self.n1(self.c1(x)))
        b = self.up(torch.relu(self.c2(self.pool(a))))
        return self.c3(torch.cat([a, b], dim=1))


def seg_net(seed: int = 0, **kwargs: Any) -> SegNet:
    """A seeded SegNet with non-trivial BatchNorm running statistics, in eval mode."""
    torch.manual_seed(seed)
    net = SegNet(**kwargs)
    if isinstance(net.n1, nn.BatchNorm2d | nn.BatchNorm3d):
        net.n1.running_mean.uniform_(-0.2, 0.2)
        net.n1.running_var.uniform_(0.5, 1.5)
    return net.eval()


def reference(net: nn.Module, image: np.ndarray) -> np.ndarray:
    """The one-process whole-image forward of ``image`` ``(C, *spatial)``: ``(classes, *spatial)``."""
    with torch.no_grad():
        return net.eval()(torch.from_numpy(image.astype(np.float32))[None])[0].numpy()


def predict_worker(rank: int, world: int, source: str, out: str, compile_kwargs: dict[str, Any],
                   predict_kwargs: dict[str, Any], weights: str | None = None, forbid_gather: bool = False) -> str:
    """Compile the seeded SegNet on ``world`` ranks, predict ``source`` into ``out``; rank 0's summary line.
    ``forbid_gather``: gathering a tiled tensor whole raises (each rank must write its own tile)."""
    import nowdl

    if forbid_gather:
        from nowdl.runtime.spatial.tiles import TileGrid

        def no_gather(*_: Any) -> None:
            raise AssertionError("a tiled output was gathered whole")

        TileGrid.gather = no_gather  # type: ignore[method-assign]

    net = seg_net()
    if weights is not None:
        net.load_state_dict(torch.load(weights, weights_only=True))
    cm = nowdl.compile(net, gpus=world, progress=False, **compile_kwargs)
    summary = cm.predict(source, out, **predict_kwargs)
    return summary.line()


def train_then_predict_worker(rank: int, world: int, source: str, out: str, steps: int) -> dict[str, torch.Tensor]:
    """``compile(seg_net(), gpus=world, stages=2)``: each rank trains its own stage, ``steps`` SGD
    steps on batches of 2, then ``cm.predict(source, out)`` in the same process; the trained state
    dict (rank 0's)."""
    import nowdl

    cm = nowdl.compile(seg_net(), gpus=world, stages=2, progress=False, mode="estimate", optimizer="sgd",
                       loss_fn=nn.CrossEntropyLoss())
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(2, 1, 64, 64, generator=g), torch.randint(0, 3, (2, 64, 64), generator=g)
    for _ in range(steps):
        cm.train_step(x, y)
    sd = cm.state_dict()
    cm.predict(source, out)
    return sd


def predict_twice_worker(rank: int, world: int, source: str, out: str, pins: dict[str, Any]) -> bool:
    """Predict ``source`` into ``out/1.zarr``, load other weights into the model in place, predict
    into ``out/2.zarr`` with the same compiled model; whether the second call reused the engine."""
    import nowdl
    from nowdl.runtime.predict import runner

    net = seg_net()
    cm = nowdl.compile(net, gpus=world, progress=False, **pins)
    cm.predict(source, f"{out}/1.zarr")
    engines = [r.engine for r in runner._RUNNERS[cm].values()]
    net.load_state_dict(seg_net(seed=1).state_dict())
    cm.predict(source, f"{out}/2.zarr")
    return [r.engine for r in runner._RUNNERS[cm].values()] == engines


def write_slide(path: Path, img: np.ndarray, tile: int = 64) -> None:
    """``img`` ``(H, W, 3)`` uint8 as a tiled pyramidal TIFF that OpenSlide reads as a generic tiled TIFF."""
    import tifffile

    with tifffile.TiffWriter(path) as w:  # levels in successive pages: OpenSlide's generic TIFF pyramid
        w.write(img, tile=(tile, tile), photometric="rgb", compression="zlib")
        w.write(img[::2, ::2], tile=(tile, tile), photometric="rgb", compression="zlib", subfiletype=1)
