"""matplotlib behind one door: the optional import, the output path check, an atomic save."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from nowdl.errors import NowdlError

__all__ = ["FORMATS", "INSTALL_HINT", "check_plot_path", "new_figure", "require_matplotlib", "save_figure"]

FORMATS = ("png", "svg", "pdf")
INSTALL_HINT = "pip install 'nowdl[plot]'"


def require_matplotlib() -> Any:
    """Import matplotlib, or raise a NowdlError that says how to install it."""
    try:
        import matplotlib
        from matplotlib.figure import Figure  # noqa: F401  (the part nowdl draws with)
    except ImportError:
        raise NowdlError(
            f"drawing needs matplotlib, which is not installed: {INSTALL_HINT} "
            "(or pip install matplotlib), then run the command again"
        ) from None
    return matplotlib


def check_plot_path(path: str | os.PathLike[str]) -> Path:
    """Refuse, before any work, a picture path nowdl cannot write: unknown suffix or no folder.

    Raises:
        NowdlError: the suffix is not .png, .svg or .pdf, or the folder does not exist or is a file.
    """
    p = Path(path)
    ext = p.suffix.lower().lstrip(".")
    if ext not in FORMATS:
        raise NowdlError(
            f"cannot draw {str(p)!r}: unknown picture format {p.suffix or '(no suffix)'!r}; "
            f"name the file .png, .svg or .pdf"
        )
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise NowdlError(f"cannot write {str(p)!r}: folder {str(parent)!r} does not exist; create it or pick another path")
    if not os.access(parent, os.W_OK):
        raise NowdlError(f"cannot write {str(p)!r}: folder {str(parent)!r} is not writable; pick another path")
    return p


def new_figure(width: float, height: float) -> Any:
    """A matplotlib Figure not tied to pyplot (no GUI backend, no global state)."""
    require_matplotlib()
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def save_figure(fig: Any, path: str | os.PathLike[str], *, dpi: int = 80) -> Path:
    """Write ``fig`` to ``path`` atomically (a failure leaves no file behind)."""
    p = check_plot_path(path)
    ext = p.suffix.lower().lstrip(".")
    fd, tmp = tempfile.mkstemp(prefix=p.name + ".", suffix=".tmp", dir=p.parent if str(p.parent) else ".")
    os.close(fd)
    try:
        meta = {"Software": None} if ext == "png" else ({"Date": None} if ext == "svg" else {})
        fig.savefig(tmp, format=ext, dpi=dpi, metadata=meta)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp made it private; a picture is not
        os.replace(tmp, p)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise NowdlError(f"cannot write {str(p)!r}: {e.strerror or e}") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return p
