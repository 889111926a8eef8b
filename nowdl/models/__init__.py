"""Model zoo: ResNet v1/v2, AmoebaNet-D, UNet (2D/3D), plain PyTorch."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from torch import nn

from nowdl.errors import NowdlError
from nowdl.models.amoebanet import AmoebaNetD, amoebanetd
from nowdl.models.resnet import ResNet, blocks_per_stage, resnet, resnet110v2, valid_resnet_depths
from nowdl.models.unet import UNet, unet, unet3d

__all__ = [
    "MODELS",
    "DEFAULT_INPUTS",
    "get_model",
    "ResNet",
    "resnet",
    "resnet110v2",
    "blocks_per_stage",
    "valid_resnet_depths",
    "AmoebaNetD",
    "amoebanetd",
    "UNet",
    "unet",
    "unet3d",
]

#: Built-in models by name. ``"amoebanet"`` is AmoebaNet-D with MPI4DL's benchmark
#: defaults (18 normal cells, 416 filters; GPipe's 318M-parameter configuration at 1000
#: classes); ``"resnet"`` defaults to ResNet-110-v2 and takes ``depth``/``version``.
MODELS: dict[str, Callable[..., nn.Module]] = {
    "resnet": resnet,
    "resnet110v2": resnet110v2,
    "amoebanet": amoebanetd,
    "unet": unet,
    "unet3d": unet3d,
}

#: A representative input shape per built-in model, as used in the GEMS/MPI4DL papers.
DEFAULT_INPUTS: dict[str, tuple[int, ...]] = {
    "resnet": (1, 3, 1024, 1024),
    "resnet110v2": (1, 3, 1024, 1024),
    "amoebanet": (1, 3, 1024, 1024),
    "unet": (1, 3, 2048, 2048),
    "unet3d": (1, 1, 128, 128, 128),
}


def get_model(name: str, **kwargs: Any) -> nn.Module:
    """Build the registered model ``name`` with ``kwargs`` passed to its builder.

    Raises NowdlError (a ValueError) for an unknown name (listing the known names) or for
    keyword arguments the builder does not accept (naming the model and the argument).
    """
    builder = MODELS.get(name)
    if builder is None:
        known = ", ".join(sorted(MODELS))
        raise NowdlError(f"unknown model {name!r}; known models: {known}")
    params = inspect.signature(builder).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        accepted = [
            n
            for n, p in params.items()
            if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        ]
        bad = sorted(k for k in kwargs if k not in accepted)
        if bad:
            raise NowdlError(
                f"model {name!r} does not accept argument(s) {', '.join(map(repr, bad))}; "
                f"it accepts: {', '.join(accepted)}"
            )
    return builder(**kwargs)
