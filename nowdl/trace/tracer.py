"""Trace an nn.Module to a torch.fx graph, check it computes what the model computes, fingerprint it.

Tracing is :func:`trace` (fx first, then a non-strict torch.export) and :func:`fingerprint`;
checking the graph against the model lives in :mod:`nowdl.trace.check`, locating the user's
failing module and line in :mod:`nowdl.trace.where`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import hashlib
import io
import logging
import math
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch import nn

from nowdl.errors import OneSampleNormError, TraceError
from nowdl.trace.check import (
    _EXPORT_MAX_ELEMENTS,
    _VALIDATE_MAX_ELEMENTS,
    _full_inputs,
    _Mismatch,
    _TrainModeOnly,
    _validate,
    check_inputs,
    eager_failure,
    first_fitting,
    shape_hint,
)
from nowdl.trace.deadcode import drop_dead_code
from nowdl.trace.functional import functionalize
from nowdl.trace.norm_batch import one_sample_norm_error, one_value_norms_in_eval
from nowdl.trace.sizes import size_refusal
from nowdl.trace.where import _first_line, _refused_by_model, _user_frame, _where

__all__ = ["Traced", "trace", "fingerprint", "check_inputs"]

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class Traced:
    """A traced model: the graph module, which tracer made it, and its fingerprint."""

    gm: fx.GraphModule
    tracer: str  # "fx" or "export"
    fingerprint: str
    validated_on: tuple[tuple[int, ...], ...]  # input shapes the eager/traced check ran on
    # [Note: training-mode graphs] why the graph equals the model in training only ("": in both
    # modes): a forward that branches on self.training is planned and run as training runs it
    train_only: str = ""
    # [Note: one-sample norms] the error a training plan on these shapes raises (a graph traced
    # for inference with PyTorch's batch-size check off), None when there is none
    one_sample: OneSampleNormError | None = None


def _with_hint(message: str, hint: str) -> str:
    """The likely cause (the input's shape against the first conv's) first, then the failure."""
    return f"{hint[0].upper()}{hint[1:]}. {message}"


def _feeds_directly(gm: fx.GraphModule, layer: str) -> bool:
    """Whether the first input goes straight into the conv module ``layer`` (fx: a call of that
    module; export: an ATen convolution on the input)."""
    ph = next((n for n in gm.graph.nodes if n.op == "placeholder"), None)
    if ph is None:
        return False
    for user in ph.users:
        if user.op == "call_module" and user.target == layer:
            return True
        if user.op == "call_function" and "conv" in str(user.target) and user.args and user.args[0] is ph:
            return True
    return False


class _LeafTracer(fx.Tracer):
    def __init__(self, leaf_types: tuple[type, ...], leaf_names: frozenset[str]) -> None:
        super().__init__()
        self._leaf_types = leaf_types
        self._leaf_names = leaf_names

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if self._leaf_types and isinstance(m, self._leaf_types):
            return True
        if qualname in self._leaf_names:
            return True
        return super().is_leaf_module(m, qualname)


def fingerprint(gm: fx.GraphModule, tracer: str = "fx") -> str:
    """A stable hash of the graph's code and every parameter and buffer's name, shape and dtype.

    Weights' values are not part of it: a plan stays valid while the model trains.
    """
    h = hashlib.sha256()
    h.update(tracer.encode())
    h.update(gm.code.encode())
    for name, t in list(gm.named_parameters()) + list(gm.named_buffers()):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
    return h.hexdigest()[:32]


def _fx_trace(model: nn.Module, leaf_modules: Sequence[type | str]) -> fx.GraphModule:
    types = tuple(t for t in leaf_modules if isinstance(t, type))
    names = frozenset(t for t in leaf_modules if isinstance(t, str))
    tracer = _LeafTracer(types, names)
    was_training = model.training
    model.train()  # a forward that branches on self.training is traced as training runs it
    try:
        graph = tracer.trace(model)
    finally:
        model.train(was_training)
    name = type(model).__name__
    return fx.GraphModule(tracer.root, graph, name)


def _export_trace(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> fx.GraphModule:
    """A non-strict torch.export of ``model`` on ``inputs`` (real or fake), made plannable (see
    [Note: exported graphs]) and free of in-place writes."""
    from nowdl.trace.exported import normalize_exported

    was_training = model.training
    model.train()
    # torch logs a failing op's traceback itself (fake_tensor at ERROR) past the stderr redirect:
    # the failure reaches the user once, in nowdl's error (-v: in full)
    quiet = {name: logging.getLogger(name) for name in ("torch.fx.experimental.symbolic_shapes",
                                                        "torch._subclasses.fake_tensor")}
    levels = {name: lg.level for name, lg in quiet.items()}
    quiet["torch.fx.experimental.symbolic_shapes"].setLevel(logging.ERROR)
    quiet["torch._subclasses.fake_tensor"].setLevel(logging.CRITICAL)
    copied = copy.deepcopy(model)
    printed = io.StringIO()  # torch.export prints its graph to stderr when it fails: -v shows it
    try:
        with contextlib.redirect_stderr(printed):
            ep = torch.export.export(copied, inputs, strict=False)
    except Exception as e:
        e.nowdl_where = _where(e, copied)  # type: ignore[attr-defined]  # the copy's modules
        e.nowdl_printed = printed.getvalue()  # type: ignore[attr-defined]
        raise
    finally:
        model.train(was_training)
        for name, lg in quiet.items():
            lg.setLevel(levels[name])
    try:  # no guard module: normalize_exported drops the guards anyway ([Note: exported graphs])
        gm = ep.module(check_guards=False)
    except TypeError:  # a torch whose module() takes no check_guards
        gm = ep.module()
    if not isinstance(gm, fx.GraphModule):
        raise TypeError(f"torch.export returned {type(gm).__name__}, not a GraphModule")
    gm = normalize_exported(gm, model)
    functionalize(gm, inputs)
    drop_dead_code(gm)
    return gm


def _structure(gm: fx.GraphModule) -> list[tuple[str, str, str, tuple[str, ...]]]:
    """A graph's nodes and edges, without the constants a shape decides (view sizes, pads)."""
    return [(n.op, str(n.target), n.name, tuple(a.name for a in n.all_input_nodes)) for n in gm.graph.nodes]


