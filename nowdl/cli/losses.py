"""``nowdl run --loss package.module:callable --loss-args JSON``, and the scores of a segmentation.

The default loss is ``torch.nn.CrossEntropyLoss()`` on integer labels: ``(N,)`` per sample for
``(N, C)`` logits, ``(N, *spatial)`` per pixel for dense outputs. Nodata pixels carry the label
``IGNORE_INDEX`` (-100), which it leaves out; a batch with no other label has loss 0 (instead of
the 0/0 NaN of the mean), and the scores leave those pixels out too. A ``--loss`` callable is
called with ``--loss-args`` (keyword arguments) and must return ``loss(output, target)``; it
gets the labels with a channel dim, ``(N, 1, *spatial)``, as MONAI's losses take them
(``monai.losses:DiceCELoss --loss-args '{"to_onehot_y": true, "softmax": true}'``).

:class:`Scores` sums, over whole images, the pixels each class is predicted (argmax of the
logits; one output channel: ``logit > 0``) and labelled, and their overlap; ``dice`` and ``iou``
are the means over the foreground classes (1 .. C-1; with one channel, class 1) that occur in
the labels or the predictions, ``accuracy`` the share of pixels (or samples) right.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from nowdl.errors import NowdlError
from nowdl.runtime.data.pixels import IGNORE_INDEX

__all__ = ["make_loss", "Scores", "add_loss_arguments"]


def add_loss_arguments(p: Any) -> None:
    """Add ``--loss``, ``--loss-args`` and ``--keys`` to ``nowdl run``'s parser ``p``."""
    p.add_argument("--loss", metavar="package.module:callable",
                   help="the loss: a callable returning loss(output, target), e.g. monai.losses:DiceCELoss; it gets "
                   "labels shaped (N, 1, *spatial) (default: torch CrossEntropyLoss on (N, *spatial) labels)")
    p.add_argument("--loss-args", metavar="JSON", help="keyword arguments for --loss, as a JSON object")
    p.add_argument("--keys", metavar="IMAGE,LABEL",
                   help="--data package.module:callable returns dictionary samples (MONAI): the image and label keys")


def _kwargs(text: str | None, flag: str, example: str) -> dict[str, Any]:
    if text is None:
        return {}
    try:
        kwargs = json.loads(text)
    except json.JSONDecodeError as e:
        raise NowdlError(f"{flag} is not valid JSON ({e.msg} at column {e.colno}): write e.g. '{example}'") from None
    if not isinstance(kwargs, dict):
        raise NowdlError(f"{flag} must be a JSON object of keyword arguments, got {type(kwargs).__name__}: "
                         f"write e.g. '{example}'")
    return kwargs


def make_loss(spec: str | None, args_json: str | None) -> nn.Module:
    """The loss of ``nowdl run``: CrossEntropyLoss, or ``spec`` called with ``args_json``.

    Raises:
        NowdlError: ``--loss-args`` without ``--loss``, bad JSON, an unimportable or failing callable.
    """
    if spec is None:
        if args_json is not None:
            raise NowdlError("--loss-args goes with --loss package.module:callable (its keyword arguments)")
        return _CrossEntropy()
    from nowdl.models.resolve import import_callable

    kwargs = _kwargs(args_json, "--loss-args", '{"to_onehot_y": true, "softmax": true}')
    fn = import_callable(spec, f"--loss {spec}", f"--loss {spec} is not callable: name a loss class or a function "
                         "returning loss(output, target)")
    try:
        loss = fn(**kwargs)
    except Exception as e:
        raise NowdlError(f"--loss {spec}(**{kwargs}) failed: {type(e).__name__}: {e}. Check --loss-args.") from None
    if not callable(loss):
        raise NowdlError(f"--loss {spec}(**{kwargs}) returned a {type(loss).__name__}, not a callable "
                         "loss(output, target)")
    return _ChannelLabels(loss)


class _CrossEntropy(nn.CrossEntropyLoss):
    """``nn.CrossEntropyLoss()``, with loss 0 (and zero gradients) when every label is ignored."""

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if isinstance(target, torch.Tensor) and target.numel() and not bool((target != self.ignore_index).any()):
            return input.sum() * 0.0
        return super().forward(input, target)


class _ChannelLabels(nn.Module):
    """A user loss given integer label maps with a channel dim (``(N, 1, *spatial)``)."""

    def __init__(self, loss: Callable[[Any, Any], torch.Tensor]) -> None:
        super().__init__()
        self.loss = loss

    def forward(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if isinstance(out, torch.Tensor) and isinstance(y, torch.Tensor) and y.dim() == out.dim() - 1 and y.dim() > 1:
            y = y.unsqueeze(1)
        return self.loss(out, y)


class Scores:
    """Dice, IoU and accuracy summed over whole images (add batches, read the means)."""

    def __init__(self) -> None:
        self.inter: dict[int, float] = {}
        self.pred: dict[int, float] = {}
        self.true: dict[int, float] = {}
        self.right = 0.0
        self.total = 0.0

    def add(self, out: torch.Tensor, y: torch.Tensor) -> None:
        """Count one batch: logits ``out`` ``(N, C, ...)`` against integer labels ``y`` ``(N, ...)``."""
        if not isinstance(out, torch.Tensor):
            raise NowdlError(f"validation scores need the model to return one tensor of logits, got {type(out).__name__}")
        y = y.to(out.device).long()
        if y.dim() == out.dim():  # (N, 1, ...) labels
            y = y[:, 0]
        classes = int(out.shape[1])
        pred = (out[:, 0] > 0).long() if classes == 1 else out.argmax(1)
        keep = y != IGNORE_INDEX  # nodata pixels count nowhere
        self.right += float(((pred == y) & keep).sum())
        self.total += float(keep.sum())
        for c in range(1, max(2, classes)):
            p, t = (pred == c) & keep, y == c
            self.inter[c] = self.inter.get(c, 0.0) + float((p & t).sum())
            self.pred[c] = self.pred.get(c, 0.0) + float(p.sum())
            self.true[c] = self.true.get(c, 0.0) + float(t.sum())

    def result(self) -> dict[str, float]:
        """``{"dice", "iou", "accuracy"}`` (dice and iou: NaN when no foreground class occurs)."""
        seen = [c for c in self.inter if self.pred[c] + self.true[c] > 0]
        dice = [2 * self.inter[c] / (self.pred[c] + self.true[c]) for c in seen]
        iou = [self.inter[c] / (self.pred[c] + self.true[c] - self.inter[c]) for c in seen]
        nan = float("nan")
        return {"dice": sum(dice) / len(dice) if dice else nan, "iou": sum(iou) / len(iou) if iou else nan,
                "accuracy": self.right / self.total if self.total else nan}
