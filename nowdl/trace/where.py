"""Where an exception came from in the user's code: the model's module and source line.

Tracing errors name the innermost frame outside torch and nowdl, and the ``nn.Module`` of the
model whose ``forward`` it was, so that a user sees ``module 'enc.2' (Block) at net.py:41``
rather than a torch.fx internals traceback.
"""

from __future__ import annotations

import os
import traceback

import torch
from torch import nn

__all__: list[str] = []  # private helpers of nowdl.trace.tracer and nowdl.trace.check


def _user_frames(exc: BaseException) -> list[tuple[traceback.FrameSummary, object]]:
    """The traceback's frames outside torch and nowdl, innermost last, with each frame's ``self``."""
    torch_dir = os.path.dirname(torch.__file__)
    here = os.path.dirname(__file__)
    out = []
    tb = exc.__traceback__
    while tb is not None:
        fname = tb.tb_frame.f_code.co_filename
        if not fname.startswith(torch_dir) and not fname.startswith(here):
            summary = traceback.extract_tb(tb, limit=1)[0]
            out.append((summary, tb.tb_frame.f_locals.get("self")))
        tb = tb.tb_next
    return out


def _user_frame(exc: BaseException) -> str:
    """The innermost traceback frame outside torch: where the user's code failed."""
    frames = _user_frames(exc)
    if not frames:
        return ""
    f = frames[-1][0]
    line = f" `{f.line.strip()}`" if f.line else ""
    return f"{f.filename}:{f.lineno} in {f.name}{line}"


def _where(exc: BaseException, model: nn.Module) -> str:
    """Which module of ``model`` and which source line an exception came from, as far as known."""
    frames = _user_frames(exc)
    names = {id(m): n for n, m in model.named_modules()}
    module = ""
    for _, owner in reversed(frames):
        if isinstance(owner, nn.Module) and id(owner) in names:
            q = names[id(owner)]
            module = f"module {q or '(the model)'!r} ({type(owner).__name__})"
            break
    line = _user_frame(exc)
    return ", ".join(p for p in (module, f"at {line}" if line else "") if p)


def _first_line(exc: BaseException) -> str:
    """The first line of an exception's message ("" when it has none)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def _refused_by_model(exc: BaseException) -> bool:
    """Whether the user's own code raised ``exc`` on purpose (a builtin exception from a ``raise``
    or ``assert`` line): the model refuses its input, as opposed to a tracer's limitation."""
    if type(exc).__module__ != "builtins":
        return False
    frames = _user_frames(exc)
    line = (frames[-1][0].line or "").strip() if frames else ""
    return line.startswith(("raise ", "raise(", "assert "))
