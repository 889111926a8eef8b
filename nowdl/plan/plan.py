"""The Plan: a versioned, fingerprinted JSON description of how a model runs on N GPUs.

[Note: plan format] See docs/plan-format.md. A plan is pure data: the runtime needs only the plan
and the model. ``version`` changes whenever a field changes meaning; a newer plan is refused.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from nowdl.errors import PlanError
from nowdl.plan.validate import check_counts, check_plan_dict
from nowdl.units import format_bytes

__all__ = ["Plan", "StagePlan", "TensorPlan", "RankPlan", "PLAN_VERSION", "format_bytes"]

PLAN_FORMAT = "nowdl.plan"
PLAN_VERSION = 3  # 3: stage recompute/offload/tiles_per_gpu, config.inference; 2: topology


def _format_time(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.1f} ms"
    return f"{s * 1e6:.0f} us"


@dataclass
class StagePlan:
    """One pipeline stage: its nodes, the ranks that hold it and what it is predicted to cost."""

    index: int
    nodes: list[str]
    ranks: list[int]  # global ranks of data-parallel copy 0, replica 0 (P ranks if spatial)
    parts: int = 1  # spatial parts (1: not spatial)
    slice: str | None = None  # vertical | horizontal | square | depth | cube
    grid: list[int] = field(default_factory=list)  # tiles per spatial dim
    fused: list[list[str]] = field(default_factory=list)  # node chains run with one deeper halo exchange
    params: int = 0  # parameter count
    param_bytes: int = 0
    recompute: bool = False  # saved activations dropped in the forward, recomputed in the backward
    offload: bool = False  # saved activations kept in host memory between forward and backward
    tiles_per_gpu: int = 1  # a spatial stage's tiles run one after another on each of its GPUs
    # [start, stop) into ``nodes``: only those nodes' saved activations recomputed; [] (absent): the whole stage
    recompute_segment: list[int] = field(default_factory=list)
    norm_schedule: str = ""  # sequential tiles' norms: passes, layerwise ([Note: layer-wise norms]); "": passes/none
    predicted: dict[str, float] = field(default_factory=dict)
    # predicted keys: peak_bytes, static_bytes, act_bytes, recv_bytes, workspace_bytes,
    # fwd_s, bwd_s, comm_s, time_s (per micro-batch, per rank of this stage)

    def tiles(self) -> str:
        """'spatial stage 0: 4 tiles (square, grid 2x2)' (for a spatial stage; with sequential tiles
        also ', 4 tiles per GPU one after another')."""
        seq = f", {self.tiles_per_gpu} tiles per GPU one after another" if self.tiles_per_gpu > 1 else ""
        if self.parts == 1:
            return f"spatial stage {self.index}: 1 GPU ({self.slice}){seq}"
        return f"spatial stage {self.index}: {self.parts} tiles ({self.slice}, grid {'x'.join(map(str, self.grid))}){seq}"


@dataclass
class TensorPlan:
    """A tensor that crosses stages: made by ``producer`` in ``from_stage``, used in ``to_stages``."""

    producer: str
    from_stage: int
    to_stages: list[int]
    shape: list[int]
    dtype: str
    bytes: int


@dataclass
class RankPlan:
    """What one global rank holds: (replica, stage, part) triples for its data-parallel copy."""

    rank: int
    dp: int
    stages: list[dict[str, int]]  # [{"replica": 0, "stage": 2, "part": 0}, ...]
    predicted_peak_bytes: float = 0.0
    predicted_time_s: float = 0.0


_REQUIRED_TOP = ("format", "version", "model", "profile", "config", "stages", "ranks", "tensors",
                 "schedule", "predicted", "solver")


@dataclass
class Plan:
    """A partition plan. Build with ``nowdl.compile(...).plan(x)``; save, load, print.

    Example:
        >>> plan = nowdl.compile(model, gpus=8).plan(torch.randn(1, 3, 2048, 2048))
        >>> plan.save("experiments/unet.json"); print(plan)
    """

    model: dict[str, Any]  # fingerprint, name, inputs, tracer
    profile: dict[str, Any]  # source, device, dtype, optimizer
    config: dict[str, Any]  # gpus, balance, stages, micro_batches, schedule, replicas, dp, spatial, gpu_memory
    stages: list[StagePlan]
    ranks: list[RankPlan]
    tensors: list[TensorPlan]
    schedule: dict[str, Any]  # name, micro_batches, inflight per stage
    predicted: dict[str, float]  # step_s, throughput, peak_bytes (max over ranks), ...
    solver: dict[str, Any]  # name, status, gap, seconds, candidates
    version: int = PLAN_VERSION
    created_by: str = ""
    warnings: list[str] = field(default_factory=list)  # e.g. GPUs left idle (see nowdl plan)
    topology: dict[str, Any] = field(default_factory=dict)  # nodes, links, node_of_rank ({}: one node)

    # ---- serialisation -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = {
            "format": PLAN_FORMAT,
            "version": self.version,
            "created_by": self.created_by,
            "model": self.model,
            "profile": self.profile,
            "config": self.config,
            "stages": [{k: v for k, v in asdict(s).items() if k not in ("recompute_segment", "norm_schedule") or v}
                       for s in self.stages],  # those two only where set: a plan without them reads as before
            "ranks": [asdict(r) for r in self.ranks],
            "tensors": [asdict(t) for t in self.tensors],
            "schedule": self.schedule,
            "predicted": self.predicted,
            "solver": self.solver,
        }
        if self.warnings:
            d["warnings"] = list(self.warnings)
        if self.topology:
            d["topology"] = self.topology
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=False)

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the plan as JSON, atomically and fsynced ([Note: durable saves] in runtime/training)."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=p.name + ".", suffix=".tmp", dir=p.parent)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(self.to_json() + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, p)
            dfd = os.open(p.parent, os.O_RDONLY)
            with contextlib.suppress(OSError):  # a filesystem that cannot fsync a folder
                os.fsync(dfd)
            os.close(dfd)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return p

    @classmethod
    def from_dict(cls, d: Any, *, source: str = "plan") -> Plan:
        """Validate and build a Plan; PlanError names the first field that is wrong."""
        if not isinstance(d, dict):
            raise PlanError(f"{source}: a plan is a JSON object, got {type(d).__name__}")
        if d.get("format") != PLAN_FORMAT:
            raise PlanError(f"{source}: not a nowdl plan (format is {d.get('format')!r}, expected {PLAN_FORMAT!r})")
        v = d.get("version")
        if not isinstance(v, int):
            raise PlanError(f"{source}: 'version' must be an integer, got {v!r}")
        if v > PLAN_VERSION:
            raise PlanError(
                f"{source}: plan version {v} was written by a newer nowdl (this one reads up to "
                f"version {PLAN_VERSION}): upgrade nowdl, or re-plan with this version"
            )
        if v < 1:
            raise PlanError(f"{source}: plan version {v} is not valid")
        missing = [k for k in _REQUIRED_TOP if k not in d]
        if missing:
            raise PlanError(f"{source}: missing field(s) {', '.join(missing)}: the file is incomplete; re-plan")
        check_plan_dict(d, source)  # field types, before building from them
        try:
            stages = [StagePlan(**s) for s in _list(d, "stages", source)]
            ranks = [RankPlan(**r) for r in _list(d, "ranks", source)]
            tensors = [TensorPlan(**t) for t in _list(d, "tensors", source)]
        except TypeError as e:
            raise PlanError(f"{source}: malformed stage, rank or tensor entry ({e})") from None
        for key in ("model", "profile", "config", "schedule", "predicted", "solver"):
            if not isinstance(d[key], dict):
                raise PlanError(f"{source}: '{key}' must be an object, got {type(d[key]).__name__}")
        warn = d.get("warnings", [])  # absent in plans written before warnings existed
        if not isinstance(warn, list) or not all(isinstance(w, str) for w in warn):
            raise PlanError(f"{source}: 'warnings' must be a list of strings")
        topo = d.get("topology", {})  # absent before version 2: one node holds every rank
        if not isinstance(topo, dict):
            raise PlanError(f"{source}: 'topology' must be an object, got {type(topo).__name__}")
        plan = cls(model=d["model"], profile=d["profile"], config=d["config"], stages=stages,
                   ranks=ranks, tensors=tensors, schedule=d["schedule"], predicted=d["predicted"],
                   solver=d["solver"], version=v, created_by=str(d.get("created_by", "")),
                   warnings=list(warn), topology=dict(topo))
        plan.validate(source=source)
        return plan

    @classmethod
    def from_json(cls, text: str, *, source: str = "plan") -> Plan:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanError(
                f"{source}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); "
                "the file may be truncated: re-plan with `nowdl plan ... --out FILE`"
            ) from None
        return cls.from_dict(d, source=source)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Plan:
        """Read and validate a plan file.

        Raises:
            PlanError: missing, malformed, truncated, or from a newer nowdl.
        """
        p = Path(path)
        try:
            text = p.read_text()
        except FileNotFoundError:
            raise PlanError(f"plan file {str(p)!r} does not exist") from None
        except OSError as e:
            raise PlanError(f"cannot read plan file {str(p)!r}: {e.strerror}") from None
        return cls.from_json(text, source=str(p))

    # ---- checks ------------------------------------------------------------------------------
    def validate(self, *, source: str = "plan") -> None:
        """Check the plan is internally consistent (stages, ranks, tensors agree)."""
        k = len(self.stages)
        if k == 0:
            raise PlanError(f"{source}: the plan has no stages")
        for key in ("fingerprint", "inputs"):
            if key not in self.model:
                raise PlanError(f"{source}: model.{key} is missing")
        for key in ("gpus", "stages", "micro_batches", "replicas", "dp"):
            val = self.config.get(key)
            if not isinstance(val, int) or val < 1:
                raise PlanError(f"{source}: config.{key} must be a positive integer, got {val!r}")
        if self.config["stages"] != k:
            raise PlanError(f"{source}: config.stages is {self.config['stages']} but the plan lists {k} stages")
        seen: dict[str, int] = {}
        for i, s in enumerate(self.stages):
            if s.index != i:
                raise PlanError(f"{source}: stage {i} has index {s.index}")
            if not s.nodes:
                raise PlanError(f"{source}: stage {i} has no nodes")
            for n in s.nodes:
                if n in seen:
                    raise PlanError(f"{source}: node {n!r} is in stages {seen[n]} and {i}")
                seen[n] = i
            if len(s.ranks) != s.parts and s.parts > 0:
                raise PlanError(f"{source}: stage {i} has {s.parts} parts but {len(s.ranks)} ranks")
        world = self.config["gpus"]
        if sorted(r.rank for r in self.ranks) != list(range(world)):
            raise PlanError(f"{source}: ranks must be 0..{world - 1}, one entry each")
        for t in self.tensors:
            if t.from_stage not in range(k) or any(j not in range(k) or j <= t.from_stage for j in t.to_stages):
                raise PlanError(f"{source}: tensor {t.producer!r} goes from stage {t.from_stage} to {t.to_stages}")
        check_counts(self, source)
        if self.topology:
            from nowdl.plan.topology import check_topology

            check_topology(self.topology, int(self.config["gpus"]), source=source)

    @property
    def fingerprint(self) -> str:
        return str(self.model["fingerprint"])

    def check_model(self, fingerprint: str, input_shapes: list[list[int]] | None = None) -> None:
        """Refuse a plan made for another model (or other input shapes).

        Raises:
            PlanError: the fingerprints or the input shapes differ.
        """
        if fingerprint != self.fingerprint:
            raise PlanError(
                f"this plan was made for another model (plan fingerprint {self.fingerprint}, this "
                f"model's {fingerprint}; plan model: {self.model.get('name', '?')}): the layers, "
                "parameter shapes or code differ. Re-plan for this model: nowdl.compile(model, gpus=N).plan(x)"
            )
        if input_shapes is not None:
            want = [list(s) for s in self.model["inputs"]]
            if [list(s) for s in input_shapes] != want:
                raise PlanError(
                    f"this plan is for inputs of shape {want}, not {[list(s) for s in input_shapes]}: "
                    "re-plan for this input size (memory and balance depend on it)"
                )

    # ---- display -------------------------------------------------------------------------------
    def node_stage(self) -> dict[str, int]:
        return {n: s.index for s in self.stages for n in s.nodes}

    def __str__(self) -> str:
        c, pr = self.config, self.predicted
        sp = c.get("spatial") or {}
        lines = [
            f"nowdl plan v{self.version} for {self.model.get('name', '?')} "
            f"input{'s' if len(self.model['inputs']) > 1 else ''} "
            f"{' + '.join('x'.join(str(d) for d in shape) for shape in self.model['inputs'])} "
            f"({self.profile.get('source', '?')} on {self.profile.get('device', '?')}, {self.profile.get('dtype', '?')}"
            + (f" weights with {self.profile['precision']} autocast" if self.profile.get("precision", "fp32") != "fp32" else "")
            + ", "
            f"{self.profile.get('optimizer', '?')})",
            f"config: {c['gpus']} GPUs = dp {c['dp']} x {len(self.ranks) // max(1, c['dp'])} ranks/pipeline; "
            f"{c['stages']} stages, {c.get('schedule', '?')} with {c['micro_batches']} micro-batches, "
            f"replicas {c['replicas']}{' (MASTER)' if c['replicas'] == 2 else ''}, balance {c.get('balance', '?')}"
            + (f"; spatial stages {sp.get('stages')} x {'/'.join(map(str, sp.get('stage_parts') or [sp.get('parts')]))} "
               f"parts ({sp.get('slice')})" if sp.get("stages") else "")
            + (f", {sp['tiles_per_gpu']} tiles per GPU in turn" if sp.get("tiles_per_gpu", 1) > 1 else "")
            + (f"; cap {format_bytes(c['gpu_memory'])}/GPU" if c.get("gpu_memory") else "")
            + (f", of which {format_bytes(sum(c['reserve'].values()))} reserved ({', '.join(k.removesuffix('_bytes') + ' ' + format_bytes(v) for k, v in c['reserve'].items())}): the plan fits the rest" if c.get("reserve") else ""),
        ]
        hdr = f"{'stage':>5} {'ranks':<12} {'nodes':>5}  {'first .. last':<34} {'params':>9} {'peak mem':>10} {'time/mb':>9} {'in':>9} {'out':>9}"
        lines.append(hdr)
        lines.append("-" * len(hdr))
        tin = [0] * len(self.stages)
        tout = [0] * len(self.stages)
        for t in self.tensors:
            tout[t.from_stage] += t.bytes
            for j in t.to_stages:
                tin[j] += t.bytes
        for s in self.stages:
            ranks = ",".join(str(r) for r in s.ranks)
            if len(ranks) > 12:
                ranks = f"{s.ranks[0]}-{s.ranks[-1]}"
            span = f"{s.nodes[0]} .. {s.nodes[-1]}"
            if len(span) > 34:
                span = span[:31] + "..."
            tag = f"{s.parts}x" if s.parts > 1 else ""
            lines.append(
                f"{s.index:>5} {ranks + (' ' + tag if tag else ''):<12} {len(s.nodes):>5}  {span:<34} "
                f"{s.params / 1e6:>8.2f}M {format_bytes(s.predicted.get('peak_bytes', 0)):>10} "
                f"{_format_time(s.predicted.get('time_s', 0)):>9} {format_bytes(tin[s.index]):>9} {format_bytes(tout[s.index]):>9}"
            )
        lines.append("-" * len(hdr))
        total_params = sum(s.params for s in self.stages)
        skips = sum(1 for t in self.tensors if any(j > t.from_stage + 1 for j in t.to_stages))
        lines.append(
            f"total: {sum(len(s.nodes) for s in self.stages)} nodes, {total_params / 1e6:.2f}M params, "
            f"{len(self.tensors)} cross-stage tensors ({skips} long skips sent directly)"
        )
        for s in self.stages:
            if s.parts > 1 or s.tiles_per_gpu > 1:
                fused = f"; halo fusion: {len(s.fused)} run(s) of {', '.join(str(len(f)) for f in s.fused)} ops" if s.fused else ""
                how = ("each tile run over the stage with its margin, recomputed in the backward" if s.tiles_per_gpu > 1
                       else "halo exchange before each conv/pool")
                lines.append(f"{s.tiles()}, {how}{fused}")
        lines.append(
            f"predicted: peak {format_bytes(pr.get('peak_bytes', 0))}/GPU (max over ranks), step "
            f"{_format_time(pr.get('step_s', 0))}, {pr.get('throughput', 0):.3g} images/s"
            f" (global batch {_count(pr.get('global_batch'))})"
        )
        if c.get("batch_choice"):
            lines.append(f"batch: {c['batch_choice']}")
        gap = self.solver.get("gap")
        lines.append(
            f"solver: {self.solver.get('name', '?')} {self.solver.get('status', '?')}"
            + (f", gap {gap:.2%}" if isinstance(gap, (int, float)) and math.isfinite(gap) else ", gap unknown")
            + f", {self.solver.get('seconds', 0):.2f} s"
            + (f", {self.solver['candidates']} configurations searched" if self.solver.get("candidates") else "")
            + _search_text(self.solver.get("search"))
        )
        if self.topology.get("nodes", 1) > 1:
            cross = self.topology.get("cross_node_bytes") or {}
            lines.append(
                f"topology: {self.topology['nodes']} nodes x {self.topology.get('gpus_per_node')} GPUs "
                f"({self.topology.get('name', '?')}); bytes per step crossing nodes: halo "
                f"{format_bytes(cross.get('halo', 0))}, boundary {format_bytes(cross.get('boundary', 0))}, dp all-reduce "
                f"{format_bytes(cross.get('dp_allreduce', 0))}, MASTER {format_bytes(cross.get('master', 0))} "
                "(nowdl show: the rank -> node map)")
        lines += [f"warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def _count(v: Any) -> str:
    """A count the predictions store as a float, as an integer ('?' when missing)."""
    return str(int(v)) if isinstance(v, (int, float)) and math.isfinite(v) and v == int(v) else str(v if v is not None else "?")


def _search_text(st: Any) -> str:
    """' (12 solved, 3 proven, 52 pruned by bounds; choice proven)' from solver.search."""
    if not isinstance(st, dict) or "evaluated" not in st:
        return ""
    return (f" ({st.get('evaluated')} solved, {st.get('proven')} proven, "
            f"{st.get('pruned_by_bound', 0)} pruned by bounds; choice {st.get('choice', '?')})")


def _list(d: dict[str, Any], key: str, source: str) -> list[dict[str, Any]]:
    v = d[key]
    if not isinstance(v, list) or not all(isinstance(x, dict) for x in v):
        raise PlanError(f"{source}: '{key}' must be a list of objects")
    return v
