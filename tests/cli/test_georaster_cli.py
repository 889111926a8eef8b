"""geotiff: sources: a prediction that keeps the source's CRS, transform and nodata (a COG and an
OME-Zarr, checked with rasterio), --normalize auto recorded by `nowdl run` and reused by predict,
and the bad inputs (one paragraph, exit 2, nothing written)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.predict_models import reference, seg_net

from nowdl.cli.commands import main

rasterio = pytest.importorskip("rasterio")
zarr = pytest.importorskip("zarr")

from rasterio import Affine  # noqa: E402

MODEL = ["helpers.predict_models:seg_net", "--model-args", '{"in_ch": 3}']
CRS = "EPSG:32633"
GRID = Affine(10.0, 0.0, 500000.0, 0.0, -10.0, 4000000.0)


def write_raster(path: Path, arr: np.ndarray, *, crs: str | None = CRS, nodata: float | None = 0) -> Path:
    with rasterio.open(path, "w", driver="GTiff", width=arr.shape[2], height=arr.shape[1], count=arr.shape[0],
                       dtype=arr.dtype.name, crs=crs, transform=GRID, nodata=nodata, tiled=True, blockxsize=32,
                       blockysize=32) as ds:
        ds.write(arr)
    return path


@pytest.fixture(autouse=True)
def _single(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture()
def scene(tmp_path: Path) -> dict[str, object]:
    """A 3-band uint16 scene of 272 x 264 pixels with a nodata corner, and the SegNet's weights."""
    arr = np.random.default_rng(0).integers(1, 60000, (3, 272, 264), dtype=np.uint16)
    arr[:, :20, :24] = 0
    torch.save(seg_net(in_ch=3).state_dict(), tmp_path / "w.pt")
    return {"dir": tmp_path, "arr": arr, "src": write_raster(tmp_path / "scene.tif", arr), "w": tmp_path / "w.pt"}


