"""--labels and --val-labels: one mask of its image's shape per image, refused in one line otherwise."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from nowdl.errors import NowdlError
from nowdl.runtime.data.datasets import check_masks


def _im(path: str, *spatial: int) -> SimpleNamespace:
    return SimpleNamespace(path=path, spatial=spatial)


def test_masks_must_pair_with_images() -> None:
    images = [_im("a.tif", 32, 32), _im("b.tif", 64, 32)]
    check_masks(images, [_im("ma.tif", 32, 32), _im("mb.tif", 64, 32)], "--labels")
    with pytest.raises(NowdlError, match=r"^--val-labels gives 1 mask\(s\) for 2 image\(s\)"):
        check_masks(images, [_im("ma.tif", 32, 32)], "--val-labels")
    with pytest.raises(NowdlError, match=r"the mask mb.tif is 32x64 but its image b.tif is 64x32"):
        check_masks(images, [_im("ma.tif", 32, 32), _im("mb.tif", 32, 64)], "--labels")
