"""A corrupt tile in a slide: the reader names the file and the region, and `nowdl run` stops
with that one paragraph (exit 2) without writing a checkpoint."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers.image_files import image, tifffile, write_tiff

from nowdl.cli.commands import main
from nowdl.errors import NowdlError
from nowdl.runtime.data.readers import open_images

UNET = ["run", "unet", "--model-args", '{"depth": 2, "base_width": 4, "out_channels": 2}', "--input", "1x3x32x32"]


def _corrupt_tiff(path: Path, tiles: list[int]) -> None:
    """A zlib-compressed tiled TIFF of ``image()`` whose ``tiles`` (16x16, row-major) hold garbage."""
    tifffile.imwrite(path, image(), tile=(16, 16), photometric="rgb", compression="zlib")
    with tifffile.TiffFile(path) as t:
        page = t.pages[0]
        spans = [(page.dataoffsets[i], page.databytecounts[i]) for i in tiles]
    data = bytearray(path.read_bytes())
    for off, n in spans:
        data[off:off + n] = bytes(range(256)) * (n // 256) + bytes(n % 256)
    path.write_bytes(bytes(data))


def test_reader_names_file_and_region(tmp_path: Path) -> None:
    _corrupt_tiff(tmp_path / "slide.tif", [5])  # row 1, column 1: pixels 16..32 x 16..32
    (im,) = open_images(f"tiff:{tmp_path}/slide.tif", 3, 2)
    assert np.array_equal(im.read([(0, 16), (0, 16)]).transpose(1, 2, 0), image()[:16, :16])  # good tiles read
    with pytest.raises(NowdlError) as e:
        im.read([(10, 30), (12, 40)])
    msg = str(e.value)
    assert msg.startswith("cannot read region [10:30, 12:40] of ") and "slide.tif" in msg and "\n" not in msg, msg
    assert "damaged" in msg


def test_run_stops_without_writing_a_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Step 1 reads good tiles and saves; step 2's crop (seeded) meets the corrupt bottom-right
    tile: the run stops with one paragraph and the checkpoint of step 1 stays the latest."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)
    _corrupt_tiff(tmp_path / "slide.tif", [15])
    write_tiff(tmp_path / "mask.tif", (image()[..., 0] > 127).astype(np.uint8), pyramid=False)
    rc = main([*UNET, "--batch-size", "2", "--steps", "8", "--data", "tiff:slide.tif", "--labels", "tiff:mask.tif",
               "--checkpoint", "ck", "--save-every", "1"])
    cap = capsys.readouterr()
    assert rc == 2, cap.err
    lines = cap.err.strip().splitlines()
    assert len(lines) == 1 and "cannot read region [" in lines[0] and "of slide.tif" in lines[0], cap.err
    assert "(unexpected:" not in cap.err and "saved checkpoint at step 1" in cap.out, cap.out
    assert (tmp_path / "ck" / "latest").read_text().strip() == "step-00000001"
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["latest", "plan.json", "step-00000001"]
