"""Field types and counts of a plan file, checked before the plan is built from it.

:func:`check_plan_dict` runs on the JSON object of a plan (after the format, version and
required fields are known to be there) and raises PlanError naming the first field whose type
is wrong (``stages[2].ranks[0]: expected an integer, got 'a'``); :func:`check_counts` runs on
the built Plan and checks what the fields must agree on: a spatial stage's grid multiplies to
its parts, every rank and stage index is in range, and every (data-parallel copy, replica,
stage, tile) is held by exactly one rank. Together with ``Plan.validate`` they make a damaged
or hand-edited plan fail when it is loaded, with one clear message, and never later inside the
runtime or ``nowdl show``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from nowdl.errors import PlanError

__all__ = ["check_plan_dict", "check_counts"]

Check = Callable[[Any], bool]


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _nat(v: Any) -> bool:
    return _int(v) and v >= 0


def _num(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and not math.isnan(v)


def _str(v: Any) -> bool:
    return isinstance(v, str)


def _list(each: Check) -> Check:
    return lambda v: isinstance(v, list) and all(each(x) for x in v)


def _opt(check: Check) -> Check:
    return lambda v: v is None or check(v)


_WHAT: dict[Check, str] = {}


def _named(check: Check, what: str) -> Check:
    _WHAT[check] = what
    return check


INT = _named(_nat, "a non-negative integer")
NUM = _named(_num, "a number")
STR = _named(_str, "a string")
BOOL = _named(lambda v: isinstance(v, bool), "true or false")
INTS = _named(_list(_nat), "a list of non-negative integers")
STRS = _named(_list(_str), "a list of strings")
CHAINS = _named(_list(_list(_str)), "a list of lists of node names")
NUMS = _named(lambda v: isinstance(v, dict) and all(_num(x) for x in v.values()), "an object of numbers")
HOLDS = _named(lambda v: isinstance(v, list) and all(isinstance(e, dict) and "stage" in e and all(_nat(x) for x in e.values())
                                                      for e in v),
               "a list of {replica, stage, part} objects of non-negative integers")
OPT_STR = _named(_opt(_str), "a string or null")
OPT_NUM = _named(_opt(_num), "a number or null")
SHAPES = _named(_list(_list(_nat)), "a list of shapes (lists of non-negative integers)")

_STAGE = {"index": INT, "nodes": STRS, "ranks": INTS, "parts": INT, "slice": OPT_STR, "grid": INTS,
          "fused": CHAINS, "params": INT, "param_bytes": INT, "recompute": BOOL, "offload": BOOL,
          "tiles_per_gpu": INT, "recompute_segment": INTS, "norm_schedule": STR, "predicted": NUMS}
_RANK = {"rank": INT, "dp": INT, "stages": HOLDS, "predicted_peak_bytes": NUM, "predicted_time_s": NUM}
_TENSOR = {"producer": STR, "from_stage": INT, "to_stages": INTS, "shape": INTS, "dtype": STR, "bytes": INT}
_TOP = {
    "model": {"fingerprint": STR, "inputs": SHAPES, "name": STR},
    "profile": {"source": STR, "device": STR, "dtype": STR, "optimizer": STR},
    "config": {"balance": STR, "schedule": STR, "gpu_memory": OPT_NUM},
    "schedule": {"name": STR, "micro_batches": INT, "inflight": INTS},
    "predicted": {k: NUM for k in ("step_s", "throughput", "peak_bytes", "global_batch", "bubble", "grad_sync_s")},
    "solver": {"name": STR, "status": STR, "gap": OPT_NUM, "seconds": NUM, "candidates": INT},
    "topology": {"name": STR, "nodes": INT, "gpus_per_node": INT, "node_of_rank": INTS, "intra": NUMS, "inter": NUMS,
                 "together": _named(_list(_list(_nat)), "a list of lists of ranks"), "cross_node_bytes": NUMS},
}


def _check(where: str, value: Any, check: Check, source: str) -> None:
    if not check(value):
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise PlanError(f"{source}: {where} must be {_WHAT[check]}, got {shown}: the plan file is damaged or was "
                        "edited by hand; re-plan (nowdl plan ... --out FILE)")


_REQUIRED = {"stages": ("index", "nodes", "ranks"), "ranks": ("rank", "dp", "stages"), "tensors": tuple(_TENSOR)}


def _entries(d: dict[str, Any], key: str, fields: dict[str, Check], source: str) -> None:
    entries = d[key]
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        return  # Plan.from_dict says it must be a list of objects
    for i, entry in enumerate(entries):
        unknown = sorted(set(entry) - set(fields))
        missing = [f for f in _REQUIRED[key] if f not in entry]
        if unknown or missing:
            what = f"unknown field(s) {', '.join(map(repr, unknown))}" if unknown else \
                f"no {', '.join(map(repr, missing))}"
            raise PlanError(f"{source}: {key}[{i}] has {what} (a {key[:-1]} entry has {', '.join(fields)}): the plan "
                            "file is damaged, edited by hand or from another nowdl; re-plan")
        for name, check in fields.items():
            if name in entry:
                _check(f"{key}[{i}].{name}", entry[name], check, source)


def check_plan_dict(d: dict[str, Any], source: str) -> None:
    """Check the types of a plan object's fields (see the module docstring).

    Raises:
        PlanError: names the first field of the wrong type, its value and the fix.
    """
    _entries(d, "stages", _STAGE, source)
    _entries(d, "ranks", _RANK, source)
    _entries(d, "tensors", _TENSOR, source)
    for top, fields in _TOP.items():
        part = d.get(top)
        if not isinstance(part, dict):
            continue  # Plan.from_dict names a section that is not an object
        for name, check in fields.items():
            if name in part:
                _check(f"{top}.{name}", part[name], check, source)
    config = d.get("config")
    spatial = config.get("spatial") if isinstance(config, dict) else None
    if spatial is not None and not isinstance(spatial, dict):
        raise PlanError(f"{source}: config.spatial must be an object or null, got {spatial!r}")
    for name, check in {"stages": INTS, "parts": INT, "slice": OPT_STR, "stage_parts": INTS}.items():
        if spatial and name in spatial:
            _check(f"config.spatial.{name}", spatial[name], check, source)
    if isinstance(config, dict) and "pinned" in config and not isinstance(config["pinned"], dict):
        raise PlanError(f"{source}: config.pinned must be an object, got {config['pinned']!r}")


def check_counts(plan: Any, source: str) -> None:
    """Check that a ``nowdl.Plan``'s counts agree: grids, rank and stage indices, and who holds what.

    Raises:
        PlanError: names the stage or rank and the numbers that disagree.
    """
    world, k = int(plan.config["gpus"]), len(plan.stages)
    reps, dp = int(plan.config["replicas"]), int(plan.config["dp"])
    if not plan.model["inputs"]:
        raise PlanError(f"{source}: model.inputs is empty: a plan needs the shape of each model input")
    for s in plan.stages:
        if s.parts < 1 or s.tiles_per_gpu < 1:
            raise PlanError(f"{source}: stage {s.index} has parts {s.parts} and tiles_per_gpu {s.tiles_per_gpu}; "
                            "both must be at least 1")
        if s.parts > 1 and math.prod(s.grid) != s.parts:
            raise PlanError(f"{source}: stage {s.index} has {s.parts} parts but its grid {s.grid} makes "
                            f"{math.prod(s.grid)} tiles")
        seg = s.recompute_segment
        if seg and (len(seg) != 2 or not 0 <= seg[0] < seg[1] <= len(s.nodes) or not s.recompute
                    or s.parts > 1 or s.tiles_per_gpu > 1):
            raise PlanError(f"{source}: stage {s.index} has recompute_segment {seg}: it must be [start, stop) with "
                            f"0 <= start < stop <= {len(s.nodes)} (the stage's nodes), on a stage with recompute true "
                            "that is not tiled; drop the field to recompute the whole stage")
        if s.norm_schedule not in ("", "passes", "layerwise"):
            raise PlanError(f"{source}: stage {s.index} has norm_schedule {s.norm_schedule!r}: it must be 'passes' or "
                            "'layerwise' (or absent: passes); re-plan")
        bad = [r for r in s.ranks if r >= world]
        if bad:
            raise PlanError(f"{source}: stage {s.index} lists rank(s) {bad} but the plan has {world} ranks")
    for group in plan.topology.get("together", []):
        if any(r >= world for r in group):
            raise PlanError(f"{source}: topology.together lists ranks {group} but the plan has {world} ranks")
    held: dict[tuple[int, int, int, int], int] = {}
    for r in plan.ranks:
        if r.dp >= dp:
            raise PlanError(f"{source}: rank {r.rank} is in data-parallel copy {r.dp} but config.dp is {dp}")
        for e in r.stages:
            rep, st, part = int(e.get("replica", 0)), int(e["stage"]), int(e.get("part", 0))
            if rep >= reps or st >= k or part >= plan.stages[st].parts:
                raise PlanError(f"{source}: rank {r.rank} holds replica {rep}, stage {st}, part {part}, which the "
                                f"plan does not have ({reps} replica(s), {k} stage(s))")
            key = (r.dp, rep, st, part)
            if key in held:
                raise PlanError(f"{source}: ranks {held[key]} and {r.rank} both hold data-parallel copy {r.dp}, "
                                f"replica {rep}, stage {st}, part {part}")
            held[key] = r.rank
    want = dp * reps * sum(s.parts for s in plan.stages)
    if len(held) != want:
        raise PlanError(f"{source}: the ranks hold {len(held)} (copy, replica, stage, part) pieces but the plan "
                        f"needs {want} (dp {dp} x replicas {reps} x the stages' parts): re-plan")
