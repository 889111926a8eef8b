"""Per-step metrics of a run: ``metrics.jsonl`` (and TensorBoard events when tensorboard is installed).

``DIR/metrics.jsonl`` (written by rank 0, flushed every step) starts with one meta line, then
one line per step::

    {"meta": {"model": "unet", "world": 4, "config": {...the plan's config...}}}
    {"step": 1, "time": 1764000000.0, "loss": 0.69, "images_per_s": 6.5, "step_s": 1.23,
     "data_wait_s": 0.01, "ranks": [{"rank": 0, "peak_bytes": 123, "predicted_bytes": 120}, ...]}

``peak_bytes`` is ``torch.cuda.max_memory_allocated`` over the step on CUDA; on CPU it is the
measure of ``benchmarks/bench_runtime.py``: the bytes of parameters, buffers and optimizer state
before the step, plus the peak of live storages the step allocates (``AllocTracker``; receive
buffers included: they are allocated fresh each step), taken on sampled steps (see :class:`PeakMeter`).
``predicted_bytes`` is the plan's ``predicted_peak_bytes``. An evaluation step with labels
(``nowdl run --eval --labels``) adds ``"dice"``, ``"iou"`` and ``"accuracy"`` of its batch.
Validation (``nowdl run --val-data``) writes its own lines, after the step it follows::

    {"step": 100, "time": 1764000000.0, "val": {"loss": 0.41, "dice": 0.83, "iou": 0.71,
     "accuracy": 0.97, "images": 4, "s": 2.5}}

(TensorBoard: ``val/loss``, ``val/dice``, ...).
"""

from __future__ import annotations

import gc
import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["MetricsWriter", "PeakMeter", "static_bytes", "peak_of", "METRICS_FILE", "TRACK_EVERY"]

log = logging.getLogger(__name__)

#: The file in ``--log-dir`` that holds the metrics.
METRICS_FILE = "metrics.jsonl"


