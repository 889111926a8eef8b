"""Which values of an exported graph share memory, read from the fake values torch.export recorded.

[Note: recorded aliasing] Making in-place writes out of place (:mod:`nowdl.trace.functional`)
needs, for every node, the input whose memory its value shares (a view, or the input itself).
An fx graph has no values, so that takes a run on fake tensors. An exported graph already holds
one fake value per node (``node.meta["val"]``), with the storages the export's run shared:
:func:`recorded_view_parents` reads the answer from them, and runs only the nodes whose
recorded value may share less memory than eager PyTorch does, on the recorded inputs. Those
are ops that can return their input itself (a CompositeImplicitAutograd ATen op such as
``dropout`` with p = 0 or ``to`` to the same dtype, which the export records as a new value) and
lifted modules of a type not known never to do so (Dropout, Identity, Flatten, ...). A storage
such a run finds shared is merged with the input's. The answer is the fake run's, node for node,
as tests/trace/test_aliasing.py checks; where a node cannot be run this way it is None and the
caller makes the fake run.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["storage_keys", "parents_from", "recorded_view_parents"]

# lifted module types whose forward never returns (a view of) its input, except in place, where
# the export records the same storage (ReLU(inplace=True) records relu_'s result: its input)
_NEW_VALUE_MODULES = (
    nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
    nn.Linear, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.LayerNorm, nn.GroupNorm,
    nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d, nn.ReLU, nn.LeakyReLU, nn.PReLU,
    nn.GELU, nn.SiLU, nn.Sigmoid, nn.Tanh, nn.ELU, nn.Softmax, nn.MaxPool1d, nn.MaxPool2d,
    nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
)


def storage_keys(value: Any) -> set[int]:
    """The storages the tensors in ``value`` live in (one key per storage)."""
    ks = set()
    for t in tree_flatten(value)[0]:
        if isinstance(t, torch.Tensor):
            try:
                ks.add(int(t.untyped_storage()._cdata))
            except (RuntimeError, NotImplementedError):
                pass
    return ks


def parents_from(gm: fx.GraphModule, keys: dict[fx.Node, set[int]]) -> dict[fx.Node, fx.Node | None]:
    """For every node, its first input sharing a storage with it (None: none does)."""
    parent: dict[fx.Node, fx.Node | None] = {}
    for n in gm.graph.nodes:
        mine = keys.get(n, set())
        parent[n] = next((a for a in n.all_input_nodes if mine and keys.get(a, set()) & mine), None)
    return parent


def _trusted(gm: fx.GraphModule, n: fx.Node) -> bool:
    """Whether ``n``'s recorded value shares exactly the memory its eager run shares."""
    if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload):
        return not n.target.has_kernel_for_dispatch_key(torch._C.DispatchKey.CompositeImplicitAutograd)
    if n.op == "call_module":
        return type(gm.get_submodule(str(n.target))) in _NEW_VALUE_MODULES
    return False


def _rerun(gm: fx.GraphModule, n: fx.Node, vals: dict[fx.Node, Any], mode: Any) -> list[Any]:
    """``n`` run again on the recorded inputs, in their fake mode: its flat outputs. A parameter
    or buffer it reads is the mode's fake of the real one, as in the fake run."""
    def arg(a: fx.Node) -> Any:
        if a.op == "get_attr" and a not in vals:
            vals[a] = tree_map(lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t,
                               _fetch(gm, str(a.target)))
        return vals[a]

    args = fx.node.map_arg(n.args, arg)
    kwargs = fx.node.map_arg(n.kwargs, arg)
    with mode, torch.no_grad():
        if n.op == "call_module":
            out = gm.get_submodule(str(n.target))(*args, **kwargs)
        elif n.op == "call_function":
            out = n.target(*args, **kwargs)  # type: ignore[operator]
        else:
            out = getattr(args[0], str(n.target))(*args[1:], **kwargs)
    return list(tree_flatten(out)[0])


def recorded_view_parents(gm: fx.GraphModule) -> dict[fx.Node, fx.Node | None] | None:
    """For every node, the input it is a view of, as the fake run of
    :func:`nowdl.trace.functional._view_parents` finds it (see [Note: recorded aliasing]);
    None when the graph holds no recorded fake values or a node cannot be checked."""
    from torch._subclasses.fake_tensor import FakeTensor

    vals: dict[fx.Node, Any] = {}
    mode = None
    for n in gm.graph.nodes:
        if n.op in ("output", "get_attr"):
            continue
        if "val" not in n.meta:
            return None
        flat = tree_flatten(n.meta["val"])[0]
        for t in flat:
            if isinstance(t, torch.Tensor):
                if not isinstance(t, FakeTensor) or (mode is not None and t.fake_mode is not mode):
                    return None
                mode = t.fake_mode
        vals[n] = n.meta["val"]
    if mode is None:
        return None
    root: dict[int, int] = {}  # union-find over storages: eager runs that share what the record does not

    def find(k: int) -> int:
        while root.get(k, k) != k:
            k = root[k]
        return k

    for n in gm.graph.nodes:
        if n.op in ("placeholder", "get_attr", "output") or _trusted(gm, n):
            continue
        try:
            fresh = _rerun(gm, n, vals, mode)
        except Exception:  # noqa: BLE001 (a node this cannot run: the caller runs the graph)
            return None
        recorded = tree_flatten(vals[n])[0]
        if len(fresh) != len(recorded):
            return None
        inputs = {k for a in n.all_input_nodes if a in vals for k in storage_keys(vals[a])}
        for f, r in zip(fresh, recorded, strict=True):
            if not isinstance(f, torch.Tensor) or not isinstance(r, torch.Tensor):
                continue
            fk, rk = next(iter(storage_keys(f)), None), next(iter(storage_keys(r)), None)
            if rk is None or fk is None:
                return None
            if fk in inputs:
                a, b = find(rk), find(fk)
                if a != b:
                    root[a] = b
            elif rk in inputs:
                return None  # recorded as shared where the eager run makes a new value
    keys: dict[fx.Node, set[int]] = {}
    for n in gm.graph.nodes:
        if n.op == "get_attr":  # the fake run fetches the real tensor: a storage no fake shares
            keys[n] = storage_keys(_fetch(gm, str(n.target)))
        elif n.op == "output":
            keys[n] = {k for a in n.all_input_nodes for k in keys.get(a, set())}
        elif n in vals:
            keys[n] = {find(k) for k in storage_keys(vals[n])}
    return parents_from(gm, keys)


def _fetch(gm: fx.GraphModule, target: str) -> Any:
    """The attribute a ``get_attr`` node reads."""
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
