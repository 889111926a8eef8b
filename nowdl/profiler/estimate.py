"""Estimate mode: run each node on fake tensors (nothing allocated), roofline times."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.func import functional_call

from nowdl.profiler.backend import Backend, PhaseResult
from nowdl.profiler.devices import DeviceSpec
from nowdl.profiler.flops import OpCostMode
from nowdl.profiler.memory import AllocTracker, conv_workspace

__all__ = ["EstimateBackend", "recording"]


class EstimateBackend(Backend):
    """Fake tensors under ``FakeTensorMode``: shapes, bytes, saved tensors and FLOPs are
    exact (CPU kernels' semantics), times are per-op rooflines on ``spec``
    (see :class:`~nowdl.profiler.flops.OpCostMode`), workspace comes from the aten-level
    allocation tracker. Parameters and buffers are faked once and swapped in with
    ``torch.func.functional_call``, so the real model is never touched.
    """


    def __init__(self, gm: torch.nn.Module, spec: DeviceSpec) -> None:
        self.gm = gm
        self.spec = spec
        self.device_label = f"estimate:{spec.name}"
        self.device_type = next((p.device.type for p in gm.parameters()), "cpu")
        self.n_runs = 1
        self.mode = FakeTensorMode(allow_non_fake_inputs=False)
        self._fake: dict[int, torch.Tensor] = {}
        for t in [*gm.parameters(), *gm.buffers()]:
            self._to_fake(t)

    def _to_fake(self, t: torch.Tensor) -> torch.Tensor:
        f = self._fake.get(id(t))
        if f is None:
            with unset_fake_temporarily():
                f = self.mode.from_tensor(t.detach())
            if t.requires_grad:
                f.requires_grad_(True)
            self._fake[id(t)] = f
        return f

    def context(self) -> AbstractContextManager[Any]:
        return self._context()

    @contextmanager
    def _context(self) -> Iterator[None]:
        # FakeTensorMode logs every failing op at ERROR level; our ProfileError says it all.
        fake_log = logging.getLogger("torch._subclasses.fake_tensor")
        level = fake_log.level
        fake_log.setLevel(logging.CRITICAL)
        try:
            with self.mode:
                yield
        finally:
            fake_log.setLevel(level)

    def input(self, t: Any) -> Any:
        """A fake copy of ``t``; a meta tensor becomes a fake one on the model's device."""
        if not isinstance(t, torch.Tensor):
            return t
        if t.device.type == "meta":
            dev = next((p.device for p in self.gm.parameters()), torch.device("cpu"))
            with self.mode:
                f = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=dev)
        else:
            with unset_fake_temporarily():
                f = self.mode.from_tensor(t.detach())
        return f.requires_grad_(True) if t.requires_grad else f

    def attr(self, obj: Any) -> Any:
        return self._to_fake(obj) if isinstance(obj, torch.Tensor) else obj

    def static_tensors(self) -> Iterable[torch.Tensor]:
        return list(self._fake.values())

    def _state(self, mod: torch.nn.Module) -> dict[str, torch.Tensor]:
        state = {n: self._to_fake(p) for n, p in mod.named_parameters(remove_duplicate=False)}
        for n, b in mod.named_buffers(remove_duplicate=False):
            state[n] = self._to_fake(b)
        return state

    def call_module(self, mod: torch.nn.Module, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Any:
        state = self._state(mod)
        if not state:  # nothing to swap in (an activation, a pool, a dropout): a plain call
            return mod(*args, **kwargs)
        return functional_call(mod, state, args, kwargs, strict=False)

    def params_of(self, mod: torch.nn.Module) -> list[torch.Tensor]:
        return [self._to_fake(p) for p in mod.parameters()]

    @property
    def memoise(self) -> bool:  # type: ignore[override]
        return _RECORD[0] is None  # a recording sees every op, so every node runs

    @contextmanager
    def _phase(self, name: str) -> Iterator[PhaseResult]:
        res = PhaseResult()
        ws = conv_workspace(self.spec.conv_workspace) if self.spec.conv_workspace else None
        rec = _RECORD[0]
        with OpCostMode(self.spec, record=rec is not None) as counter, AllocTracker(ws, log=True) as tracker:
            yield res
        res.seconds = counter.seconds
        res.flops = counter.flops
        res.workspace = tracker.workspace
        res.alloc = tracker
        if rec is not None and counter.record is not None:
            rec.setdefault(name, []).extend(counter.record)

    def phase(self, name: str, accounting: bool) -> AbstractContextManager[PhaseResult]:
        return self._phase(name)


_RECORD: list[dict[str, list[tuple[str, float, float, float]]] | None] = [None]


@contextmanager
def recording() -> Iterator[dict[str, list[tuple[str, float, float, float]]]]:
    """Every op the estimate-mode profiles inside the block count, by phase ("fwd", "bwd"): what
    ``benchmarks/fit_specs.py`` fits a spec's efficiency to, so that the fit and the plan count the
    same ops ([Note: op efficiency]). Nodes are not memoised while recording."""
    ops: dict[str, list[tuple[str, float, float, float]]] = {}
    _RECORD[0] = ops
    try:
        yield ops
    finally:
        _RECORD[0] = None