def static_bytes(modules: Sequence[nn.Module], opt: torch.optim.Optimizer | None) -> int:
    """Parameters, buffers and optimizer state that live across steps (storages counted once)."""
    seen: set[int] = set()
    total = 0
    tensors: list[torch.Tensor] = []
    for mod in modules:
        tensors += list(mod.parameters()) + list(mod.buffers())
    if opt is not None:
        for st in opt.state.values():
            tensors += [v for v in st.values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        key = int(t.untyped_storage()._cdata)
        if key not in seen:
            seen.add(key)
            total += int(t.untyped_storage().nbytes())
    return total


def peak_of(step: Callable[[], Any], modules: Sequence[nn.Module], opt: torch.optim.Optimizer | None,
            cap: int | None = None) -> tuple[Any, int]:
    """Run ``step()``; returns its result and static bytes before it + the peak of storages it
    allocates (``cap``: raise ``torch.OutOfMemoryError`` above it, [Note: memory cap])."""
    from nowdl.profiler.memory import AllocTracker
    from nowdl.runtime.training.memory_cap import CapTracker

    if opt is not None:
        opt.zero_grad(set_to_none=True)
    gc.collect()
    static = static_bytes(modules, opt)
    with AllocTracker() if cap is None else CapTracker(cap, static) as tracker:
        out = step()
    return out, static + tracker.peak


#: On CPU the tracker runs on the second step and every ``TRACK_EVERY``-th after it (it slows a step).
TRACK_EVERY = 16


class PeakMeter:
    """This rank's peak bytes per step: CUDA's allocator peak, or on CPU the tracker on sampled steps.

    The AllocTracker sees every aten op from Python, which slows a CPU step several-fold on small
    models; it runs on the second step and every ``TRACK_EVERY``-th step after (every step while
    ``watch`` is set, as ``nowdl run`` checks its first steps against the cap, and under
    ``NOWDL_MEMORY_CAP=BYTES,oom``), and the steps in between report the last measured peak. The
    first step (which builds the stages) reports the static bytes (parameters, buffers, optimizer
    state) it ended with.
    """

    def __init__(self, cm: Any, *, cuda: bool, evaluation: bool = False) -> None:
        from nowdl.runtime.training.memory_cap import injected_cap

        self.cm, self.cuda, self.last, self.steps = cm, cuda, 0, 0
        self.evaluation = evaluation  # eval steps run on the inference plans' engines
        cap, raises = injected_cap()
        self.oom_cap = cap if raises and not cuda else None  # [Note: memory cap]
        self.watch = False

    def _engine(self) -> Any:
        """The engine the steps run on: the training engine, or the last inference engine used."""
        tr = getattr(self.cm, "_trainer", None)
        if tr is None:
            return None
        if self.evaluation:
            ev = getattr(tr, "_evaluator", None)
            return ev.last.engine if ev is not None and ev.last is not None else None
        return tr.engine

    def run(self, step: Callable[[], Any]) -> tuple[Any, int]:
        """Run ``step()`` (a ``train_step``/``eval_step``); returns its result and the peak bytes."""
        self.steps += 1
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            out = step()
            return out, int(torch.cuda.max_memory_allocated())
        eng = self._engine()
        if eng is None:  # the first step builds the engine
            out = step()
            eng = self._engine()
            self.last = static_bytes([eng.stages[s].module for _, s in eng.held], eng.optimizer)
            return out, self.last
        if (self.steps - 2) % TRACK_EVERY and not self.watch and self.oom_cap is None:
            return step(), self.last
        out, peak = peak_of(step, [eng.stages[s].module for _, s in eng.held], eng.optimizer, self.oom_cap)
        self.last = peak
        return out, self.last


def _finite(v: float | int) -> float | None:
    """``v`` as a JSON number (None for NaN or infinity)."""
    return float(v) if math.isfinite(v) else None


class MetricsWriter:
    """Writes ``DIR/metrics.jsonl`` on rank 0 (every rank calls ``step``: the per-rank peaks are gathered).

    Nothing is created until the first step is written.

    Args:
        log_dir: the folder.
        rank, world: this process and the job size.
        meta: the first line's ``meta`` object (model, world, config).
        predicted_bytes: this rank's predicted peak (the plan's).
    """

    def __init__(self, log_dir: str | Path, *, rank: int, world: int, meta: dict[str, Any],
                 predicted_bytes: float) -> None:
        self.dir, self.rank, self.world, self.meta = Path(log_dir), rank, world, meta
        self.predicted = int(predicted_bytes)
        self._file: Any = None
        self._tb: Any = None

    def _open(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self._file = open(self.dir / METRICS_FILE, "w")  # noqa: SIM115 - closed in close()
        self._file.write(json.dumps({"meta": self.meta}) + "\n")
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            log.info("tensorboard is not installed: writing %s only", METRICS_FILE)
        else:
            self._tb = SummaryWriter(log_dir=str(self.dir))

    def step(self, step: int, *, loss: float | None, images_per_s: float, step_s: float, data_wait_s: float,
             peak_bytes: int, scores: dict[str, float] | None = None) -> None:
        """Record step ``step`` (1-based; ``scores``: an evaluation's dice, iou, accuracy); a
        collective: every rank calls it."""
        mine = {"rank": self.rank, "peak_bytes": int(peak_bytes), "predicted_bytes": self.predicted}
        ranks = [mine]
        if self.world > 1:
            box: list[Any] = [None] * self.world if self.rank == 0 else []
            dist.gather_object(mine, box if self.rank == 0 else None, dst=0)
            ranks = list(box)
        if self.rank != 0:
            return
        if self._file is None:
            self._open()
        loss_v = None if loss is None or not math.isfinite(loss) else float(loss)
        rec = {"step": step, "time": time.time(), "loss": loss_v, "images_per_s": float(images_per_s),
               "step_s": float(step_s), "data_wait_s": float(data_wait_s), "ranks": ranks}
        extra = {k: _finite(v) for k, v in (scores or {}).items()}
        rec.update(extra)
        self._file.write(json.dumps(rec) + "\n")
        self._file.flush()
        if self._tb is not None:
            if loss_v is not None:
                self._tb.add_scalar("loss", loss_v, step)
            self._tb.add_scalar("images_per_s", images_per_s, step)
            self._tb.add_scalar("step_s", step_s, step)
            self._tb.add_scalar("data_wait_s", data_wait_s, step)
            for r in ranks:
                self._tb.add_scalar(f"peak_bytes/rank{r['rank']}", r["peak_bytes"], step)
            for k, v in extra.items():
                if v is not None:
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()

    def validation(self, step: int, values: dict[str, float]) -> None:
        """Record a validation after step ``step`` (rank 0 writes; the other ranks' calls do nothing)."""
        if self.rank != 0:
            return
        if self._file is None:
            self._open()
        val = {k: _finite(v) for k, v in values.items()}
        self._file.write(json.dumps({"step": step, "time": time.time(), "val": val}) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in val.items():
                if v is not None:
                    self._tb.add_scalar(f"val/{k}", v, step)
            self._tb.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
