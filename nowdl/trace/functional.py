"""Make a traced graph free of in-place writes, so any cut between stages keeps its meaning.

[Note: functional graphs] ``relu_(x)`` changes ``x`` for every later user. Inside one process
that is what eager PyTorch does; across stages it is not: a stage that received ``x`` holds
a leaf tensor autograd will not let it write, and a later stage that also receives ``x`` gets
the value from before the write. So every write is turned into an out-of-place op whose
result the later users read instead: in-place modules (``nn.ReLU(inplace=True)``, copied with
``inplace=False``; the model's own module is left alone), ``inplace=True`` arguments,
``torch.relu_``-style functions, ``x += y`` (``operator.iadd``), ``x[i] = v``, ``x.add_(y)``
methods, and ATen ops whose schema writes an argument (``aten.relu_``, ``aten.add.out``).
Writes to parameters and buffers (BatchNorm's ``num_batches_tracked += 1``) are state, not
data flow, and stay. Which values share memory is read off storage identity: of the fake values
an exported graph recorded ([Note: recorded aliasing]), else of a run on fake tensors: a write through a view whose base or sibling views are read later becomes one
node that writes a copy of the base through the same views, and those readers read the copy.
"""

from __future__ import annotations

import copy
import inspect
import logging
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from nowdl.trace.aliasing import parents_from, recorded_view_parents, storage_keys

__all__ = ["functionalize", "inplace_write"]

log = logging.getLogger(__name__)

_OPERATORS: dict[Callable[..., Any], Callable[..., Any]] = {
    operator.iadd: operator.add, operator.isub: operator.sub, operator.imul: operator.mul,
    operator.itruediv: operator.truediv, operator.ifloordiv: operator.floordiv,
    operator.imod: operator.mod, operator.ipow: operator.pow, operator.iand: operator.and_,
    operator.ior: operator.or_, operator.ixor: operator.xor, operator.ilshift: operator.lshift,
    operator.irshift: operator.rshift, operator.imatmul: operator.matmul,
}
# methods ending in "_" that do not write the tensor's values
_NOT_WRITES = {"requires_grad_", "retain_grad", "share_memory_", "record_stream", "set_grad_enabled_"}


def _setitem(x: torch.Tensor, index: Any, value: Any) -> torch.Tensor:
    """Out-of-place ``x[index] = value``."""
    y = x.clone()
    y[index] = value
    return y


def _copy(x: torch.Tensor, src: Any, non_blocking: bool = False) -> torch.Tensor:
    """Out-of-place ``x.copy_(src)``: src broadcast to x's shape, dtype and device."""
    s = src if isinstance(src, torch.Tensor) else torch.as_tensor(src)
    return s.to(device=x.device, dtype=x.dtype, non_blocking=non_blocking).expand_as(x).clone()


def _zero(x: torch.Tensor) -> torch.Tensor:
    """Out-of-place ``x.zero_()``."""
    return torch.zeros_like(x)


def _fill(x: torch.Tensor, value: Any) -> torch.Tensor:
    """Out-of-place ``x.fill_(value)`` (a tensor value keeps its gradient)."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype=x.dtype, device=x.device).expand_as(x).clone()
    return torch.full_like(x, value)


_METHODS: dict[str, Callable[..., Any]] = {"copy_": _copy, "zero_": _zero, "fill_": _fill}


@dataclass
class _Write:
    """An in-place node: the value it writes and how to make it out-of-place."""

    node: fx.Node
    written: fx.Node
    rewrite: Callable[[], None]


def _bound_inplace(fn: Callable[..., Any], node: fx.Node) -> str | None:
    """The name under which ``fn``'s ``inplace`` argument is True at ``node``, if it is."""
    if node.kwargs.get("inplace") is True:
        return "inplace"
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    if "inplace" not in sig.parameters:
        return None
    try:
        bound = sig.bind(*node.args, **node.kwargs)
    except TypeError:
        return None
    return "inplace" if bound.arguments.get("inplace") is True else None


def _aten_functional(op: torch._ops.OpOverload) -> tuple[torch._ops.OpOverload, list[int], list[str]] | None:
    """The out-of-place overload of a writing ATen op, the written positions and out= names."""
    schema = op._schema
    writes = [i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write]
    if not writes:
        return None
    name, _, overload = schema.name.partition("::")[2], None, op._overloadname
    outs = [a.name for a in schema.arguments if a.is_out]
    packet_name = name[:-1] if name.endswith("_") and not outs else name
    packet = getattr(torch.ops.aten, packet_name, None)
    if packet is None:
        return None
    keep = [a for a in schema.arguments if not a.is_out]
    want = [(a.name, str(a.type)) for a in keep]
    candidates = [overload] if not outs else list(packet.overloads())
    for ov in candidates:
        f = getattr(packet, ov, None)
        if f is None or f is op:
            continue
        fs = f._schema
        if fs.is_mutable:
            continue
        if [(a.name, str(a.type)) for a in fs.arguments] == want:
            return f, writes, outs
    return None


