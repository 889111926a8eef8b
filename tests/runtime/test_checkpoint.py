"""Checkpoints: resharded resume across plans, damaged and foreign checkpoints, atomic saves, the API's shape."""

from __future__ import annotations

import errno
import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.distributed import run_workers
from helpers.exactness import adam, make_batch, make_loss, make_model

import nowdl
from nowdl.runtime.training import checkpoint as ckmod
from nowdl.runtime.training import dcp_files
from nowdl.runtime.training.checkpoint import CheckpointError

NAME = "resnet_bn"
TOTAL = 4  # samples per step in every plan below


def _cm(gpus: int, cfg: dict[str, Any]) -> nowdl.CompiledModel:
    return nowdl.compile(make_model(NAME), gpus=gpus, spatial_parts=1, mode="estimate", optimizer=adam, loss_fn=make_loss(NAME),
                         cache=False, progress=False, timeout_s=60, **cfg)


def _train(cm: nowdl.CompiledModel, steps: range) -> list[float]:
    return [cm.train_step(*make_batch(NAME, TOTAL, s)) for s in steps]


def _save_after_two(rank: int, world: int, cfg: dict[str, Any], ckpt: str) -> list[float]:
    cm = _cm(world, cfg)
    losses = _train(cm, range(2))
    cm.save_checkpoint(ckpt)
    return losses


