"""``nowdl run --val-data SOURCE --val-labels SOURCE --val-every N``: validation on whole held-out images.

Every ``--val-every`` steps (and after the last step) each held-out image runs whole, at its
own size, through ``cm.evaluate`` (an inference plan per image shape, made once and cached:
[Note: eval plans] in runtime/training/evaluate.py) with the trained weights. Rank 0 sums the
loss (mean over images) and the pixels of :class:`nowdl.cli.losses.Scores` (Dice, IoU,
accuracy over all images' pixels), prints one line and logs it (``MetricsWriter.validation``:
``metrics.jsonl`` and TensorBoard's ``val/*``).

Sources: the large-image readers (``zarr:``, ``tiff:``, ``h5:``, or any reader ``nowdl run
--data`` takes; a folder gives every file in it) with ``--val-labels`` masks of the same layout,
each image read whole on every rank; or ``package.module:callable`` returning a Dataset of
``(x, y)`` samples (or dictionaries, with ``--keys``), each sample evaluated at its size.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Iterator
from typing import Any

import torch

from nowdl.cli.losses import Scores
from nowdl.errors import NowdlError

__all__ = ["add_validation_arguments", "check_validation", "check_plan_purpose", "ValidationSet", "validate", "eval_batch", "val_due",
           "val_line"]


def add_validation_arguments(p: argparse.ArgumentParser) -> None:
    """Add ``--val-data``, ``--val-labels`` and ``--val-every`` to ``nowdl run``'s parser ``p``."""
    p.add_argument("--val-data", metavar="SOURCE", help="held-out images validated whole through the inference "
                   "plan: zarr:/tiff:/h5: (with --val-labels) or package.module:callable returning a Dataset")
    p.add_argument("--val-labels", metavar="SOURCE", help="masks of --val-data, same layout and shape")
    p.add_argument("--val-every", type=int, metavar="N", help="validate every N steps (default: after the last step)")


def check_validation(args: argparse.Namespace) -> None:
    """Refuse inconsistent validation options before anything runs.

    Raises:
        NowdlError: ``--val-labels`` or ``--val-every`` without ``--val-data``, ``--val-every`` < 1.
    """
    data, labels, every = getattr(args, "val_data", None), getattr(args, "val_labels", None), getattr(args, "val_every", None)
    if data is None and (labels is not None or every is not None):
        flag = "--val-labels" if labels is not None else "--val-every"
        raise NowdlError(f"{flag} goes with --val-data SOURCE (the held-out images to validate on)")
    if every is not None and every < 1:
        raise NowdlError(f"--val-every must be a positive number of steps, got {every}")
    if data is not None and getattr(args, "eval", False):
        raise NowdlError("--val-data validates during training; with --eval give the images as --data (and --labels)")


def check_plan_purpose(args: argparse.Namespace, plan_path: str) -> None:
    """Refuse to train on an inference plan (``nowdl run PLAN.json`` without ``--eval``).

    Raises:
        PlanError: the plan is an inference plan.
    """
    if not getattr(args, "eval", False):
        from nowdl.plan.plan import Plan
        from nowdl.plan.purpose import require_training

        require_training(Plan.load(plan_path), f"the plan in {plan_path}")


