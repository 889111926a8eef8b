"""Per-node costs (NodeCost) and a model's cost table (Profile), with JSON round-trip."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from nowdl.profiler.alloc.log import AllocLog

__all__ = ["NodeCost", "Profile", "PROFILE_FORMAT_VERSION"]

PROFILE_FORMAT_VERSION = 3  # 2: NodeCost.fwd_workspace_bytes; 3: NodeCost.alloc


@dataclass(frozen=True)
class NodeCost:
    """What one torch.fx node costs for one micro-batch.

    Times are seconds, sizes bytes. ``saved_bytes`` is what this node itself saves for
    backward (deduplicated by storage, parameters and buffers excluded): a ReLU saves its
    output, a conv its input, BatchNorm its input and statistics. ``act_bytes`` is the
    planner's attribution of saved activations: each saved storage is counted exactly once
    in the whole graph, charged to the node that produced it (so the sum of ``act_bytes``
    over a set of nodes is the saved-activation memory of that set when nothing crosses it).
    ``self_saved`` tells whether the node's own output is among what it saves; when it is
    not, the output is held only because a consumer saves it.
    """

    name: str
    op: str  # fx op: placeholder, get_attr, call_module, call_function, call_method, output
    target: str  # readable target, e.g. "torch.nn.Conv2d" or "torch.cat"
    fwd_s: float = 0.0
    bwd_s: float = 0.0
    flops: int = 0  # forward FLOPs (a multiply-add counts 2)
    out_bytes: int = 0  # bytes of the node's output tensor(s)
    out_shape: tuple[int, ...] | None = None  # shape of the (first) output tensor
    out_dtype: str = "float32"
    saved_bytes: int = 0
    saved_tensors: int = 0  # tensors autograd saves for the backward (a recomputed stage's hook calls)
    act_bytes: int = 0
    self_saved: bool = False
    param_bytes: int = 0  # parameters owned by this node (each parameter charged once)
    buffer_bytes: int = 0
    grad_bytes: int = 0
    optim_bytes: int = 0  # optimizer state for the given optimizer
    workspace_bytes: int = 0  # largest transient memory above inputs+outputs, fwd or bwd
    fwd_workspace_bytes: int = 0  # the forward's transient alone (what an inference holds)
    alloc: AllocLog | None = None  # the aten allocations of its forward and backward ([Note: allocation log])

    @property
    def static_bytes(self) -> int:
        """Memory held for the whole run: params, buffers, grads and optimizer state."""
        return self.param_bytes + self.buffer_bytes + self.grad_bytes + self.optim_bytes

    @property
    def time_s(self) -> float:
        """Forward plus backward time of one micro-batch."""
        return self.fwd_s + self.bwd_s


@dataclass
class Profile:
    """A model's per-node cost table in topological order, plus how it was made."""

    nodes: list[NodeCost]
    edges: list[tuple[str, str]]  # (producer, consumer) data dependencies between nodes
    source: str  # "measure" or "estimate"
    device: str  # e.g. "cpu", "cuda:0 (NVIDIA H100)", or the device spec name
    dtype: str = "float32"
    optimizer: str = "adam"
    input_shapes: list[list[int]] = field(default_factory=list)
    fingerprint: str = ""
    wall_s: float = 0.0  # how long profiling took
    precision: str = "fp32"  # "bf16"/"fp16": profiled under autocast, outputs counted at that width
    # measure mode: the factors that made the nodes' fwd/bwd add up to one whole pass
    # ([Note: whole-pass scale] in profiler/compose.py); (1, 1) when not applied
    time_scale: tuple[float, float] = (1.0, 1.0)

    def __post_init__(self) -> None:
        self._index = {n.name: i for i, n in enumerate(self.nodes)}

    def __getitem__(self, name: str) -> NodeCost:
        return self.nodes[self._index[name]]

    def __contains__(self, name: object) -> bool:
        return name in self._index

    def __len__(self) -> int:
        return len(self.nodes)

    def out_ranks(self) -> dict[str, int]:
        """Each node's output rank (number of dims), where the output is a tensor."""
        return {n.name: len(n.out_shape) for n in self.nodes if n.out_shape is not None}

    def totals(self) -> dict[str, float]:
        """Sums over all nodes of the additive fields."""
        keys = ("fwd_s", "bwd_s", "flops", "saved_bytes", "act_bytes", "param_bytes",
                "buffer_bytes", "grad_bytes", "optim_bytes")
        return {k: sum(getattr(n, k) for n in self.nodes) for k in keys}

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": "nowdl.profile",
            "version": PROFILE_FORMAT_VERSION,
            "source": self.source,
            "device": self.device,
            "dtype": self.dtype,
            "optimizer": self.optimizer,
            "input_shapes": self.input_shapes,
            "fingerprint": self.fingerprint,
            "wall_s": self.wall_s,
            "precision": self.precision,
            "time_scale": list(self.time_scale),
            "nodes": [asdict(n) for n in self.nodes],
            "edges": [list(e) for e in self.edges],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Profile:
        if d.get("format") != "nowdl.profile" or d.get("version") != PROFILE_FORMAT_VERSION:
            raise ValueError(
                f"not a nowdl profile of version {PROFILE_FORMAT_VERSION} "
                f"(format={d.get('format')!r}, version={d.get('version')!r})"
            )
        fwd_scale, bwd_scale = d.get("time_scale", (1.0, 1.0))
        nodes = []
        for n in d["nodes"]:
            n = dict(n)
            if n.get("out_shape") is not None:
                n["out_shape"] = tuple(n["out_shape"])
            if n.get("alloc") is not None:
                n["alloc"] = AllocLog.from_dict(n["alloc"])
            nodes.append(NodeCost(**n))
        return cls(
            nodes=nodes,
            edges=[(a, b) for a, b in d["edges"]],
            source=d["source"],
            device=d["device"],
            dtype=d.get("dtype", "float32"),
            optimizer=d.get("optimizer", "adam"),
            input_shapes=[list(s) for s in d.get("input_shapes", [])],
            fingerprint=d.get("fingerprint", ""),
            wall_s=float(d.get("wall_s", 0.0)),
            precision=str(d.get("precision", "fp32")),
            time_scale=(float(fwd_scale), float(bwd_scale)),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> Profile:
        return cls.from_dict(json.loads(text))