def inplace_write(gm: fx.GraphModule, node: fx.Node) -> _Write | None:
    """If ``node`` writes one of its inputs in place, what it writes and how to undo that."""
    if node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        if getattr(mod, "inplace", False) is True and node.args and isinstance(node.args[0], fx.Node):
            def rewrite_module() -> None:
                new = copy.copy(mod)
                new.inplace = False  # type: ignore[assignment]
                owner, _, leaf = str(node.target).rpartition(".")
                setattr(gm.get_submodule(owner) if owner else gm, leaf, new)
            return _Write(node, node.args[0], rewrite_module)
        return None
    if node.op == "call_method":
        name = str(node.target)
        if not name.endswith("_") or name.endswith("__") or name in _NOT_WRITES:
            return None
        if not node.args or not isinstance(node.args[0], fx.Node):
            return None
        if name in _METHODS:
            helper = _METHODS[name]

            def rewrite_helper() -> None:
                node.op, node.target = "call_function", helper
            return _Write(node, node.args[0], rewrite_helper)
        if not hasattr(torch.Tensor, name[:-1]):
            return None

        def rewrite_method() -> None:
            node.target = name[:-1]
        return _Write(node, node.args[0], rewrite_method)
    if node.op != "call_function":
        return None
    target = node.target
    first = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    if isinstance(target, torch._ops.OpOverload):
        found = _aten_functional(target)
        if found is None:
            return None
        func, writes, outs = found
        written = None
        if outs:
            written = node.kwargs.get(outs[0])
        elif writes[0] < len(node.args):
            written = node.args[writes[0]]
        if not isinstance(written, fx.Node):
            return None

        def rewrite_aten() -> None:
            node.target = func
            node.kwargs = {k: v for k, v in node.kwargs.items() if k not in outs}
        return _Write(node, written, rewrite_aten)
    fn: Any = target
    if first is None:
        return None
    if fn in _OPERATORS:
        def rewrite_operator() -> None:
            node.target = _OPERATORS[fn]  # type: ignore[index]
        return _Write(node, first, rewrite_operator)
    if fn is operator.setitem:
        def rewrite_setitem() -> None:
            node.target = _setitem
        return _Write(node, first, rewrite_setitem)
    if not callable(fn):
        return None
    key = _bound_inplace(fn, node)
    if key is not None:
        def rewrite_kwarg() -> None:
            try:
                bound = inspect.signature(fn).bind(*node.args, **node.kwargs)
            except (TypeError, ValueError):  # pragma: no cover - checked by _bound_inplace
                node.kwargs = {**node.kwargs, "inplace": False}
                return
            bound.arguments["inplace"] = False
            node.args, node.kwargs = tuple(bound.args), dict(bound.kwargs)
        return _Write(node, first, rewrite_kwarg)
    short = getattr(fn, "__name__", "")
    if short.endswith("_") and not short.endswith("__"):
        ns = next((ns for ns in (torch, torch.nn.functional, torch.special)
                   if getattr(ns, short, None) is fn and callable(getattr(ns, short[:-1], None))), None)
        if ns is not None:
            out_of_place = getattr(ns, short[:-1])

            def rewrite_function() -> None:
                node.target = out_of_place
            return _Write(node, first, rewrite_function)
    return None


