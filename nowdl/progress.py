"""A progress bar for long planning (tqdm on stderr, silent when not a terminal)."""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["Progress"]


class Progress:
    """A tqdm bar on stderr for long searches, silent when not a terminal or disabled."""

    def __init__(self, desc: str, *, enabled: bool) -> None:
        self.desc = desc
        self.enabled = enabled and sys.stderr.isatty()
        self._bar: Any = None

    def update(self, done: int, total: int) -> None:
        if not self.enabled or total < 8:
            return
        if self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=self.desc, unit="config", leave=False, file=sys.stderr)
        self._bar.n = done
        self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
