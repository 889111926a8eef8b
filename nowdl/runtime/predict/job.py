"""``predict(cm, source, out)``: open the inputs, name the outputs, predict, convert, rename into place.

OUT ending in ``.zarr``, ``.tif``/``.tiff`` or ``.nii.gz``/``.nii`` holds one image's prediction;
any other OUT is a folder that gets one ``<image name>.<format>`` per image. Nothing appears
under OUT until every image is written: the outputs are made under ``.OUT.nowdl-partial`` and
renamed at the end, and a failure (a full disk) removes them (see ``writers``). A ``geotiff:``
source's CRS, transform and nodata go into its output ([Note: georeferenced outputs] in ``georef``):
a ``.tif`` is then a Cloud-Optimized GeoTIFF.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from nowdl.errors import NowdlError
from nowdl.runtime.data.pixels import Normalize, parse_normalize
from nowdl.runtime.data.readers import ImageArray, open_images
from nowdl.runtime.predict.agreement import agree, rank_world, write_error
from nowdl.runtime.predict.runner import Target, discard_targets, predict_images
from nowdl.runtime.predict.summary import PredictSummary
from nowdl.runtime.predict.writers import check_out, discard, output_kind, partial_path, publish

__all__ = ["predict", "FORMATS", "model_input"]

#: --format -> (kind, file suffix)
FORMATS = {"zarr": ("zarr", ".zarr"), "tif": ("tiff", ".tif"), "nii.gz": ("nifti", ".nii.gz")}
_SUFFIX = {"zarr": ".zarr", "tiff": ".tif", "nifti": ".nii.gz"}


def model_input(cm: Any) -> tuple[int, int]:
    """(input channels, spatial dims) of the model: from its plan, else from its first convolution."""
    from torch import nn

    if getattr(cm, "plan_path", None) is not None:
        from nowdl.plan.plan import Plan

        shape = Plan.load(cm.plan_path).model["inputs"][0]
        return int(shape[1]), len(shape) - 2
    for m in cm.model.modules():
        if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            return int(m.in_channels), len(m.kernel_size)
    raise NowdlError(f"cannot tell the input channels of {type(cm.model).__name__} (it has no convolution): predict "
                     "with a plan JSON made for it (nowdl plan MODEL --input 1xCxHxW --out plan.json)")


def _stem(image: ImageArray, taken: set[str]) -> str:
    name = Path(image.path.split(" level ")[0].split(":")[0]).name
    name = re.sub(r"(\.nii\.gz|\.[A-Za-z0-9]+)$", "", name) or "image"
    index = re.search(r"\[(\d+)\]$", image.path)
    name += f"-{index.group(1)}" if index else ""
    base, n = name, 1
    while name in taken:
        n += 1
        name = f"{base}-{n}"
    taken.add(name)
    return name


def _header(spec: str, image: ImageArray) -> tuple[Any, Any]:
    """(affine, spacing) of a NIfTI input, else (None, None)."""
    if not spec.startswith("nifti:"):
        return None, None
    from nowdl.runtime.data.volumes import nifti_header

    return nifti_header(image.path)


def _geo(targets: list[Target], images: Sequence[ImageArray], out: Path) -> list[Target]:
    """``targets`` with their image's GeoRef, and nodata masking where the image declares a value."""
    from nowdl.runtime.predict.georef import check_georef

    for t, im in zip(targets, images, strict=True):
        check_georef(im, str(out))
        t.geo, t.nodata = im.geo, im.nodata is not None
    return targets


def _targets(spec: str, images: Sequence[ImageArray], out: Path, fmt: str | None
             ) -> tuple[list[Target], Path, bool]:
    """One Target per image, the partial path that becomes OUT, and whether OUT is a folder."""
    targets, stage, folder = _named_targets(spec, images, out, fmt)
    return _geo(targets, images, out), stage, folder


