"""Pictures of plans: the numbers behind each panel, the files the CLI writes, and its errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from nowdl.cli.commands import main
from nowdl.plan.plan import Plan
from nowdl.plot import memory_bars, stage_graph, timeline
from nowdl.plot.graph import main_layers
from nowdl.plot.memory import KIND_COLORS
from nowdl.schedule import build_schedule, simulate

ROOT = Path(__file__).resolve().parents[2]
PLANS = {
    "pipeline": ROOT / "experiments" / "unet_2048_8gpu_memory.json",
    "master": ROOT / "experiments" / "resnet110v2_1024_4gpu_master.json",
    "spatial": ROOT / "experiments" / "unet_8192_sp4x2.json",
}
OLD_PLAN = ROOT / "experiments" / "amoebanet_2048_sp4.json"  # its breakdown keys are removed below


@pytest.fixture(params=sorted(PLANS))
def plan(request: pytest.FixtureRequest) -> Plan:
    return Plan.load(PLANS[request.param])


def test_memory_bars_are_the_plans_numbers(plan: Plan) -> None:
    bars = memory_bars(plan)
    assert [b.rank for b in bars] == sorted(r.rank for r in plan.ranks if r.dp == 0)
    for b in bars:
        rp = next(r for r in plan.ranks if r.rank == b.rank)
        assert b.peak == rp.predicted_peak_bytes
        assert sum(b.parts.values()) == pytest.approx(b.peak, rel=1e-9)
        assert {k for k, v in b.parts.items() if v > 0} <= set(KIND_COLORS)  # every kind is drawn
        held = [plan.stages[int(e["stage"])] for e in rp.stages]
        assert b.parts["saved activations"] == pytest.approx(  # less what one micro-batch freed by the peak
            sum(s.predicted["inflight"] * s.predicted["saved_bytes"] - s.predicted.get("freed_bytes", 0.0)
                for s in held))
        assert any(s.predicted.get("freed_bytes", 0.0) > 0 for s in plan.stages)  # the plans carry it
        assert b.parts["parameters"] == pytest.approx(sum(s.predicted["weight_bytes"] for s in held))
    if plan.config["replicas"] == 2:
        assert bars[0].label == "s0+s3'"


def test_drawn_bars_reach_the_peak(plan: Plan) -> None:
    """The stacked bars drawn add up to each rank's peak (a kind without a colour was left out)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from nowdl.plot.memory import draw_memory

    fig, ax = plt.subplots()
    bars = draw_memory(ax, plan)
    tops: dict[float, float] = {}
    for patch in ax.patches:
        x = round(patch.get_x() + patch.get_width() / 2, 6)
        tops[x] = max(tops.get(x, 0.0), patch.get_y() + patch.get_height())
    plt.close(fig)
    unit = bars[0].peak / tops[0.0]  # bytes per unit of the axis: GiB, MiB, ...
    assert min(abs(unit / 2.0**e - 1) for e in (0, 10, 20, 30, 40)) < 1e-9
    for x, b in enumerate(bars):
        assert tops[float(x)] * unit == pytest.approx(b.peak, rel=1e-9)


def test_memory_bars_of_an_older_plan() -> None:
    plan = Plan.load(OLD_PLAN)
    breakdown = ("weight_bytes", "grad_bytes", "optim_bytes", "saved_bytes", "recv_bytes", "send_bytes",
                 "workspace_bytes", "recv_held", "send_held")
    for st in plan.stages:  # as a plan written before the breakdown existed (its peak: the bound)
        for key in breakdown:
            st.predicted.pop(key, None)
        st.predicted["peak_bytes"] += st.predicted.pop("freed_bytes", 0.0)
    for rp in plan.ranks:
        rp.predicted_peak_bytes = sum(plan.stages[int(e["stage"])].predicted["peak_bytes"] for e in rp.stages)
    for b in memory_bars(plan):
        assert set(b.parts) == {"weights, gradients, optimizer", "saved activations", "boundary tensors, workspace"}
        assert sum(b.parts.values()) == pytest.approx(b.peak, rel=1e-9)


def test_timeline_boxes_are_the_schedule_and_bubbles_the_gaps(plan: Plan) -> None:
    tl = timeline(plan)
    sched = build_schedule(plan)
    grid = simulate(sched, plan)
    assert tl.rows == sorted(sched) and tl.steps == len(grid)
    for r in tl.rows:
        mine = sorted(b.step for b in tl.boxes if b.row == r)
        assert len(mine) == len(sched[r])
        assert [b.action for b in sorted((b for b in tl.boxes if b.row == r), key=lambda b: b.step)] == sched[r]
        assert sorted(mine + tl.bubbles[r]) == list(range(tl.steps)), "every cell is a box or a bubble"
        assert all(grid[t][r] is None for t in tl.bubbles[r])
    assert 0 < tl.idle < 1
    if plan.config.get("spatial"):
        assert tl.labels[0].startswith("ranks 0-3") and "4 tiles" in tl.labels[0]


