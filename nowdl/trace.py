"""Trace an nn.Module to a torch.fx graph, check it computes what the model computes, fingerprint it."""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import io
import logging
import math
import os
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch import nn

from nowdl.errors import TraceError
from nowdl.functional import functionalize

__all__ = ["Traced", "trace", "fingerprint", "check_inputs"]

log = logging.getLogger(__name__)

# Inputs larger than this many elements per sample are validated on a shrunk copy (the fx
# graph does not depend on the spatial size), so a 16384^2 plan needs no 16384^2 forward.
_VALIDATE_MAX_ELEMENTS = 3 * 256 * 256
_SHRINK_SIDES = (64, 128, 256, 32, 512)


@dataclass(frozen=True)
class Traced:
    """A traced model: the graph module, which tracer made it, and its fingerprint."""

    gm: fx.GraphModule
    tracer: str  # "fx" or "export"
    fingerprint: str
    validated_on: tuple[tuple[int, ...], ...]  # input shapes the eager/traced check ran on


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


def check_inputs(model: nn.Module, example_inputs: Sequence[torch.Tensor]) -> None:
    """Raise TraceError if an example input's dtype or rank cannot fit the model.

    Checks what can be known before running: tensors, floating dtype equal to the
    parameters', and the rank the first convolution or pooling layer expects.
    """
    if not example_inputs:
        raise TraceError("no example input given: pass a tensor such as torch.randn(1, 3, 2048, 2048)")
    pdtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    for i, x in enumerate(example_inputs):
        if not isinstance(x, torch.Tensor):
            raise TraceError(
                f"example input {i} is a {type(x).__name__}, not a torch.Tensor: pass tensors "
                "(meta tensors are fine for planning: torch.empty(shape, device='meta'))"
            )
        if not x.is_floating_point():
            raise TraceError(
                f"example input {i} has dtype {x.dtype}; images must be floating point "
                f"(the model's parameters are {sorted(str(d) for d in pdtypes) or ['float32']}): "
                "convert with x.float()"
            )
        if pdtypes and x.dtype not in pdtypes:
            want = sorted(str(d) for d in pdtypes)
            raise TraceError(
                f"example input {i} has dtype {x.dtype} but the model's parameters are {want}: "
                f"convert the input with x.to({want[0]}) or the model with model.to(...)"
            )
    first = _first_spatial_module(model)
    if first is not None:
        name, mod, dims = first
        want_rank = dims + 2
        x0 = example_inputs[0]
        if x0.dim() != want_rank:
            raise TraceError(
                f"example input of shape {list(x0.shape)} has rank {x0.dim()}, but the model's first "
                f"spatial layer '{name}' ({type(mod).__name__}) takes rank-{want_rank} input "
                f"(batch, channels, {dims} spatial dims): give e.g. shape "
                f"{[1, _in_channels(mod)] + [256] * dims}"
            )
        c = _in_channels(mod)
        if c and x0.dim() >= 2 and x0.shape[1] != c:
            raise TraceError(
                f"example input of shape {list(x0.shape)} has {x0.shape[1]} channels, but the model's "
                f"first layer '{name}' ({type(mod).__name__}) expects {c}: use shape "
                f"{[x0.shape[0], c] + list(x0.shape[2:])}"
            )


def _first_spatial_module(model: nn.Module) -> tuple[str, nn.Module, int] | None:
    kinds: tuple[tuple[type[nn.Module], int], ...] = (
        (nn.Conv1d, 1), (nn.Conv2d, 2), (nn.Conv3d, 3),
        (nn.ConvTranspose1d, 1), (nn.ConvTranspose2d, 2), (nn.ConvTranspose3d, 3),
    )
    for name, m in model.named_modules():
        for cls, dims in kinds:
            if type(m) is cls:
                return str(name), m, dims
    return None


def _in_channels(m: nn.Module) -> int:
    return int(getattr(m, "in_channels", 0) or 0)


