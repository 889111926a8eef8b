"""Prediction outputs: OME-Zarr metadata and pyramid, pyramidal TIFF, NIfTI affine, atomic replacement."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import numpy as np
import pytest
from helpers.predict_models import reference, seg_net

import nowdl
from nowdl.errors import NowdlError
from nowdl.runtime.predict import writers

zarr = pytest.importorskip("zarr")
tifffile = pytest.importorskip("tifffile")
nibabel = pytest.importorskip("nibabel")


def _source(d: Path, shape: tuple[int, ...] = (1, 320, 288), seed: int = 0) -> tuple[str, np.ndarray]:
    img = np.random.default_rng(seed).random(shape).astype(np.float32)
    zarr.save_array(str(d / "in.zarr"), img)
    return f"zarr:{d / 'in.zarr'}", img


def _cm(**kw: object) -> nowdl.CompiledModel:
    return nowdl.compile(seg_net(**kw), gpus=1, progress=False, cache=False)  # type: ignore[arg-type]


def _left(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name != "in.zarr")


def test_ome_zarr_metadata_and_pyramid(tmp_path: Path) -> None:
    src, img = _source(tmp_path)
    out = tmp_path / "pred.zarr"
    _cm().predict(src, out, output="probabilities")
    meta = json.loads((out / "zarr.json").read_text())
    assert meta["zarr_format"] == 3 and meta["node_type"] == "group"
    ms = meta["attributes"]["ome"]["multiscales"][0]
    assert meta["attributes"]["ome"]["version"] == "0.5"
    assert [a["name"] for a in ms["axes"]] == ["c", "y", "x"]
    assert [a["type"] for a in ms["axes"]] == ["channel", "space", "space"]
    shapes = [zarr.open_array(str(out / ds["path"])).shape for ds in ms["datasets"]]
    assert shapes == [(3, 320, 288), (3, 160, 144)]  # a 2x smaller level until the largest side is <= 256
    assert ms["datasets"][1]["coordinateTransformations"][0]["scale"] == [1.0, 2.0, 2.0]
    level0 = np.asarray(zarr.open_array(str(out / "0"))[:])
    ref = reference(seg_net(), img)
    e = np.exp(ref - ref.max(0))
    np.testing.assert_allclose(level0, e / e.sum(0), atol=1e-5)
    level1 = np.asarray(zarr.open_array(str(out / "1"))[:])
    np.testing.assert_allclose(level1, level0.reshape(3, 160, 2, 144, 2).mean((2, 4)), atol=1e-6)
    assert zarr.open_array(str(out / "0")).chunks == (3, 256, 256)
    assert _left(tmp_path) == ["pred.zarr"]


def test_tiff_pyramid_reads_back(tmp_path: Path) -> None:
    src, img = _source(tmp_path)
    out = tmp_path / "pred.tif"
    _cm().predict(src, out, output="argmax")
    with tifffile.TiffFile(out) as tif:
        levels = tif.series[0].levels
        assert [lv.shape for lv in levels] == [(320, 288), (160, 144)]
        assert tif.pages[0].is_tiled
        got = levels[0].asarray()
    np.testing.assert_array_equal(got, reference(seg_net(), img).argmax(0))
    assert _left(tmp_path) == ["pred.tif"]


def test_nifti_keeps_the_affine(tmp_path: Path) -> None:
    vol = np.random.default_rng(3).random((24, 16, 16)).astype(np.float32)
    affine = np.array([[0.5, 0, 0, -10], [0, 0.8, 0, 5], [0, 0, 2.0, 1], [0, 0, 0, 1]])
    nibabel.save(nibabel.Nifti1Image(vol, affine), str(tmp_path / "vol.nii.gz"))
    out = tmp_path / "seg.nii.gz"
    cm = nowdl.compile(seg_net(dims=3), gpus=1, progress=False, cache=False)
    cm.predict(f"nifti:{tmp_path / 'vol.nii.gz'}", out, output="argmax")
    img = nibabel.load(str(out))
    np.testing.assert_allclose(img.affine, affine)
    assert img.header.get_zooms()[:3] == pytest.approx((0.5, 0.8, 2.0))
    np.testing.assert_array_equal(np.asarray(img.dataobj), reference(seg_net(dims=3), vol[None]).argmax(0))


def test_existing_out_is_refused_then_replaced(tmp_path: Path) -> None:
    src, _ = _source(tmp_path, (1, 32, 32))
    out = tmp_path / "pred.zarr"
    out.mkdir()
    (out / "old").write_text("x")
    with pytest.raises(NowdlError, match="already exists: pass --overwrite"):
        _cm().predict(src, out)
    assert (out / "old").exists()
    _cm().predict(src, out, overwrite=True)
    assert not (out / "old").exists() and (out / "0").is_dir()
    assert _left(tmp_path) == ["pred.zarr"]


@pytest.mark.parametrize("name", ["pred.zarr", "pred.tif", "preds"])
def test_a_full_disk_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    src, _ = _source(tmp_path, (1, 64, 64))

    def full(self: object, bounds: object, values: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writers.LevelStore, "write", full)
    with pytest.raises(NowdlError, match="the disk is full .*ENOSPC.*nothing was written"):
        _cm().predict(src, tmp_path / name, window=(32, 64))
    assert _left(tmp_path) == []


def test_a_full_disk_while_converting_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from nowdl.runtime.predict import export

    src, _ = _source(tmp_path, (1, 32, 32))

    def full(*args: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(export, "write_tiff", full)
    with pytest.raises(NowdlError, match="the disk is full"):
        _cm().predict(src, tmp_path / "pred.tif")
    assert _left(tmp_path) == []


def test_a_folder_gets_one_output_per_image(tmp_path: Path) -> None:
    for i in range(2):
        img = np.random.default_rng(i).integers(0, 255, (48, 64), dtype=np.uint8)
        tifffile.imwrite(tmp_path / f"s{i}.tif", img, tile=(16, 16))
    _cm().predict(f"tiff:{tmp_path}", tmp_path / "preds", format="tif", output="argmax")
    assert sorted(p.name for p in (tmp_path / "preds").iterdir()) == ["s0.tif", "s1.tif"]
    with pytest.raises(NowdlError, match="gives 2 images but --out"):
        _cm().predict(f"tiff:{tmp_path}", tmp_path / "one.zarr")
