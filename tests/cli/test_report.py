"""nowdl report: reading a run's metrics.jsonl, the summary, the picture and the errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from nowdl.cli.commands import main
from nowdl.cli.report import rank_peaks, read_metrics, summary
from nowdl.errors import NowdlError

GiB = 2**30


def _step(i: int, *, loss: float | None = None, ips: float = 10.0, peaks: tuple[int, ...] = (5, 6)) -> dict[str, Any]:
    return {"step": i, "time": 1.7e9 + i, "loss": loss, "images_per_s": ips, "step_s": 0.5, "data_wait_s": 0.05,
            "ranks": [{"rank": r, "peak_bytes": p * GiB, "predicted_bytes": 4 * GiB} for r, p in enumerate(peaks)]}


def _write(d: Path, lines: list[Any]) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "metrics.jsonl").write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return d


@pytest.fixture
def log(tmp_path: Path) -> Path:
    return _write(tmp_path / "run", [
        {"meta": {"model": "unet", "world_size": 2, "config": {"stages": 2}}},
        _step(0, loss=2.0, ips=1.0, peaks=(3, 7)),
        _step(1, loss=1.5, ips=10.0),
        _step(2, loss=None, ips=12.0),
        _step(3, loss=1.0, ips=14.0, peaks=(6, 2)),
    ])


def test_read_and_summarise(log: Path) -> None:
    m = read_metrics(log)
    assert m.meta["model"] == "unet" and [s.step for s in m.steps] == [0, 1, 2, 3]
    assert rank_peaks(m) == {0: (6 * GiB, 4 * GiB), 1: (7 * GiB, 4 * GiB)}
    text = summary(m)
    assert "4 steps" in text and "model unet" in text
    assert "12 images/s" in text, "mean of 10, 12, 14: the first step excluded"
    assert "final 1 (step 3)" in text
    assert "1.75" in text and "1.50" in text  # measured / predicted per rank
    assert "rank 1 used 1.75x" in text


def test_no_loss_and_one_step(tmp_path: Path) -> None:
    text = summary(read_metrics(_write(tmp_path / "r", [_step(0, ips=3.0)])))
    assert "none logged" in text and "3 images/s mean over the only step" in text


@pytest.mark.parametrize("ext", ["png", "svg"])
def test_report_cli_plot(ext: str, log: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / f"report.{ext}"
    assert main(["report", str(log), "--plot", str(out)]) == 0
    text = capsys.readouterr().out
    assert "measured peak" in text and f"drew {out}" in text
    data = out.read_bytes()
    assert len(data) > 5_000 and (data.startswith(b"\x89PNG") if ext == "png" else b"<svg" in data[:2000])


def test_report_cli_text_only(log: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(log)]) == 0
    assert "throughput" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("lines", "needle"),
    [
        ([_step(0), "{not json"], "metrics.jsonl, line 2: not valid JSON"),
        ([_step(0), {"step": 1}], "line 2: missing field(s) time"),
        ([{**_step(0), "step": "one"}], "line 1: 'step' must be an integer"),
        ([{**_step(0), "images_per_s": "fast"}], "line 1: 'images_per_s' must be a finite number"),
        ([{**_step(0), "loss": "low"}], "line 1: 'loss' must be a number or null"),
        ([{**_step(0), "ranks": [{"rank": 0}]}], "line 1: a 'ranks' entry needs"),
        ([_step(0), {"meta": {}}], "line 2: a 'meta' line may only come first"),
        ([[1, 2]], "line 1: a step is a JSON object"),
        ([{"meta": {"model": "unet"}}], "has no steps yet"),
    ],
)
def test_malformed_log(lines: list[Any], needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = _write(tmp_path / "run", lines)
    with pytest.raises(NowdlError, match="line|steps"):
        read_metrics(d)
    pic = tmp_path / "r.png"
    assert main(["report", str(d), "--plot", str(pic)]) == 2
    err = capsys.readouterr().err
    assert needle in err, err
    assert err.count("\n") <= 2 and not pic.exists()


@pytest.mark.parametrize(
    ("setup", "needle"),
    [("missing", "does not exist: give the --log-dir"), ("empty", "metrics.jsonl does not exist")],
)
def test_missing_log(setup: str, needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "run"
    if setup == "empty":
        d.mkdir()
    pic = tmp_path / "r.png"
    assert main(["report", str(d), "--plot", str(pic)]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") <= 2
    assert not pic.exists()


def test_report_bad_plot_path(log: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(log), "--plot", str(tmp_path / "r.xyz")]) == 2
    assert "unknown picture format" in capsys.readouterr().err
    assert not (tmp_path / "r.xyz").exists()


def test_report_without_matplotlib(log: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    import sys

    for mod in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    pic = tmp_path / "r.png"
    assert main(["report", str(log), "--plot", str(pic)]) == 2
    assert "pip install 'nowdl[plot]'" in capsys.readouterr().err and not pic.exists()
    assert main(["report", str(log)]) == 0, "the text summary needs no matplotlib"
