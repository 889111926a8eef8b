"""A rank's step as the caching allocator sees it: the nodes' logged allocations in the runtime's order.

[Note: allocation order] :class:`RankOrder` replays, for the stages one rank holds, the
allocations each node logged while it was profiled ([Note: allocation log]) in the order the
runtime makes them, as calls to a :class:`~nowdl.profiler.alloc.caching.CachingAllocator`:

* before the first step each parameter, buffer and frozen parameter, one allocation each;
* a forward ``F`` (stage, micro-batch): the received tensors (or the batch, for the input's
  placeholder), then node by node its forward's events; a node's output lives while a later node
  of the stage still reads it, or until the stage's forward ends when a later stage reads it (it
  is sent), and while a node that saves it waits for its backward; what a node saves of its own
  waits for its backward too. The last stage's loss keeps its saved tensors and labels
  (``act_bytes`` of the output node) until the backward;
* a backward ``B``: the received gradients of the stage's outputs (the loss's gradients on the
  last stage, after its transient), then node by node in reverse its backward's events; a
  gradient lives until its producer's backward has run, a second gradient of the same tensor is
  added into the first and freed (autograd's in-place accumulation); parameter gradients stay
  to the end of the step, and a later micro-batch's are added in place. The gradients of the
  received tensors die when the backward ends (sent);
* a recomputed stage's forward saves nothing but keeps its inputs; its backward runs the forward
  again (saving) before the backward ([Note: recompute]); an offloaded stage's forward keeps no
  saved tensor on the device but its inputs, and its backward fetches them back in the reverse of
  the saving order, at most ``WINDOW`` times the largest ahead of the node that reads them, each
  freed after the last backward that reads it ([Note: offload] in runtime/pipeline/offload.py);
* an inference forward frees what a node saves at once; ``W`` (zero bubble) allocates nothing
  here: its ``B`` is charged whole;
* the step begins by freeing the previous step's parameter gradients (``zero_grad(set_to_none=True)``)
  and ends with the optimizer: its states are allocated at the first step, and Adam's foreach
  update holds one temporary per parameter (``_foreach_sqrt`` of the second moments).

Batch sizes other than the profiled one scale every activation allocation by the ratio (the
parameters and their gradients do not scale).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from nowdl.profiler.alloc.caching import CachingAllocator
from nowdl.profiler.alloc.log import AllocLog
from nowdl.profiler.cost import NodeCost, Profile
from nowdl.profiler.memory import OPTIMIZER_STATES

__all__ = ["StageNodes", "RankOrder", "stage_nodes", "WINDOW"]

WINDOW = 2  # the offload prefetch window, in largest saved tensors (runtime/pipeline/offload.py)


@dataclass(frozen=True)
class StageNodes:
    """One stage's nodes in forward order, what it receives and sends, where each value is last read."""

    nodes: tuple[NodeCost, ...]
    recv: tuple[str, ...]  # producers in other stages whose outputs the stage reads
    sent: frozenset[str]  # the stage's nodes whose outputs later stages read
    inputs: dict[str, tuple[str, ...]]  # node -> the producers it reads
    last: dict[str, int]  # value -> position (in ``nodes``) of its last reader in the stage
    out_bytes: dict[str, int]
    loss: bool  # holds the model's output node (the loss runs here)


def stage_nodes(prof: Profile, names: Sequence[str]) -> StageNodes:
    """The :class:`StageNodes` of the stage made of the profile's nodes ``names``."""
    mine = set(names)
    nodes = tuple(n for n in prof.nodes if n.name in mine and n.op != "get_attr")
    static = {n.name for n in prof.nodes if n.op == "get_attr"}
    inputs: dict[str, list[str]] = {n.name: [] for n in nodes}
    sent: set[str] = set()
    recv: list[str] = []
    for u, v in prof.edges:
        if v in inputs and u not in static:
            inputs[v].append(u)
            if u not in mine and u not in recv:
                recv.append(u)
        elif u in mine and v not in mine:
            sent.add(u)
    last: dict[str, int] = {}
    for i, n in enumerate(nodes):
        for u in inputs[n.name]:
            last[u] = i
    return StageNodes(nodes, tuple(recv), frozenset(sent), {k: tuple(v) for k, v in inputs.items()}, last,
                      {n.name: n.out_bytes for n in prof.nodes}, any(n.op == "output" for n in nodes))


@dataclass(eq=False)
class _Value:
    """The allocations behind one node's output (or a received tensor), and who still holds them."""

    handles: list[int]
    nbytes: int = 0
    refs: int = 1
    parents: list[_Value] = field(default_factory=list)  # values whose storage it shares


