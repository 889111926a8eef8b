"""Test helper: hypothesis settings profiles for the property tests, and a count of their cases.

Profiles (chosen by ``NOWDL_HYPOTHESIS``; the default is ``ci``):

* ``ci``: derandomized (a fixed seed: every run draws the same cases), no example database,
  each property at its CI count (``examples(n)`` is ``n``). CI and ``make test`` use it.
* ``dev``: random seeds, the CI counts: new cases on every run.
* ``long``: random seeds and ten times the cases, for local runs before a release.

``count(name)`` adds one to a property's case count; ``tests/conftest.py`` prints the counts
at the end of the session ("hypothesis cases run: ...").
"""

from __future__ import annotations

import os
from collections import Counter

from hypothesis import HealthCheck, settings

__all__ = ["PROFILE", "examples", "count", "COUNTS"]

_SCALE = {"ci": 1, "dev": 1, "long": 10}
_common = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow, HealthCheck.filter_too_much,
                                                       HealthCheck.data_too_large]}
settings.register_profile("ci", derandomize=True, database=None, print_blob=True, **_common)  # type: ignore[arg-type]
settings.register_profile("dev", print_blob=True, **_common)  # type: ignore[arg-type]
settings.register_profile("long", print_blob=True, **_common)  # type: ignore[arg-type]

PROFILE = os.environ.get("NOWDL_HYPOTHESIS", "ci")
if PROFILE not in _SCALE:
    raise ValueError(f"NOWDL_HYPOTHESIS={PROFILE!r}: use one of {', '.join(_SCALE)}")
settings.load_profile(PROFILE)

COUNTS: Counter[str] = Counter()


def examples(n: int) -> int:
    """The number of cases a property runs: ``n`` in CI, ten times that with the long profile."""
    return n * _SCALE[PROFILE]


def count(name: str) -> None:
    """Count one case of property ``name``."""
    COUNTS[name] += 1
