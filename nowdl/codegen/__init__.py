"""Per-stage module generation from a Plan: runnable stage modules and their readable source."""

from nowdl.codegen.source import stage_source, write_sources
from nowdl.codegen.stage import StageModule, build_stages
from nowdl.codegen.stages import split_stages

__all__ = ["split_stages", "StageModule", "build_stages", "stage_source", "write_sources"]