def _export(model: nn.Module, example_inputs: tuple[torch.Tensor, ...]
            ) -> tuple[fx.GraphModule, Callable[[], tuple[tuple[int, ...], ...]]]:
    """The exported graph at the example's shape, and the check to run on it.

    A small example (up to about 3x256x256 per sample) is checked at its own shape. A larger one
    is exported at its shape (on fake tensors when it is too large to allocate: a meta input of a
    16384^2 image) and checked through a second export at a small shape: that one must compute
    what the model computes and have the same nodes and edges. Running the model four times at
    the example's size (train and eval, model and graph) took 9.7 of the 11.1 s of tracing
    MONAI's BasicUNet++ at 512^2. A real example whose model runs at no smaller size is checked
    at its own shape after all.
    """
    total = sum(math.prod(x.shape) for x in example_inputs)
    real = all(x.device.type != "meta" for x in example_inputs)
    allocatable = real or total <= _EXPORT_MAX_ELEMENTS
    if allocatable:
        gm = _export_trace(model, _full_inputs(example_inputs))
        if max(math.prod(x.shape[1:]) for x in example_inputs) <= _VALIDATE_MAX_ELEMENTS:
            return gm, lambda: _validate(model, gm, example_inputs, train=True)
    else:
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode(allow_non_fake_inputs=True):
            fake = tuple(torch.empty(x.shape, dtype=x.dtype) for x in example_inputs)
        gm = _export_trace(model, fake)

    def check() -> tuple[tuple[int, ...], ...]:
        try:
            return _check_small()
        except _Mismatch:
            if not allocatable:
                raise
        # the export at a small shape differs in its nodes, or the model runs at its example's
        # size only: check the graph there after all
        return _validate(model, gm, example_inputs, train=True)

    def _check_small() -> tuple[tuple[int, ...], ...]:
        small = first_fitting(model, example_inputs)[0]
        if small is None:
            raise _Mismatch("no smaller input of the same rank runs through the model, so the export at full size "
                            "cannot be checked: pass a real example tensor")
        try:
            small_gm = _export_trace(model, small)
        except Exception as e:
            raise _Mismatch(f"the check at shape {[list(x.shape) for x in small]} does not export "
                            f"({type(e).__name__}: {_first_line(e)})") from e
        shapes = _validate(model, small_gm, small, train=True)
        if _structure(small_gm) != _structure(gm):
            raise _Mismatch(f"the graph exported at {[list(x.shape) for x in example_inputs]} has other nodes "
                            f"than the one checked at {[list(x.shape) for x in small]}")
        return shapes

    return gm, check


