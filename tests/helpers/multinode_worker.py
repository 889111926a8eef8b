"""Test helper (not a test module): one rank of a multi-node job, started by torchrun or with srun's variables.

    python tests/helpers/multinode_worker.py PLAN.json OUT_DIR MODEL_KIND STEPS

Trains ``STEPS`` SGD steps of the plan's model (float64, seeded weights and data, as
``tests/runtime/test_multinode.py`` builds them) and writes ``OUT_DIR/rank<r>.json`` (what the launcher
told this rank) and, on rank 0, ``OUT_DIR/result.pt`` (losses and the whole state dict).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

import nowdl
from nowdl.runtime.launch.group import launch_env

__all__ = ["LR", "batch", "main", "make_model", "sgd"]

LR = 0.05


def make_model(kind: str) -> nn.Module:
    """The model of ``kind`` with fixed weights (float64: the comparison is to 1e-9)."""
    torch.manual_seed(0)
    if kind == "resnet":
        return nowdl.models.resnet(depth=8, version=1, num_classes=3, width=4, conv_bias=False).double()
    raise ValueError(kind)


def batch(step: int, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return (torch.randn(total, 3, 16, 16, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (total,), generator=g))


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR)


def main(argv: list[str]) -> int:
    plan_path, out, kind, steps = argv[0], Path(argv[1]), argv[2], int(argv[3])
    env = launch_env()
    plan = nowdl.Plan.load(plan_path)
    total = int(plan.config["micro_batches"]) * int(plan.config["replicas"]) * int(plan.config["dp"])
    cm = nowdl.compile(make_model(kind), plan=plan_path, optimizer=sgd, loss_fn=nn.CrossEntropyLoss(),
                       timeout_s=60, progress=False, cache=False)
    losses = [cm.train_step(*batch(step, total)) for step in range(steps)]
    sd = cm.state_dict()
    (out / f"rank{env.rank}.json").write_text(json.dumps({
        "rank": env.rank, "world": env.world_size, "local_rank": env.local_rank, "node_rank": env.node_rank,
        "local_world_size": env.local_world_size, "launcher": env.launcher,
        "device": str(cm._trainer.engine.device), "losses": losses}))
    if env.rank == 0:
        torch.save({"losses": losses, "state": sd}, out / "result.pt")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