def _user_frames(exc: BaseException) -> list[tuple[traceback.FrameSummary, object]]:
    """The traceback's frames outside torch and nowdl, innermost last, with each frame's ``self``."""
    torch_dir = os.path.dirname(torch.__file__)
    here = os.path.dirname(__file__)
    out = []
    tb = exc.__traceback__
    while tb is not None:
        fname = tb.tb_frame.f_code.co_filename
        if not fname.startswith(torch_dir) and not fname.startswith(here):
            summary = traceback.extract_tb(tb, limit=1)[0]
            out.append((summary, tb.tb_frame.f_locals.get("self")))
        tb = tb.tb_next
    return out


def _user_frame(exc: BaseException) -> str:
    """The innermost traceback frame outside torch: where the user's code failed."""
    frames = _user_frames(exc)
    if not frames:
        return ""
    f = frames[-1][0]
    line = f" `{f.line.strip()}`" if f.line else ""
    return f"{f.filename}:{f.lineno} in {f.name}{line}"


def _where(exc: BaseException, model: nn.Module) -> str:
    """Which module of ``model`` and which source line an exception came from, as far as known."""
    frames = _user_frames(exc)
    names = {id(m): n for n, m in model.named_modules()}
    module = ""
    for _, owner in reversed(frames):
        if isinstance(owner, nn.Module) and id(owner) in names:
            q = names[id(owner)]
            module = f"module {q or '(the model)'!r} ({type(owner).__name__})"
            break
    line = _user_frame(exc)
    return ", ".join(p for p in (module, f"at {line}" if line else "") if p)


_EXPORT_MAX_ELEMENTS = 2**26


def _full_inputs(example_inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Real tensors of exactly the example's shapes (torch.export specialises on shapes)."""
    if all(x.device.type != "meta" for x in example_inputs):
        return tuple(example_inputs)
    total = sum(math.prod(x.shape) for x in example_inputs)
    if total > _EXPORT_MAX_ELEMENTS:
        raise RuntimeError(
            f"torch.export specialises on the input shape and needs a real input of "
            f"{[list(x.shape) for x in example_inputs]} ({total} elements), too large to allocate for a check"
        )
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(x.shape, generator=g, dtype=x.dtype) for x in example_inputs)


def _shrunk_inputs(example_inputs: Sequence[torch.Tensor]) -> Iterable[tuple[torch.Tensor, ...]]:
    """Candidate small inputs of the same rank/dtype for checking the graph by value."""
    per_sample = max(math.prod(x.shape[1:]) for x in example_inputs)
    if (per_sample <= _VALIDATE_MAX_ELEMENTS and all(x.device.type != "meta" for x in example_inputs)):
        yield _full_inputs(example_inputs)
        return
    for side in _SHRINK_SIDES:
        shrunk = []
        for x in example_inputs:
            shape = list(x.shape[:2]) + [min(int(d), side) for d in x.shape[2:]]
            shape[0] = min(shape[0], 2)
            g = torch.Generator().manual_seed(0)
            shrunk.append(torch.randn(shape, generator=g, dtype=x.dtype))
        yield tuple(shrunk)


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Run a check on a small input on one thread: on a busy machine, waking torch's pool for
    each tiny op costs more than the op (a 2,000-node check took 35 s on 2 threads, 1 s on one)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _run(m: nn.Module, inputs: Sequence[torch.Tensor], seed: int) -> object:
    small = all(math.prod(x.shape) <= 2 * _VALIDATE_MAX_ELEMENTS for x in inputs)
    with torch.random.fork_rng(devices=[]), torch.no_grad(), (_one_thread() if small else contextlib.nullcontext()):
        torch.manual_seed(seed)
        return m(*inputs)


def _flatten(out: object) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [t for k in sorted(out, key=str) for t in _flatten(out[k])]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _flatten(o)]
    return []


def _same(a: object, b: object) -> tuple[bool, str]:
    fa, fb = _flatten(a), _flatten(b)
    if len(fa) != len(fb):
        return False, f"{len(fb)} output tensors instead of {len(fa)}"
    for i, (x, y) in enumerate(zip(fa, fb, strict=True)):
        if x.shape != y.shape:
            return False, f"output {i} has shape {list(y.shape)} instead of {list(x.shape)}"
        if not torch.allclose(x.float(), y.float(), rtol=1e-5, atol=1e-6, equal_nan=True):
            diff = (x.float() - y.float()).abs().max().item()
            return False, f"output {i} differs by up to {diff:.3g}"
    return True, ""


