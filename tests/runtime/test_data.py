"""Large-image readers (zarr, TIFF with a pyramid, HDF5), seeded crops, the seeded loader, and their errors."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.image_files import H, W, image, make_files, write_tiff

import nowdl
from nowdl.errors import NowdlError
from nowdl.runtime.data.datasets import check_sample
from nowdl.runtime.data.loader import StepSampler, epoch_order
from nowdl.runtime.data.readers import open_images


@pytest.fixture
def files(tmp_path: Path) -> dict[str, np.ndarray]:
    return make_files(tmp_path)


def test_readers_agree(tmp_path: Path, files: dict[str, np.ndarray]) -> None:
    want = files["img"].transpose(2, 0, 1)
    for spec in (f"tiff:{tmp_path}/img.tif", f"zarr:{tmp_path}/img.zarr:x", f"h5:{tmp_path}/img.h5:x"):
        (im,) = open_images(spec, 3, 2)
        assert im.shape == (3, H, W), spec
        np.testing.assert_array_equal(im.read([(5, 20), (7, 40)]), want[:, 5:20, 7:40])
    (lvl,) = open_images(f"tiff:{tmp_path}/img.tif:level=1", 3, 2)
    assert lvl.shape == (3, H // 2, W // 2)
    np.testing.assert_array_equal(lvl.read([(0, 32), (0, 32)]), want[:, ::2, ::2])
    for spec in (f"tiff:{tmp_path}/mask.tif", f"zarr:{tmp_path}/img.zarr:y", f"h5:{tmp_path}/img.h5:y"):
        (mk,) = open_images(spec, 1, 2, label=True)
        np.testing.assert_array_equal(mk.read([(0, H), (0, W)])[0], files["mask"])


def test_crops_are_seeded_and_counted(tmp_path: Path, files: dict[str, np.ndarray]) -> None:
    ds = nowdl.data.crops(f"tiff:{tmp_path}/img.tif", (3, 16, 16), labels=f"tiff:{tmp_path}/mask.tif", seed=3)
    assert len(ds) == (H * W) // (16 * 16)
    x, y = ds[5]
    im, (a, b) = ds.origin(5)
    assert x.shape == (3, 16, 16) and x.dtype == torch.float32 and y.shape == (16, 16) and y.dtype == torch.long
    torch.testing.assert_close(x, torch.from_numpy(files["img"][a:a + 16, b:b + 16].transpose(2, 0, 1) / 255.0).float())
    assert torch.equal(y, torch.from_numpy(files["mask"][a:a + 16, b:b + 16]).long())
    again = nowdl.data.crops(f"tiff:{tmp_path}/img.tif", (3, 16, 16), seed=3)
    assert torch.equal(again[5][0], x)
    assert ds.counter.pixels[f"{tmp_path}/img.tif"] == 3 * 16 * 16
    whole = nowdl.data.crops(f"zarr:{tmp_path}/img.zarr:x", (3, H, W))  # the crop is the whole image
    assert len(whole) == 1 and whole.origin(0) == (0, (0, 0))


def test_lazy_batch_reads_only_the_window(tmp_path: Path, files: dict[str, np.ndarray]) -> None:
    ds = nowdl.data.crops(f"h5:{tmp_path}/img.h5:x", (3, 32, 32), labels=f"h5:{tmp_path}/img.h5:y")
    x, y = ds.lazy_batch([0, 3])
    assert tuple(x.shape) == (2, 3, 32, 32) and tuple(y.shape) == (2, 32, 32)
    assert not ds.counter.pixels  # nothing read yet
    tile = x.rows(1, 2).read([(0, 32), (16, 32)])
    assert tile.shape == (1, 3, 32, 16)
    assert torch.equal(tile[0], ds[3][0][:, :, 16:])
    assert ds.counter.pixels[f"{tmp_path}/img.h5:x"] == 3 * 32 * 16 + 3 * 32 * 32  # the tile, then ds[3]
    assert torch.equal(y.rows(0, 1).read()[0], ds[0][1])


def test_folder_of_tiffs(tmp_path: Path) -> None:
    (tmp_path / "imgs").mkdir()
    (tmp_path / "masks").mkdir()
    for i in range(3):
        img = image(i)
        write_tiff(tmp_path / "imgs" / f"s{i}.tif", img, pyramid=False)
        write_tiff(tmp_path / "masks" / f"s{i}.tif", (img[..., 1] > 100).astype(np.uint8), pyramid=False)
    ds = nowdl.data.crops(f"tiff:{tmp_path}/imgs", (3, 32, 32), labels=f"tiff:{tmp_path}/masks")
    assert len(ds.images) == 3 and len(ds) == 3 * 4


def test_loader_same_batches_with_workers(tmp_path: Path, files: dict[str, np.ndarray]) -> None:
    ds = nowdl.data.crops(f"zarr:{tmp_path}/img.zarr:x", (3, 16, 16), labels=f"zarr:{tmp_path}/img.zarr:y")
    one = list(nowdl.data.loader(ds, 4, seed=1, workers=0, steps=5))
    two = list(nowdl.data.loader(ds, 4, seed=1, workers=2, steps=5))
    later = list(nowdl.data.loader(ds, 4, seed=1, workers=2, start_step=3, steps=2))  # a resumed stream
    for (x1, y1), (x2, y2) in zip(one, two, strict=True):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(later[0][0], one[3][0]) and torch.equal(later[1][1], one[4][1])
    assert one[0][0].shape == (4, 3, 16, 16) and one[0][1].shape == (4, 16, 16)
    sampler = StepSampler(10, 4, seed=2)  # steps cross epochs: 10 samples, 4 per step
    assert sampler.indices(2) == epoch_order(10, 2, 0)[8:] + epoch_order(10, 2, 1)[:2]


def test_reader_errors(tmp_path: Path, files: dict[str, np.ndarray], monkeypatch: pytest.MonkeyPatch) -> None:
    def err(fn: object, *args: object, **kw: object) -> str:
        with pytest.raises(NowdlError) as e:
            fn(*args, **kw)  # type: ignore[operator]
        return str(e.value)

    assert "nope.tif does not exist" in err(open_images, f"tiff:{tmp_path}/nope.tif", 3, 2)
    (tmp_path / "junk.tif").write_bytes(b"not a tiff at all")
    assert f"cannot read {tmp_path}/junk.tif as a TIFF" in err(open_images, f"tiff:{tmp_path}/junk.tif", 3, 2)
    msg = err(open_images, f"tiff:{tmp_path}/img.tif:level=2", 3, 2)
    assert "img.tif has 2 pyramid level(s)" in msg and "level=0..1" in msg
    assert "has no dataset 'z'" in err(open_images, f"h5:{tmp_path}/img.h5:z", 3, 2)
    assert "has no array 'z'" in err(open_images, f"zarr:{tmp_path}/img.zarr:z", 3, 2)
    assert "zarr group: name its array" in err(open_images, f"zarr:{tmp_path}/img.zarr", 3, 2)
    assert "4 channel(s)" in err(open_images, f"tiff:{tmp_path}/img.tif", 4, 2)
    write_tiff(tmp_path / "small.tif", np.zeros((32, 64), np.uint8), pyramid=False)
    msg = err(nowdl.data.crops, f"tiff:{tmp_path}/img.tif", (3, 16, 16), labels=f"tiff:{tmp_path}/small.tif")
    assert f"the mask {tmp_path}/small.tif is 32x64 but its image {tmp_path}/img.tif is 64x64" in msg
    assert "smaller than the crop" in err(nowdl.data.crops, f"tiff:{tmp_path}/img.tif", (3, 128, 128))
    monkeypatch.setitem(sys.modules, "h5py", None)
    assert "pip install 'nowdl[data]'" in err(open_images, f"h5:{tmp_path}/img.h5:x", 3, 2)


def test_check_sample() -> None:
    ok = (torch.zeros(3, 8, 8), torch.zeros(8, 8, dtype=torch.long))
    check_sample(ok, 0, "ds", (3, 8, 8), (8, 8))
    check_sample((torch.zeros(3, 8, 8), 2), 0, "ds", (3, 8, 8), ())
    for bad, words in [((torch.zeros(3, 8, 9), ok[1]), "x has shape (3, 8, 9)"),
                       (torch.zeros(3, 8, 8), "is a Tensor"),
                       ((np.zeros((3, 8, 8)), ok[1]), "x is a ndarray"),
                       ((ok[0], torch.zeros(8, 8)), "y is a torch.float32 tensor")]:
        with pytest.raises(NowdlError, match="sample 7 of ds") as e:
            check_sample(bad, 7, "ds", (3, 8, 8), (8, 8))
        assert words in str(e.value)


def test_read_ahead(tmp_path: Path, files: dict[str, np.ndarray]) -> None:
    """Windows read in step 0 are read ahead for the next steps: same tensors, same pixels, none past the end."""
    from nowdl.runtime.data.prefetch import TileReadAhead

    ds = nowdl.data.crops(f"tiff:{tmp_path}/img.tif", (3, 32, 32), labels=f"tiff:{tmp_path}/mask.tif")
    ref = nowdl.data.crops(f"tiff:{tmp_path}/img.tif", (3, 32, 32), labels=f"tiff:{tmp_path}/mask.tif")
    sampler = StepSampler(len(ds), 2)
    ahead = TileReadAhead(ds, sampler, stop=3)
    for step in range(3):
        x, y = ahead.batch(step)
        idx = sampler.indices(step)
        for row in range(2):  # as the engine reads: a micro-batch's tile, then its mask
            tile = x.rows(row, row + 1).read([(0, 32), (16, 32)])
            assert torch.equal(tile[0], ref[idx[row]][0][:, :, 16:])
            assert torch.equal(y.rows(row, row + 1).read()[0], ref[idx[row]][1])
        if step == 0:
            assert set(ahead.ahead) == {1}
    ahead.close()
    assert ds.counter.pixels[f"{tmp_path}/img.tif"] == 3 * 2 * 3 * 32 * 16  # nothing read for a 4th step
    assert ds.counter.pixels[f"{tmp_path}/mask.tif"] == 3 * 2 * 32 * 32
    assert ahead.blocked > 0
