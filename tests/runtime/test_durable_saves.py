"""Crash consistency of checkpoint saves: every file, folder and pointer fsynced; re-saves keep a copy;
a simulated power loss at any moment of a save loads a complete step or refuses, never a mix."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from helpers.exactness import adam, make_batch, make_loss, make_model
from helpers.power_loss import Journal

import nowdl
from nowdl.runtime.training import checkpoint as ckmod
from nowdl.runtime.training.checkpoint import CheckpointError, open_checkpoint

NAME = "resnet_bn"


def _cm() -> nowdl.CompiledModel:
    return nowdl.compile(make_model(NAME), gpus=1, spatial_parts=1, stages=1, dp=1, replicas=1, micro_batches=1,
                         mode="estimate", optimizer=adam, loss_fn=make_loss(NAME), cache=False, progress=False)


def _read(root: Path) -> tuple[int, dict[str, torch.Tensor]] | None:
    ck = open_checkpoint(root)
    if ck is None:
        return None
    return ck.step, ck.read(dict.fromkeys(ck.index()))


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_every_file_its_folder_and_latest_are_fsynced(tmp_path: Path) -> None:
    cm = _cm()
    cm.train_step(*make_batch(NAME, 2, 0))
    root = tmp_path / "ck"
    root.mkdir()
    with Journal(root) as j:
        cm.save_checkpoint(root)
    step = root / "step-00000001"
    files = sorted(str(p.relative_to(root)) for p in step.iterdir())
    assert "step-00000001/nowdl.json" in files and "step-00000001/.metadata" in files
    synced = set(j.fsyncs)
    # DCP's shards and metadata (fsynced as .metadata.tmp, then renamed), nowdl's record: each under the
    # folder's name before its rename, and that folder after them
    for f in files:
        assert f".saving-{f}" in synced or f".saving-{f}.tmp" in synced, (f, sorted(synced))
    assert ".saving-step-00000001" in synced and "." in synced and ".latest.tmp" in synced, sorted(synced)


def test_a_resave_interrupted_between_its_renames_loads_the_old_copy(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    cm = _cm()
    cm.train_step(*make_batch(NAME, 2, 0))
    root = tmp_path / "ck"
    cm.save_checkpoint(root)
    before = _read(root)
    assert before is not None
    with torch.no_grad():
        next(iter(cm.parameters())).add_(1.0)  # the same step, other weights
    real = ckmod.replace_durable
    calls = []

    def crash_second(src: Path, dst: Path) -> None:
        calls.append(dst.name)
        if len(calls) == 2:  # the old copy is aside, the new one not yet in place
            raise OSError(5, "Input/output error")
        real(src, dst)

    monkeypatch.setattr(ckmod, "replace_durable", crash_second)
    with pytest.raises(CheckpointError, match="replaced-step-00000001 is kept intact"):
        cm.save_checkpoint(root)
    monkeypatch.undo()
    assert calls[0] == ".replaced-step-00000001" and not (root / "step-00000001").exists()
    again = _read(root)  # latest names the missing folder: its copy aside is read
    assert again is not None and again[0] == 1 and _same(again[1], before[1])
    cm.save_checkpoint(root)  # the next save settles it
    assert not any(p.name.startswith(".replaced") for p in root.iterdir())
    after = _read(root)
    assert after is not None and not _same(after[1], before[1])


@pytest.mark.slow
def test_power_loss_at_any_moment_loads_a_complete_step_never_a_mix(tmp_path: Path) -> None:
    cm = _cm()
    root = tmp_path / "ck"
    versions: list[tuple[int, dict[str, torch.Tensor]]] = []

    def save() -> None:
        cm.save_checkpoint(root, keep=2)
        got = _read(root)
        assert got is not None
        versions.append(got)

    cm.train_step(*make_batch(NAME, 2, 0))
    save()  # step 1: on disk before the journal starts
    with Journal(root) as j:
        for s in (1, 2):
            cm.train_step(*make_batch(NAME, 2, s))
            save()  # steps 2 and 3 (keep=2: step 1 is removed by the second)
        with torch.no_grad():
            next(iter(cm.parameters())).mul_(0.5)
        save()  # step 3 again, other weights
    assert [v[0] for v in versions] == [1, 2, 3, 3] and len(j.moments) > 40
    rng = random.Random(0)
    loaded = {}
    for n in range(220):
        into = tmp_path / f"crash{n}"
        into.mkdir()
        moment = j.crash(rng, into)
        got = _read(into)  # a CheckpointError here fails the test: a durable save is never refused
        assert got is not None, f"moment {moment}: no checkpoint found"
        match = [i for i, (step, t) in enumerate(versions) if step == got[0] and _same(t, got[1])]
        assert match, f"moment {moment}: step {got[0]} loaded with tensors of no complete save (a mix)"
        loaded[match[0]] = loaded.get(match[0], 0) + 1
    assert len(loaded) >= 3, loaded  # the crashes reach the old, the new and the re-saved steps
