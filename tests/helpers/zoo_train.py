"""Test helper (not a test module): train model-zoo nets on gloo ranks and check them there.

Every case of ``run_cases`` runs in ONE pool of ``WORLD`` processes, one after another (spawning
and importing torch, timm and smp costs more than most cases); after a failure the remaining
cases are not run. Each case trains ``STEPS`` SGD steps (momentum 0.9) in float64; then one rank
(rank 0 and rank 1 in turns; rank 0, which holds the trained state dict and logits, sends them
to rank 1 on its turns) trains the same micro-batches on one process with gradient
accumulation (``helpers.reference.train_reference``) and compares, so that no state dict leaves
the ranks, while the other runs the case's planner checks (``helpers.zoo_checks``: the refusal to
tile the net whole, DeepLabV3+'s one-sample refusal), which need no process group. SGD, not Adam:
Adam divides by the square root of the gradients' second moment, which turns a true gradient of
zero into steps of about the learning rate and its round-off (1e-16) into weight differences of
1e-8 on these deep nets.

After training, ``cm.eval_step`` of one sample (an inference plan on the ranks, with the trained
weights) is compared with the reference model's forward in eval mode: prediction with every net.
A case with ``predict`` also streams a zarr image through ``cm.predict`` on the ranks' tiles.
"""

from __future__ import annotations

import copy
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from helpers.distributed import run_workers
from helpers.reference import train_reference
from helpers.zoo import build, by_id, first_tensor, out_shape
from helpers.zoo_checks import run_check

__all__ = ["WORLD", "STEPS", "TOL", "Train", "TrainResult", "run_cases"]

WORLD = 2
STEPS = 2
TOL = 1e-9  # rtol and atol of every state-dict entry and of eval_step's logits


@dataclass(frozen=True)
class Train:
    net: str
    cfg: dict[str, Any]
    checks: tuple[str, ...] = ()  # planner checks (helpers.zoo_checks.CHECKS), on the ranks that do not compare
    predict: bool = False  # also cm.predict of a zarr image on the ranks (run_cases' predict_dir)

    @property
    def total(self) -> int:
        return int(self.cfg["micro_batches"])


class _Loss(nn.Module):
    """MSE of the logits (dense outputs) or cross-entropy (classifiers); torchvision's dict too."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.fn = nn.MSELoss() if kind == "image" else nn.CrossEntropyLoss()

    def forward(self, out: Any, target: torch.Tensor) -> torch.Tensor:
        logits = first_tensor(out)
        if isinstance(self.fn, nn.MSELoss) and logits.shape != target.shape:  # no silent broadcasting
            raise ValueError(f"logits {list(logits.shape)} and target {list(target.shape)} differ")
        return self.fn(logits, target)  # type: ignore[no-any-return]


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-2, momentum=0.9)


def _data(net_id: str, total: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    net = by_id(net_id)
    g = torch.Generator().manual_seed(100 + step)
    n = total * net.shape[0]
    x = torch.randn(n, *net.shape[1:], generator=g, dtype=torch.float64)
    if net.output == "image":
        return x, torch.randn(out_shape(net, n), generator=g, dtype=torch.float64)
    return x, torch.randint(0, net.classes, (n,), generator=g)


def _sample(net_id: str) -> torch.Tensor:
    """The one sample both sides predict after training."""
    g = torch.Generator().manual_seed(99)
    return torch.randn(1, *by_id(net_id).shape[1:], generator=g, dtype=torch.float64)


@dataclass
class TrainResult:
    losses: list[float]  # rank 0's
    ref_losses: list[float]
    rank_losses: list[list[float]]  # every rank's
    layout: list[tuple[int, list[int]]]  # (parts, grid) of each stage
    keys: list[str]  # state-dict entries on one side only
    off: list[str]  # entries (and "eval_step") further than TOL from one process, with assert_close's words
    max_dw: float  # largest difference of a state-dict entry
    pred_diff: float  # eval_step against the reference model in eval mode
    checks: dict[str, Any] = field(default_factory=dict)  # helpers.zoo_checks' outcomes
    predict_line: str = ""  # cm.predict's summary line (a case with predict)
    predict_out: str = ""  # the zarr it wrote
    secs: list[float] = field(default_factory=list)  # each rank's seconds for the case (checks included)


def _compare(case: Train, model: nn.Module, losses: list[float], sd: dict[str, torch.Tensor],
             pred: torch.Tensor) -> dict[str, Any]:
    """Train ``model`` (the untouched copy) on one process and compare with the ranks' ``sd`` and ``pred``."""
    ref_losses, ref_sd = train_reference(model, _sgd(model.parameters()), _Loss(by_id(case.net).output),
                                         lambda step: _data(case.net, case.total, step), case.total, STEPS)
    with torch.no_grad():  # the ranks run one thread each: so does train_reference, and this
        ref_pred = first_tensor(model.eval()(_sample(case.net)))
    off = []
    for k, ref in ref_sd.items():  # weights, running statistics and num_batches_tracked
        if k in sd:
            try:
                torch.testing.assert_close(sd[k], ref, rtol=TOL, atol=TOL)
            except AssertionError as e:
                off.append(f"{k}: {e}")
    try:
        torch.testing.assert_close(pred, ref_pred, rtol=TOL, atol=TOL)
    except AssertionError as e:
        off.append(f"eval_step: {e}")
    return {"ref_losses": ref_losses, "keys": sorted(set(sd) ^ set(ref_sd)) or ([] if list(sd) == list(ref_sd)
                                                                                 else ["(order)"]),
            "off": off, "max_dw": max((float((sd[k].double() - v.double()).abs().max()) for k, v in ref_sd.items()
                                       if k in sd and v.numel()), default=0.0),
            "pred_diff": float((pred - ref_pred).abs().max())}