def _view_parents(gm: fx.GraphModule, inputs: Sequence[torch.Tensor]) -> dict[fx.Node, fx.Node | None]:
    """For every node, the input it is a view of (shares memory with), from one fake-tensor run."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    keys: dict[fx.Node, set[int]] = {}
    mode = FakeTensorMode(allow_non_fake_inputs=True)

    class _Probe(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            out = super().run_node(n)
            keys[n] = storage_keys(out)
            return out

    # the probe runs the model's own modules in train mode: BatchNorm would count a batch
    saved = [(b, b.detach().clone()) for b in gm.buffers()]
    try:
        with mode, torch.no_grad():
            fakes = [mode.from_tensor(x) if x.device.type != "meta" else
                     torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="cpu") for x in inputs]
            _Probe(gm, garbage_collect_values=False).run(*fakes)  # keep values: no address reuse
    finally:
        with torch.no_grad():
            for b, old in saved:
                b.copy_(old)
    return parents_from(gm, keys)


def _root(n: fx.Node, parent: dict[fx.Node, fx.Node | None]) -> fx.Node:
    while (p := parent.get(n)) is not None:
        n = p
    return n


def _chain(n: fx.Node, root: fx.Node, parent: dict[fx.Node, fx.Node | None]) -> list[fx.Node]:
    """The view nodes from ``root`` (excluded) down to ``n`` (included)."""
    out = []
    while n is not root:
        out.append(n)
        p = parent[n]
        assert p is not None
        n = p
    return out[::-1]


def functionalize(gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor]) -> list[str]:
    """Rewrite every in-place write in ``gm`` out of place (see [Note: functional graphs]).

    A write into a value no other alias of which is read later becomes its out-of-place op.
    A write through a view whose base (or another view of it) is read later becomes one node
    that copies the base, writes the copy through the same views and returns it; the base's
    later readers read the copy, and the views read later are taken again from it.

    Args:
        gm: the traced graph, changed in place (its code is recompiled).
        example_inputs: inputs of the traced shapes (meta tensors are fine): a run on fake
            tensors finds which values share memory.

    Returns:
        The names of the nodes rewritten.
    """
    nodes = list(gm.graph.nodes)
    # decided before any rewrite: replacing an in-place module also changes its other calls
    writers = [n for n in nodes if (w := inplace_write(gm, n)) is not None and w.written.op != "get_attr"]
    if not writers:
        return []
    parent = recorded_view_parents(gm)  # [Note: recorded aliasing]
    if parent is None:
        parent = _view_parents(gm, example_inputs)
    order = {n: i for i, n in enumerate(nodes)}
    done: list[str] = []
    for node in writers:
        w = inplace_write(gm, node)
        if w is None:  # a second call of an in-place module already made out-of-place
            w = _Write(node, node.args[0], lambda: None) if isinstance(node.args[0], fx.Node) else None
        if w is None:  # pragma: no cover - in-place modules always take a tensor first
            continue
        written = w.written
        root = _root(written, parent)
        if root.op == "get_attr":
            continue  # a write into a parameter or buffer (through a view): state, not data flow
        # values made before the write, sharing its memory and read after it, see the write in
        # eager PyTorch (values made after it are taken from already-rewritten inputs)
        aliases = [a for a in gm.graph.nodes if order[a] < order[node] and a is not written
                   and _root(a, parent) is root and any(order[u] > order[node] for u in a.users)]
        if not aliases:
            later = [u for u in written.users if order[u] > order[node]]
            w.rewrite()
            for u in later:
                _repoint(u, written, node, parent)
            parent[node] = None  # its result is a new tensor now
        else:
            _replay(gm, node, w, root, aliases, parent, order, len(done))
        done.append(node.name)
    gm.graph.lint()
    gm.recompile()
    log.info("made %d in-place node(s) out-of-place: %s", len(done), ", ".join(done[:8]))
    return done


def _repoint(user: fx.Node, old: fx.Node, new: fx.Node, parent: dict[fx.Node, fx.Node | None]) -> None:
    """``user`` reads ``new`` instead of ``old`` (and is a view of it if it was a view of ``old``)."""
    user.replace_input_with(old, new)
    if parent.get(user) is old:
        parent[user] = new


def _replay(gm: fx.GraphModule, node: fx.Node, w: _Write, root: fx.Node, aliases: list[fx.Node],
            parent: dict[fx.Node, fx.Node | None], order: dict[fx.Node, int], index: int) -> None:
    """Replace a write through views of ``root`` by one node returning a written copy of ``root``."""
    written = w.written
    chain = _chain(written, root, parent)
    # the write as a small graph: copy the base, take the same views of the copy, write them
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    ext: list[fx.Node] = [root]
    env[root] = sub.placeholder("base")
    for n in [*chain, node]:
        for a in n.all_input_nodes:
            if a not in env and a not in chain:
                env[a] = sub.placeholder(f"in{len(ext)}")
                ext.append(a)
    copy_ = sub.call_method("clone", (env[root],))
    env_copy = dict(env)
    env_copy[root] = copy_
    for n in [*chain, node]:
        env_copy[n] = sub.node_copy(n, lambda a: env_copy[a])
    sub.output(copy_)
    name = f"_nowdl_write_{index}"
    gm.add_submodule(name, fx.GraphModule(gm, sub, class_name="WriteThroughView"))
    with gm.graph.inserting_after(node):
        new_root = gm.graph.call_module(name, tuple(ext))
    new_root.meta = dict(node.meta)
    parent[new_root] = None
    order[new_root] = order[node]
    # re-take every alias read later (and the written view, which the node returned) from the copy
    last = new_root
    for a in [*aliases, written, node]:
        if a is root:
            fresh = new_root
        else:
            src = written if a is node else a
            fresh = new_root
            for v in _chain(src, root, parent):
                prev, was = fresh, parent[v]

                def arg(x: fx.Node, prev: fx.Node = prev, was: fx.Node | None = was) -> fx.Node:
                    return prev if x is was else x
                with gm.graph.inserting_after(last):
                    fresh = gm.graph.node_copy(v, arg)
                parent[fresh] = prev
                order[fresh] = order[node]
                last = fresh
        for u in [u for u in a.users if order.get(u, -1) > order[node]]:
            _repoint(u, a, fresh, parent)
    for u in list(node.users):
        u.replace_input_with(node, written)  # only earlier readers are left: none, a write is read after
    gm.graph.erase_node(node)
    parent.pop(node, None)
