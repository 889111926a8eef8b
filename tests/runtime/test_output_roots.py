"""What a stage keeps of its outputs until their backward: on a GPipe rank the peak grows with M by
what the plan charges per micro-batch, not by outputs nothing saves ([Note: backward roots])."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from helpers.distributed import run_workers
from torch import nn

import nowdl
from nowdl.runtime.training.metrics import peak_of

SIZE = 32
OUT_BYTES = 8 * SIZE * SIZE * 4  # one 8-channel activation of one micro-batch


class Head(nn.Module):
    """Ends in an add whose output nothing saves (cross-entropy saves its log-softmax)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(1, 8, 3, padding=1)
        self.b = nn.Conv2d(8, 8, 3, padding=1)
        self.c = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x))))) + 1.0


class Body(nn.Module):
    """Its first stage ends in an add that the next stage's relu reads (a relu saves its output,
    not its input): nothing saves the add's output, the first stage need not keep it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(1, 8, 3, padding=1)
        self.b = nn.Conv2d(8, 8, 3, padding=1)
        self.c = nn.Conv2d(8, 8, 3, padding=1)
        self.d = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.b(torch.relu(self.a(x))) + 1.0
        return self.d(torch.relu(self.c(torch.relu(h))))


MODELS: dict[str, Callable[[], nn.Module]] = {"head": Head, "body": Body}


def _batch(m: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(m, 1, SIZE, SIZE, generator=g), torch.randint(0, 8, (m, SIZE, SIZE), generator=g)


def _worker(rank: int, world: int, plan_path: str, m: int, name: str) -> int:
    torch.manual_seed(0)
    cm = nowdl.compile(MODELS[name](), plan=plan_path, optimizer="adam", loss_fn=nn.CrossEntropyLoss(),
                       cache=False, progress=False, backend="gloo")
    x, y = _batch(m)
    cm.train_step(x, y)
    eng = cm._trainer.engine
    return peak_of(lambda: cm.train_step(x, y), [eng.stages[s].module for _, s in eng.held], eng.optimizer)[1]


def _growth(tmp_path: Path, name: str, rank: int, check: Callable[[nowdl.Plan], Any], **kw: Any) -> tuple[int, float]:
    """Measured and predicted growth of ``rank``'s peak from M = 1 to M = 4 (2 GPipe stages)."""
    peaks, predicted = {}, {}
    for m in (1, 4):
        torch.manual_seed(0)
        plan = nowdl.compile(MODELS[name](), gpus=2, stages=2, micro_batches=m, schedule="gpipe", dp=1,
                             replicas=1, spatial_parts=1, mode="estimate", optimizer="adam", cache=False,
                             progress=False, loss_fn=nn.CrossEntropyLoss(), **kw).plan(
            _batch(1)[0], target=_batch(1)[1])
        check(plan)
        path = tmp_path / f"{name}-{m}.json"
        plan.save(path)
        peaks[m] = run_workers(_worker, 2, str(path), m, name)[rank]
        predicted[m] = plan.ranks[rank].predicted_peak_bytes
    return peaks[4] - peaks[1], predicted[4] - predicted[1]


def test_gpipe_last_stage_holds_no_model_output(tmp_path: Path) -> None:
    def check(plan: nowdl.Plan) -> None:
        assert plan.stages[1].nodes[-2:] == ["add", "output"], plan.stages[1].nodes

    grown, charged = _growth(tmp_path, "head", 1, check)
    # holding each micro-batch's output would add 3 x OUT_BYTES more than the plan charges
    assert grown <= charged + OUT_BYTES, (grown, charged, OUT_BYTES)


def test_gpipe_stage_keeps_no_unsaved_output(tmp_path: Path) -> None:
    """Rank 0 keeps the add's autograd edge, not the add, per micro-batch."""
    def check(plan: nowdl.Plan) -> None:
        assert [t.producer for t in plan.tensors if t.from_stage == 0] == ["add"], plan.tensors

    grown, charged = _growth(tmp_path, "body", 0, check, balance="compute")
    assert grown <= charged + OUT_BYTES, (grown, charged, OUT_BYTES)  # keeping each add: 3 x OUT_BYTES more