def trace(
    model: nn.Module,
    example_inputs: Sequence[torch.Tensor],
    *,
    leaf_modules: Sequence[type | str] = (),
    tracer: str = "auto",
) -> Traced:
    """Trace ``model`` and check the graph against eager execution on the example inputs.

    torch.fx ``symbolic_trace`` is tried first (``leaf_modules`` names module types or
    qualified names to keep opaque); if it fails or its output differs from eager, a
    non-strict ``torch.export`` is tried and checked the same way. Inputs larger than
    about 3x256x256 per sample are checked on a shrunk copy of the same rank.

    Args:
        model: the unmodified nn.Module.
        example_inputs: one micro-batch of inputs (real or meta tensors).
        leaf_modules: module types or qualified names fx must not trace into.
        tracer: "auto", "fx" or "export".

    Returns:
        Traced(gm, tracer, fingerprint, validated_on). Where a BatchNorm sees one value per
        channel in training (a batch of 1 after global pooling), the graph is traced with it in
        eval mode, for inference only: ``one_sample`` holds the OneSampleNormError (naming it
        and the fixes) that a training plan raises ([Note: one-sample norms]).

    Raises:
        TraceError: neither tracer gives a graph equal to the model; the message names the
            module, the source line and what to try.

    Example:
        >>> t = trace(MyNet(), (torch.randn(1, 3, 64, 64),))
        >>> t.gm.graph.print_tabular()
    """
    try:
        return _trace(model, example_inputs, leaf_modules=leaf_modules, tracer=tracer)
    except TraceError as e:  # a BatchNorm of one value per channel: say so ([Note: one-sample norms])
        one = one_sample_norm_error(model, tuple(example_inputs), e)
        if one is None:
            raise
        one.__cause__ = e
    with one_value_norms_in_eval():
        try:
            t = _trace(model, example_inputs, leaf_modules=leaf_modules, tracer=tracer)
        except TraceError as again:
            raise one from again
    return dataclasses.replace(t, one_sample=one)