def test_stage_graph_edges_carry_the_tensors(plan: Plan) -> None:
    g = stage_graph(plan)
    assert [b.stage for b in g.boxes] == list(range(len(plan.stages)))
    assert sum(e.bytes for e in g.edges) == sum(t.bytes * len(t.to_stages) for t in plan.tensors)
    skips = {(e.src, e.dst) for e in g.edges if e.skip}
    want = {(t.from_stage, j) for t in plan.tensors for j in t.to_stages if j > t.from_stage + 1}
    assert skips == want
    if plan.config["stages"] == 8:
        assert any(dst - src >= 3 for src, dst in skips)  # a UNet long skip, sent directly


def test_main_layers() -> None:
    nodes = ["encoders_0_conv1", "encoders_0_relu1", "add_3", "pools_0", "encoders_1_conv1", "stages_0_8_conv1_bn"]
    assert main_layers(nodes, limit=5) == (["encoders_0", "pools_0", "encoders_1", "stages_0_8"], 0)
    assert main_layers(nodes, limit=3) == (["encoders_0", "pools_0", "stages_0_8"], 1)
    assert main_layers(["x", "conv1"]) == (["x", "conv1"], 0)


@pytest.mark.parametrize("name", sorted(PLANS))
def test_show_plot_writes_png_and_svg(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for ext in ("png", "svg"):
        out = tmp_path / f"{name}.{ext}"
        assert main(["show", str(PLANS[name]), "--plot", str(out)]) == 0
        assert f"drew {out}" in capsys.readouterr().out
        data = out.read_bytes()
        assert len(data) > 10_000
        assert data.startswith(b"\x89PNG") if ext == "png" else b"<svg" in data[:2000]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{name}.png", f"{name}.svg"], "no temporary files left"


def test_plan_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, pic = tmp_path / "p.json", tmp_path / "p.png"
    rc = main(["plan", "unet", "--model-args", '{"depth": 2, "base_width": 8}', "--input", "1x3x64x64",
               "--gpus", "4", "--stages", "4", "--dp", "1", "--replicas", "1", "--out", str(out), "--plot", str(pic)])
    assert rc == 0 and out.exists() and pic.read_bytes().startswith(b"\x89PNG")
    assert f"drew {pic}" in capsys.readouterr().out


def _fails(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err, err
    assert err.count("\n") <= 2, "one paragraph"


@pytest.mark.parametrize(
    ("plot", "needle"),
    [("out.xyz", "unknown picture format"), ("out", "unknown picture format"),
     ("nodir/out.png", "does not exist"), ("afile.txt/out.png", "does not exist")],
)
def test_bad_plot_path(plot: str, needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "afile.txt").write_text("a file, not a folder")
    before = sorted(tmp_path.rglob("*"))
    _fails(["show", str(PLANS["pipeline"]), "--plot", str(tmp_path / plot)], needle, capsys)
    assert capsys.readouterr().out == ""
    out = tmp_path / "p.json"
    _fails(["plan", "unet", "--model-args", '{"depth": 2, "base_width": 8}', "--input", "1x3x64x64", "--gpus", "2",
            "--out", str(out), "--plot", str(tmp_path / plot)], needle, capsys)
    assert sorted(tmp_path.rglob("*")) == before, "nothing written"


def test_missing_plan_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _fails(["show", str(tmp_path / "none.json"), "--plot", str(tmp_path / "x.png")], "does not exist", capsys)
    assert list(tmp_path.iterdir()) == []


def test_missing_matplotlib_says_how_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    for mod in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    pic, out = tmp_path / "x.png", tmp_path / "p.json"
    _fails(["show", str(PLANS["master"]), "--plot", str(pic)], "pip install 'nowdl[plot]'", capsys)
    _fails(["plan", "unet", "--model-args", '{"depth": 2, "base_width": 8}', "--input", "1x3x64x64", "--gpus", "2",
            "--out", str(out), "--plot", str(pic)], "pip install 'nowdl[plot]'", capsys)
    assert list(tmp_path.iterdir()) == []
    assert main(["show", str(PLANS["master"])]) == 0, "show without --plot needs no matplotlib"


def test_core_imports_without_matplotlib() -> None:
    code = ("import sys; sys.modules['matplotlib'] = None; import nowdl, nowdl.cli.commands, nowdl.plot, nowdl.cli.report; "
            "from nowdl.plot import memory_bars, timeline, stage_graph; print('ok')")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr
