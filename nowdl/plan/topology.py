"""Cluster topology: GPUs per node, the intra-node link (NVLink/PCIe) and the inter-node link (InfiniBand).

[Note: topology] A job of ``gpus`` ranks runs on ``nodes`` nodes of ``gpus_per_node`` GPUs each.
Launchers number ranks node by node (torchrun: ``rank = node_rank x nproc_per_node +
local_rank``; srun with block distribution likewise), so rank r sits on node
``r // gpus_per_node``. The planner chooses which (data-parallel copy, stage, tile) each rank
holds, and charges every message at the link it crosses: ``intra`` inside a node, ``inter``
between nodes. Bandwidths are bytes/s per GPU and direction; a latency is charged per message
round (one halo exchange, one ring step of an all-reduce across nodes).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nowdl.errors import NowdlError, PlanError

__all__ = ["Link", "NodeSpec", "Topology", "BUILTIN_NODES", "node_spec_for", "make_topology", "check_topology",
           "INTRA_LATENCY_S"]

#: latency of one message round inside a node (the planner's long-standing halo latency)
INTRA_LATENCY_S = 10e-6


@dataclass(frozen=True)
class Link:
    """One kind of link: bandwidth (bytes/s per GPU, one direction) and latency (s per message)."""

    bw: float
    latency_s: float

    def to_dict(self) -> dict[str, float]:
        return {"bw": self.bw, "latency_s": self.latency_s}


@dataclass(frozen=True)
class NodeSpec:
    """What one node of a cluster looks like; ``intra_bw`` None means the device spec's ``link_bw``."""

    gpus_per_node: int
    inter_bw: float
    inter_latency_s: float
    intra_latency_s: float = INTRA_LATENCY_S
    intra_bw: float | None = None
    name: str = "custom"

    @classmethod
    def from_dict(cls, d: Any, *, source: str = "device spec") -> NodeSpec:
        """Parse the ``"node"`` object of a device spec JSON (errors name the bad field)."""
        if not isinstance(d, dict):
            raise NowdlError(f"{source}: 'node' must be a JSON object, got {type(d).__name__}")
        known = {"gpus_per_node", "inter_bw", "inter_latency_s", "intra_latency_s", "intra_bw", "name"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise NowdlError(f"{source}: 'node' has unknown field(s) {unknown}; valid fields: {sorted(known)}")
        g = d.get("gpus_per_node")
        if isinstance(g, bool) or not isinstance(g, int) or g < 1:
            raise NowdlError(f"{source}: node.gpus_per_node must be a positive integer, got {g!r}")
        nums: dict[str, float] = {}
        for k in ("inter_bw", "inter_latency_s", "intra_latency_s", "intra_bw"):
            v = d.get(k)
            if v is None and k in ("intra_latency_s", "intra_bw"):
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or \
                    (k.endswith("bw") and v == 0):
                raise NowdlError(f"{source}: node.{k} must be a positive number, got {v!r}")
            nums[k] = float(v)
        return cls(gpus_per_node=g, inter_bw=nums["inter_bw"], inter_latency_s=nums["inter_latency_s"],
                   intra_latency_s=nums.get("intra_latency_s", INTRA_LATENCY_S), intra_bw=nums.get("intra_bw"),
                   name=str(d.get("name", "custom")))


#: DGX-class nodes: 8 GPUs on NVLink, one InfiniBand NIC per GPU (H100: 8 x 400 Gb/s NDR;
#: A100: 8 x 200 Gb/s HDR), i.e. 50 GB/s and 25 GB/s per GPU and direction between nodes.
BUILTIN_NODES: dict[str, NodeSpec] = {
    "dgx-h100": NodeSpec(8, 50e9, 20e-6, name="dgx-h100"),
    "dgx-a100": NodeSpec(8, 25e9, 20e-6, name="dgx-a100"),
}
_DEFAULT_NODE = {"h100": "dgx-h100", "h200": "dgx-h100", "a100": "dgx-a100"}


@dataclass(frozen=True)
class Topology:
    """``nodes`` x ``gpus_per_node`` GPUs; rank r is on node ``r // gpus_per_node``."""

    nodes: int
    gpus_per_node: int
    intra: Link
    inter: Link
    name: str = "custom"
    allreduce: Link | None = None  # measured all-reduce inside a node (bus bw, latency); None: ring at intra.bw

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def multi_node(self) -> bool:
        return self.nodes > 1

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def link(self, ranks: Any) -> Link:
        """The link a message among ``ranks`` crosses: intra when they share one node."""
        return self.intra if len({self.node_of(r) for r in ranks}) <= 1 else self.inter

    def to_dict(self) -> dict[str, Any]:
        d = {"name": self.name, "nodes": self.nodes, "gpus_per_node": self.gpus_per_node,
             "intra": self.intra.to_dict(), "inter": self.inter.to_dict()}
        if self.allreduce is not None:
            d["allreduce"] = self.allreduce.to_dict()
        return d

    def describe(self) -> str:
        """'8 nodes x 8 GPUs (dgx-h100; intra 450 GB/s 10 us, inter 50 GB/s 20 us)'."""
        return (f"{self.nodes} node{'s' if self.nodes != 1 else ''} x {self.gpus_per_node} GPUs ({self.name}; "
                f"intra {self.intra.bw / 1e9:.0f} GB/s {self.intra.latency_s * 1e6:.0f} us, "
                f"inter {self.inter.bw / 1e9:.0f} GB/s {self.inter.latency_s * 1e6:.0f} us)")

    @classmethod
    def from_dict(cls, d: Any, *, source: str = "plan") -> Topology:
        """Read ``plan["topology"]`` back (PlanError-worthy problems raise NowdlError naming the field)."""
        if not isinstance(d, dict):
            raise NowdlError(f"{source}: 'topology' must be an object, got {type(d).__name__}")
        try:
            links = {k: Link(float(d[k]["bw"]), float(d[k]["latency_s"])) for k in ("intra", "inter", "allreduce")
                     if k in d or k != "allreduce"}
            nodes, g = d["nodes"], d["gpus_per_node"]
        except (KeyError, TypeError, ValueError) as e:
            raise NowdlError(f"{source}: topology needs nodes, gpus_per_node, intra/inter {{bw, latency_s}} ({e})") from None
        for k, v in (("nodes", nodes), ("gpus_per_node", g)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise NowdlError(f"{source}: topology.{k} must be a positive integer, got {v!r}")
        return cls(nodes, g, links["intra"], links["inter"], str(d.get("name", "custom")), links.get("allreduce"))


def node_spec_for(device_spec: Any, spec_name: str | None) -> NodeSpec | None:
    """The node description that goes with a device spec: the ``"node"`` object of a JSON spec
    file, else the built-in DGX node of a built-in GPU (h100/h200: dgx-h100, a100: dgx-a100),
    else None (one node holds every rank unless --nodes/--gpus-per-node say otherwise)."""
    if isinstance(device_spec, (str, os.PathLike)):
        text = str(device_spec)
        if text.strip().lower() in BUILTIN_NODES:
            return BUILTIN_NODES[text.strip().lower()]
        if text.endswith(".json") or os.path.isfile(text):
            try:
                d = json.loads(Path(text).read_text())
            except (OSError, json.JSONDecodeError):
                return None  # the device spec loader reports it
            if isinstance(d, dict) and "node" in d:
                return NodeSpec.from_dict(d["node"], source=text)
            return None
    key = (spec_name or "").strip().lower()
    return BUILTIN_NODES[_DEFAULT_NODE[key]] if key in _DEFAULT_NODE else None


def make_topology(gpus: int, *, nodes: int | None = None, gpus_per_node: int | None = None,
                  node: NodeSpec | None = None, link_bw: float, link_latency_s: float | None = None,
                  allreduce: Link | None = None) -> Topology:
    """The topology of a ``gpus``-rank job.

    ``nodes``/``gpus_per_node`` (the --nodes/--gpus-per-node flags) win; otherwise the node
    spec's GPUs per node applies when it divides ``gpus`` (a job of fewer GPUs fits one node);
    otherwise one node holds every rank. ``link_bw`` is the device spec's NVLink bandwidth;
    ``link_latency_s`` (measured, ``nowdl calibrate``) replaces the intra-node latency and
    ``allreduce`` (measured bus bandwidth and latency) prices the all-reduce inside a node.

    Raises:
        NowdlError: nodes x gpus_per_node != gpus, or gpus not a multiple of gpus_per_node.
    """
    for k, v in (("nodes", nodes), ("gpus_per_node", gpus_per_node)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise NowdlError(f"--{k.replace('_', '-')} must be a positive integer, got {v!r}")
    if nodes is not None and gpus_per_node is not None:
        if nodes * gpus_per_node != gpus:
            raise NowdlError(f"--nodes {nodes} x --gpus-per-node {gpus_per_node} = {nodes * gpus_per_node} GPUs, "
                             f"but --gpus is {gpus}: give nodes x gpus-per-node = gpus "
                             f"(e.g. --nodes {max(1, gpus // gpus_per_node)} --gpus-per-node {gpus_per_node})")
    elif nodes is not None:
        if gpus % nodes:
            raise NowdlError(f"--gpus {gpus} does not split over --nodes {nodes} evenly ({gpus} / {nodes} = "
                             f"{gpus / nodes:g}): every node runs the same number of ranks; change --nodes or --gpus")
        gpus_per_node = gpus // nodes
    elif gpus_per_node is not None:
        if gpus > gpus_per_node and gpus % gpus_per_node:
            raise NowdlError(f"--gpus {gpus} is not a multiple of --gpus-per-node {gpus_per_node}: every node runs "
                             f"the same number of ranks; use --gpus {(gpus // gpus_per_node + 1) * gpus_per_node}")
        nodes = max(1, gpus // gpus_per_node)
        gpus_per_node = min(gpus, gpus_per_node)
    elif node is not None and gpus > node.gpus_per_node and gpus % node.gpus_per_node == 0:
        nodes, gpus_per_node = gpus // node.gpus_per_node, node.gpus_per_node
    else:
        nodes, gpus_per_node = 1, gpus
    n = node or NodeSpec(gpus_per_node, link_bw, INTRA_LATENCY_S if link_latency_s is None else link_latency_s)
    intra = Link(n.intra_bw if n.intra_bw is not None else link_bw,
                 n.intra_latency_s if link_latency_s is None else link_latency_s)
    return Topology(nodes, gpus_per_node, intra, Link(n.inter_bw, n.inter_latency_s), n.name if node else "flat",
                    allreduce)


def check_topology(topology: dict[str, Any], gpus: int, *, source: str = "plan") -> None:
    """Check a plan's ``topology`` for its ``gpus`` ranks: nodes x gpus_per_node = gpus, and a node map that numbers ranks
    node by node (as launchers do) and keeps every group in ``topology.together`` on one node.

    Raises:
        PlanError: the numbers, and the fix.
    """
    try:
        topo = Topology.from_dict(topology, source=source)
    except NowdlError as e:
        raise PlanError(str(e)) from None
    if topo.gpus != gpus:
        raise PlanError(f"{source}: topology.nodes {topo.nodes} x gpus_per_node {topo.gpus_per_node} = {topo.gpus} "
                        f"GPUs, but config.gpus is {gpus}: re-plan with --nodes N --gpus-per-node G, N x G = {gpus}")
    got = topology.get("node_of_rank")
    if got is None:
        return
    want = [topo.node_of(r) for r in range(gpus)]
    if not isinstance(got, list) or len(got) != gpus:
        raise PlanError(f"{source}: topology.node_of_rank must list the node of each of the {gpus} ranks")
    bad = [r for r in range(gpus) if got[r] != want[r]]
    if bad:
        r = bad[0]
        raise PlanError(f"{source}: topology.node_of_rank puts rank {r} on node {got[r]}, but launchers put rank "
                        f"{r} on node {r} // {topo.gpus_per_node} = {want[r]} ({len(bad)} rank(s) differ): re-plan "
                        "instead of editing the rank map")
    for group in topology.get("together", []):
        nodes = sorted({want[int(r)] for r in group})
        if len(nodes) > 1:
            raise PlanError(f"{source}: the rank map splits ranks {group} over nodes {nodes}, but the plan needs them "
                            f"on one node (a tile group or MASTER pair of {len(group)} ranks, {topo.gpus_per_node} "
                            "GPUs per node): re-plan for this cluster (--nodes N --gpus-per-node G)")
