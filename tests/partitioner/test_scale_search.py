"""Search at any scale: tile grids up to the GPU count, the micro-batch size from the global
batch, sequential tiles per GPU, and the errors when nothing fits or pins cannot add up."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from helpers.distributed import run_workers
from helpers.exactness import STEPS, adam, make_batch, make_loss, make_model
from helpers.reference import train_reference

import nowdl
from nowdl.errors import InfeasibleError, NowdlError
from nowdl.partitioner.config.candidate import PlanRequest, batch_splits, enumerate_candidates
from nowdl.partitioner.config.grids import part_counts, sub_grid, tile_counts


def _unet(**kw: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    return nowdl.models.unet(base_width=4, depth=2, **kw)


def _plan(model: torch.nn.Module, shape: tuple[int, ...], **kw: Any) -> nowdl.Plan:
    cm = nowdl.compile(model, mode="estimate", device_spec="h100", cache=False, progress=False, **kw)
    return cm.plan(torch.empty(shape, device="meta"))


def test_part_counts_go_up_to_the_gpus_for_grids_that_cut_the_image() -> None:
    assert part_counts(64, "square", (8192, 8192)) == [2, 4, 8, 16, 32, 64]
    odd = part_counts(16, "square", (3000, 3000))
    assert {3, 5, 6, 10, 12, 15} <= set(odd) and 7 not in odd and 11 not in odd  # 7 and 11 do not divide 3000
    big = part_counts(128, "square", (960, 960))
    assert {120, 128} <= set(big) and 127 not in big  # 10 x 12 tiles of 96 x 80 pixels; 8 x 16 of 120 x 60
    assert part_counts(8, "cube", (64, 64, 64)) == [8]
    assert sub_grid("square", 4, 2, 2) == (1, 2) and sub_grid("square", 2, 2, 2) == (2, 1)
    assert tile_counts(1, "square", (64, 64)) == [2, 4, 8, 16]  # 16 x 16 pixel tiles at most
    assert tile_counts(4, "square", None) == []


def test_64_tiles_on_64_gpus() -> None:
    plan = _plan(_unet(), (1, 3, 1024, 1024), gpus=64, stages=1, spatial_parts=64, global_batch=1)
    st = plan.stages[0]
    assert (st.parts, st.grid, plan.config["dp"]) == (64, [8, 8], 1)
    free = _plan(_unet(), (1, 3, 1024, 1024), gpus=64, global_batch=1, gpu_memory="40MiB", tiles_per_gpu=1,
                 planner=nowdl.PlannerOptions(time_limit=60))
    assert max(s.parts for s in free.stages) > 16, [s.parts for s in free.stages]  # the cap needs more than 16 tiles
    assert free.solver["candidates"] < 5000


def test_global_batch_splits() -> None:
    req = PlanRequest(gpus=4, global_batch=8)
    assert batch_splits(req, 1, 2, 1, [1]) == [(4, 1)]  # m free: micro-batches of the example's size
    assert batch_splits(req, 1, 2, 3, [1]) == [(2, 2)]  # the largest size up to the example's that divides
    assert batch_splits(PlanRequest(gpus=4, global_batch=8, micro_batches=2), 2, 1, 1, [2]) == [(2, 2)]
    assert batch_splits(PlanRequest(gpus=4, global_batch=8, micro_batch_size=4), 1, 2, 1, [1]) == [(1, 4)]
    assert batch_splits(PlanRequest(gpus=4, global_batch=6), 1, 4, 1, [1]) == []  # 6 is not a multiple of dp 4
    assert batch_splits(PlanRequest(gpus=4), 1, 1, 3, [1, 2]) == [(1, 3), (2, 3)]  # free: the example's size
    pinned = PlanRequest(gpus=4, global_batch=8, micro_batches=1)
    cands = list(enumerate_candidates(pinned, tileable_front=False, tileable_back=False, max_stages=4))
    assert cands and all(c.global_batch() == 8 and c.micro_batches == 1 for c in cands)
    assert {(c.dp * c.replicas, c.micro_batch_size) for c in cands} == {(1, 8), (2, 4), (4, 2)}


def test_the_fixed_case_plans_one_micro_batch_of_four() -> None:
    """compile(m, gpus=4, stages=1, spatial_parts=4, micro_batches=1) on a global batch of 4:
    one micro-batch of 4 samples (it was refused as if spatial stages needed a stage after them)."""
    plan = _plan(make_model("monai_unet"), (1, 1, 16, 16), gpus=4, stages=1, spatial_parts=4, micro_batches=1,
                 global_batch=4)
    c = plan.config
    assert (c["micro_batches"], c["micro_batch_size"], c["global_batch"], c["dp"]) == (1, 4, 4, 1)
    assert plan.model["inputs"] == [[4, 1, 16, 16]]  # the plan is made at the micro-batch it runs
    one = _plan(make_model("monai_unet"), (1, 1, 16, 16), gpus=4, stages=1, spatial_parts=4, micro_batches=1,
                global_batch=1)
    assert plan.stages[0].predicted["act_bytes"] == pytest.approx(4 * one.stages[0].predicted["act_bytes"], rel=0.01)


def _fixed_case_worker(rank: int, world: int) -> tuple[list[float], dict[str, torch.Tensor], dict[str, Any]]:
    cm = nowdl.compile(make_model("monai_unet"), gpus=world, stages=1, spatial_parts=4, micro_batches=1,
                       mode="estimate", optimizer=adam, loss_fn=make_loss("monai_unet"), cache=False, progress=False,
                       timeout_s=120)
    losses = [cm.train_step(*make_batch("monai_unet", 4, step)) for step in range(STEPS)]
    plan = cm._trainer.plan
    assert plan is not None
    return losses, cm.state_dict(), dict(plan.config)


@pytest.mark.slow
def test_the_fixed_case_trains_exactly_on_four_ranks() -> None:
    results = run_workers(_fixed_case_worker, 4, timeout_s=300)
    model = make_model("monai_unet")
    ref_losses, ref_sd = train_reference(model, adam(model.parameters()), make_loss("monai_unet"),
                                         lambda step: make_batch("monai_unet", 4, step), 1, STEPS)
    losses, sd, config = results[0]
    assert (config["micro_batches"], config["micro_batch_size"]) == (1, 4)
    assert all(r[0] == losses for r in results)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-7)
    for k, ref in ref_sd.items():
        if ref.is_floating_point():
            torch.testing.assert_close(sd[k], ref, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


def test_the_plan_says_which_batch_it_chose_and_why() -> None:
    free = _plan(_unet(), (1, 3, 256, 256), gpus=4)
    why = free.config["batch_choice"]
    assert f"global batch {free.config['global_batch']} chosen by the planner" in why and "--batch-size" in why
    assert free.config["global_batch"] == free.predicted["global_batch"]
    assert f"batch: {why}" in str(free)
    given = _plan(_unet(), (1, 3, 256, 256), gpus=4, global_batch=12)
    assert given.config["global_batch"] == 12 and "as given" in given.config["batch_choice"]
    c = given.config
    assert c["micro_batches"] * c["replicas"] * c["dp"] * c["micro_batch_size"] == 12


def test_sequential_tiles_trade_time_for_memory() -> None:
    shape = (1, 3, 512, 512)
    whole = _plan(_unet(), shape, gpus=1, global_batch=1, tiles_per_gpu=1)
    seq = _plan(_unet(), shape, gpus=1, global_batch=1, tiles_per_gpu=4)
    st = seq.stages[0]
    assert st.tiles_per_gpu == 4 and seq.config["spatial"]["tiles_per_gpu"] == 4
    assert seq.predicted["peak_bytes"] < 0.6 * whole.predicted["peak_bytes"]
    assert seq.predicted["step_s"] > 1.25 * whole.predicted["step_s"]  # the forward twice (b = 2f: 4/3), margins
    assert "4 tiles per GPU" in str(seq)
    # under a cap the whole image cannot meet, "auto" picks sequential tiles on one GPU
    cap = int(0.7 * whole.predicted["peak_bytes"])
    auto = _plan(_unet(), shape, gpus=1, global_batch=1, gpu_memory=cap)
    assert auto.stages[0].tiles_per_gpu > 1 and auto.predicted["peak_bytes"] <= cap


def test_sequential_tiles_hold_norms_and_charge_their_passes() -> None:
    """BatchNorm runs on sequential tiles with statistics passes ([Note: norm passes cost]): the
    whole UNet is one stage of 4 tiles on one GPU, the passes on their own line of time."""
    plan = _plan(_unet(norm=True), (1, 3, 256, 256), gpus=1, global_batch=1, tiles_per_gpu=4)
    st = plan.stages[0]
    assert st.tiles_per_gpu == 4 and any("bn" in n for n in st.nodes)
    assert st.predicted["norm_passes_s"] > st.predicted["seq_recompute_s"] > 0.0 and st.predicted["comm_s"] == 0.0


@pytest.mark.parametrize(("kw", "needle"), [
    ({"tiles_per_gpu": 3}, "tiles_per_gpu=3 cannot cut the 256x256 input"),
    ({"tiles_per_gpu": "many"}, "tiles_per_gpu='many' is neither 'auto' nor a positive integer"),
    ({"tiles_per_gpu": 0}, "tiles_per_gpu=0 is neither"),
])
def test_bad_tiles_per_gpu_is_refused(kw: dict[str, Any], needle: str) -> None:
    with pytest.raises(NowdlError, match=needle.replace("(", r"\(")):
        _plan(_unet(), (1, 3, 256, 256), gpus=2, **kw)


def test_nothing_fits_names_the_cap_and_the_smallest_changes() -> None:
    with pytest.raises(InfeasibleError) as e:
        _plan(_unet(), (1, 3, 512, 512), gpus=1, global_batch=1, tiles_per_gpu=1, gpu_memory="20MiB")
    msg = str(e.value)
    assert "the memory cap is the constraint that failed" in msg and "1 tile per GPU (pinned)" in msg
    assert "4 GPUs would fit it" in msg
    t = re.search(r"or allow sequential tiles \(--tiles-per-gpu (\d+) or auto\): ", msg)  # windows of the whole reach
    assert t is not None and f"{t.group(1)} tiles per GPU in turn" in msg, msg


def test_pins_that_cannot_fill_the_gpus_show_the_arithmetic() -> None:
    """A UNet's spatial stage is mirrored at the back: 4 stages with 2 parts take 6 ranks."""
    with pytest.raises(NowdlError) as e:
        _plan(_unet(), (1, 3, 256, 256), gpus=4, stages=4, spatial_parts=2, spatial_stages=1, tiles_per_gpu=1)
    msg = str(e.value)
    assert "2 plain stages + 2 spatial stages x 2 tiles = 6 ranks per pipeline" in msg, msg
    assert "GPU counts that are: " in msg and " 6," in msg
