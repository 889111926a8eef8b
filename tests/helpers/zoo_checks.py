"""Test helper (not a test module): the planner checks of the model-zoo nets, run by a training
rank while the other compares with one process (``helpers.zoo_train``), outcomes returned.

* ``whole``: the whole net pinned on 2 tiles (``stages=1, spatial_parts=2``): the planner's
  refusal, which names the node that keeps it off tiles, or "" when it plans;
* ``one_sample_pinned``: a batch of 1 in 4 micro-batches pinned (stages=2, global batch 4), one
  sample each: the refusal ([Note: one-sample norms]).

A check returns what happened, an unexpected exception included (as its type and text), so that
the test says what went wrong and the training case still counts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from helpers.zoo import build, by_id

__all__ = ["CHECKS", "run_check"]


def _error(e: BaseException) -> dict[str, Any]:
    return {"error": type(e).__name__, "text": str(e), "node": getattr(e, "node", None)}


def _whole(net_id: str) -> dict[str, Any]:
    import nowdl

    net = by_id(net_id)
    cm = nowdl.compile(build(net), gpus=2, stages=1, spatial_parts=2, slice="vertical", progress=False, cache=False)
    try:
        cm.plan(torch.empty(net.shape, device="meta"))
    except Exception as e:
        return _error(e)
    return {"error": "", "text": ""}


def _one_sample_pinned(net_id: str) -> dict[str, Any]:
    import nowdl

    net = by_id(net_id)
    cm = nowdl.compile(build(net), gpus=2, stages=2, progress=False, cache=False, global_batch=4, micro_batches=4,
                       replicas=1, dp=1)
    try:
        cm.plan(torch.empty((1, *net.shape[1:]), device="meta"))
    except Exception as e:
        return _error(e)
    return {"error": "", "text": ""}


CHECKS: dict[str, Callable[[str], dict[str, Any]]] = {
    "whole": _whole, "one_sample_pinned": _one_sample_pinned}


def run_check(name: str, net_id: str) -> dict[str, Any]:
    return CHECKS[name](net_id)
