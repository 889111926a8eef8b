"""Checking a traced graph: do the example inputs fit the model, and does the graph compute
what the model computes?

:func:`check_inputs` catches what can be known before running (tensors, dtype); :func:`shape_hint`
guesses at a wrong rank or channel count from the first convolution.
``_validate`` runs the model and the graph under the same RNG state and compares their outputs
(fx graphs in eval mode on a shrunk input, exported graphs at their own shape in train and
eval mode, the model's state put back after each run); ``_Mismatch`` says the graph computes something else.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import logging
import math
from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_map

from nowdl.errors import TraceError
from nowdl.trace.state import kept_state
from nowdl.trace.where import _first_line, _user_frame

log = logging.getLogger(__name__)

__all__ = ["check_inputs", "shape_hint", "eager_failure", "first_fitting", "stand_in"]

# Inputs larger than this many elements per sample are validated on a shrunk copy (the fx
# graph does not depend on the spatial size), so a 16384^2 plan needs no 16384^2 forward.
_VALIDATE_MAX_ELEMENTS = 3 * 256 * 256
_SHRINK_SIDES = (64, 128, 256, 32, 512)
# volumes: a 64^3 check of SwinUNETR (feature size 48) ran 2.3 s a forward, four forwards per
# check; 32^3 is 8x less and still deep enough for five halvings
_SHRINK_SIDES_3D = (32, 64, 16, 128, 256)


def check_inputs(model: nn.Module, example_inputs: Sequence[torch.Tensor]) -> None:
    """Raise TraceError if an example input is not a floating tensor of the model's dtype.

    Checks what can be known before running: tensors, and a floating dtype equal to the
    parameters'. The rank and channels are checked by :func:`shape_hint`.
    """
    if not example_inputs:
        raise TraceError("no example input given: pass a tensor such as torch.randn(1, 3, 2048, 2048)")
    _check_arity(model, len(example_inputs))
    pdtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    for i, x in enumerate(example_inputs):
        if not isinstance(x, torch.Tensor):
            raise TraceError(
                f"example input {i} is a {type(x).__name__}, not a torch.Tensor: pass tensors "
                "(meta tensors are fine for planning: torch.empty(shape, device='meta'))"
            )
        if not x.is_floating_point():
            if i > 0 and not x.is_complex():  # an index input beside the image: time steps, labels
                continue
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


def _check_arity(model: nn.Module, given: int) -> None:
    """Raise TraceError if forward() needs more positional inputs than given, or takes fewer."""
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):  # a builtin or C forward: nothing to read
        return
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p.name for p in positional if p.default is p.empty]
    varargs = any(p.kind == p.VAR_POSITIONAL for p in params)
    name = type(model).__name__
    if given < len(required):
        raise TraceError(
            f"{name}.forward takes {_inputs(len(required))} ({', '.join(required)}), {given} given: pass one "
            f"example tensor per input (nowdl plan and profile: one --input SHAPE each, in that order; nowdl run feeds one input, "
            "so train such a model from Python: cm.train_step((a, b), y))"
        )
    if given > len(positional) and not varargs:
        raise TraceError(
            f"{name}.forward takes at most {_inputs(len(positional))} "
            f"({', '.join(p.name for p in positional) or 'none'}), {given} given: pass fewer example tensors"
        )


def _inputs(n: int) -> str:
    return f"{n} input" + ("" if n == 1 else "s")


def shape_hint(model: nn.Module, example_inputs: Sequence[torch.Tensor]) -> tuple[str, str] | None:
    """A guess at a wrong input shape: the first input's rank or channels against the first
    convolution's, as ``(message, first layer's name)``; None when they agree or there is no conv.

    Only a guess (the first input may reach that layer through a reshape or a concatenation, as
    in a generator fed a latent vector or a registration net fed two images), so :func:`trace`
    raises it only when the model cannot be traced on these inputs, or when the traced graph
    feeds the input straight into that layer.
    """
    first = _first_spatial_module(model)
    if first is None or not example_inputs:
        return None
    name, mod, dims = first
    want_rank = dims + 2
    x0 = example_inputs[0]
    if x0.dim() != want_rank:
        return (
            f"example input of shape {list(x0.shape)} has rank {x0.dim()}, but the model's first "
            f"spatial layer '{name}' ({type(mod).__name__}) takes rank-{want_rank} input "
            f"(batch, channels, {dims} spatial dims): give e.g. shape "
            f"{[1, _in_channels(mod)] + [256] * dims}"
        ), name
    c = _in_channels(mod)
    if c and x0.dim() >= 2 and x0.shape[1] != c:
        return (
            f"example input of shape {list(x0.shape)} has {x0.shape[1]} channels, but the model's "
            f"first layer '{name}' ({type(mod).__name__}) expects {c}: use shape "
            f"{[x0.shape[0], c] + list(x0.shape[2:])}"
        ), name
    return None


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


_EXPORT_MAX_ELEMENTS = 2**26


def stand_in(shape: Sequence[int], dtype: torch.dtype, generator: torch.Generator | None = None) -> torch.Tensor:
    """A real tensor standing in for a meta example: random values for a floating input, zeros
    for an integer one (time steps, labels: 0 is a valid index wherever any is)."""
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(tuple(shape), generator=generator, dtype=dtype)
    return torch.zeros(tuple(shape), dtype=dtype)


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
    return tuple(stand_in(x.shape, x.dtype, g) for x in example_inputs)


def _shrunk_inputs(example_inputs: Sequence[torch.Tensor]) -> Iterable[tuple[torch.Tensor, ...]]:
    """Candidate small inputs of the same rank/dtype for checking the graph by value."""
    per_sample = max(math.prod(x.shape[1:]) for x in example_inputs)
    if (per_sample <= _VALIDATE_MAX_ELEMENTS and all(x.device.type != "meta" for x in example_inputs)):
        yield _full_inputs(example_inputs)
        return
    volume = max(x.dim() for x in example_inputs) >= 5
    for side in _SHRINK_SIDES_3D if volume else _SHRINK_SIDES:
        shrunk = []
        for x in example_inputs:
            shape = list(x.shape[:2]) + [min(int(d), side) for d in x.shape[2:]]
            shape[0] = min(shape[0], 2)
            g = torch.Generator().manual_seed(0)
            shrunk.append(stand_in(shape, x.dtype, g))
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


def _model_device(m: nn.Module) -> torch.device | None:
    """Where ``m``'s first parameter or buffer lives (None: it holds neither, or only meta tensors)."""
    for t in itertools.chain(m.parameters(), m.buffers()):
        return None if t.device.type == "meta" else t.device
    return None


