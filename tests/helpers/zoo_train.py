"""Test helper (not a test module): train model-zoo nets on gloo ranks and on one process.

Every case of ``run_cases`` runs in ONE pool of ``WORLD`` processes, one after another (spawning
and importing torch, timm and smp costs more than most cases); after a failure the remaining
cases are not run. Each case trains ``STEPS`` SGD steps (momentum 0.9) in float64 and is compared
with one process running the same micro-batches with gradient accumulation
(``helpers.reference.train_reference``). SGD, not Adam: Adam divides by the square root of the
gradients' second moment, which turns a true gradient of zero into steps of about the learning
rate and its round-off (1e-16) into weight differences of 1e-8 on these deep nets.

After training, ``cm.eval_step`` of one sample (an inference plan on the ranks, with the trained
weights) is compared with the reference model's forward in eval mode: prediction with every net.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from helpers.distributed import run_workers
from helpers.reference import train_reference
from helpers.zoo import build, by_id, first_tensor, out_shape

__all__ = ["WORLD", "STEPS", "Train", "TrainResult", "run_cases"]

WORLD = 2
STEPS = 2


@dataclass(frozen=True)
class Train:
    net: str
    cfg: dict[str, Any]

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


def _make(net_id: str) -> nn.Module:
    return build(by_id(net_id)).double()


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


#: losses, state dict, (parts, grid) of each stage, eval_step's logits (rank 0; None elsewhere)
_Ran = tuple[list[float], dict[str, torch.Tensor], list[tuple[int, list[int]]], torch.Tensor | None]


def _train_one(world: int, case: Train) -> _Ran:
    import nowdl

    cfg = {"dp": 1, "replicas": 1, "schedule": "1f1b", **case.cfg}
    cm = nowdl.compile(_make(case.net), gpus=world, mode="estimate", optimizer=_sgd, loss_fn=_Loss(by_id(case.net).output),
                       cache=False, progress=False, timeout_s=120, **cfg)
    losses = [cm.train_step(*_data(case.net, case.total, step)) for step in range(STEPS)]
    plan = cm._trainer.plan
    assert plan is not None
    layout = [(s.parts, list(s.grid)) for s in plan.stages]
    sd = cm.state_dict()
    pred = cm.eval_step(_sample(case.net))
    return losses, sd, layout, None if pred is None else first_tensor(pred)


def _train_worker(rank: int, world: int, cases: list[tuple[str, Train]]) -> dict[str, _Ran | str]:
    import traceback

    import torch.distributed as dist

    out: dict[str, _Ran | str] = {}
    first_failure = ""
    for cid, case in cases:
        if first_failure:
            out[cid] = f"not run: case {first_failure} failed before it"
            continue
        failed = torch.zeros(1)
        try:
            out[cid] = _train_one(world, case)
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


@dataclass
class TrainResult:
    losses: list[float]  # rank 0's
    ref_losses: list[float]
    sd: dict[str, torch.Tensor]  # cm.state_dict() after the last step
    ref_sd: dict[str, torch.Tensor]
    layout: list[tuple[int, list[int]]]  # (parts, grid) of each stage
    rank_losses: list[list[float]]  # every rank's
    pred: torch.Tensor  # cm.eval_step of one sample after training (rank 0's)
    ref_pred: torch.Tensor  # the reference model's forward in eval mode


def run_cases(cases: dict[str, Train]) -> dict[str, TrainResult | str]:
    """Train every case in one pool of WORLD processes and in one process (the reference): a
    TrainResult per case, or the error text of the ranks where it failed."""
    todo = list(cases.items())
    per_rank = run_workers(_train_worker, WORLD, todo, timeout_s=240 + 120 * len(todo))
    results: dict[str, TrainResult | str] = {}
    for cid, case in todo:
        got = [r[cid] for r in per_rank]
        errors = [g for g in got if isinstance(g, str)]
        if errors:
            results[cid] = "\n".join(dict.fromkeys(errors))
            continue
        model = _make(case.net)
        ref_losses, ref_sd = train_reference(model, _sgd(model.parameters()), _Loss(by_id(case.net).output),
                                             lambda step, c=case: _data(c.net, c.total, step), case.total, STEPS)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as the ranks run
        try:
            with torch.no_grad():
                ref_pred = first_tensor(model.eval()(_sample(case.net)))
        finally:
            torch.set_num_threads(threads)
        losses, sd, layout, pred = got[0]  # type: ignore[misc]
        results[cid] = TrainResult(losses, ref_losses, sd, ref_sd, layout, [g[0] for g in got],  # type: ignore[index]
                                   pred, ref_pred)
    return results
