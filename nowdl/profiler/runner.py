"""Node-by-node graph walk shared by measure and estimate modes (one accounting routine).

The backends it drives implement :class:`nowdl.profiler.backend.Backend` (re-exported here).
"""

from __future__ import annotations

import dataclasses
import operator
import sys
from collections.abc import Callable, Hashable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import GraphModule, Node
from torch.fx.node import map_arg
from torch.utils._pytree import tree_flatten, tree_map

from nowdl.errors import ProfileError
from nowdl.profiler.alloc.log import RawLog, node_log, raw_log
from nowdl.profiler.backend import Backend, PhaseResult
from nowdl.profiler.cost import NodeCost
from nowdl.profiler.memo import Entry, input_tensors, make_entry, memo_key, replay
from nowdl.profiler.memory import (
    StaticCost,
    StorageLedger,
    capture_saved,
    fetch_attr,
    static_costs,
    tensor_bytes,
)

__all__ = ["Backend", "PhaseResult", "walk", "target_name", "dtype_name"]

_INPLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv,
                      operator.ifloordiv, operator.imod, operator.ipow, operator.iand,
                      operator.ior, operator.ixor, operator.ilshift, operator.irshift,
                      operator.imatmul, operator.setitem}


def target_name(node: Node, gm: GraphModule) -> str:
    """A readable target: the module class for call_module, the qualified function name."""
    t = node.target
    if node.op == "call_module":
        mod = gm.get_submodule(str(t))
        return f"{type(mod).__module__}.{type(mod).__qualname__}"
    if node.op == "call_function":
        short = getattr(t, "__name__", None)
        if short:
            for prefix, ns in (("torch", torch), ("torch.nn.functional", torch.nn.functional)):
                if getattr(ns, short, None) is t:
                    return f"{prefix}.{short}"
        mod_name = getattr(t, "__module__", None) or ""
        name = getattr(t, "__qualname__", None) or short or str(t)
        if mod_name in ("_operator", "operator"):
            mod_name = "operator"
        return f"{mod_name}.{name}" if mod_name else str(name)
    return str(t)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def _is_inplace(node: Node, mod: torch.nn.Module | None) -> bool:
    if node.op == "call_module":
        return bool(getattr(mod, "inplace", False))
    if node.kwargs.get("inplace") is True:
        return True
    if node.op == "call_function":
        if node.target in _INPLACE_OPERATORS:
            return True
        if isinstance(node.target, torch._ops.OpOverload):  # aten.relu_, aten.add.out: the schema says
            return bool(node.target._schema.is_mutable)
        name = getattr(node.target, "__name__", "")
        return name.endswith("_") and not name.endswith("__")
    if node.op == "call_method":
        name = str(node.target)
        return (name.endswith("_") and not name.endswith("__")) or name == "__setitem__"
    return False


def _tensors(x: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)]


@dataclass
class _Rec:
    fwd_s: float = 0.0
    bwd_s: float = 0.0
    flops: int = 0
    out_bytes: int = 0
    out_shape: tuple[int, ...] | None = None
    out_dtype: str = "float32"
    saved_bytes: int = 0
    saved_tensors: int = 0
    self_saved: bool = False
    workspace_bytes: int = 0
    fwd_workspace_bytes: int = 0
    raw: RawLog | None = None  # [Note: allocation log]: the run's, and the producers it names
    names: tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]] = ((), (), ())  # inputs', shared, saved


