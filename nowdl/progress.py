"""Progress on long planning: a tqdm bar, or a status line (stderr, silent when not a terminal)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

__all__ = ["Progress", "status"]


@contextlib.contextmanager
def status(text: str, *, enabled: bool) -> Iterator[None]:
    """One line on stderr while a long step runs ("nowdl: tracing UNet ..."), erased after it;
    silent when not a terminal or disabled."""
    show = enabled and sys.stderr.isatty()
    if show:
        print(f"nowdl: {text} ...", end="\r", file=sys.stderr, flush=True)
    try:
        yield
    finally:
        if show:
            print(" " * (len(text) + 11), end="\r", file=sys.stderr, flush=True)


class Progress:
    """A tqdm bar on stderr for long searches, silent when not a terminal or disabled."""

    def __init__(self, desc: str, *, enabled: bool, unit: str = "config", min_total: int = 8) -> None:
        self.desc, self.unit, self.min_total = desc, unit, min_total
        self.enabled = enabled and sys.stderr.isatty()
        self._bar: Any = None

    def update(self, done: int, total: int) -> None:
        if not self.enabled or total < self.min_total:
            return
        if self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=self.desc, unit=self.unit, leave=False, file=sys.stderr)
        self._bar.n = done
        self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
