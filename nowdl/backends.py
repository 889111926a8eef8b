"""The process-group backends nowdl runs on, and the check of a backend's name.

``compile(backend=...)`` checks the name when it is called; the launch layer checks it again,
with what this machine's torch supports (NCCL needs CUDA), when the process group starts.
"""

from __future__ import annotations

from nowdl.errors import NowdlError

__all__ = ["BACKENDS", "backend_name"]

BACKENDS: tuple[str, ...] = ("nccl", "gloo", "mpi")


def backend_name(backend: object, source: str) -> str:
    """``backend`` lower-cased when it is one of BACKENDS.

    Raises:
        NowdlError: naming ``source`` (the argument or variable that gave it) and the choices.
    """
    name = backend.strip().lower() if isinstance(backend, str) else None
    if name not in BACKENDS:
        raise NowdlError(f"{source}={backend!r} is not one of {', '.join(BACKENDS)}: pass one of them or None "
                         "(nccl with CUDA, gloo on CPU)")
    return name
