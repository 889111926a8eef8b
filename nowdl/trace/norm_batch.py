"""BatchNorm that sees one value per channel in training: which node, and what to do.

[Note: one-sample norms] BatchNorm in training normalises each channel over the batch and the
spatial dims. Where a net pools globally before a BatchNorm (DeepLabV3's ASPP pooling branch,
some squeeze-and-excitation blocks), a micro-batch of one sample leaves it one value per
channel, and PyTorch refuses ("Expected more than 1 value per channel when training"). That is
the model's own limit, not a tracing failure: :func:`one_sample_norm_error` turns it into an
:class:`~nowdl.errors.OneSampleNormError` naming the node and its input, with the two fixes (2 or
more samples per micro-batch, or the norms in eval mode); the planner then plans micro-batches of
at least 2 samples for such nets (:mod:`nowdl.partitioner.config.two_samples`).

An inference plan of one sample needs no batch statistics: eval mode normalises with the
running ones. ``nowdl.trace.trace`` therefore traces such a net again with those BatchNorms in
eval mode (:func:`one_value_norms_in_eval`): the graph calls the same BatchNorm modules, which
follow ``train()``/``eval()`` ([Note: exported graphs]), and ``Traced.one_sample`` keeps the
error, which a training plan for that shape raises.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from nowdl.errors import NowdlError, OneSampleNormError

__all__ = ["ONE_VALUE", "one_sample_norm_error", "one_sample_norm", "two_samples", "on_two_samples", "one_value_norms_in_eval"]

log = logging.getLogger(__name__)
T = TypeVar("T")

ONE_VALUE = "Expected more than 1 value per channel when training"


class _Found(Exception):
    pass


def one_sample_norm(model: nn.Module, inputs: Sequence[torch.Tensor]) -> tuple[str, tuple[int, ...]] | None:
    """(module name, input shape) of the first BatchNorm that sees one value per channel when
    ``model`` runs in training on ``inputs`` (on fake tensors: nothing is computed or updated)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    found: list[tuple[str, tuple[int, ...]]] = []
    names = {m: n for n, m in model.named_modules()}

    def probe(m: nn.Module, args: tuple[Any, ...]) -> None:
        x = args[0] if args else None
        if isinstance(x, torch.Tensor) and x.dim() >= 2 and math.prod(x.shape) == x.shape[1]:
            found.append((names.get(m, type(m).__name__), tuple(int(s) for s in x.shape)))
            raise _Found

    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    handles = [m.register_forward_pre_hook(probe) for m in norms]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    was = model.training
    quiet = logging.getLogger("torch._subclasses.fake_tensor")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad():
            fake = [torch.empty(x.shape, dtype=x.dtype) for x in inputs]
            model.train()
            model(*fake)
    except Exception:  # noqa: BLE001 - a probe: _Found, or the model failing for another reason
        pass
    finally:
        quiet.setLevel(level)
        model.train(was)
        for h in handles:
            h.remove()
        model.load_state_dict(state)
    return found[0] if found else None


def one_sample_norm_error(model: nn.Module, inputs: Sequence[torch.Tensor], failure: BaseException
                          ) -> OneSampleNormError | None:
    """The error to raise when ``failure`` (of tracing ``model`` on ``inputs``) is a BatchNorm
    seeing one value per channel ([Note: one-sample norms]); None when it is something else."""
    text = f"{failure}\n{getattr(failure, 'detail', '')}"
    if ONE_VALUE not in text:
        return None
    node, shape = one_sample_norm(model, inputs) or ("a BatchNorm", ())
    n = int(inputs[0].shape[0]) if inputs and inputs[0].dim() else 1
    err = OneSampleNormError(
        f"node {node!r} (BatchNorm) normalises one value per channel in training: its input is "
        f"{list(shape) or 'one value per channel'}, from a micro-batch of {n} sample{'s' if n != 1 else ''} "
        "after global pooling. Train with 2 or more samples per micro-batch (the planner does so when the "
        "micro-batch size is free: give the global batch; or pass an example of 2+ samples, --input 2x...), "
        "or put the BatchNorms in eval mode (frozen statistics) before compiling")
    err.node = node
    err.detail = getattr(failure, "detail", "") or str(failure)
    return err


def two_samples(examples: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...] | None:
    """``examples`` with 2 samples each instead of 1 (the sample repeated; meta stays meta), or
    None when any of them has another batch size."""
    if not examples or any(x.dim() == 0 or x.shape[0] != 1 for x in examples):
        return None
    return tuple(torch.empty((2, *x.shape[1:]), dtype=x.dtype, device="meta") if x.device.type == "meta"
                 else x.repeat(2, *([1] * (x.dim() - 1))) for x in examples)


def on_two_samples(error: OneSampleNormError, examples: Sequence[torch.Tensor], target: torch.Tensor | None,
                   run: Callable[[tuple[torch.Tensor, ...], torch.Tensor | None], T], *, undo: Callable[[], None]) -> T:
    """``run`` (a plan search) on 2-sample versions of ``examples`` and ``target`` after ``error``
    ([Note: one-sample norms]); ``error`` again, with why, where there are none or ``run`` fails
    (``undo`` first: the pins leave no micro-batch of 2 samples, say)."""
    two = two_samples(examples)
    if two is None:
        undo()
        raise error
    log.warning("%s: planning micro-batches of at least 2 samples", str(error).split(". ")[0])
    tt = two_samples((target,)) if target is not None else None
    try:
        return run(two, tt[0] if tt else None)
    except NowdlError as again:
        undo()
        error.args = (f"{error} (with 2 samples per micro-batch: {str(again).splitlines()[0]})",)
        raise error from again


@contextlib.contextmanager
def one_value_norms_in_eval() -> Iterator[None]:
    """Within it, ``F.batch_norm`` in training normalises an input of one value per channel
    with its running statistics, as eval mode does (PyTorch refuses it, and cannot export it):
    to trace a graph for inference, whose BatchNorm modules run in eval mode anyway."""
    batch_norm = F.batch_norm

    def norm(x: torch.Tensor, running_mean: torch.Tensor | None, running_var: torch.Tensor | None,
             weight: torch.Tensor | None = None, bias: torch.Tensor | None = None, training: bool = False,
             momentum: float = 0.1, eps: float = 1e-5) -> torch.Tensor:
        if training and running_mean is not None and running_var is not None and x.dim() >= 2 \
                and math.prod(x.shape) == x.shape[1]:
            training = False
        return batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps)

    F.batch_norm = norm  # type: ignore[assignment]
    try:
        yield
    finally:
        F.batch_norm = batch_norm
