"""`nowdl calibrate`, the calibrated DeviceSpec fields, the planner's use of them and the run probe's cache."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from helpers.distributed import run_workers

import nowdl
from nowdl.cli.commands import main
from nowdl.partitioner.costs.traffic import format_node_map
from nowdl.partitioner.placement.layout import allreduce_s
from nowdl.plan.topology import Link, Topology
from nowdl.profiler import BUILTIN_SPECS, DeviceSpec
from nowdl.profiler.calibrate.links import fit_line, probe_links
from nowdl.profiler.flops import OpCostMode

TINY = {"depth": 8, "version": 1, "width": 4, "num_classes": 3}


@pytest.fixture
def alone(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_calibrate_quick_writes_a_spec_the_planner_takes(alone: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = alone / "spec.json"
    assert main(["calibrate", "--quick", "--out", str(out)]) == 0
    cap = capsys.readouterr()
    assert "point-to-point latency (link_latency_s)" in cap.out and f"wrote {out}" in cap.out
    assert "nowdl calibrate: starting 2 gloo processes" in cap.err  # progress on stderr
    spec = DeviceSpec.load(out)
    assert spec.link_latency_s is not None and spec.allreduce_bw is not None and spec.allreduce_latency_s is not None
    assert 1e6 < spec.link_bw < 1e12 and 1e6 < spec.allreduce_bw < 1e12  # bytes/s: loopback, not memcpy-free
    assert 0 <= spec.link_latency_s < 0.1 and 0 <= spec.allreduce_latency_s < 0.1
    rates = (spec.op_throughput or {})["float32"]
    assert set(rates) == {"conv2d", "conv3d", "matmul", "elementwise", "norm"}
    assert all(1e6 < r < 1e13 for r in rates.values()), rates
    assert spec.fp32_flops == max(rates["conv2d"], rates["conv3d"], rates["matmul"])
    assert spec.mem_bw == rates["elementwise"]
    assert spec.calibration is not None and spec.calibration["backend"] == "gloo" and spec.calibration["ranks"] == 2

    model = nowdl.models.resnet(**TINY)
    plan = nowdl.compile(model, gpus=3, stages=2, spatial_parts=2, device_spec=str(out), mode="estimate",
                         progress=False).plan(torch.empty(1, 3, 32, 32, device="meta"))
    assert plan.topology["intra"] == {"bw": spec.link_bw, "latency_s": spec.link_latency_s}
    assert plan.topology["allreduce"] == {"bw": spec.allreduce_bw, "latency_s": spec.allreduce_latency_s}
    assert plan.profile["device_spec"] == spec.name
    assert "measured all-reduce" in format_node_map(plan)  # `nowdl show` says which links priced the plan
    assert main(["plan", "resnet", "--model-args", json.dumps(TINY), "--input", "1x3x32x32", "--gpus", "2",
                 "--device-spec", str(out)]) == 0
    assert "stage" in capsys.readouterr().out


def test_old_spec_json_still_loads(tmp_path: Path) -> None:
    old = {"name": "mine", "fp32_flops": 1e12, "bf16_flops": 2e12, "fp16_flops": 2e12, "mem_bw": 1e11,
           "link_bw": 5e10, "memory_bytes": 2**34, "tf32_flops": None}
    (tmp_path / "old.json").write_text(json.dumps(old))
    spec = DeviceSpec.load(tmp_path / "old.json")
    assert spec.link_latency_s is None and spec.allreduce_bw is None and spec.op_throughput is None
    assert spec.to_dict() == old  # unset calibrated fields are not written: profile cache keys stay as they were
    assert BUILTIN_SPECS["h100"].to_dict() == DeviceSpec.from_dict(BUILTIN_SPECS["h100"].to_dict()).to_dict()
    full = dataclasses.replace(spec, link_latency_s=3e-5, allreduce_bw=1e9, allreduce_latency_s=1e-4,
                               op_throughput={"float32": {"matmul": 1e11}}, calibration={"host": "x"})
    assert DeviceSpec.from_json(full.to_json()) == full


@pytest.mark.parametrize(("field", "value"), [
    ("link_latency_s", -1.0),
    ("link_latency_s", "fast"),
    ("allreduce_bw", 0),
    ("allreduce_latency_s", float("nan")),
    ("op_throughput", [1, 2]),
    ("op_throughput", {"int8": {"matmul": 1e9}}),
    ("op_throughput", {"float32": {"conv9d": 1e9}}),
    ("op_throughput", {"float32": {"matmul": -5}}),
    ("calibration", "yesterday"),
])
def test_bad_calibrated_fields_are_refused(field: str, value: Any) -> None:
    d = {**BUILTIN_SPECS["a100"].to_dict(), field: value}
    with pytest.raises(ValueError, match=field):
        DeviceSpec.from_dict(d)


def test_fit_line_recovers_latency_and_bandwidth() -> None:
    sizes = [1024.0, 65536.0, 2**20, 2**23]
    lat, bw = fit_line(sizes, [50e-6 + s / 2e9 for s in sizes])
    assert lat == pytest.approx(50e-6, rel=1e-6) and bw == pytest.approx(2e9, rel=1e-6)
    lat, bw = fit_line(sizes, [s / 1e9 for s in sizes])  # no latency at all
    assert lat == pytest.approx(0.0, abs=1e-12) and bw == pytest.approx(1e9, rel=1e-6)
    lat, bw = fit_line(sizes, [1e-3 - s * 1e-12 for s in sizes])  # falling times (noise): still usable
    assert lat >= 0 and bw > 0


def test_calibrated_rates_replace_the_peaks_in_estimates() -> None:
    x = torch.randn(1, 8, 32, 32)
    w = torch.randn(8, 8, 3, 3)
    base = BUILTIN_SPECS["h100"]
    slow = dataclasses.replace(base, op_throughput={"float32": {"conv2d": 1e9, "elementwise": 1e8}})
    with OpCostMode(slow) as m:
        F.conv2d(x, w, padding=1)
    assert m.seconds == pytest.approx(m.flops / 1e9)
    with OpCostMode(slow) as m:
        F.relu(x)
    assert m.seconds == pytest.approx(m.bytes / 1e8)
    with OpCostMode(base) as m:  # no calibrated rate: the roofline on the peaks
        F.conv2d(x, w, padding=1)
    assert m.seconds == pytest.approx(max(m.flops / base.fp32_flops, m.bytes / base.mem_bw))
    with OpCostMode(slow) as m:  # bfloat16 was not calibrated: peaks again
        F.conv2d(x.bfloat16(), w.bfloat16(), padding=1)
    assert m.seconds == pytest.approx(max(m.flops / base.bf16_flops, m.bytes / base.mem_bw))


def test_measured_allreduce_prices_the_intra_node_ring() -> None:
    link = Link(1e10, 1e-5)
    plain = Topology(1, 4, link, link)
    measured = dataclasses.replace(plain, allreduce=Link(1e9, 2e-4))
    assert allreduce_s(1e8, [4], plain) == pytest.approx(1.5 * 1e8 / 1e10)
    assert allreduce_s(1e8, [4], measured) == pytest.approx(1.5 * 1e8 / 1e9 + 2e-4)
    assert Topology.from_dict(measured.to_dict()) == measured


def _probe_worker(rank: int, world: int, cache: str) -> dict[str, Any]:
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    logging.getLogger("nowdl.profiler.calibrate.links").addHandler(Keep())
    first, where1 = probe_links(cache, repeats=2)
    second, where2 = probe_links(cache, repeats=2)
    torch.distributed.barrier()
    if rank == 0:
        Path(where2).write_text("{ not json")
    torch.distributed.barrier()
    third, where3 = probe_links(cache, repeats=2)
    return {"where": [where1, where2, where3], "same": first == second, "p2p": first["p2p"], "warned": seen}


def test_run_probe_is_cached_and_a_corrupt_cache_is_measured_again(tmp_path: Path) -> None:
    r0, r1 = run_workers(_probe_worker, 2, str(tmp_path / "links"), timeout_s=90)
    assert r0["where"][0] == "measured" and r0["where"][2] == "measured"
    assert r0["where"][1].startswith(str(tmp_path / "links")) and r0["where"][1].endswith("-gloo-w2-cpu.json")
    assert r0["same"] and r1["same"] and r0["p2p"] == r1["p2p"]  # every rank plans with rank 0's figures
    assert r0["p2p"].bw > 0 and r0["p2p"].latency_s >= 0
    assert any("ignoring corrupt link cache" in m for m in r0["warned"]), r0["warned"]


def _in_job_worker(rank: int, world: int) -> dict[str, Any]:
    from nowdl.profiler.calibrate.command import calibrate

    return calibrate(quick=True, repeats=2).to_dict()


def test_calibrate_inside_a_job_uses_its_group() -> None:
    """Under torchrun every rank measures the job's links; rank 0's compute rates reach every rank."""
    r0, r1 = run_workers(_in_job_worker, 2, timeout_s=90)
    assert r0 == r1
    assert r0["calibration"]["ranks"] == 2 and r0["calibration"]["backend"] == "gloo"
    assert r0["link_bw"] > 0 and set(r0["op_throughput"]["float32"]) == {"conv2d", "conv3d", "matmul", "elementwise",
                                                                          "norm"}
