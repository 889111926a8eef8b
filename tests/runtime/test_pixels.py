"""[Note: input values]: the dtype rule of every reader, per-band normalisation, nodata as a zero
input and an ignored label, and the default loss and scores that leave those labels out."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from nowdl.cli.losses import Scores, make_loss
from nowdl.errors import NowdlError
from nowdl.runtime.data.datasets import CropDataset
from nowdl.runtime.data.pixels import (
    IGNORE_INDEX,
    Normalize,
    check_nodata,
    labels,
    parse_normalize,
    pixels,
    scale,
)


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.int16, np.int32, np.float32, np.float64, np.bool_])
def test_one_dtype_rule(dtype: type) -> None:
    arr = (np.arange(24).reshape(2, 3, 4) % 2).astype(dtype) if dtype is np.bool_ else np.arange(24, dtype=dtype).reshape(2, 3, 4)
    top = 1.0 if np.dtype(dtype).kind in "fb" else float(np.iinfo(dtype).max)
    x = scale(arr)
    assert x.dtype == torch.float32
    np.testing.assert_allclose(x.numpy(), arr.astype(np.float64) / top, rtol=1e-6)


def test_normalize_parse_apply_and_refusals() -> None:
    norm = parse_normalize("mean=0.5,0.25,std=2,4")
    assert isinstance(norm, Normalize) and norm.mean == (0.5, 0.25) and norm.std == (2.0, 4.0)
    assert parse_normalize(norm.text()) == norm and parse_normalize("auto") == "auto" and parse_normalize(None) is None
    x = pixels(np.full((2, 2, 2), 255, np.uint8), normalize=norm)
    np.testing.assert_allclose(x[:, 0, 0].numpy(), [(1 - 0.5) / 2, (1 - 0.25) / 4])
    for bad, words in (("mean=1,2", "write --normalize"), ("mean=1,x,std=1,1", "must be numbers"),
                       ("mean=1,2,std=1", r"2 mean\(s\) but 1 std"), ("mean=1,std=0", "positive")):
        with pytest.raises(NowdlError, match=words):
            parse_normalize(bad)
    with pytest.raises(NowdlError, match="gives 2 value.*has 3 band"):
        norm.check(3, "x")


def test_nodata_is_zero_input_and_ignored_label() -> None:
    arr = np.full((2, 3, 3), 7, np.uint16)
    arr[0, 0, 0] = 9  # the nodata value in one band makes the pixel nodata
    arr = arr.astype(np.float32)
    arr[1, 2, 2] = np.nan
    x = pixels(arr, nodata=9.0, normalize=Normalize((1.0, 1.0), (2.0, 2.0)))
    assert float(x[:, 0, 0].abs().sum()) == 0 and float(x[:, 2, 2].abs().sum()) == 0
    assert math.isclose(float(x[0, 1, 1]), 3.0) and bool(torch.isfinite(x).all())
    bad = np.zeros((3, 3), bool)
    bad[0, 0] = True
    y = labels(np.array([[1, 2, 5], [1, 1, 1], [0, 0, 0]], np.uint8), mask_nodata=5, image_bad=bad)
    assert y[0, 0] == IGNORE_INDEX and y[0, 2] == IGNORE_INDEX and y[0, 1] == 2


def test_nodata_outside_the_dtype_is_refused() -> None:
    check_nodata(0.0, np.uint8, "a.tif")
    check_nodata(float("nan"), np.float32, "a.tif")
    for value, dtype in ((-9999.0, np.uint8), (0.5, np.int16), (float("nan"), np.uint16), (1e39, np.float32)):
        with pytest.raises(NowdlError, match="a.tif declares nodata .*gdal_edit.py"):
            check_nodata(value, dtype, "a.tif")


class _Arr:
    def __init__(self, a: np.ndarray, nodata: float | None = None) -> None:
        self.a, self.shape, self.dtype, self.nodata = a, a.shape, a.dtype, nodata

    def __getitem__(self, idx: object) -> np.ndarray:
        return self.a[idx]  # type: ignore[index]


def test_auto_stats_leave_nodata_out_and_crops_use_them() -> None:
    from nowdl.runtime.data.readers import ImageArray

    rng = np.random.default_rng(0)
    a = rng.integers(1, 1000, (2, 16, 16)).astype(np.uint16)
    a[:, :4] = 0
    image = ImageArray(lambda: _Arr(a, nodata=0.0), "img", "cf")
    mask = ImageArray(lambda: _Arr(np.ones((16, 16), np.uint8)), "mask", "none")
    ds = CropDataset([image], [mask], (2, 16, 16), seed=0)
    norm = ds.band_stats()
    valid = a[:, 4:].reshape(2, -1).astype(np.float64) / 65535
    np.testing.assert_allclose(norm.mean, valid.mean(1), rtol=1e-6)  # of the float32 inputs
    np.testing.assert_allclose(norm.std, valid.std(1), rtol=1e-6)
    ds.normalize = norm
    x, y = ds[0]
    assert float(x[:, 4:].mean()) == pytest.approx(0, abs=1e-6) and float(x[:, :4].abs().max()) == 0
    assert bool((y[:4] == IGNORE_INDEX).all()) and bool((y[4:] == 1).all())
    with pytest.raises(NowdlError, match="gives 1 value"):
        CropDataset([image], None, (2, 16, 16), normalize=Normalize((0.0,), (1.0,)))


def test_default_loss_and_scores_leave_ignored_labels_out() -> None:
    loss = make_loss(None, None)
    out = torch.randn(1, 3, 4, 4, requires_grad=True)
    y = torch.randint(0, 3, (1, 4, 4))
    y[0, 0] = IGNORE_INDEX
    torch.testing.assert_close(loss(out, y), torch.nn.functional.cross_entropy(out, y))
    none = torch.full((1, 4, 4), IGNORE_INDEX)
    zero = loss(out, none)
    zero.backward()
    assert float(zero.detach()) == 0 and out.grad is not None and float(out.grad.abs().sum()) == 0
    s = Scores()
    s.add(out.detach(), y)
    assert s.total == 12


def test_outputs_of_nodata_inputs_are_masked_at_the_output_scale() -> None:
    from nowdl.runtime.data.readers import ImageArray
    from nowdl.runtime.predict.georef import NodataMask

    a = np.ones((1, 6, 6), np.uint8)
    a[0, :4, :2] = 0  # output pixels (0, 0) and (1, 0) of a 2x smaller output: all their inputs nodata
    a[0, 4, 2] = 0  # output pixel (2, 1): one of its four inputs only
    mask = NodataMask(ImageArray(lambda: _Arr(a, nodata=0.0), "img", "cf"), (2, 2), 255.0)
    got = mask([(0, 3), (0, 3)], np.zeros((1, 3, 3), np.float32))
    assert got[0, :2, 0].tolist() == [255, 255] and float(got.sum()) == 2 * 255
    tail = mask([(1, 3), (0, 2)], np.zeros((1, 2, 2), np.float32))  # a share away from the origin
    assert tail[0, :, 0].tolist() == [255, 0] and float(tail.sum()) == 255