def _resume_two(rank: int, world: int, cfg: dict[str, Any], ckpt: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    cm = _cm(world, cfg)
    cm.load_checkpoint(ckpt, make_batch(NAME, TOTAL, 2)[0])
    return _train(cm, range(2, 4)), cm.state_dict()


PIPE2 = {"stages": 2, "dp": 1, "replicas": 1, "micro_batches": 4, "schedule": "1f1b"}
ONE = {"stages": 1, "dp": 1, "replicas": 1, "micro_batches": 4, "schedule": "gpipe"}
DP2 = {"stages": 1, "dp": 2, "replicas": 1, "micro_batches": 2, "schedule": "gpipe"}
MASTER = {"stages": 2, "dp": 1, "replicas": 2, "micro_batches": 2, "schedule": "1f1b"}


def _uninterrupted() -> tuple[list[float], dict[str, torch.Tensor]]:
    cm = _cm(1, ONE)
    losses = _train(cm, range(4))
    return losses, cm.state_dict()


@pytest.mark.parametrize(("before", "after"), [((2, PIPE2), (1, ONE)),
                                               pytest.param((1, ONE), (2, MASTER), marks=pytest.mark.slow),
                                               pytest.param((2, PIPE2), (2, DP2), marks=pytest.mark.slow)],
                         ids=["2-stages-to-1-gpu", "1-gpu-to-master", "2-stages-to-dp2"])
def test_resume_after_replanning_is_exact(tmp_path: Path, before: tuple[int, dict[str, Any]],
                                          after: tuple[int, dict[str, Any]]) -> None:
    """Train 2 steps on one plan, resume on a plan with other stages/GPUs for 2 more: the same
    losses and weights as 4 uninterrupted steps on one process (weights and Adam state resharded)."""
    ckpt = str(tmp_path / "ck")
    first = run_workers(_save_after_two, before[0], before[1], ckpt, timeout_s=180)[0]
    second = run_workers(_resume_two, after[0], after[1], ckpt, timeout_s=180)
    losses, sd = second[0]
    ref_losses, ref_sd = _uninterrupted()
    torch.testing.assert_close(torch.tensor(first + losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-7)
    one_copy = after[1]["dp"] == 1 and after[1]["replicas"] == 1
    for k, ref in ref_sd.items():
        if ref.is_floating_point() and (one_copy or "running" not in k):
            torch.testing.assert_close(sd[k], ref, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


def _saved(tmp_path: Path) -> Path:
    cm = _cm(1, ONE)
    _train(cm, range(1))
    cm.save_checkpoint(tmp_path / "ck")
    return tmp_path / "ck"


def _load(ckpt: Path, name: str = NAME) -> None:
    cm = _cm(1, ONE) if name == NAME else nowdl.compile(make_model(name), gpus=1, stages=1, micro_batches=4, dp=1,
                                                         replicas=1, spatial_parts=1, mode="estimate", optimizer=adam,
                                                         loss_fn=make_loss(name), cache=False, progress=False)
    cm.load_checkpoint(ckpt, make_batch(name, TOTAL, 0)[0])


def _shard(ckpt: Path) -> Path:
    return next((ckpt / (ckpt / "latest").read_text()).glob("*.distcp"))


def test_layout_and_json(tmp_path: Path) -> None:
    ckpt = _saved(tmp_path)
    step = ckpt / "step-00000001"
    assert (ckpt / "latest").read_text() == "step-00000001"
    record = json.loads((step / "nowdl.json").read_text())
    assert record["format"] == "nowdl.checkpoint" and record["step"] == 1 and record["world"] == 1
    assert set(record["files"]) == {p.name for p in step.iterdir() if p.name != "nowdl.json"}
    assert record["optimizer"]["class"] == "Adam" and record["optimizer"]["groups"][0]["lr"] == pytest.approx(1e-2)
    _load(ckpt)


def test_truncated_shard_names_the_file(tmp_path: Path) -> None:
    ckpt = _saved(tmp_path)
    shard = _shard(ckpt)
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match=r"checkpoint file .*\.distcp has 1000 bytes but was written with"):
        _load(ckpt)


def test_corrupt_shard_names_the_file(tmp_path: Path) -> None:
    ckpt = _saved(tmp_path)
    shard = _shard(ckpt)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{shard.name} is corrupt \(CRC-32 mismatch\)"):
        _load(ckpt)


def test_foreign_checkpoint(tmp_path: Path) -> None:
    ckpt = _saved(tmp_path)
    with pytest.raises(CheckpointError, match=r"has no tensor 'model/.*': it was saved from another model"):
        _load(ckpt, "monai_unet")


class _Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        return (print, ("pwned",))


def test_metadata_is_not_unpickled_freely(tmp_path: Path) -> None:
    """A .metadata file holding anything but DCP's own classes is refused, not executed."""
    ckpt = _saved(tmp_path)
    step = ckpt / "step-00000001"
    meta = step / ".metadata"
    meta.write_bytes(pickle.dumps(_Evil()))
    record = json.loads((step / "nowdl.json").read_text())
    record["files"][".metadata"] = [meta.stat().st_size, ckmod._crc(meta)]
    (step / "nowdl.json").write_text(json.dumps(record))
    with pytest.raises(CheckpointError, match=r"cannot read .*\.metadata \(refusing to load builtins\.print\)"):
        _load(ckpt)


def test_crash_mid_save_keeps_the_previous_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cm = _cm(1, ONE)
    _train(cm, range(1))
    cm.save_checkpoint(tmp_path / "ck")
    _train(cm, range(1, 2))
    real = dcp_files.dcp.save

    def crash(state: Any, **kw: Any) -> Any:
        real(state, **kw)  # the shards are written, then the disk fills up
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dcp_files.dcp, "save", crash)
    with pytest.raises(CheckpointError, match=r"saving the checkpoint of step 2 to .*ck failed \(OSError: No space left "
                       r"on device\): the previous checkpoint .*step-00000001 is kept intact and a resume starts from "
                       r"it; free space"):
        cm.save_checkpoint(tmp_path / "ck")
    monkeypatch.undo()
    assert (tmp_path / "ck" / "latest").read_text() == "step-00000001"
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["latest", "step-00000001"]  # no debris left
    _load(tmp_path / "ck")  # the previous checkpoint is whole
    cm.save_checkpoint(tmp_path / "ck")
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["latest", "step-00000002"]


def test_failed_pointer_write_keeps_the_previous_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cm = _cm(1, ONE)
    _train(cm, range(1))
    with monkeypatch.context() as m:  # the first save of a folder fails: nothing to keep
        m.setattr(dcp_files.dcp, "save", lambda state, **kw: (_ for _ in ()).throw(OSError(errno.EDQUOT, "Disk quota exceeded")))
        with pytest.raises(CheckpointError, match=r"Disk quota exceeded\): no earlier checkpoint is there"):
            cm.save_checkpoint(tmp_path / "ck")
    assert list((tmp_path / "ck").iterdir()) == []
    cm.save_checkpoint(tmp_path / "ck")
    _train(cm, range(1, 2))
    real = ckmod.write_durable

    def full(path: Path, text: str) -> None:
        if path.name == ".latest.tmp":
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, text)

    monkeypatch.setattr(ckmod, "write_durable", full)
    with pytest.raises(CheckpointError, match="step-00000001 is kept intact"):
        cm.save_checkpoint(tmp_path / "ck")
    monkeypatch.undo()
    assert (tmp_path / "ck" / "latest").read_text() == "step-00000001"
    _load(tmp_path / "ck")