def _run(m: nn.Module, inputs: Sequence[torch.Tensor], seed: int) -> object:
    small = all(math.prod(x.shape) <= 2 * _VALIDATE_MAX_ELEMENTS for x in inputs)
    dev = _model_device(m)  # a model already on the GPU (after a training step) checks on the GPU
    if dev is not None:
        inputs = [x.to(dev) if x.device.type not in ("meta", dev.type) else x for x in inputs]
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
    input shape, so they are compared at the example's own shape (``train=True``), in train and
    then eval mode, each run from the model's state, which is put back after it (no buffer of
    the model moves).
    Any exception the graph raises where the model runs is a mismatch: the trace is wrong.
    """
    was_training = model.training
    last_err: Exception | None = None
    ran_on: Sequence[torch.Tensor] = ()
    if train:
        inputs = _full_inputs(example_inputs)
        for mode in (True, False):  # train mode (batch statistics, dropout), then eval mode
            try:
                _compare_kept(model, gm, inputs, mode)
            except _Mismatch as m:
                if not mode:  # training matched just before: the forward branches on self.training
                    raise _TrainModeOnly(tuple(tuple(x.shape) for x in inputs), str(m)) from m
                raise
            except Exception as e:  # the model itself fails (the graph's failures are mismatches)
                last_err, ran_on = e, inputs
                break
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
                    last_err, ran_on = e, inputs
                    continue
                try:
                    _compare(ref, gm, inputs, "eval")
                except _Mismatch as m:  # traced in training mode: does it hold there?
                    if _train_mode_matches(model, gm, inputs):
                        raise _TrainModeOnly(tuple(tuple(x.shape) for x in inputs), str(m)) from m
                    raise
                return tuple(tuple(x.shape) for x in inputs)
        finally:
            model.train(was_training)
            gm.train(was_training)
    raise TraceError(_fails_as_is(model, last_err, example_inputs, ran_on))


def _fails_as_is(model: nn.Module, err: BaseException | None, example_inputs: Sequence[torch.Tensor],
                 ran_on: Sequence[torch.Tensor] = ()) -> str:
    """The message for a model that fails on the input (``ran_on``: the copy it ran on) with no
    tracing involved."""
    where = _user_frame(err) if err is not None else ""
    first = _first_line(err) if err is not None else ""
    shapes = [list(x.shape) for x in example_inputs]
    small = [list(x.shape) for x in ran_on]
    copy_note = f" (run on a smaller copy, {small})" if small and small != shapes else ""
    return (f"{type(model).__name__} fails on the example input {shapes}{copy_note} when run as is, without nowdl: "
            f"{type(err).__name__}: {first}{' at ' + where if where else ''}. "
            "Make the model run on the example input first (its dtype, shape and device).")


def first_fitting(model: nn.Module, example_inputs: Sequence[torch.Tensor]
                  ) -> tuple[tuple[torch.Tensor, ...] | None, Exception | None, Sequence[torch.Tensor]]:
    """The first of the check's sizes (``_shrunk_inputs``) the model runs on in eval mode, or
    None; the last failure and the inputs it failed on. Raises what allocating them raises."""
    was_training = model.training
    model.eval()
    err: Exception | None = None
    ran_on: Sequence[torch.Tensor] = ()
    try:
        for inputs in _shrunk_inputs(example_inputs):
            try:
                _run(model, inputs, seed=1234)
                return inputs, None, ()
            except Exception as e:  # noqa: BLE001 (this size does not fit the model; try another)
                err, ran_on = e, inputs
    finally:
        model.train(was_training)
    return None, err, ran_on


def eager_failure(model: nn.Module, example_inputs: Sequence[torch.Tensor]) -> str | None:
    """The message when the model itself (no tracing) fails on the example input, in eval mode
    on the sizes the check uses; None when it runs on one of them."""
    try:
        fits, err, ran_on = first_fitting(model, example_inputs)
    except Exception as e:  # noqa: BLE001 (an example too large to allocate: say nothing)
        log.debug("could not run the model eagerly: %s", e)
        return None
    return None if fits is not None or err is None else _fails_as_is(model, err, example_inputs, ran_on)


class _Mismatch(Exception):
    pass


class _TrainModeOnly(Exception):
    """The graph computes what the model computes in training but not in eval mode: its forward
    branches on ``self.training`` (MONAI's DynUNet returns its deep-supervision heads only in
    training). ``shapes``: the input shapes checked; ``why``: the eval-mode difference."""

    def __init__(self, shapes: tuple[tuple[int, ...], ...], why: str) -> None:
        super().__init__(why)
        self.shapes = shapes
        self.why = why


def _compare_kept(model: nn.Module, gm: nn.Module, inputs: Sequence[torch.Tensor], train: bool) -> None:
    """``_compare`` in train or eval mode, each run from the model's state on entry, which is
    kept (the running statistics of its norms do not move; see :mod:`nowdl.trace.state`); the
    model's own failure propagates as it is."""
    with kept_state(model, gm) as restore:
        model.train(train)
        ref = _clone(_run(model, inputs, seed=1234))  # its tensors may be buffers that restore() writes
        restore()
        gm.train(train)
        _compare(ref, gm, inputs, "train" if train else "eval")


def _clone(out: object) -> object:
    """``out`` with every tensor in it cloned."""
    return tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, out)


def _train_mode_matches(model: nn.Module, gm: nn.Module, inputs: Sequence[torch.Tensor]) -> bool:
    """Whether the graph returns what the model returns in training mode."""
    try:
        _compare_kept(model, gm, inputs, True)
    except Exception:  # noqa: BLE001 (any failure: not a training-mode graph either)
        return False
    return True


def _compare(ref: object, gm: nn.Module, inputs: Sequence[torch.Tensor], mode: str) -> None:
    """Raise _Mismatch unless ``gm`` runs on ``inputs`` and returns what the model returned."""
    try:
        got = _run(gm, inputs, seed=1234)
    except Exception as e:  # the graph fails where the model runs: the trace is wrong
        raise _Mismatch(f"the graph fails in {mode} mode where the model runs ({type(e).__name__}: {_first_line(e)})") from e
    ok, why = _same(ref, got)
    if not ok:
        raise _Mismatch(f"{why} in {mode} mode")
