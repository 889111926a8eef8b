"""Per-stage module generation from a Plan: runnable stage modules, chained in one process, and their readable source."""

from typing import TYPE_CHECKING

from nowdl.lazy import lazy_exports

if TYPE_CHECKING:
    from nowdl.codegen.chain import StageChain, chain_stages
    from nowdl.codegen.source import stage_source, write_sources
    from nowdl.codegen.stage import StageModule, build_stages

__all__ = ["StageModule", "build_stages", "StageChain", "chain_stages", "stage_source", "write_sources"]

__getattr__ = lazy_exports(__name__, {
    "stage_source": "source", "write_sources": "source", "StageModule": "stage",
    "build_stages": "stage", "StageChain": "chain", "chain_stages": "chain",
})
