"""What ``torch.cuda.max_memory_reserved`` will show: the caching allocator over a step's allocations.

:mod:`~nowdl.profiler.alloc.caching` simulates PyTorch's CUDA caching allocator with the sizes
and options of :mod:`~nowdl.profiler.alloc.sizes` ([Note: caching allocator]);
:mod:`~nowdl.profiler.alloc.log` records the aten allocations each node makes while it is
profiled ([Note: allocation log]); :mod:`~nowdl.profiler.alloc.order` lays those out in the order
a rank's training or inference step makes them ([Note: allocation order]);
:mod:`~nowdl.profiler.alloc.predict` replays a plan's ranks through the simulation and records
the predicted ``max_memory_reserved`` in the plan ([Note: allocator reserve]).
"""

from typing import TYPE_CHECKING

from nowdl.lazy import lazy_exports

if TYPE_CHECKING:
    from nowdl.profiler.alloc.caching import CachingAllocator
    from nowdl.profiler.alloc.predict import allocator_reserve, simulate_plan
    from nowdl.profiler.alloc.sizes import AllocatorConfig, AllocatorOOM

__all__ = ["AllocatorConfig", "AllocatorOOM", "CachingAllocator", "allocator_reserve", "simulate_plan"]

__getattr__ = lazy_exports(__name__, {
    "AllocatorConfig": "sizes", "AllocatorOOM": "sizes", "CachingAllocator": "caching",
    "allocator_reserve": "predict", "simulate_plan": "predict",
})
