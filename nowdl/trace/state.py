"""Running a model and its graph on the model's own modules, leaving their state as it was.

The check against eager execution (:mod:`nowdl.trace.check`) runs the model and the traced graph
in train and in eval mode. An exported graph shares the model's modules, parameters and buffers,
and a run in train mode moves the norms' running statistics. :func:`kept_state` snapshots every
parameter and buffer (and which tensor each module holds under each name) and every module's
train/eval flag; its ``restore`` puts them back (every buffer, and the parameters whose version
counter says they were written in place) between the two runs and on exit, so each run
starts from the state the model had, as it would on a deep copy, without copying the modules
(two deep copies of SwinUNETR and its graph per mode took about a tenth of tracing it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["kept_state"]


@contextlib.contextmanager
def kept_state(*modules: nn.Module) -> Iterator[Callable[[], None]]:
    """Yield ``restore()``, which puts the parameters, buffers and train/eval flags of
    ``modules`` (and all their submodules) back as they were on entry; called again on exit."""
    subs = list({id(s): s for m in modules for s in m.modules()}.values())
    flags = [(s, s.training) for s in subs]
    slots = [(s, dict(s._parameters), dict(s._buffers)) for s in subs]
    # tensor, its value, its version counter or None: a buffer is always copied back (kernels
    # such as batch_norm's write running statistics without moving the counter), a parameter
    # when the counter moved (a write in place on it)
    values: dict[int, list[Any]] = {}
    for _, params, bufs in slots:
        for t in bufs.values():
            if t is not None:
                values[id(t)] = [t, t.detach().clone(), None]
        for t in params.values():
            if t is not None and id(t) not in values:
                values[id(t)] = [t, t.detach().clone(), t._version]

    def restore() -> None:
        for s, params, bufs in slots:
            s._parameters.clear()
            s._parameters.update(params)
            s._buffers.clear()
            s._buffers.update(bufs)
        with torch.no_grad():
            for kept in values.values():
                t, saved, version = kept
                if version is None:
                    t.copy_(saved)
                elif t._version != version:
                    t.copy_(saved)
                    kept[2] = t._version
        for s, flag in flags:
            s.training = flag

    try:
        yield restore
    finally:
        restore()
