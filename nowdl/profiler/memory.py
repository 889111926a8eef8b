"""Shared memory accounting: saved-tensor capture, storage attribution, workspace, params."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = [
    "OPTIMIZER_STATES",
    "storage_key",
    "storage_nbytes",
    "tensor_bytes",
    "capture_saved",
    "AllocTracker",
    "conv_workspace",
    "host_memory",
    "StorageLedger",
    "StaticCost",
    "static_costs",
    "fetch_attr",
]

OPTIMIZER_STATES = {"sgd": 0, "momentum": 1, "adam": 2, "adamw": 2}


def storage_key(t: torch.Tensor) -> int:
    """Identity of ``t``'s storage (the StorageImpl address; stable while it is alive)."""
    return int(t.untyped_storage()._cdata)


def storage_nbytes(t: torch.Tensor) -> int:
    """Bytes of the whole storage behind ``t`` (what keeping ``t`` alive holds)."""
    return int(t.untyped_storage().nbytes())


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s elements (numel x element size)."""
    return t.numel() * t.element_size()


@contextmanager
def capture_saved(into: list[torch.Tensor]) -> Iterator[None]:
    """Append every tensor autograd saves for backward inside the block to ``into``."""

    def pack(t: torch.Tensor) -> torch.Tensor:
        into.append(t)
        return t

    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


class AllocTracker(TorchDispatchMode):
    """Tracks storages that aten ops newly allocate and polls when they die (weak refs).

    ``workspace`` = peak live new bytes minus new bytes still live at the end: the transient
    memory above the op's inputs and outputs. Only allocations visible at the aten level are
    seen (a library's internal scratch, e.g. oneDNN or cuDNN workspaces, is not), so on CPU
    this is a lower bound; a storage is new when no argument of the op shares it, and a
    storage freed inside one aten op is noticed at the next op. ``library_workspace(func, args,
    out)``, when given, adds what a library holds during the op on top of everything live then
    (:func:`conv_workspace`). With ``log``, ``events`` records each allocation (its bytes; the
    ``i``-th gets id ``i``) and each free (``-(id + 1)``) in order, a library's workspace as an
    allocation freed at once ([Note: allocation log] in profiler/alloc/log.py); ``ids`` maps the
    storages still live to their ids.
    """

    def __init__(self, library_workspace: Callable[[Any, tuple[Any, ...], Any], int] | None = None,
                 log: bool = False) -> None:
        super().__init__()
        self.log = log
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = 0
        self.peak = 0
        self.library_workspace = library_workspace  # (func, args, out) -> bytes held during the op
        self.events: list[int] = []
        self.ids: dict[int, int] = {}  # storage key -> id in events
        self._count = 0

    def _logged(self, nbytes: int) -> int:
        self.events.append(nbytes)
        self._count += 1
        return self._count - 1

    def poll(self) -> None:
        """Forget storages that have been freed."""
        for key in [k for k, (ref, _) in self._live.items() if ref.expired()]:
            self.current -= self._live.pop(key)[1]
            i = self.ids.pop(key, None) if self.log else None
            if i is not None:
                self.events.append(-(i + 1))

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if self.log:
            self.poll()  # what Python freed between ops goes before this op's allocations
        out = func(*args, **kwargs)
        self.poll()
        if _HOST[0]:
            return out
        in_keys = {storage_key(t) for t in tree_flatten((args, kwargs))[0]
                   if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            try:
                st = t.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            key = int(st._cdata)
            if key in in_keys or key in self._live:
                continue
            nb = int(st.nbytes())
            self._live[key] = (StorageWeakRef(st), nb)
            self.current += nb
            if self.log and nb > 0:  # an empty storage takes no memory from an allocator
                self.ids[key] = self._logged(nb)
        extra = self.library_workspace(func, args, out) if self.library_workspace is not None else 0
        if self.log and extra > 0:
            self.events.append(-(self._logged(extra) + 1))
        self.peak = max(self.peak, self.current + extra)
        return out

    @property
    def workspace(self) -> int:
        """Transient bytes: peak of new allocations above what is still live now."""
        self.poll()
        return max(0, self.peak - self.current)


_HOST = [0]  # > 0 while host-memory copies are made on a CPU rank ([Note: host copies on CPU])


@contextmanager
def host_memory() -> Iterator[None]:
    """Allocations made inside are host memory, not the device's: :class:`AllocTracker` leaves them out.

    [Note: host copies on CPU] On a CPU rank the device and the host are the same memory, and an
    offloaded stage's host copies (runtime/pipeline/offload.py) are CPU tensors like every other.
    The offload path makes them inside this block, so the tracker measures what a GPU would hold on
    the device; on CUDA the copies are pinned host buffers the allocator never sees anyway.
    """
    _HOST[0] += 1
    try:
        yield
    finally:
        _HOST[0] -= 1


_CONV = {torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default}


def conv_workspace(ratio: float) -> Callable[[Any, tuple[Any, ...], Any], int]:
    """The cuDNN workspace of a convolution: ``ratio`` x the bytes of its tensor operands.

    [Note: convolution workspace] On a GPU a convolution's library (cuDNN) allocates a workspace
    through PyTorch's caching allocator for the length of the call, on top of the tensors live
    then; ``torch.cuda.max_memory_allocated`` counts it, an aten-level tracker cannot see it. Its
    size depends on the algorithm cuDNN picks; on one H200 (torch 2.11, cuDNN's heuristics,
    NCHW float32 with TF32) the peaks of a UNet's training and inference steps at 1024² and 2048²
    exceeded the aten-level peaks by about 1.2x the bytes of the convolution running at the peak
    (forward: input, weight and output; backward: output gradient, input, weight and the
    gradients), consistent with cuDNN converting each NCHW operand to NHWC for Hopper's tensor
    cores. The ratio is a device spec's ``conv_workspace`` (fitted by benchmarks/fit_specs.py from
    benchmarks/records/); a spec without it charges none.
    """

    def bytes_of(func: Any, args: tuple[Any, ...], out: Any) -> int:
        if func not in _CONV:
            return 0
        import os
        rule = os.environ.get("WSRULE", "sum")
        tensors = [t for t in tree_flatten((args, out))[0] if isinstance(t, torch.Tensor)]
        if rule == "max":
            return int(ratio * max(tensor_bytes(t) for t in tensors))
        if rule == "out":
            o = out[0] if isinstance(out, (tuple, list)) else out
            return int(ratio * (tensor_bytes(o) if isinstance(o, torch.Tensor) else 0))
        if rule == "in":
            a = args[1] if func is torch.ops.aten.convolution_backward.default else args[0]
            return int(ratio * tensor_bytes(a))
        return int(ratio * sum(tensor_bytes(t) for t in tensors))

    return bytes_of


class StorageLedger:
    """Attributes saved storages to the node that produced them, each storage once.

    Storages are keyed by :func:`storage_key`. Outputs stored in the graph environment are
    registered with their producer (a view keeps its base's producer); :meth:`alias` maps
    a clone made for an in-place op back to the original storage. Parameters, buffers and
    graph constants (``static``) are never counted. :meth:`release` drops a storage when
    no environment value refers to it any more, so a reused address is not confused with it.
    """

    def __init__(self, static: Iterable[torch.Tensor] = ()) -> None:
        self.static_keys = {storage_key(t) for t in static}
        self.owner: dict[int, str] = {}
        self.refs: dict[int, int] = defaultdict(int)
        self.charged: set[int] = set()
        self.aliases: dict[int, int] = {}
        self._held: dict[int, list[torch.Tensor]] = defaultdict(list)
        self.act: dict[str, int] = defaultdict(int)

    def add_static(self, t: torch.Tensor) -> None:
        """Exclude ``t``'s storage from activation accounting (a parameter or constant)."""
        self.static_keys.add(storage_key(t))

    def resolve(self, t: torch.Tensor) -> int:
        """The key of ``t``'s storage after following clone aliases."""
        k = storage_key(t)
        return self.aliases.get(k, k)

    def producers(self, tensors: Iterable[Any]) -> list[str]:
        """The node that produced each tensor's storage ("" for a parameter, constant or internal tensor)."""
        return [self.owner.get(self.resolve(t), "") for t in tensors if isinstance(t, torch.Tensor)]

    def alias(self, clone: torch.Tensor, original: torch.Tensor) -> None:
        """Treat ``clone``'s storage as ``original``'s (in-place ops run on clones).

        The clone is kept alive until the original is released, so its address cannot be
        reused by an unrelated storage while the alias exists.
        """
        k = self.resolve(original)
        self.aliases[storage_key(clone)] = k
        self._held[k].append(clone)

    def register(self, node: str, values: Any) -> list[int]:
        """Record the tensors of an environment value produced by ``node``; returns their keys."""
        keys = []
        for t in tree_flatten(values)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            k = self.resolve(t)
            if k in self.static_keys:
                continue
            self.owner.setdefault(k, node)
            self.refs[k] += 1
            keys.append(k)
        return keys

    def release(self, keys: Iterable[int]) -> None:
        """An environment value holding ``keys`` was freed."""
        for k in keys:
            self.refs[k] -= 1
            if self.refs[k] <= 0:
                self.refs.pop(k, None)
                self.owner.pop(k, None)
                self.charged.discard(k)
                for a in [a for a, o in self.aliases.items() if o == k]:
                    del self.aliases[a]
                self._held.pop(k, None)

    def account(self, node: str, saved: Iterable[torch.Tensor], out_keys: Iterable[int]
                ) -> tuple[int, bool]:
        """Charge what ``node`` saved; returns (saved_bytes, self_saved).

        Storages produced by a registered node are charged to that node once in the whole
        graph; storages no node produced (internal tensors such as BatchNorm statistics or
        pooling indices) are charged to ``node`` itself.
        """
        outs = set(out_keys)
        seen: dict[int, int] = {}
        for t in saved:
            if not isinstance(t, torch.Tensor):
                continue
            k = self.resolve(t)
            if k in self.static_keys or k in seen:
                continue
            seen[k] = storage_nbytes(t)
        for k, nb in seen.items():
            if k in self.owner:
                if k not in self.charged:
                    self.charged.add(k)
                    self.act[self.owner[k]] += nb
            else:
                self.act[node] += nb
        return sum(seen.values()), bool(outs & set(seen))


@dataclass(frozen=True)
class StaticCost:
    """Parameter-related bytes a node owns."""

    param_bytes: int = 0
    buffer_bytes: int = 0
    grad_bytes: int = 0
    optim_bytes: int = 0
    params: int = 0  # parameter elements (for plan tables)
    sizes: tuple[int, ...] = ()  # bytes of each parameter that requires grad (one allocation each)
    fixed: tuple[int, ...] = ()  # bytes of each buffer and frozen parameter


def static_costs(gm: torch.fx.GraphModule, optimizer: str) -> dict[str, StaticCost]:
    """Params/buffers/grads/optimizer state per node; each tensor charged to its first user.

    A call_module node owns its module's parameters and buffers (recursively); a get_attr
    node owns the tensor it fetches (a Parameter counts as a parameter, anything else as a
    buffer). Optimizer state = states(optimizer) x bytes of parameters requiring grad.
    """
    states = OPTIMIZER_STATES[optimizer]
    seen: set[int] = set()
    result: dict[str, StaticCost] = {}
    for node in gm.graph.nodes:
        params: list[torch.Tensor] = []
        buffers: list[torch.Tensor] = []
        if node.op == "call_module":
            mod = gm.get_submodule(str(node.target))
            params = list(mod.parameters())
            buffers = list(mod.buffers())
        elif node.op == "get_attr":
            obj = fetch_attr(gm, str(node.target))
            if isinstance(obj, torch.nn.Parameter):
                params = [obj]
            elif isinstance(obj, torch.Tensor):
                buffers = [obj]
        p = b = g = count = 0
        sizes: list[int] = []
        fixed: list[int] = []
        for t in params:
            if id(t) not in seen:
                seen.add(id(t))
                p += tensor_bytes(t)
                g += tensor_bytes(t) if t.requires_grad else 0
                count += t.numel()
                (sizes if t.requires_grad else fixed).append(tensor_bytes(t))
        for t in buffers:
            if id(t) not in seen:
                seen.add(id(t))
                b += tensor_bytes(t)
                fixed.append(tensor_bytes(t))
        if p or b:
            result[node.name] = StaticCost(p, b, g, states * g, count, tuple(sizes), tuple(fixed))
    return result


def fetch_attr(gm: torch.nn.Module, target: str) -> Any:
    """``gm``'s attribute at dotted path ``target`` (as fx's get_attr does)."""
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