def _named_targets(spec: str, images: Sequence[ImageArray], out: Path, fmt: str | None
                   ) -> tuple[list[Target], Path, bool]:
    stage = partial_path(out)
    if str(out).lower().endswith((".zarr", ".tif", ".tiff", ".nii.gz", ".nii")):
        if len(images) != 1:
            raise NowdlError(f"--data gives {len(images)} images but --out {out} names one output: give a folder as "
                             "--out (one output per image there)")
        kind = output_kind(out)
        affine, spacing = _header(spec, images[0])
        if kind == "zarr":
            return [Target(stage, kind, out.name, None, affine, spacing)], stage, False
        suffix = ".nii.gz" if str(out).lower().endswith(".nii.gz") else out.suffix
        file = partial_path(out, suffix)
        return [Target(partial_path(out, ".work.zarr"), kind, out.name, file, affine, spacing)], file, False
    if fmt is not None and fmt not in FORMATS:
        raise NowdlError(f"--format {fmt!r}: use one of {', '.join(FORMATS)}")
    kind, suffix = FORMATS[fmt or "zarr"]
    taken: set[str] = set()
    targets = []
    for im in images:
        name = _stem(im, taken)
        affine, spacing = _header(spec, im)
        if kind == "zarr":
            targets.append(Target(stage / f"{name}.zarr", kind, f"{name}.zarr", None, affine, spacing))
        else:
            targets.append(Target(stage / f".{name}.work.zarr", kind, f"{name}{suffix}", stage / f"{name}{suffix}", affine,
                                  spacing))
    return targets, stage, True


def _convert(targets: Sequence[Target], output: str) -> None:
    from nowdl.runtime.predict.export import write_nifti, write_tiff
    from nowdl.runtime.predict.georef import write_cog
    from nowdl.runtime.predict.writers import LevelStore, pyramid_shapes

    for t in targets:
        if t.file is None:
            continue
        if t.kind == "tiff" and t.grid is not None:
            write_cog(t.work, t.file, t.grid, t.fill, labels=output == "argmax")
        elif t.kind == "tiff":
            write_tiff(t.work, len(pyramid_shapes(LevelStore(t.work, 0).shape[1:])), t.file)
        else:
            write_nifti(t.work, t.file, t.affine, t.spacing)
        discard(t.work)


def predict(cm: Any, source: str | Sequence[ImageArray], out: str | os.PathLike[str], *, output: str = "logits",
            window: Sequence[int] | None = None, overwrite: bool = False, fmt: str | None = None,
            on_window: Callable[[int, int], None] | None = None, timeout_s: float = 300.0,
            backend: str | None = None, measure_memory: bool = True,
            weights: dict[str, torch.Tensor] | None = None, normalize: Normalize | str | None = None
            ) -> PredictSummary:
    """Predict ``source`` (a ``--data`` reader spec, or opened images) into ``out`` (collective);
    ``weights``: the whole model's state to run (default: the model's own); ``normalize``: the
    per-band normalisation the model was trained with (a ``Normalize`` or ``mean=...,std=...``).

    Raises:
        PlanError: ``cm`` was compiled from a plan file that is a training plan (predict runs inference plans).
        NowdlError: a missing source or level, an existing ``out`` without ``overwrite``, an
            output suffix predict does not write, bands that differ from the model's input channels
            or ``normalize``'s, a geotiff: source without a CRS, a failed write (nothing is left under ``out``).
    """
    from nowdl.runtime.launch.group import init_distributed, launch_env

    if launch_env().world_size > 1:
        init_distributed(backend=backend, timeout_s=timeout_s)
    rank, _ = rank_world()
    if getattr(cm, "plan_path", None) is not None:
        from nowdl.plan.plan import Plan
        from nowdl.plan.purpose import require_inference

        require_inference(Plan.load(cm.plan_path), f"the plan {cm.plan_path}")  # before anything is written
    channels, ndim = model_input(cm)
    spec = source if isinstance(source, str) else ""
    images = open_images(source, channels, ndim) if isinstance(source, str) else list(source)
    norm = parse_normalize(normalize) if isinstance(normalize, str) else normalize
    if not isinstance(norm, Normalize) and norm is not None:
        raise NowdlError("predict takes the training data's --normalize values (mean=...,std=...; a nowdl run "
                         "checkpoint records them), not --normalize auto")
    if norm is not None:
        norm.check(channels, "the model's input")
    target = Path(out)
    check_out(target, overwrite)
    targets, stage, folder = _targets(spec, images, target, fmt)
    err = None
    if rank == 0:
        for path in {stage, *(t.work for t in targets)}:
            discard(path)  # debris of an earlier run that died
        if folder:
            stage.mkdir()
    agree(err)
    try:
        summary = predict_images(cm, images, targets, output=output, window=window, on_window=on_window,
                                 timeout_s=timeout_s, backend=backend, measure_memory=measure_memory,
                                 weights=weights, normalize=norm)
        err = None
        if rank == 0:
            try:
                _convert(targets, output)
                publish(stage, target)
            except OSError as e:
                err = write_error(e, str(target))
        agree(err)
    except BaseException:
        if rank == 0:
            discard_targets(targets)
            discard(stage)
        raise
    return summary
