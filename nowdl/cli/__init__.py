"""The command line: ``nowdl plan | show | run | profile | codegen | calibrate | report``.

``main`` parses the arguments and runs the planning commands; ``inputs`` reads ``--input`` (the
whole input of one micro-batch, batch first) for every command; ``run`` and its ``runspec``,
``runplan`` and ``resume`` train from the shell; ``report`` reads a run's metrics log; ``pictures`` draws plans
and runs for ``--plot``.
"""

from typing import TYPE_CHECKING

from nowdl.lazy import lazy_exports

if TYPE_CHECKING:
    from nowdl.cli.commands import main

__all__ = ["main"]

__getattr__ = lazy_exports(__name__, {
    "main": "commands",
})
