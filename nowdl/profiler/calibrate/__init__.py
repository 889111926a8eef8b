"""``nowdl calibrate``: measure this machine's links and compute, written as a DeviceSpec.

``links`` fits point-to-point and all-reduce times; ``ops`` measures achieved FLOP/s per op
class; ``command`` runs both and writes the spec.
"""

from typing import TYPE_CHECKING

from nowdl.lazy import lazy_exports

if TYPE_CHECKING:
    from nowdl.profiler.calibrate.command import calibrate, calibrate_command

__all__ = ["calibrate", "calibrate_command"]

__getattr__ = lazy_exports(__name__, {
    "calibrate": "command", "calibrate_command": "command",
})