def _validate(model: nn.Module, gm: nn.Module, example_inputs: Sequence[torch.Tensor], *,
              train: bool = False) -> tuple[tuple[int, ...], ...]:
    """Compare eager and traced outputs under the same RNG state; return the shapes used.

    fx graphs share the model's submodules and are compared in eval mode (dropout off,
    BatchNorm on running statistics, nothing mutated), on a shrunk input when the example is
    large (an fx graph does not depend on the input size). Exported graphs specialise on the
    input shape, so they are compared at the example's own shape, in train mode on copies (so
    no buffer of the model moves); ``train=True`` callers check eval mode separately.
    Any exception the graph raises where the model runs is a mismatch: the trace is wrong.
    """
    was_training = model.training
    last_err: Exception | None = None
    if train:
        inputs = _full_inputs(example_inputs)
        for mode in (True, False):  # train mode (batch statistics, dropout), then eval mode
            m, g = copy.deepcopy(model).train(mode), copy.deepcopy(gm).train(mode)
            try:
                ref = _run(m, inputs, seed=1234)
            except Exception as e:
                last_err = e
                break
            _compare(ref, g, inputs, "train" if mode else "eval")
        else:
            return tuple(tuple(x.shape) for x in inputs)
    else:
        model.eval()
        gm.eval()
        try:
            for inputs in _shrunk_inputs(example_inputs):
                try:
                    ref = _run(model, inputs, seed=1234)
                except Exception as e:  # this size does not fit the model; try another
                    last_err = e
                    continue
                _compare(ref, gm, inputs, "eval")
                return tuple(tuple(x.shape) for x in inputs)
        finally:
            model.train(was_training)
            gm.train(was_training)
    where = _user_frame(last_err) if last_err else ""
    raise TraceError(
        f"the model fails on the example input {[list(x.shape) for x in example_inputs]}"
        f"{' (checked on a smaller copy)' if last_err else ''}: "
        f"{type(last_err).__name__}: {last_err}{' at ' + where if where else ''}. "
        "Check the input's shape (batch, channels, spatial...) against the model."
    )


class _Mismatch(Exception):
    pass


def _compare(ref: object, gm: nn.Module, inputs: Sequence[torch.Tensor], mode: str) -> None:
    """Raise _Mismatch unless ``gm`` runs on ``inputs`` and returns what the model returned."""
    try:
        got = _run(gm, inputs, seed=1234)
    except Exception as e:  # the graph fails where the model runs: the trace is wrong
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise _Mismatch(f"the graph fails in {mode} mode where the model runs ({type(e).__name__}: {first})") from e
    ok, why = _same(ref, got)
    if not ok:
        raise _Mismatch(f"{why} in {mode} mode")


def _fx_trace(model: nn.Module, leaf_modules: Sequence[type | str]) -> fx.GraphModule:
    types = tuple(t for t in leaf_modules if isinstance(t, type))
    names = frozenset(t for t in leaf_modules if isinstance(t, str))
    tracer = _LeafTracer(types, names)
    graph = tracer.trace(model)
    name = type(model).__name__
    return fx.GraphModule(tracer.root, graph, name)


