"""The memory a plan keeps back on each GPU for what the cost model does not see."""

from __future__ import annotations

from nowdl.profiler.devices import DeviceSpec

__all__ = ["memory_reserve", "NCCL_BYTES", "SLACK"]

NCCL_BYTES = 256 * 2**20
SLACK = 0.02


def memory_reserve(spec: DeviceSpec, gpus: int) -> dict[str, int]:
    """What a plan keeps of each GPU's memory for what it does not model, by term ([Note: memory reserve]).

    [Note: memory reserve] A GPU process holds memory that torch's caching allocator never
    hands out to tensors: the CUDA context and the cuDNN and cuBLAS handles (``context_bytes``
    of the spec), NCCL's buffers when several GPUs talk (``NCCL_BYTES``), and the allocator's
    own slack, the free parts of its cached segments that a request of another size cannot use
    (``SLACK`` of the memory). A plan caps each rank at ``memory_bytes`` less this reserve and
    shows the reserve as a line of its own (``nowdl plan``, ``nowdl show``, the memory picture).
    The context and slack figures are assumed until a GPU's records measure them
    (``benchmarks/gpu_check.py`` records the context and the allocator's reserved bytes); a spec
    without ``context_bytes`` (the CPU) reserves nothing.
    """
    if not spec.context_bytes:
        return {}
    out = {"context_bytes": int(spec.context_bytes), "slack_bytes": int(SLACK * spec.memory_bytes)}
    if gpus > 1:
        out["nccl_bytes"] = NCCL_BYTES
    return out