def test_not_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        _load(tmp_path)
    (tmp_path / "latest").write_text("step-00000009")
    with pytest.raises(CheckpointError, match="points to 'step-00000009', which is not a checkpoint folder"):
        _load(tmp_path)


def _damaged_rank1(rank: int, world: int, ckpt: str) -> str:
    cm = _cm(world, PIPE2)
    try:
        cm.load_checkpoint(ckpt, make_batch(NAME, TOTAL, 0)[0])
    except CheckpointError as e:
        return str(e)
    return "loaded"


def test_damaged_shard_fails_every_rank_alike(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ck")
    run_workers(_save_after_two, 2, PIPE2, ckpt, timeout_s=180)
    shards = sorted((tmp_path / "ck" / "step-00000002").glob("*.distcp"))
    assert len(shards) == 2
    shards[1].write_bytes(shards[1].read_bytes()[:1000])
    errors = run_workers(_damaged_rank1, 2, ckpt, timeout_s=180)
    assert errors[0] == errors[1] and shards[1].name in errors[0] and "1000 bytes" in errors[0]


# ---- the API's shape -----------------------------------------------------------------------------
def test_optimizer_and_state_before_the_first_step() -> None:
    model = make_model(NAME)
    cm = nowdl.compile(model, gpus=1, stages=1, micro_batches=4, dp=1, replicas=1, spatial_parts=1, mode="estimate",
                       optimizer=adam, loss_fn=make_loss(NAME), cache=False, progress=False)
    assert isinstance(cm.optimizer, torch.optim.Adam)
    sched = torch.optim.lr_scheduler.StepLR(cm.optimizer, step_size=1, gamma=0.5)
    assert [n for n, _ in cm.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert sum(p.numel() for p in cm.parameters()) == sum(p.numel() for p in model.parameters())
    sd = cm.state_dict()
    assert list(sd) == list(model.state_dict())
    sd = {k: v + 1 if v.is_floating_point() else v for k, v in sd.items()}
    cm.load_state_dict(sd)
    # a plain PyTorch loop: batches from a DataLoader, a scheduler stepped after each step
    data = [make_batch(NAME, TOTAL, s) for s in range(3)]
    loader = torch.utils.data.DataLoader(data, batch_size=None)
    ref = make_model(NAME)
    ref.load_state_dict(sd)
    ref_opt = adam(ref.parameters())
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    for x, y in loader:
        loss = cm.train_step(x, y)
        sched.step()
        ref_opt.zero_grad()
        ref_loss = sum(make_loss(NAME)(ref(xc), yc) for xc, yc in zip(x.chunk(4), y.chunk(4), strict=True)) / 4
        ref_loss.backward()
        ref_opt.step()
        ref_sched.step()
        assert loss == pytest.approx(float(ref_loss.detach()), rel=1e-5)
    assert cm.optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5**3)
    for k, v in ref.state_dict().items():
        if v.is_floating_point():
            torch.testing.assert_close(cm.state_dict()[k], v, rtol=1e-5, atol=1e-6)
    # eval loop
    ref.eval()
    with torch.no_grad():
        for x, _ in loader:
            torch.testing.assert_close(cm.eval_step(x), ref(x), rtol=1e-5, atol=1e-6)


def test_named_optimizer_trains() -> None:
    cm = nowdl.compile(make_model(NAME), gpus=1, stages=1, micro_batches=4, dp=1, replicas=1, spatial_parts=1,
                       mode="estimate", optimizer="sgd", loss_fn=make_loss(NAME), cache=False, progress=False)
    assert isinstance(cm.optimizer, torch.optim.SGD)
    before = {k: v.clone() for k, v in cm.state_dict().items()}
    cm.train_step(*make_batch(NAME, TOTAL, 0))
    assert any(not torch.equal(before[k], v) for k, v in cm.state_dict().items() if v.is_floating_point())
