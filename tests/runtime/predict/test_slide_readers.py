"""The openslide: and nifti: readers (predict's and nowdl run's)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers.predict_models import write_slide

from nowdl.errors import NowdlError
from nowdl.runtime.data.readers import is_reader_spec, open_images

pytest.importorskip("openslide")
nibabel = pytest.importorskip("nibabel")


def test_openslide_reads_a_generated_pyramidal_tiff(tmp_path: Path) -> None:
    img = np.random.default_rng(0).integers(0, 255, (192, 256, 3), dtype=np.uint8)
    write_slide(tmp_path / "slide.tif", img)
    [level0] = open_images(f"openslide:{tmp_path / 'slide.tif'}", 3, 2)
    assert level0.shape == (3, 192, 256)
    np.testing.assert_array_equal(level0.read([(10, 74), (100, 164)]), img[10:74, 100:164].transpose(2, 0, 1))
    [level1] = open_images(f"openslide:{tmp_path}:level=1", 3, 2)
    assert level1.shape == (3, 96, 128)
    np.testing.assert_array_equal(level1.read([(0, 96), (0, 128)]), img[::2, ::2].transpose(2, 0, 1))
    with pytest.raises(NowdlError, match=r"has 2 level\(s\) \(0..1\) but .* asks for level 5"):
        open_images(f"openslide:{tmp_path / 'slide.tif'}:level=5", 3, 2)


def test_openslide_reads_an_aperio_svs(tmp_path: Path) -> None:
    """An Aperio .svs (what the scanners write: tiled TIFF pages, the level sizes in the description)
    goes through OpenSlide's Aperio driver, not the generic TIFF one."""
    import openslide
    import tifffile

    img = np.random.default_rng(1).integers(0, 255, (320, 256, 3), dtype=np.uint8)
    path = tmp_path / "slide.svs"
    with tifffile.TiffWriter(path) as t:
        for level, down in enumerate((1, 4)):
            lvl = np.ascontiguousarray(img[::down, ::down])
            desc = (f"Aperio Image Library v12.0.15\r\n{img.shape[1]}x{img.shape[0]} [0,0 {lvl.shape[1]}x{lvl.shape[0]}]"
                    " (128x128) RAW|AppMag = 20|MPP = 0.5" if level == 0 else
                    f"Aperio Image Library v12.0.15\r\n{img.shape[1]}x{img.shape[0]} -> {lvl.shape[1]}x{lvl.shape[0]}")
            t.write(lvl, tile=(128, 128), photometric="rgb", description=desc, metadata=None)
    with openslide.OpenSlide(str(path)) as s:
        assert s.properties["openslide.vendor"] == "aperio"
    [level0] = open_images(f"openslide:{path}", 3, 2)
    assert level0.shape == (3, 320, 256)
    np.testing.assert_array_equal(level0.read([(33, 290), (7, 250)]), img[33:290, 7:250].transpose(2, 0, 1))
    [level1] = open_images(f"openslide:{path}:level=1", 3, 2)
    assert level1.shape == (3, 80, 64)
    np.testing.assert_array_equal(level1.read([(0, 80), (0, 64)]), img[::4, ::4].transpose(2, 0, 1))


def test_openslide_refuses_what_it_cannot_read(tmp_path: Path) -> None:
    (tmp_path / "x.svs").write_bytes(b"not a slide")
    with pytest.raises(NowdlError, match="cannot open .*x.svs with OpenSlide"):
        open_images(f"openslide:{tmp_path / 'x.svs'}", 3, 2)
    with pytest.raises(NowdlError, match="does not exist"):
        open_images(f"openslide:{tmp_path / 'missing.svs'}", 3, 2)


def test_nifti_volumes_and_masks(tmp_path: Path) -> None:
    vols = [np.random.default_rng(i).random((20, 16, 12)).astype(np.float32) for i in range(2)]
    for i, v in enumerate(vols):
        nibabel.save(nibabel.Nifti1Image(v, np.eye(4)), str(tmp_path / f"v{i}.nii.gz"))
    (tmp_path / "masks").mkdir()
    nibabel.save(nibabel.Nifti1Image((vols[0] > 0.5).astype(np.uint8), np.eye(4)), str(tmp_path / "masks" / "m.nii"))
    assert is_reader_spec(f"nifti:{tmp_path}")
    images = open_images(f"nifti:{tmp_path}", 1, 3)
    assert [im.shape for im in images] == [(1, 20, 16, 12)] * 2
    np.testing.assert_array_equal(images[1].read([(2, 10), (0, 16), (4, 8)])[0], vols[1][2:10, :, 4:8])
    [mask] = open_images(f"nifti:{tmp_path / 'masks' / 'm.nii'}", 1, 3, label=True)
    np.testing.assert_array_equal(mask.read([(0, 20), (0, 16), (0, 12)])[0], vols[0] > 0.5)
    (tmp_path / "empty").mkdir()
    with pytest.raises(NowdlError, match="holds no .nii/.nii.gz volumes"):
        open_images(f"nifti:{tmp_path / 'empty'}", 1, 3)
