"""Read the metrics log of ``nowdl run --log-dir DIR`` and summarise it (``nowdl report DIR``).

[Note: metrics log] ``DIR/metrics.jsonl`` is written by rank 0, one JSON object per line per
step: ``{"step": int, "time": unix seconds, "loss": float|null, "images_per_s": float,
"step_s": float, "data_wait_s": float, "ranks": [{"rank": int, "peak_bytes": int,
"predicted_bytes": int}, ...]}``, optionally preceded by one ``{"meta": {...}}`` line (model,
world size, plan config). Evaluation steps may add ``dice``, ``iou`` and ``accuracy``;
validation lines ``{"step": int, "time": float, "val": {"loss", "dice", "iou", "accuracy",
...}}`` (``nowdl run --val-data``) are read into ``Metrics.validations``. Reading needs no
matplotlib; ``--plot`` draws with it.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nowdl.errors import NowdlError
from nowdl.plan.plan import format_bytes

__all__ = ["METRICS_FILE", "Step", "Validation", "Metrics", "read_metrics", "rank_peaks", "summary"]

METRICS_FILE = "metrics.jsonl"

_NUMBERS = ("time", "images_per_s", "step_s", "data_wait_s")


@dataclass(frozen=True)
class Step:
    """One line of the log: one training step as rank 0 saw it."""

    step: int
    time: float
    loss: float | None
    images_per_s: float
    step_s: float
    data_wait_s: float
    ranks: tuple[tuple[int, int, int], ...]  # (rank, measured peak bytes, predicted bytes)
    scores: dict[str, float | None] = field(default_factory=dict)  # an evaluation's dice, iou, accuracy


@dataclass(frozen=True)
class Validation:
    """One validation line: the step it followed and its figures (None: not a number)."""

    step: int
    values: dict[str, float | None]


@dataclass
class Metrics:
    """A whole log: the optional meta line, then the steps in file order."""

    path: Path
    meta: dict[str, Any] = field(default_factory=dict)
    steps: list[Step] = field(default_factory=list)
    validations: list[Validation] = field(default_factory=list)


def _bad(path: Path, line: int, what: str) -> NowdlError:
    return NowdlError(f"{path}, line {line}: {what}; the metrics log is damaged: fix or delete that line "
                      "(or run again with --log-dir)")


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _step(d: Any, path: Path, line: int) -> Step:
    if not isinstance(d, dict):
        raise _bad(path, line, f"a step is a JSON object, got {type(d).__name__}")
    missing = [k for k in ("step", *_NUMBERS, "loss", "ranks") if k not in d]
    if missing:
        raise _bad(path, line, f"missing field(s) {', '.join(missing)}")
    if not isinstance(d["step"], int) or isinstance(d["step"], bool):
        raise _bad(path, line, f"'step' must be an integer, got {d['step']!r}")
    for k in _NUMBERS:
        if not _number(d[k]):
            raise _bad(path, line, f"'{k}' must be a finite number, got {d[k]!r}")
    loss = d["loss"]
    if isinstance(loss, bool) or (loss is not None and not isinstance(loss, (int, float))):
        raise _bad(path, line, f"'loss' must be a number or null, got {loss!r}")
    ranks = d["ranks"]
    if not isinstance(ranks, list):
        raise _bad(path, line, "'ranks' must be a list of {rank, peak_bytes, predicted_bytes} objects")
    rows: list[tuple[int, int, int]] = []
    for r in ranks:
        vals = [r.get(k) for k in ("rank", "peak_bytes", "predicted_bytes")] if isinstance(r, dict) else [None]
        ints = [v for v in vals if isinstance(v, int) and not isinstance(v, bool)]
        if len(ints) != 3:
            raise _bad(path, line, f"a 'ranks' entry needs integer rank, peak_bytes and predicted_bytes, got {r!r}")
        rows.append((ints[0], ints[1], ints[2]))
    return Step(step=d["step"], time=float(d["time"]), loss=None if loss is None else float(loss),
                images_per_s=float(d["images_per_s"]), step_s=float(d["step_s"]),
                data_wait_s=float(d["data_wait_s"]), ranks=tuple(rows),
                scores={k: _score(d[k], k, path, line) for k in _SCORES if k in d})


_SCORES = ("dice", "iou", "accuracy")


def _score(v: Any, key: str, path: Path, line: int) -> float | None:
    if v is not None and not _number(v):
        raise _bad(path, line, f"'{key}' must be a finite number or null, got {v!r}")
    return None if v is None else float(v)


def _validation(d: dict[str, Any], path: Path, line: int) -> Validation:
    if not isinstance(d.get("step"), int) or isinstance(d["step"], bool) or not isinstance(d["val"], dict):
        raise _bad(path, line, "a validation line needs an integer 'step' and a 'val' object")
    return Validation(step=d["step"], values={str(k): _score(v, str(k), path, line) for k, v in d["val"].items()})


def read_metrics(log_dir: str | os.PathLike[str]) -> Metrics:
    """Read and check ``DIR/metrics.jsonl``.

    Raises:
        NowdlError: no such folder, no metrics.jsonl in it, or a malformed line (file and line number).
    """
    d = Path(log_dir)
    if not d.is_dir():
        raise NowdlError(f"log folder {str(d)!r} does not exist: give the --log-dir of a `nowdl run`")
    path = d / METRICS_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise NowdlError(f"{path} does not exist: `nowdl run --log-dir {d}` writes it (rank 0, one line a step)") from None
    except OSError as e:
        raise NowdlError(f"cannot read {path}: {e.strerror}") from None
    out = Metrics(path=path)
    for i, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            raise _bad(path, i, f"not valid JSON ({e.msg} at column {e.colno})") from None
        if isinstance(obj, dict) and "meta" in obj and "step" not in obj:
            if out.steps or out.meta:
                raise _bad(path, i, "a 'meta' line may only come first")
            if not isinstance(obj["meta"], dict):
                raise _bad(path, i, "'meta' must be an object")
            out.meta = obj["meta"]
            continue
        if isinstance(obj, dict) and "val" in obj:
            out.validations.append(_validation(obj, path, i))
            continue
        out.steps.append(_step(obj, path, i))
    if not out.steps:
        raise NowdlError(f"{path} has no steps yet: the run wrote nothing, or was stopped before its first step")
    return out


def rank_peaks(m: Metrics) -> dict[int, tuple[int, int]]:
    """rank -> (largest measured peak bytes over all steps, largest predicted bytes)."""
    out: dict[int, tuple[int, int]] = {}
    for s in m.steps:
        for rank, peak, pred in s.ranks:
            old = out.get(rank, (0, 0))
            out[rank] = (max(old[0], peak), max(old[1], pred))
    return dict(sorted(out.items()))


def summary(m: Metrics) -> str:
    """A short text summary: steps, mean images/s (first step excluded), final loss, memory per rank."""
    steps = m.steps
    timed = steps[1:] if len(steps) > 1 else steps
    ips = sum(s.images_per_s for s in timed) / len(timed)
    wait = sum(s.data_wait_s for s in timed) / max(1e-12, sum(s.step_s for s in timed))
    losses = [s for s in steps if s.loss is not None]
    meta = m.meta
    head = f"{m.path}: {len(steps)} steps (step {steps[0].step} .. {steps[-1].step})"
    if meta:
        bits = [f"{k} {meta[k]}" for k in ("model", "world_size") if k in meta]
        head += f", {', '.join(bits)}" if bits else ""
    lines = [
        head,
        f"throughput: {ips:.3g} images/s mean over {'steps after the first' if len(steps) > 1 else 'the only step'}, "
        f"step {sum(s.step_s for s in timed) / len(timed):.3g} s, waiting for data {wait:.0%} of it",
        f"loss: final {losses[-1].loss:.6g} (step {losses[-1].step}), first {losses[0].loss:.6g}" if losses
        else "loss: none logged (evaluation or loss not reported)",
    ]
    scored = [s for s in steps if s.scores]
    if scored:
        lines.append(_scores_line("evaluation", scored[-1].scores, f"step {scored[-1].step}"))
    if m.validations:
        first, last = m.validations[0], m.validations[-1]
        lines.append(_scores_line("validation", last.values, f"after step {last.step}; {len(m.validations)} "
                                  f"validation(s), first loss {_fmt(first.values.get('loss'))}"))
    peaks = rank_peaks(m)
    if peaks:
        lines.append(f"{'rank':>4} {'measured peak':>14} {'predicted':>10} {'ratio':>6}")
        for rank, (peak, pred) in peaks.items():
            ratio = f"{peak / pred:.2f}" if pred > 0 else "-"
            lines.append(f"{rank:>4} {format_bytes(peak):>14} {format_bytes(pred):>10} {ratio:>6}")
        worst = max(peaks.items(), key=lambda kv: kv[1][0] / kv[1][1] if kv[1][1] else 0.0)
        if worst[1][1] and worst[1][0] > worst[1][1]:
            lines.append(f"rank {worst[0]} used {worst[1][0] / worst[1][1]:.2f}x its predicted peak: "
                         "the cost model under-counts there")
    return "\n".join(lines)


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.4g}"


def _scores_line(what: str, values: dict[str, float | None], where: str) -> str:
    shown = [f"{k} {_fmt(values.get(k))}" for k in ("loss", *_SCORES) if k in values]
    return f"{what}: {', '.join(shown)} ({where})"
