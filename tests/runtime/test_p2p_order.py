"""Point-to-point order: what NCCL needs of the runtime's messages, checked on gloo ranks.

NCCL ignores tags: a receive takes the next message its peer sends on that group, so every
(group, sender, receiver) must post its receives in the order the sender posts its sends (gloo
matches by tag, so a run can be exact on gloo and wrong on NCCL). NCCL also runs the single sends
and receives between two ranks of a group on one stream in posting order, so on each group the
two ranks' whole sequences (both directions interleaved) must mirror each other, or a receive
posted ahead blocks the send its peer waits for ([Note: p2p lanes] in runtime/pipeline/transfers.py).
Each rank records the messages it posts through runtime/launch/comm.py; the tests compare the two
sides of every pair.
"""

from __future__ import annotations

import collections
import os
from typing import Any

import pytest
from helpers.distributed import run_workers
from helpers.exactness import adam, make_batch, make_loss, make_model

Post = tuple[str, Any, int, int, int, tuple[int, ...]]  # kind, group, sender, receiver, tag, shape


def _recorded(rank: int, world: int, name: str, cfg: dict[str, Any]) -> list[Post]:
    """One training step of ``name`` under ``compile(**cfg)``, recording every message this rank posts."""
    import torch.distributed as dist

    import nowdl
    from nowdl.runtime.launch import comm

    os.environ[comm.STAGE_VAR] = "0"
    log: list[Post] = []
    isend, irecv, exchange = comm.isend, comm.irecv, comm.exchange

    def ranks(group: Any) -> Any:
        return None if group is None else (group.group_name, tuple(dist.get_process_group_ranks(group)))

    def rec_isend(t: Any, dst: int, group: Any = None, tag: int = 0) -> Any:
        log.append(("S", ranks(group), rank, dst, tag, tuple(t.shape)))
        return isend(t, dst, group, tag)

    def rec_irecv(t: Any, src: int, group: Any = None, tag: int = 0) -> Any:
        log.append(("R", ranks(group), src, rank, tag, tuple(t.shape)))
        return irecv(t, src, group, tag)

    def rec_exchange(recvs: Any, sends: Any, group: Any = None, tag: int = 0) -> Any:
        log.extend(("BR", ranks(group), src, rank, tag, tuple(t.shape)) for t, src in recvs)  # one NCCL group call
        log.extend(("BS", ranks(group), rank, dst, tag, tuple(t.shape)) for t, dst in sends)
        return exchange(recvs, sends, group, tag)

    comm.isend, comm.irecv, comm.exchange = rec_isend, rec_irecv, rec_exchange
    cm = nowdl.compile(make_model(name), gpus=world, mode="estimate", optimizer=adam, loss_fn=make_loss(name),
                       cache=False, progress=False, timeout_s=60, **cfg)
    cm.train_step(*make_batch(name, cfg["micro_batches"] * cfg["replicas"] * cfg["dp"], 0))
    return log


def _faults(logs: list[list[Post]]) -> list[str]:
    """Where NCCL would pair the wrong messages or wait forever (empty: it would run them):

    - per (group, sender, receiver), the receives in the order of the sends;
    - per group and pair of ranks, the single sends and receives (a batched exchange is one
      NCCL group call, exempt) of the two ranks mirror each other op by op.
    """
    sends: dict[Any, list[tuple[int, tuple[int, ...]]]] = collections.defaultdict(list)
    recvs: dict[Any, list[tuple[int, tuple[int, ...]]]] = collections.defaultdict(list)
    seq: dict[Any, list[tuple[str, int, int, int, tuple[int, ...]]]] = collections.defaultdict(list)
    for rank, log in enumerate(logs):
        for kind, group, src, dst, tag, shape in log:
            (sends if kind.endswith("S") else recvs)[(group, src, dst)].append((tag, shape))
            if kind in ("S", "R"):
                peer = dst if kind == "S" else src
                seq[(group, rank, peer)].append((kind, src, dst, tag, shape))
    out = [f"group {g} {s}->{d}: sends {sends[g, s, d][:4]}..., receives {recvs[g, s, d][:4]}..."
           for g, s, d in sorted(set(sends) | set(recvs), key=str) if sends[g, s, d] != recvs[g, s, d]]
    for (g, a, b), mine in sorted(seq.items(), key=str):
        if a < b:
            theirs = [("R" if k == "S" else "S", s, d, t, sh) for k, s, d, t, sh in seq.get((g, b, a), [])]
            if mine != theirs:
                i = next((i for i, (x, y) in enumerate(zip(mine, theirs, strict=False)) if x != y),
                         min(len(mine), len(theirs)))
                out.append(f"group {g} ranks {a}<->{b}: op {i} of rank {a} is {mine[i] if i < len(mine) else None}, "
                           f"rank {b}'s mirror {theirs[i] if i < len(theirs) else None}")
    return out


def _mismatched(name: str, world: int, cfg: dict[str, Any]) -> list[str]:
    logs = run_workers(_recorded, world, name, cfg, timeout_s=240)
    assert any(logs), "no point-to-point message was recorded"
    return _faults(logs)


@pytest.mark.parametrize(("name", "world", "cfg"), [
    ("monai_unet", 4, {"stages": 4, "spatial_parts": 1, "micro_batches": 4, "schedule": "1f1b"}),
    ("resnet_bn", 3, {"stages": 2, "spatial_parts": 2, "spatial_stages": 1, "slice": "horizontal",
                      "micro_batches": 2, "schedule": "1f1b"}),
    ("resnet_bn", 2, {"stages": 2, "spatial_parts": 1, "micro_batches": 2, "schedule": "gpipe"}),
    ("resnet_bn", 4, {"stages": 2, "spatial_parts": 2, "spatial_stages": 1, "slice": "vertical",
                      "micro_batches": 2, "replicas": 2, "schedule": "1f1b"}),
], ids=["pipeline-long-skips", "tiles-then-pipeline", "gpipe-two-ranks", "master"])
def test_each_lane_posts_in_its_peers_order(name: str, world: int, cfg: dict[str, Any]) -> None:
    assert _mismatched(name, world, {"dp": 1, "replicas": 1, **cfg}) == []


def test_the_check_sees_a_receive_posted_ahead_of_a_send() -> None:
    """One group both ways, as in GPipe's first step without lanes: rank 0 posts the receive of
    rank 1's message before its own second send, which rank 1 receives first."""
    g = ("w", (0, 1))
    logs = [[("S", g, 0, 1, 4, ()), ("R", g, 1, 0, 6, ()), ("S", g, 0, 1, 5, ())],
            [("R", g, 0, 1, 4, ()), ("R", g, 0, 1, 5, ()), ("S", g, 1, 0, 6, ())]]
    assert _faults(logs) == ["group ('w', (0, 1)) ranks 0<->1: op 1 of rank 0 is ('R', 1, 0, 6, ()), "
                             "rank 1's mirror ('S', 0, 1, 5, ())"]
