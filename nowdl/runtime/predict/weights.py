"""Weights for predict: a nowdl checkpoint folder (any plan: read by name) or a plain state_dict file."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nowdl.errors import NowdlError
from nowdl.runtime.training.checkpoint import CheckpointError, open_checkpoint

__all__ = ["load_weights", "load_checkpoint_weights"]


def _check_keys(model: nn.Module, keys: set[str], where: str) -> None:
    want = set(model.state_dict())
    missing, extra = sorted(want - keys), sorted(keys - want)
    if missing or extra:
        shown = (f"it lacks {', '.join(missing[:3])}" + (" ..." if len(missing) > 3 else "") if missing else
                 f"it has {', '.join(extra[:3])}" + (" ..." if len(extra) > 3 else "") + " that the model has not")
        raise CheckpointError(f"{where} holds the weights of another model: {shown} ({len(want)} tensors in this "
                              f"model, {len(keys)} saved): give the checkpoint of this model, or the MODEL and "
                              "--model-args it was trained with")


def load_checkpoint_weights(model: nn.Module, ck: Any) -> None:
    """Load the ``model/<name>`` tensors of the opened checkpoint ``ck`` (any plan) into ``model``.

    Raises:
        CheckpointError: ``ck`` holds another model's weights (names the keys).
    """
    saved = {k[len("model/"):] for k in ck.index() if k.startswith("model/")}
    _check_keys(model, saved, f"checkpoint {ck.dir}")
    sd = model.state_dict()
    got = ck.read({f"model/{k}": tuple(v.shape) for k, v in sd.items()})
    model.load_state_dict({k: got[f"model/{k}"] for k in sd})


def load_weights(model: nn.Module, source: str | os.PathLike[str]) -> str:
    """Load ``source`` into ``model`` (every rank calls it: a checkpoint read is collective).

    A folder is a nowdl checkpoint (``cm.save_checkpoint`` / ``nowdl run --checkpoint``): its
    ``model/<name>`` tensors, saved by any plan, are read by name. A file is a ``state_dict``
    (``torch.save(model.state_dict(), f)``, ``nowdl export``), loaded with ``weights_only=True``.
    Returns a short description for the summary.

    Raises:
        NowdlError: a missing source, a checkpoint or state_dict of another model (names the keys or shapes).
    """
    path = Path(source)
    if not path.exists():
        raise NowdlError(f"--checkpoint {path} does not exist: give a nowdl checkpoint folder or a state_dict file")
    if path.is_dir():
        ck = open_checkpoint(path)
        if ck is None:
            raise CheckpointError(f"{path} holds no nowdl checkpoint (no 'latest'): give the folder `nowdl run "
                                  "--checkpoint` or cm.save_checkpoint wrote, or a state_dict file")
        load_checkpoint_weights(model, ck)
        return f"checkpoint {ck.dir} (step {ck.step})"
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise NowdlError(f"cannot read {path} as a state_dict ({type(e).__name__}: {str(e)[:200]}): give a file "
                         "torch.save(model.state_dict(), ...) wrote, or a nowdl checkpoint folder") from None
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise NowdlError(f"{path} is not a state_dict (a dict of tensors): save model.state_dict()")
    _check_keys(model, set(sd), str(path))
    try:
        model.load_state_dict(sd)
    except RuntimeError as e:
        first = str(e).splitlines()[1:2] or [str(e)]
        raise CheckpointError(f"{path} holds the weights of another model configuration ({first[0].strip()[:200]}): "
                              "give the MODEL and --model-args it was trained with") from None
    return f"state_dict {path}"