class RankOrder:
    """Replays one rank's steps through ``sim`` ([Note: allocation order])."""

    def __init__(self, sim: CachingAllocator, stages: dict[tuple[int, int], StageNodes], *, optimizer: str,
                 scale: float = 1.0, recompute: frozenset[int] = frozenset(), offload: frozenset[int] = frozenset()) -> None:
        self.sim, self.stages, self.scale = sim, stages, scale
        self.recompute, self.offload = recompute, offload
        self.states = OPTIMIZER_STATES.get(optimizer, 0)
        self.adam = optimizer in ("adam", "adamw")
        self.vals: dict[tuple[object, ...], _Value] = {}
        self.kept: dict[tuple[object, ...], list[int]] = {}  # a node's own saved allocations
        self.saves: dict[tuple[object, ...], list[_Value]] = {}  # values a node saves
        self.grads: dict[tuple[object, ...], _Value] = {}  # gradient of a value, until its producer's backward
        self.held_in: dict[tuple[object, ...], list[_Value]] = {}  # a recomputed stage's inputs
        self.away: dict[tuple[object, ...], list[tuple[tuple[object, ...], int]]] = {}  # offloaded: (key, bytes)
        self.pgrads: dict[tuple[int, str], list[int]] = {}
        self.params: list[int] = []
        for (_, _), st in stages.items():
            for n in st.nodes:
                if n.alloc is not None:
                    for size in (*n.alloc.p, *n.alloc.u):
                        sim.malloc(size)
                    self.params.extend(n.alloc.p)
        self.optim_made = False

    # ---- helpers -------------------------------------------------------------------------------
    def _alloc(self, nbytes: float) -> int:
        return self.sim.malloc(int(nbytes * self.scale))

    def _drop(self, v: _Value | None) -> None:
        if v is None:
            return
        v.refs -= 1
        if v.refs == 0:
            for h in v.handles:
                self.sim.free(h)
            for p in v.parents:
                self._drop(p)

    def _hold(self, v: _Value) -> _Value:
        v.refs += 1
        return v

    def _value(self, handles: list[int]) -> _Value:
        return _Value(handles, sum(self.sim.live[h].requested for h in handles))

    def _replay(self, events: Sequence[int], keep_unscaled: frozenset[int] = frozenset()) -> dict[int, int]:
        """Allocate and free as ``events`` say; the handles of what is still live, by id."""
        ids: dict[int, int] = {}
        n = 0
        for e in events:
            if e > 0:
                ids[n] = self.sim.malloc(e) if n in keep_unscaled else self._alloc(e)
                n += 1
            else:
                self.sim.free(ids.pop(-e - 1))
        return ids

    # ---- a step --------------------------------------------------------------------------------
    def step(self, actions: Sequence[tuple[str, int, int, int]], train: bool) -> None:
        """One step of ``actions`` (kind, replica, stage, micro-batch), as the runtime runs it."""
        for hs in self.pgrads.values():  # zero_grad(set_to_none=True)
            for h in hs:
                self.sim.free(h)
        self.pgrads.clear()
        for kind, r, s, m in actions:
            if kind == "F":
                self.forward(r, s, m, "train" if train else "infer")
            elif kind == "B":
                self.backward(r, s, m)
        if train and self.params:
            if not self.optim_made:
                for size in self.params:
                    for _ in range(self.states):
                        self.sim.malloc(size)
                self.optim_made = True
            if self.adam:
                for h in [self.sim.malloc(size) for size in self.params]:
                    self.sim.free(h)

    def forward(self, r: int, s: int, m: int, mode: str, rerun: bool = False) -> None:
        """``mode``: "train" (saving), "infer" (nothing saved) or "recompute"'s saving-free forward."""
        st = self.stages[(r, s)]
        mb = (r, m)
        if mode == "train" and s in self.recompute and not rerun:
            mode = "ckpt"
        saving = mode == "train"
        away = mode == "train" and s in self.offload
        inputs: list[_Value] = []  # the stage's inputs (a recomputed stage keeps them for its backward)
        kept_in = self.held_in.setdefault(mb + (s,), []) if mode == "ckpt" else []
        for u in st.recv:
            if rerun:  # the recomputed forward reads the inputs the stage kept
                self.vals[(*mb, u)] = self._hold(self.vals[(*mb, u)])
            else:
                self.vals[(*mb, u)] = self._value([self._alloc(st.out_bytes[u])])
            inputs.append(self.vals[(*mb, u)])
            if mode == "ckpt":
                kept_in.append(self._hold(inputs[-1]))
        for i, n in enumerate(st.nodes):
            key = (*mb, n.name)
            if n.op == "placeholder":
                got = self.vals.get(key) if rerun else None
                self.vals[key] = self._hold(got) if got is not None else self._value([self._alloc(n.out_bytes)])
                inputs.append(self.vals[key])
                if mode == "ckpt":
                    kept_in.append(self._hold(inputs[-1]))
            elif n.op == "output":
                if saving and st.loss and n.act_bytes:
                    self.kept[key] = [self._alloc(n.act_bytes)]  # the loss's saved tensors and labels
            elif n.alloc is not None:
                self._node_forward(n.alloc, key, mb, saving, inputs if away else None)
            for u in st.inputs[n.name]:
                if st.last.get(u) == i and u not in st.sent:
                    self._drop(self.vals.get((*mb, u)))
            if n.name not in st.last and n.name not in st.sent:
                self._drop(self.vals.get(key))  # read by no node of the stage nor a later stage
        for u in st.sent:
            self._drop(self.vals.get((*mb, u)))

    def _node_forward(self, log: AllocLog, key: tuple[object, ...], mb: tuple[int, int], saving: bool,
                      away: list[_Value] | None) -> None:
        """One node's forward; ``away``: the stage's inputs when its saved tensors go to the host."""
        live = self._replay(log.f)
        out = self._value([live.pop(i) for i in log.o if i in live])
        for a in log.a:
            shared = self.vals.get((*mb, a))
            if shared is not None:
                out.parents.append(self._hold(shared))
        self.vals[key] = out
        own = list(live.values())
        saved = [self.vals[(*mb, u)] for u in log.s if (*mb, u) in self.vals]
        if not saving or away is not None:
            if saving and away is not None:  # [Note: offload]: copied out, fetched back for the backward
                self.away[key] = [((key, k), self.sim.live[h].requested) for k, h in enumerate(own)] + [
                    ((id(v), 0), v.nbytes) for v in saved if v not in away and v.nbytes]
                self.saves[key] = [self._hold(v) for v in saved if v in away]
            for h in own:
                self.sim.free(h)
            return
        self.kept[key] = own
        self.saves[key] = [self._hold(v) for v in saved]

    def backward(self, r: int, s: int, m: int) -> None:
        st = self.stages[(r, s)]
        mb = (r, m)
        if s in self.recompute:
            self.forward(r, s, m, "train", rerun=True)
            for v in self.held_in.pop(mb + (s,), []):
                self._drop(v)
        for u in st.sent:
            self._grad((*mb, u), self._value([self._alloc(st.out_bytes[u])]))
        fetched: dict[object, list[int]] = {}  # offload: key -> [handle, bytes, backwards left to read it]
        order = [n for n in reversed(st.nodes) if n.op != "placeholder"]
        largest = max((b for n in order for _, b in self.away.get((*mb, n.name), [])), default=0)
        for i, n in enumerate(order):
            key = (*mb, n.name)
            if n.op == "output":
                if st.loss and n.workspace_bytes:
                    self.sim.free(self._alloc(n.workspace_bytes))
                for h in self.kept.pop(key, []):
                    self.sim.free(h)
                for u in st.inputs[n.name]:
                    self._grad((*mb, u), self._value([self._alloc(st.out_bytes[u])]))
                continue
            if s in self.offload:
                self._fetch(order[i:], mb, fetched, WINDOW * largest)
            if n.alloc is not None:
                self._node_backward(n.alloc, key, mb, r, n.name)
            for v in self.saves.pop(key, []):
                self._drop(v)
            for h in self.kept.pop(key, []):
                self.sim.free(h)
            for k, _ in self.away.pop(key, []):
                got = fetched.get(k)
                if got is not None:
                    got[2] -= 1
                    if got[2] == 0:
                        self.sim.free(fetched.pop(k)[0])
            self._drop(self.grads.pop(key, None))
        for u in st.recv:
            self._drop(self.grads.pop((*mb, u), None))
        for n in st.nodes:
            if n.op == "placeholder":
                self._drop(self.grads.pop((*mb, n.name), None))

    def _grad(self, key: tuple[object, ...], value: _Value) -> None:
        if key in self.grads:  # autograd adds a second gradient into the first
            self._drop(value)
        else:
            self.grads[key] = value

    def _node_backward(self, log: AllocLog, key: tuple[object, ...], mb: tuple[int, int], r: int, name: str) -> None:
        grads = {i for i, _ in log.g}
        made = sum(1 for e in log.b if e > 0)
        freed = {-e - 1 for e in log.b if e < 0}
        live = self._replay(log.b, frozenset(i for i in range(made) if i not in freed and i not in grads))
        mine = self.grads.get(key)
        for i, u in log.g:
            if i in live:
                self._grad((*mb, u), self._value([live.pop(i)]))
            elif i == -1 and mine is not None:  # a slice of this node's own output gradient
                self._grad((*mb, u), self._hold(mine))
        if not live:
            return
        if (r, name) in self.pgrads:  # a later micro-batch: added into the gradients in place
            for h in live.values():
                self.sim.free(h)
        else:
            self.pgrads[(r, name)] = list(live.values())

    def _fetch(self, rest: Sequence[NodeCost], mb: tuple[int, int], fetched: dict[object, list[int]],
               window: int) -> None:
        """Fetch back the offloaded tensors ``rest[0]``'s backward reads, and those of the backwards after
        it while less than ``window`` bytes wait on the device ahead of autograd."""
        readers: dict[object, int] = {}
        for n in rest:
            for k, _ in self.away.get((*mb, n.name), []):
                readers[k] = readers.get(k, 0) + 1
        now = {k for k, _ in self.away.get((*mb, rest[0].name), [])}
        ahead = sum(f[1] for k, f in fetched.items() if k not in now)
        for j, n in enumerate(rest):
            for k, b in self.away.get((*mb, n.name), []):
                if k not in fetched:
                    if j > 0 and ahead >= window:
                        return
                    fetched[k] = [self.sim.malloc(b), b, readers[k]]
                    ahead += b if j > 0 else 0