def _predict(world: int, net_id: str, source: str, out: str) -> str:
    import nowdl

    pins = {"stages": 1, "spatial_parts": world, "slice": "vertical", "micro_batches": 1, "replicas": 1, "dp": 1}
    cm = nowdl.compile(build(by_id(net_id)).eval(), gpus=world, progress=False, cache=False, **pins)
    return cm.predict(source, out).line()


def _to_rank(sd: dict[str, torch.Tensor], pred: Any, rank: int, dst: int) -> tuple[dict[str, torch.Tensor], Any]:
    """Rank 0's state dict and eval_step logits, on rank ``dst`` too (entry by entry)."""
    import torch.distributed as dist

    meta = [[(k, tuple(v.shape), v.dtype) for k, v in sd.items()], pred] if rank == 0 else [None, None]
    dist.broadcast_object_list(meta, src=0)
    got = {}
    for k, shape, dtype in meta[0]:  # type: ignore[union-attr]
        t = sd[k].detach().contiguous() if rank == 0 else torch.empty(shape, dtype=dtype)
        dist.broadcast(t, src=0)
        got[k] = t
    return (got, meta[1]) if rank == dst else ({}, None)


def _train_one(rank: int, world: int, case: Train, predict_dir: str, ref_rank: int) -> dict[str, Any]:
    import nowdl

    model = build(by_id(case.net)).double()
    ref_model = copy.deepcopy(model) if rank == ref_rank else None  # what one process starts from
    cfg = {"dp": 1, "replicas": 1, "schedule": "1f1b", **case.cfg}
    cm = nowdl.compile(model, gpus=world, mode="estimate", optimizer=_sgd, loss_fn=_Loss(by_id(case.net).output),
                       cache=False, progress=False, timeout_s=120, **cfg)
    losses = [cm.train_step(*_data(case.net, case.total, step)) for step in range(STEPS)]
    plan = cm._trainer.plan
    assert plan is not None
    out: dict[str, Any] = {"losses": losses, "layout": [(s.parts, list(s.grid)) for s in plan.stages]}
    sd = cm.state_dict()  # rank 0's; {} elsewhere
    pred = cm.eval_step(_sample(case.net))  # rank 0's; None elsewhere
    pred = None if pred is None else first_tensor(pred)
    del cm
    if ref_rank != 0:
        sd, pred = _to_rank(sd, pred, rank, ref_rank)
    if ref_model is not None:
        assert pred is not None
        out.update(_compare(case, ref_model, losses, sd, pred))
    # the other rank plans meanwhile (no process group); with more checks than ranks, in turns
    out["checks"] = {c: run_check(c, case.net) for i, c in enumerate(case.checks)
                     if (ref_rank + 1 + i) % world == rank}
    if case.predict:
        out["predict_line"] = _predict(world, case.net, f"zarr:{predict_dir}/in.zarr", f"{predict_dir}/out.zarr")
    return out


def _train_worker(rank: int, world: int, cases: list[tuple[str, Train]], predict_dir: str
                  ) -> dict[str, dict[str, Any] | str]:
    import traceback

    import torch.distributed as dist

    out: dict[str, dict[str, Any] | str] = {}
    first_failure = ""
    for i, (cid, case) in enumerate(cases):
        if first_failure:
            out[cid] = f"not run: case {first_failure} failed before it"
            continue
        failed = torch.zeros(1)
        t0 = time.perf_counter()
        try:
            out[cid] = _train_one(rank, world, case, predict_dir, i % world)  # the ranks compare in turns
            out[cid]["secs"] = time.perf_counter() - t0  # type: ignore[index]
        except Exception:
            out[cid] = f"rank {rank}: " + traceback.format_exc()
            print(f"case {cid} failed on {out[cid]}", file=sys.stderr, flush=True)
            failed += 1
        try:
            dist.all_reduce(failed)  # every rank learns whether any rank failed
        except RuntimeError:  # a peer timed out and gloo closed the connection: stop here
            failed += 1
        if failed.item():
            first_failure = cid
            if not isinstance(out[cid], str):
                out[cid] = "another rank failed (see its traceback in that rank's result)"
    return out


def run_cases(cases: dict[str, Train], predict_dir: str = "") -> dict[str, TrainResult | str]:
    """Train every case in one pool of WORLD processes, compared there with one process: a
    TrainResult per case, or the error text of the ranks where it failed. ``predict_dir`` holds
    ``in.zarr``, the image a case with ``predict`` streams into ``out.zarr`` beside it."""
    todo = list(cases.items())
    per_rank = run_workers(_train_worker, WORLD, todo, predict_dir, timeout_s=240 + 120 * len(todo))
    results: dict[str, TrainResult | str] = {}
    for cid, _ in todo:
        got = [r[cid] for r in per_rank]
        errors = [g for g in got if isinstance(g, str)]
        if errors:
            results[cid] = "\n".join(dict.fromkeys(errors))
            continue
        first = got[0]
        ref = next(g for g in got if isinstance(g, dict) and "ref_losses" in g)  # the rank that compared
        assert isinstance(first, dict)
        checks = {k: v for g in got if isinstance(g, dict) for k, v in g["checks"].items()}
        results[cid] = TrainResult(first["losses"], ref["ref_losses"], [g["losses"] for g in got],  # type: ignore[index]
                                   first["layout"], ref["keys"], ref["off"], ref["max_dw"], ref["pred_diff"],
                                   checks, first.get("predict_line", ""),
                                   f"{predict_dir}/out.zarr" if cases[cid].predict else "",
                                   [g["secs"] for g in got])  # type: ignore[index]
    return results