class ValidationSet:
    """The held-out samples, one at a time, as ``(x (1, C, ...), y (1, ...))``."""

    def __init__(self, args: argparse.Namespace, sample_shape: tuple[int, ...], normalize: Any = None) -> None:
        from nowdl.runtime.data.feed import check_data_spec
        from nowdl.runtime.data.readers import READERS

        spec = str(args.val_data)
        self.spec = spec
        self.normalize = normalize  # the training data's (reader images only)
        kind = check_data_spec(spec)
        self.images: list[Any] = []
        self.masks: list[Any] | None = None
        self.dataset: Any = None
        if kind in READERS:
            from nowdl.runtime.data.datasets import check_masks
            from nowdl.runtime.data.readers import open_images

            if args.val_labels is None:
                raise NowdlError(f"--val-data {spec} needs --val-labels {kind}:MASK (same layout and shape as the images)")
            ndim = len(sample_shape) - 1
            self.images = open_images(spec, sample_shape[0], ndim)
            self.masks = open_images(args.val_labels, 1, ndim, label=True,
                                     stacked=any(im.index is not None for im in self.images))
            check_masks(self.images, self.masks, "--val-labels")
        elif kind == "dataset":
            from nowdl.runtime.data.datasets import dataset_from_callable

            if args.val_labels is not None:
                raise NowdlError("--val-labels goes with reader --val-data (zarr:, tiff:, h5:); a Dataset returns its labels")
            self.dataset = dataset_from_callable(spec, None)
            if getattr(args, "keys", None):
                from nowdl.runtime.data.keyed import KeyedDataset, parse_keys

                self.dataset = KeyedDataset(self.dataset, parse_keys(args.keys), f"--val-data {spec}")
        else:
            raise NowdlError(f"--val-data {spec}: give zarr:/tiff:/h5: images with --val-labels, or a "
                             "package.module:callable Dataset")

    def __len__(self) -> int:
        return len(self.images) if self.dataset is None else len(self.dataset)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self.dataset is not None:
            for i in range(len(self.dataset)):
                x, y = self.dataset[i]
                yield x.unsqueeze(0).float(), torch.as_tensor(y).unsqueeze(0)
            return
        from nowdl.runtime.data.pixels import invalid, labels, pixels

        assert self.masks is not None
        for im, mk in zip(self.images, self.masks, strict=True):
            whole = [(0, s) for s in im.spatial]
            raw = im.read(whole)
            yield (pixels(raw, im.nodata, self.normalize)[None],
                   labels(mk.read(whole)[0], mk.nodata, invalid(raw, im.nodata))[None])


def validate(cm: Any, vset: ValidationSet, rank: int) -> dict[str, float]:
    """Validate on every image of ``vset`` (collective): ``{"loss", "dice", "iou", "accuracy",
    "images", "s"}`` (scores on rank 0 only; the loss on every rank)."""
    t0 = time.perf_counter()
    scores = Scores()
    losses: list[float] = []
    for x, y in vset:
        out, loss = cm.evaluate(x, y)
        losses.append(loss)
        if rank == 0 and out is not None:
            scores.add(out, y)
    mean = sum(losses) / len(losses) if losses and not any(math.isnan(v) for v in losses) else math.nan
    res = {"loss": mean, **(scores.result() if rank == 0 else {})}
    res.update(images=float(len(losses)), s=time.perf_counter() - t0)
    return res


def eval_batch(cm: Any, x: Any, y: Any, rank: int, labelled: bool) -> tuple[float | None, dict[str, float] | None]:
    """One ``nowdl run --eval`` step (collective): ``(mean loss, scores)`` over the labels when
    ``labelled`` (scores on rank 0), else ``(None, None)``."""
    from nowdl.runtime.spatial.tiles import TiledInput

    out, loss = cm.evaluate(x, y if labelled else None)
    if not labelled:
        return None, None
    scores = None
    if rank == 0 and out is not None:
        s = Scores()
        s.add(out, y.read() if isinstance(y, TiledInput) else y)
        scores = s.result()
    return (None if math.isnan(loss) else loss), scores


def val_due(args: argparse.Namespace, done: int, start: int, total: int) -> bool:
    """Whether validation runs after step ``done`` (1-based) of a run of steps ``start+1 .. total``."""
    every = getattr(args, "val_every", None)
    return getattr(args, "val_data", None) is not None and (done == total or (every is not None and
                                                                                (done - start) % every == 0))


def val_line(step: int, res: dict[str, float]) -> str:
    """Rank 0's line for a validation after ``step``."""
    shown = "  ".join(f"{k} {res[k]:.4f}" for k in ("loss", "dice", "iou", "accuracy") if k in res and not math.isnan(res[k]))
    return f"validation after step {step}: {shown}  ({int(res['images'])} image(s), {res['s']:.2f} s)"
