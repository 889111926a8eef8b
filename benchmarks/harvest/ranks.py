"""Several ranks on the one device (gloo, CUDA tensors staged through pinned host memory) against one process.

NCCL refuses two ranks on one GPU, so these runs use gloo with nowdl's host-staged transport:
every CUDA path of the runtime (streams, pinned buffers, halo exchange, offload, per-rank memory)
runs, with the messages crossing through host memory. Each configuration trains ``STEPS`` steps on
``world`` ranks and once in this process on the same micro-batches from the same weights; the row
keeps both losses, the largest weight difference, and each rank's allocator peak against its plan.
A single-rank NCCL group checks that NCCL initialises and reduces on this machine.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import nowdl

from .records import Records, log
from .steps import build_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from helpers.distributed import WorkerError, run_workers  # noqa: E402

__all__ = ["ranks_section", "CONFIGS"]

STEPS = 2
MICRO = 2  # micro-batches per step (each of one sample)

#: name -> (world, compile keywords); the model and sizes come from the section's arguments
CONFIGS: dict[str, tuple[int, dict[str, Any]]] = {
    "pipeline 2 stages": (2, {"stages": 2, "spatial_parts": 1, "dp": 1, "replicas": 1, "micro_batches": MICRO,
                              "balance": "compute"}),
    "spatial 2 tiles": (2, {"stages": 1, "spatial_parts": 2, "dp": 1, "replicas": 1, "micro_batches": MICRO}),
    "data parallel 2": (2, {"stages": 1, "spatial_parts": 1, "dp": 2, "replicas": 1, "micro_batches": 1}),
    "2 stages x 2 tiles, offload": (4, {"stages": 2, "spatial_parts": 2, "spatial_stages": 1, "dp": 1, "replicas": 1,
                                        "micro_batches": MICRO, "offload": "on"}),
    "spatial 4 tiles": (4, {"stages": 1, "spatial_parts": 4, "dp": 1, "replicas": 1, "micro_batches": MICRO}),
}


def _data(step: int, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(MICRO, *shape[1:], generator=g), torch.randint(0, 2, (MICRO, *shape[2:]), generator=g)


def _worker(rank: int, world: int, device: str, model_args: dict[str, Any], shape: tuple[int, ...],
            kw: dict[str, Any]) -> dict[str, Any]:
    dev = torch.device(device)
    cm = nowdl.compile(build_model("unet", model_args), gpus=world, mode="estimate", device=dev, device_spec=kw.pop("spec"),
                       loss_fn=nn.CrossEntropyLoss(), cache=False, progress=False, timeout_s=180, backend="gloo", **kw)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    t = time.perf_counter()
    losses = [cm.train_step(*_data(s, shape)) for s in range(STEPS)]
    wall = time.perf_counter() - t
    plan = cm._train().plan
    return {"losses": losses, "sd": {k: v.detach().cpu() for k, v in cm.state_dict().items()}, "wall_s": wall,
            "max_allocated": int(torch.cuda.max_memory_allocated(dev)) if dev.type == "cuda" else None,
            "predicted_peak": float(plan.ranks[rank].predicted_peak_bytes),
            "staged_bytes": _staged_bytes(), "plan_config": dict(plan.config)}


def _staged_bytes() -> int | None:
    """Bytes the host-staged transport moved in this process (None where the runtime does not count)."""
    try:
        from nowdl.runtime.launch import comm  # type: ignore[attr-defined]
    except ImportError:
        return None
    counter = getattr(comm, "staged_bytes", None)
    return int(counter()) if callable(counter) else None


def _reference(model_args: dict[str, Any], shape: tuple[int, ...], device: torch.device) -> tuple[list[float], dict[str, Any]]:
    """One process, the same micro-batches, Adam as compile() builds it by default."""
    ref = build_model("unet", model_args).to(device)
    opt = torch.optim.Adam(ref.parameters(), lr=1e-3)
    losses = []
    for s in range(STEPS):
        x, y = _data(s, shape)
        opt.zero_grad()
        total = 0.0
        for xi, yi in zip(x.chunk(MICRO), y.chunk(MICRO), strict=True):
            loss = nn.functional.cross_entropy(ref(xi.to(device)), yi.to(device)) / MICRO
            loss.backward()
            total += float(loss.detach())
        opt.step()
        losses.append(total)
    return losses, {k: v.detach().cpu() for k, v in ref.state_dict().items()}


def ranks_section(recs: Records, cpu: bool, spec: str, device: torch.device) -> None:
    model_args: dict[str, Any] = {"depth": 2, "base_width": 8} if cpu else {"depth": 4, "base_width": 32}
    shape = (1, 3, 64, 64) if cpu else (1, 3, 1024, 1024)
    ref_losses, ref_sd = _reference(model_args, shape, device)
    method = "spawn" if device.type == "cuda" else "forkserver"  # a forked child cannot use CUDA
    for name, (world, kw) in CONFIGS.items():
        if recs.left() < 30:
            recs.add("ranks", {"config": name, "skipped": "budget"})
            continue
        log(f"ranks: {name} ({world} ranks on {device})")
        row: dict[str, Any] = {"config": name, "world": world, "compile": kw, "model_args": model_args,
                               "input": list(shape), "reference_losses": ref_losses}
        t = time.perf_counter()
        try:
            res = run_workers(_worker, world, str(device), model_args, shape, {**kw, "spec": spec}, timeout_s=240,
                              start_method=method, env={"NOWDL_BACKEND": "gloo"})
            sd = res[0]["sd"]
            row.update(ok=True, losses=res[0]["losses"],
                       loss_diff=max(abs(a - b) for a, b in zip(res[0]["losses"], ref_losses, strict=True)),
                       weight_diff=max(float((sd[k].float() - ref_sd[k].float()).abs().max()) for k in ref_sd),
                       per_rank=[{k: r[k] for k in ("max_allocated", "predicted_peak", "staged_bytes", "wall_s")}
                                 for r in res], plan_config=res[0]["plan_config"])
            log(f"  -> loss diff {row['loss_diff']:.2e}, weight diff {row['weight_diff']:.2e}")
        except WorkerError as e:
            row.update(ok=False, error={str(r): f.strip()[-1500:] for r, f in sorted(e.failures.items())} or str(e)[:1500])
            log(f"  -> failed: {str(e)[:300]}")
        except Exception as e:  # noqa: BLE001
            row.update(ok=False, error=f"{type(e).__name__}: {e}"[:1500])
        row["wall_s"] = time.perf_counter() - t
        recs.add("ranks", row)


def nccl_section(recs: Records, device: torch.device) -> None:
    """A one-rank NCCL group on this GPU: init, all_reduce, barrier (NCCL refuses two ranks on one GPU)."""
    if device.type != "cuda" or not torch.distributed.is_nccl_available():
        recs.put("nccl", {"skipped": "no CUDA or no NCCL"})
        return
    res = run_workers(_nccl_worker, 1, str(device), timeout_s=120, start_method="spawn", init_group=False)
    recs.put("nccl", res[0])


def _nccl_worker(rank: int, world: int, device: str) -> dict[str, Any]:
    import torch.distributed as dist

    dev = torch.device(device)
    torch.cuda.set_device(dev)
    t = time.perf_counter()
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
    x = torch.ones(1 << 20, device=dev)
    dist.all_reduce(x)
    torch.cuda.synchronize(dev)
    out = {"ok": bool(x[0].item() == world), "init_and_allreduce_s": time.perf_counter() - t,
           "nccl_version": ".".join(map(str, torch.cuda.nccl.version())), "env": os.environ.get("NCCL_DEBUG")}
    dist.destroy_process_group()
    return out