def _export_trace(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> fx.GraphModule:
    """A non-strict torch.export of ``model`` on ``inputs`` (real or fake), made plannable (see
    [Note: exported graphs]) and free of in-place writes."""
    from nowdl.exported import normalize_exported

    was_training = model.training
    model.train()
    quiet = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
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
        quiet.setLevel(level)
    gm = ep.module()
    if not isinstance(gm, fx.GraphModule):
        raise TypeError(f"torch.export returned {type(gm).__name__}, not a GraphModule")
    gm = normalize_exported(gm, model)
    functionalize(gm, inputs)
    return gm


def _structure(gm: fx.GraphModule) -> list[tuple[str, str, str, tuple[str, ...]]]:
    """A graph's nodes and edges, without the constants a shape decides (view sizes, pads)."""
    return [(n.op, str(n.target), n.name, tuple(a.name for a in n.all_input_nodes)) for n in gm.graph.nodes]


def _export(model: nn.Module, example_inputs: tuple[torch.Tensor, ...]
            ) -> tuple[fx.GraphModule, Callable[[], tuple[tuple[int, ...], ...]]]:
    """The exported graph at the example's shape, and the check to run on it.

    An example too large to allocate (a meta input of a 16384^2 image) is exported on fake
    tensors, which costs no memory, and checked through a second export at a small shape: that
    one must compute what the model computes and have the same nodes and edges.
    """
    total = sum(math.prod(x.shape) for x in example_inputs)
    real = all(x.device.type != "meta" for x in example_inputs)
    if real or total <= _EXPORT_MAX_ELEMENTS:
        gm = _export_trace(model, _full_inputs(example_inputs))
        return gm, lambda: _validate(model, gm, example_inputs, train=True)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = tuple(torch.empty(x.shape, dtype=x.dtype) for x in example_inputs)
    gm = _export_trace(model, fake)

    def check() -> tuple[tuple[int, ...], ...]:
        for small in _shrunk_inputs(example_inputs):
            try:
                _run(copy.deepcopy(model).eval(), small, seed=0)
            except Exception:  # this size does not fit the model; try another
                continue
            try:
                small_gm = _export_trace(model, small)
            except Exception as e:
                raise _Mismatch(f"the check at shape {[list(x.shape) for x in small]} does not export "
                                f"({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''})") from e
            shapes = _validate(model, small_gm, small, train=True)
            if _structure(small_gm) != _structure(gm):
                raise _Mismatch(f"the graph exported at {[list(x.shape) for x in example_inputs]} has other nodes "
                                f"than the one checked at {[list(x.shape) for x in small]}")
            return shapes
        raise _Mismatch("no smaller input of the same rank runs through the model, so the export at full size "
                        "cannot be checked: pass a real example tensor")

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
        Traced(gm, tracer, fingerprint, validated_on).

    Raises:
        TraceError: neither tracer gives a graph equal to the model; the message names the
            module, the source line and what to try.

    Example:
        >>> t = trace(MyNet(), (torch.randn(1, 3, 64, 64),))
        >>> t.gm.graph.print_tabular()
    """
    if tracer not in ("auto", "fx", "export"):
        raise TraceError(f"unknown tracer {tracer!r}: use 'auto', 'fx' or 'export'")
    if not isinstance(model, nn.Module):
        raise TraceError(f"expected an nn.Module, got {type(model).__name__}")
    example_inputs = tuple(example_inputs)
    check_inputs(model, example_inputs)
    mname = type(model).__name__
    failures: list[str] = []
    details: list[str] = []
    order = ["fx", "export"] if tracer == "auto" else [tracer]
    for kind in order:
        check: Callable[[], tuple[tuple[int, ...], ...]]
        try:
            if kind == "fx":
                gm = _fx_trace(model, leaf_modules)
                functionalize(gm, example_inputs)
                check = functools.partial(_validate, model, gm, example_inputs)
            else:
                gm, check = _export(model, example_inputs)
        except Exception as e:
            where = getattr(e, "nowdl_where", None) or _where(e, model)
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            failures.append(f"{kind} failed{' in ' + where if where else ''}: {type(e).__name__}: {first}")
            details.append(f"--- {kind} ---\n" + getattr(e, "nowdl_printed", "") + "".join(traceback.format_exception(e)))
            log.info("tracing %s with %s failed: %s", mname, kind, e)
            continue
        try:
            shapes = check()
        except _Mismatch as m:
            failures.append(f"{kind} traced a graph that computes something else: {m}")
            details.append(f"--- {kind} graph ---\n{gm.graph}")
            log.info("%s graph of %s disagrees with eager: %s", kind, mname, m)
            continue
        log.info("traced %s with %s: %d nodes", mname, kind, len(gm.graph.nodes))
        return Traced(gm=gm, tracer=kind, fingerprint=fingerprint(gm, kind), validated_on=shapes)
    err = TraceError(
        f"nowdl cannot trace {mname}: " + "; ".join(failures) + ". "
        "What to do: make that forward() free of Python branches on tensor values and of writes into "
        "slices, or keep the module opaque with leaf_modules=[ThatModule] (nowdl then places it whole "
        "in one stage)."
    )
    err.detail = "\n".join(details)
    raise err