class _Walker:
    def __init__(self, gm: GraphModule, inputs: tuple[Any, ...], backend: Backend,
                 autocast: torch.dtype | None = None) -> None:
        self.gm = gm
        self.backend = backend
        self.autocast = autocast
        self.inputs = iter(inputs)
        self.env: dict[Node, Any] = {}
        self.env_keys: dict[Node, list[int]] = {}
        self.env_rg: dict[Node, bool] = {}
        self.ledger = StorageLedger(backend.static_tensors())
        self.memo: dict[Hashable, Entry | None] = {}

    def _store(self, node: Node, value: Any) -> list[int]:
        self.env[node] = value
        keys = self.ledger.register(node.name, value)
        self.env_keys[node] = keys
        self.env_rg[node] = any(t.requires_grad for t in _tensors(value))
        return keys

    def free(self, node: Node) -> None:
        if node in self.env:
            del self.env[node]
            self.ledger.release(self.env_keys.pop(node))

    def _describe(self, rec: _Rec, value: Any) -> None:
        ts = _tensors(value)
        # under autocast the runtime sends every floating tensor at the autocast width
        wire = self.autocast
        rec.out_bytes = sum(t.numel() * wire.itemsize if wire is not None and t.is_floating_point()
                            else tensor_bytes(t) for t in ts)
        if ts:
            rec.out_shape = tuple(int(s) for s in ts[0].shape)
            dt = wire if wire is not None and ts[0].is_floating_point() else ts[0].dtype
            rec.out_dtype = dtype_name(dt)

    def run(self, node: Node) -> _Rec:
        rec = _Rec()
        if node.op == "placeholder":
            try:
                value = self.backend.input(next(self.inputs))
            except StopIteration:
                if node.args:  # a parameter with a default value
                    value = self.backend.input(node.args[0])
                    self._store(node, value)
                    self._describe(rec, value)
                    return rec
                raise ProfileError(
                    f"graph placeholder {node.format_node()} has no example input: pass one "
                    f"tensor per placeholder in example_inputs"
                ) from None
            self._store(node, value)
            self._describe(rec, value)
            return rec
        if node.op == "get_attr":
            value = self.backend.attr(fetch_attr(self.gm, str(node.target)))
            for t in _tensors(value):
                self.ledger.add_static(t)
            self._store(node, value)
            self._describe(rec, value)
            return rec
        if node.op == "output":
            return rec
        return self._run_call(node, rec)

    def _inputs(self, node: Node, inplace: bool
                ) -> tuple[tuple[Any, ...], dict[str, Any], list[tuple[torch.Tensor, torch.Tensor]]]:
        """Fresh detached inputs for one run; an in-place op gets a clone of its first tensor."""
        clones: list[tuple[torch.Tensor, torch.Tensor]] = []

        def leaf(n: Node) -> Any:
            rg = self.env_rg[n]

            def conv(t: Any) -> Any:
                if not isinstance(t, torch.Tensor):
                    return t
                x = t.detach()
                if rg and (x.is_floating_point() or x.is_complex()):
                    x.requires_grad_(True)
                if inplace and not clones:
                    c = x.clone()
                    clones.append((c, t))
                    return c
                return x

            return tree_map(conv, self.env[n])

        args = map_arg(node.args, leaf)
        kwargs = map_arg(node.kwargs, leaf)
        assert isinstance(args, tuple) and isinstance(kwargs, dict)
        return args, kwargs, clones

    def _run_call(self, node: Node, rec: _Rec) -> _Rec:
        backend = self.backend
        mod: torch.nn.Module | None = None
        call: Callable[[tuple[Any, ...], dict[str, Any]], Any]
        if node.op == "call_module":
            mod = self.gm.get_submodule(str(node.target))
            m = mod

            def call(a: tuple[Any, ...], k: dict[str, Any]) -> Any:
                return backend.call_module(m, a, k)
        elif node.op == "call_function":
            fn = node.target
            assert callable(fn)

            def call(a: tuple[Any, ...], k: dict[str, Any]) -> Any:
                return fn(*a, **k)
        elif node.op == "call_method":
            meth = str(node.target)

            def call(a: tuple[Any, ...], k: dict[str, Any]) -> Any:
                return getattr(a[0], meth)(*a[1:], **k)
        else:
            raise ProfileError(f"unknown fx op {node.op!r} at node {node.format_node()}")
        inplace = _is_inplace(node, mod)
        key = None
        if backend.memoise and not inplace:
            key = memo_key(node, mod, self.env.__getitem__, self.env_rg.__getitem__, self.autocast)
            hit = self.memo.get(key) if key is not None else None
            if hit is not None:
                return self._replay(node, rec, hit)
        entry: Entry | None = None
        params = backend.params_of(mod) if mod is not None else []

        fwd_times: list[float] = []
        bwd_times: list[float] = []
        for i in range(backend.n_runs):
            accounting = i == 0
            args, kwargs, clones = self._inputs(node, inplace)
            saved: list[torch.Tensor] = []
            cap = capture_saved(saved) if accounting else nullcontext()
            cast = (torch.autocast(device_type=backend.device_type, dtype=self.autocast)
                    if self.autocast is not None else nullcontext())
            with cap, cast, backend.phase("fwd", accounting) as pf:
                out = call(args, kwargs)
            if pf.seconds is not None:
                fwd_times.append(pf.seconds)
            if accounting:
                rec.flops = pf.flops or 0
                rec.workspace_bytes = rec.fwd_workspace_bytes = pf.workspace or 0
                for c, orig in clones:
                    self.ledger.alias(c, orig)
                value = tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out)
                out_keys = self._store(node, value)
                self.env_rg[node] = any(t.requires_grad for t in _tensors(out))
                self._describe(rec, value)
                rec.saved_bytes, rec.self_saved = self.ledger.account(node.name, saved, out_keys)
                rec.saved_tensors = len(saved)
                self._name_producers(rec, node, _tensors((args, kwargs)), out_keys, saved)
                if key is not None:
                    entry = make_entry(rec.flops, rec.workspace_bytes, out,
                                       input_tensors(node, self.env.__getitem__), saved, self.ledger.static_keys)
            del saved
            outs = [t for t in _tensors(out) if t.requires_grad]
            pb, grads = PhaseResult(), []
            if outs:
                grads = [torch.ones_like(t) for t in outs]
                with backend.phase("bwd", accounting) as pb:
                    torch.autograd.backward(outs, grads)
                if pb.seconds is not None:
                    bwd_times.append(pb.seconds)
                if accounting:
                    rec.workspace_bytes = max(rec.workspace_bytes, pb.workspace or 0)
            if accounting:
                rec.raw = raw_log(pf.alloc, pb.alloc, out, _tensors((args, kwargs)), params, grads)
            del grads
            del out, outs, args, kwargs, clones
            for p in params:
                p.grad = None
        if fwd_times:
            rec.fwd_s = backend.summarise(fwd_times)
        if bwd_times:
            rec.bwd_s = backend.summarise(bwd_times)
        if key is not None and entry is not None:
            self.memo[key] = dataclasses.replace(entry, fwd_s=rec.fwd_s, bwd_s=rec.bwd_s, workspace=rec.workspace_bytes,
                                                 fwd_workspace=rec.fwd_workspace_bytes, alloc=rec.raw)
        return rec

    def _name_producers(self, rec: _Rec, node: Node, inputs: list[torch.Tensor], out_keys: list[int],
                        saved: list[torch.Tensor]) -> None:
        """The producers of the node's inputs, of the storages its output shares and of those it saves."""
        owner = self.ledger.owner
        shared = tuple(owner[k] for k in out_keys if owner.get(k, node.name) != node.name)
        saves = tuple(n for n in self.ledger.producers(saved) if n)
        rec.names = (tuple(self.ledger.producers(inputs)), shared, saves)

    def _replay(self, node: Node, rec: _Rec, e: Entry) -> _Rec:
        """A node identical to one already run: its recorded costs, fresh outputs, and what it
        saves attributed by the ledger as a run would be (see [Note: node memo])."""
        value, saved = replay(e, input_tensors(node, self.env.__getitem__))
        out_keys = self._store(node, value)
        self.env_rg[node] = e.requires_grad
        self._describe(rec, value)
        rec.saved_bytes, rec.self_saved = self.ledger.account(node.name, saved, out_keys)
        rec.saved_tensors = len(saved)
        rec.fwd_s, rec.bwd_s, rec.flops, rec.workspace_bytes = e.fwd_s, e.bwd_s, e.flops, e.workspace
        rec.fwd_workspace_bytes = e.fwd_workspace
        rec.raw = e.alloc
        self._name_producers(rec, node, input_tensors(node, self.env.__getitem__), out_keys, saved)
        return rec