def _trace(
    model: nn.Module,
    example_inputs: Sequence[torch.Tensor],
    *,
    leaf_modules: Sequence[type | str] = (),
    tracer: str = "auto",
) -> Traced:
    """:func:`trace` itself, before a BatchNorm of one value per channel is named."""
    if tracer not in ("auto", "fx", "export"):
        raise TraceError(f"unknown tracer {tracer!r}: use 'auto', 'fx' or 'export'")
    if not isinstance(model, nn.Module):
        raise TraceError(f"expected an nn.Module, got {type(model).__name__}")
    example_inputs = tuple(example_inputs)
    check_inputs(model, example_inputs)
    hint = shape_hint(model, example_inputs)
    mname = type(model).__name__
    failures: list[str] = []
    details: list[str] = []
    refused: Exception | None = None  # the model's own code raised while torch.export ran it
    order = ["fx", "export"] if tracer == "auto" else [tracer]
    for kind in order:
        check: Callable[[], tuple[tuple[int, ...], ...]]
        try:
            if kind == "fx":
                gm = _fx_trace(model, leaf_modules)
                functionalize(gm, example_inputs)
                drop_dead_code(gm)
                check = functools.partial(_validate, model, gm, example_inputs)
            else:
                gm, check = _export(model, example_inputs)
        except Exception as e:
            where = getattr(e, "nowdl_where", None) or _where(e, model)
            first = _first_line(e)
            failures.append(f"{kind} failed{' in ' + where if where else ''}: {type(e).__name__}: {first}")
            details.append(f"--- {kind} ---\n" + getattr(e, "nowdl_printed", "") + "".join(traceback.format_exception(e)))
            log.info("tracing %s with %s failed: %s", mname, kind, e)
            if kind == "export" and _refused_by_model(e):
                refused = e
            continue
        try:
            shapes = check()
        except TraceError as e:  # the model itself fails on the input: no tracer helps
            sized = size_refusal(gm, example_inputs, mname)  # [Note: size multiples]
            if sized is not None:
                raise TraceError(sized) from e
            if hint is None:
                raise
            raise TraceError(_with_hint(str(e), hint[0])) from e
        except _TrainModeOnly as e:  # [Note: training-mode graphs]
            log.warning("%s returns something else in eval mode than in training (%s): nowdl traced its "
                        "training-mode graph, which training needs; cm(x), eval_step and the plan's stages "
                        "return what training returns (deep supervision's extra outputs, say)", mname, e.why)
            return Traced(gm=gm, tracer=kind, fingerprint=fingerprint(gm, kind), validated_on=e.shapes,
                          train_only=e.why)
        except _Mismatch as m:
            failures.append(f"{kind} traced a graph that computes something else: {m}")
            details.append(f"--- {kind} graph ---\n{gm.graph}")
            log.info("%s graph of %s disagrees with eager: %s", kind, mname, m)
            continue
        log.info("traced %s with %s: %d nodes", mname, kind, len(gm.graph.nodes))
        if hint is not None and _feeds_directly(gm, hint[1]):
            raise TraceError(hint[0])  # the layer took the input anyway: unbatched, say
        if hint is not None:
            log.info("input shape differs from the first conv's (%s), but the model takes it", hint[0])
        return Traced(gm=gm, tracer=kind, fingerprint=fingerprint(gm, kind), validated_on=shapes)
    raise _failure(model, example_inputs, hint, refused, failures, details)


def _failure(model: nn.Module, example_inputs: tuple[torch.Tensor, ...], hint: tuple[str, str] | None,
             refused: Exception | None, failures: list[str], details: list[str]) -> TraceError:
    """The error when neither tracer gave a graph, most likely cause first: the model failing by
    itself, the model refusing the input's size, the input's shape, else the tracers' failures
    (their tracebacks and graph dumps in ``detail``, shown with -v)."""
    mname = type(model).__name__
    broken = eager_failure(model, example_inputs)
    if broken is not None:  # no tracer can help: say what the model itself raised
        msg = broken
    elif refused is not None:  # it runs at a small size but raises at this one: the size is refused
        msg = (f"{mname} refuses the example input {[list(x.shape) for x in example_inputs]}: "
               f"{type(refused).__name__}: {_first_line(refused)} at {_user_frame(refused)} (its own code raised this while "
               "torch.export ran it on fake tensors of that size): give an input the model accepts")
    elif hint is not None:
        msg = f"tracing {mname} on this input failed: {failures[-1]}"
    else:
        msg = (f"nowdl cannot trace {mname}: " + "; ".join(failures) + ". "
               "What to do: make that forward() free of Python branches on tensor values and of writes into "
               "slices, or keep the module opaque with planner=nowdl.PlannerOptions(leaf_modules=[ThatModule]) "
               "(nowdl then places it whole in one stage).")
    err = TraceError(msg if hint is None else _with_hint(msg, hint[0]))
    err.detail = "\n".join(details)
    return err