def _predict(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    rc = main(["predict", *args])
    return rc, capsys.readouterr().err


def test_prediction_keeps_crs_transform_and_nodata(scene: dict[str, object], capsys: pytest.CaptureFixture[str]) -> None:
    d, arr = Path(str(scene["dir"])), np.asarray(scene["arr"])
    for out in ("pred.tif", "pred.zarr"):
        rc, err = _predict(capsys, *MODEL, "--checkpoint", str(scene["w"]), "--data", f"geotiff:{scene['src']}",
                           "--out", str(d / out))
        assert rc == 0, err
    x = arr.astype(np.float32) / 65535
    bad = (arr == 0).any(axis=0)
    x[:, bad] = 0  # nodata: a zero input
    want = reference(seg_net(in_ch=3), x)
    with rasterio.open(scene["src"]) as src, rasterio.open(d / "pred.tif") as pred:
        assert pred.crs == src.crs and pred.transform == src.transform and pred.shape == src.shape
        assert pred.tags(ns="IMAGE_STRUCTURE")["LAYOUT"] == "COG" and pred.block_shapes[0] == (256, 256)
        assert pred.overviews(1) == [2] and np.isnan(pred.nodata)
        got = pred.read()
        # pixel alignment: the same pixel centre maps to the same place, and its value is the forward's there
        assert pred.xy(137, 201) == src.xy(137, 201)
    assert np.isnan(got[:, bad]).all()
    np.testing.assert_allclose(got[:, ~bad], want[:, ~bad], atol=1e-5)
    group = zarr.open_group(str(d / "pred.zarr"), mode="r")
    assert group.attrs["proj:code"] == CRS and group.attrs["spatial:transform"] == list(GRID)[:6]
    assert [c["name"] for c in group.attrs["zarr_conventions"]] == ["proj", "spatial"]
    assert group["1"].attrs["spatial:transform"] == [20.0, 0.0, 500000.0, 0.0, -20.0, 4000000.0]
    np.testing.assert_array_equal(np.asarray(group["0"][:]), got)


def test_normalize_auto_is_recorded_and_reused(scene: dict[str, object], capsys: pytest.CaptureFixture[str]) -> None:
    d = Path(str(scene["dir"]))
    mask = write_raster(d / "mask.tif", (np.asarray(scene["arr"])[:1] % 3).astype(np.uint8), nodata=None)
    rc = main(["run", *MODEL, "--input", "1x3x64x64", "--batch-size", "2", "--data", f"geotiff:{scene['src']}", "--labels",
               f"geotiff:{mask}", "--normalize", "auto", "--steps", "1", "--workers", "0", "--checkpoint",
               str(d / "ck")])
    text = capsys.readouterr().out
    assert rc == 0, text
    line = next(ln for ln in text.splitlines() if "--normalize mean=" in ln)
    given = line.split("--normalize ")[1].split(" ")[0]
    record = json.loads(next((d / "ck").glob("step-*/nowdl.json")).read_text())
    assert len(record["run"]["normalize"]["mean"]) == 3
    rc = main(["run", *MODEL, "--input", "1x3x64x64", "--batch-size", "2", "--data", f"geotiff:{scene['src']}",
               "--labels", f"geotiff:{mask}", "--steps", "2", "--workers", "0", "--checkpoint", str(d / "ck")])
    err = capsys.readouterr().err  # a resume must normalise as the run did
    assert rc == 2 and "resume with the same --normalize (mean=" in err, err
    outs = {}
    for name, more in (("ck", []), ("given", ["--normalize", given]), ("none", ["--normalize", "mean=0,0,0,std=1,1,1"])):
        rc, err = _predict(capsys, *MODEL, "--checkpoint", str(d / "ck"), "--data", f"geotiff:{scene['src']}",
                           "--out", str(d / f"{name}.zarr"), *more)
        assert rc == 0, err
        outs[name] = np.asarray(zarr.open_array(str(d / f"{name}.zarr" / "0"))[:])
    np.testing.assert_allclose(outs["ck"], outs["given"], atol=1e-4, equal_nan=True)
    assert not np.allclose(outs["ck"], outs["none"], atol=1e-2, equal_nan=True)


def test_bad_rasters_are_refused(scene: dict[str, object], capsys: pytest.CaptureFixture[str]) -> None:
    d, arr = Path(str(scene["dir"])), np.asarray(scene["arr"])
    no_crs = write_raster(d / "nocrs.tif", arr[:, :64, :64], crs=None)
    small = write_raster(d / "small.tif", (arr[:, :64, :64] % 255).astype(np.uint8), nodata=None)
    cases = [
        (f"geotiff:{no_crs}", [], "has no CRS"),
        (f"geotiff:{scene['src']}", ["--model-args", '{"in_ch": 4}'], "has 3 band(s) but the model takes 4"),
        (f"geotiff:{scene['src']}", ["--normalize", "mean=0,0,std=1,1"], "gives 2 value(s) per statistic"),
        (f"geotiff:{small}:nodata=-9999", [], "declares nodata -9999, which its uint8 pixels cannot hold"),
    ]
    for source, more, words in cases:
        out = d / "bad.tif"
        args = [*MODEL, "--checkpoint", str(scene["w"]), "--data", source, "--out", str(out), *more]
        if "in_ch" in " ".join(more):
            args[2] = more[1]
            torch.save(seg_net(in_ch=4).state_dict(), d / "w4.pt")
            args[4] = str(d / "w4.pt")
            args = args[:-2]
        rc, err = _predict(capsys, *args)
        assert rc == 2 and err.startswith("nowdl predict: error: ") and err.count("\n") == 1, err
        assert words in err, err
        assert not out.exists() and not [p for p in d.iterdir() if ".nowdl-" in p.name]
    mask = write_raster(d / "mask.tif", np.zeros((1, 272, 264), np.uint8), nodata=None)
    rc = main(["run", *MODEL, "--input", "1x3x64x64", "--batch-size", "2", "--data", f"geotiff:{scene['src']}", "--labels",
               f"geotiff:{mask}", "--normalize", "mean=1,std=1", "--steps", "1", "--checkpoint",
               str(d / "ck")])
    err = capsys.readouterr().err
    assert rc == 2 and "--normalize gives 1 value(s) per statistic but the data" in err and not (d / "ck").exists()
