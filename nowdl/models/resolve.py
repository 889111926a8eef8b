"""Build a model from the command line's MODEL and --model-args."""

from __future__ import annotations

import importlib
import json
import os
import sys
from collections.abc import Callable
from typing import Any

from torch import nn

from nowdl.errors import NowdlError
from nowdl.models import DEFAULT_INPUTS, MODELS

__all__ = ["resolve_model", "import_callable"]


def resolve_model(spec: str, model_args: str | None) -> tuple[nn.Module, list[int] | None, str]:
    """Build the model named by ``spec``; returns (model, default input shape or None, display name).

    Raises:
        NowdlError: unknown built-in, unimportable path, bad JSON, or the callable rejects the args.
    """
    try:
        kwargs: dict[str, Any] = json.loads(model_args) if model_args else {}
    except json.JSONDecodeError as e:
        raise NowdlError(f"--model-args is not valid JSON ({e.msg} at column {e.colno}): write e.g. '{{\"depth\": 4}}'") from None
    if not isinstance(kwargs, dict):
        raise NowdlError(f"--model-args must be a JSON object of keyword arguments, got {type(kwargs).__name__}")
    if ":" not in spec:
        if spec not in MODELS:
            raise NowdlError(
                f"unknown model {spec!r}: built-in models are {', '.join(sorted(MODELS))}; "
                "or give 'package.module:callable' (e.g. monai.networks.nets:UNet)"
            )
        try:
            model = MODELS[spec](**kwargs)
        except TypeError as e:
            raise NowdlError(f"built-in model {spec!r} does not take these --model-args: {e}") from None
        default = DEFAULT_INPUTS.get(spec)
        return model, list(default) if default else None, spec
    fn = import_callable(spec, f"model {spec!r}", f"{spec!r} is not callable")
    try:
        model = fn(**kwargs)
    except Exception as e:
        raise NowdlError(f"{spec}(**{kwargs}) failed: {type(e).__name__}: {e}. Check --model-args.") from None
    if not isinstance(model, nn.Module):
        raise NowdlError(f"{spec} returned a {type(model).__name__}, not an nn.Module")
    return model, None, spec


def import_callable(spec: str, what: str, not_callable: str) -> Callable[..., Any]:
    """The callable named by ``package.module:attr[.attr]``; ``what`` names it in errors.

    Raises:
        NowdlError: the module does not import, has no such attribute, or it is not callable
            (then ``not_callable`` is the message).
    """
    mod_name, _, attr = spec.partition(":")
    _current_folder_first()
    try:
        fn: Any = importlib.import_module(mod_name)
    except ImportError as e:
        raise NowdlError(f"cannot import {mod_name!r} for {what}: {e}. Is it installed, in the current folder "
                         f"({os.getcwd()}) or on PYTHONPATH?") from None
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise NowdlError(f"{mod_name!r} has no attribute {attr!r} ({what})")
        fn = getattr(fn, part)
    if not callable(fn):
        raise NowdlError(not_callable)
    return fn  # type: ignore[no-any-return]


def _current_folder_first() -> None:
    """Put the current folder first on ``sys.path``, as ``python -m`` does (the ``nowdl`` script's own
    folder is there instead), so ``nowdl plan mymodels:net`` finds ``mymodels.py`` beside the user."""
    cwd = os.getcwd()
    if not any(os.path.abspath(p or ".") == cwd for p in sys.path):
        sys.path.insert(0, cwd)