def walk(
    gm: GraphModule,
    inputs: tuple[Any, ...],
    backend: Backend,
    optimizer: str,
    progress: bool = True,
    autocast: torch.dtype | None = None,
) -> tuple[list[NodeCost], list[tuple[str, str]]]:
    """Run every node of ``gm`` once (plus timing repeats) and build its NodeCost table.

    A node's value is freed as soon as its last consumer has run. Each run feeds the node
    detached copies of its inputs; a float input requires grad when its producer's output
    did (parameters require grad, the example inputs usually do not), as in training.
    With ``autocast`` (bfloat16 or float16) every forward runs under ``torch.autocast`` as the
    runtime's does, so saved tensors, workspaces and times are those of mixed precision, and
    outputs are counted at that width (the runtime sends floating tensors in it).
    """
    from tqdm.auto import tqdm

    nodes: list[Node] = list(gm.graph.nodes)
    users_left = {n: len(n.users) for n in nodes}
    static: dict[str, StaticCost] = static_costs(gm, optimizer)
    walker = _Walker(gm, inputs, backend, autocast)
    recs: list[_Rec] = []
    show = progress and sys.stderr.isatty()
    with backend.context(), tqdm(total=len(nodes), desc="nowdl profile", unit="node",
                                 disable=not show, delay=1.0, file=sys.stderr) as bar:
        for node in nodes:
            try:
                recs.append(walker.run(node))
            except ProfileError:
                raise
            except Exception as e:
                _refuse_size(gm, inputs, e)
                raise ProfileError(
                    f"could not profile node {node.format_node()} "
                    f"(target {target_name(node, gm)}): {type(e).__name__}: {str(e).rstrip('. ')}. "
                    f"Check that the model runs eagerly on the example inputs; in estimate "
                    f"mode an op without a fake-tensor kernel cannot be estimated, so use "
                    f"mode='measure' or replace the op."
                ) from e
            for inp in node.all_input_nodes:
                users_left[inp] -= 1
                if users_left[inp] == 0:
                    walker.free(inp)
            if users_left[node] == 0:
                walker.free(node)
            bar.update(1)
    costs = []
    for node, rec in zip(nodes, recs, strict=True):
        st = static.get(node.name, StaticCost())
        costs.append(NodeCost(
            name=node.name,
            op=node.op,
            target=target_name(node, gm),
            fwd_s=rec.fwd_s,
            bwd_s=rec.bwd_s,
            flops=rec.flops,
            out_bytes=rec.out_bytes,
            out_shape=rec.out_shape,
            out_dtype=rec.out_dtype,
            saved_bytes=rec.saved_bytes,
            saved_tensors=rec.saved_tensors,
            act_bytes=walker.ledger.act.get(node.name, 0),
            self_saved=rec.self_saved,
            param_bytes=st.param_bytes,
            buffer_bytes=st.buffer_bytes,
            grad_bytes=st.grad_bytes,
            optim_bytes=st.optim_bytes,
            workspace_bytes=rec.workspace_bytes,
            fwd_workspace_bytes=rec.fwd_workspace_bytes,
            alloc=node_log(rec.raw, *rec.names, st.sizes, st.fixed),
        ))
    edges = [(inp.name, node.name) for node in nodes for inp in node.all_input_nodes]
    return costs, edges



def _refuse_size(gm: GraphModule, inputs: tuple[Any, ...], e: Exception) -> None:
    """Raise the one-paragraph refusal of an input size the network cannot take ([Note: size
    multiples]) when ``e`` is a size mismatch that a nearby multiple avoids."""
    if "size" not in str(e).lower():
        return
    from nowdl.trace.sizes import size_refusal

    tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
    msg = size_refusal(gm, tensors, "the model")
    if msg is not None:
        raise ProfileError(msg) from e
