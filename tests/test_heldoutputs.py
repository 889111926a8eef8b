"""The last stage keeps no model output for its backward (the loss is the root): a GPipe last stage's
peak grows with M by what the plan charges per micro-batch, not by the model's output too."""

from __future__ import annotations

from pathlib import Path

import torch
from distributed import run_workers
from torch import nn

import nowdl
from nowdl.runtime.metrics import peak_of

SIZE = 32


class Head(nn.Module):
    """Ends in an add whose output nothing saves (cross-entropy saves its log-softmax)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(1, 8, 3, padding=1)
        self.b = nn.Conv2d(8, 8, 3, padding=1)
        self.c = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x))))) + 1.0


def _batch(m: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(m, 1, SIZE, SIZE, generator=g), torch.randint(0, 8, (m, SIZE, SIZE), generator=g)


def _worker(rank: int, world: int, plan_path: str, m: int) -> int:
    torch.manual_seed(0)
    cm = nowdl.compile(Head(), plan=plan_path, optimizer="adam", loss_fn=nn.CrossEntropyLoss(), cache=False,
                       progress=False, backend="gloo")
    x, y = _batch(m)
    cm.train_step(x, y)
    eng = cm._trainer.engine
    return peak_of(lambda: cm.train_step(x, y), [eng.stages[s].module for _, s in eng.held], eng.optimizer)[1]


def test_gpipe_last_stage_holds_no_model_output(tmp_path: Path) -> None:
    peaks, predicted = {}, {}
    for m in (1, 4):
        torch.manual_seed(0)
        plan = nowdl.compile(Head(), gpus=2, stages=2, micro_batches=m, schedule="gpipe", dp=1, replicas=1,
                             spatial_parts=1, mode="estimate", optimizer="adam", cache=False, progress=False,
                             loss_fn=nn.CrossEntropyLoss()).plan(*_batch(1)[:1], target=_batch(1)[1])
        assert plan.stages[1].nodes[-2:] == ["add", "output"], plan.stages[1].nodes
        path = tmp_path / f"plan-{m}.json"
        plan.save(path)
        peaks[m] = run_workers(_worker, 2, str(path), m)[1]
        predicted[m] = plan.ranks[1].predicted_peak_bytes
    out_bytes = 8 * SIZE * SIZE * 4  # the model's output, one micro-batch
    grown, charged = peaks[4] - peaks[1], predicted[4] - predicted[1]
    # holding each micro-batch's output would add 3 x out_bytes more than the plan charges
    assert grown <= charged + out_bytes, (grown, charged, out_bytes)


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


def _body_worker(rank: int, world: int, plan_path: str, m: int) -> int:
    torch.manual_seed(0)
    cm = nowdl.compile(Body(), plan=plan_path, optimizer="adam", loss_fn=nn.CrossEntropyLoss(), cache=False,
                       progress=False, backend="gloo")
    x, y = _batch(m)
    cm.train_step(x, y)
    eng = cm._trainer.engine
    return peak_of(lambda: cm.train_step(x, y), [eng.stages[s].module for _, s in eng.held], eng.optimizer)[1]


def test_gpipe_stage_keeps_no_unsaved_output(tmp_path: Path) -> None:
    """[Note: backward roots]: rank 0 keeps the add's autograd edge, not the add, per micro-batch."""
    peaks, predicted = {}, {}
    for m in (1, 4):
        torch.manual_seed(0)
        plan = nowdl.compile(Body(), gpus=2, stages=2, micro_batches=m, schedule="gpipe", dp=1, replicas=1,
                             spatial_parts=1, mode="estimate", optimizer="adam", cache=False, progress=False,
                             balance="compute", loss_fn=nn.CrossEntropyLoss()).plan(*_batch(1)[:1], target=_batch(1)[1])
        assert [t.producer for t in plan.tensors if t.from_stage == 0] == ["add"], plan.tensors
        path = tmp_path / f"plan-{m}.json"
        plan.save(path)
        peaks[m] = run_workers(_body_worker, 2, str(path), m)[0]
        predicted[m] = plan.ranks[0].predicted_peak_bytes
    out_bytes = 8 * SIZE * SIZE * 4
    grown, charged = peaks[4] - peaks[1], predicted[4] - predicted[1]
    assert grown <= charged + out_bytes, (grown, charged, out_bytes)  # keeping each add: 3 x out_bytes more
