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
