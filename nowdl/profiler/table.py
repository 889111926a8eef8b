"""The per-node table of a profile (`nowdl profile`): time, FLOPs and bytes."""

from __future__ import annotations

from typing import Any

from nowdl.units import format_bytes

__all__ = ["print_profile"]


def print_profile(prof: Any, top: int, sort: str) -> None:
    """Print ``nowdl profile``'s per-node table of ``prof``: the ``top`` nodes by ``sort``."""
    keyf = {
        "time": lambda n: n.fwd_s + n.bwd_s, "flops": lambda n: n.flops, "act": lambda n: n.act_bytes,
        "saved": lambda n: n.saved_bytes, "params": lambda n: n.param_bytes, "out": lambda n: n.out_bytes,
        "order": None,
    }[sort]
    nodes = list(prof.nodes)
    if keyf is not None:
        nodes.sort(key=keyf, reverse=True)
    if top:
        nodes = nodes[:top]
    print(f"profile ({prof.source} on {prof.device}, {prof.dtype}, {prof.optimizer}): {len(prof.nodes)} nodes, "
          f"input {prof.input_shapes}, made in {prof.wall_s:.2f} s")
    hdr = f"{'node':<28} {'target':<22} {'fwd':>9} {'bwd':>9} {'GFLOP':>9} {'out':>10} {'saved':>10} {'act':>10} {'params':>10}"
    print(hdr)
    print("-" * len(hdr))
    for n in nodes:
        print(f"{n.name[:28]:<28} {n.target.split('.')[-1][:22]:<22} {n.fwd_s * 1e3:>7.2f}ms {n.bwd_s * 1e3:>7.2f}ms "
              f"{n.flops / 1e9:>9.2f} {format_bytes(n.out_bytes):>10} {format_bytes(n.saved_bytes):>10} "
              f"{format_bytes(n.act_bytes):>10} {format_bytes(n.param_bytes):>10}")
    t = prof.totals()
    print("-" * len(hdr))
    print(f"{'total':<28} {'':<22} {t['fwd_s'] * 1e3:>7.2f}ms {t['bwd_s'] * 1e3:>7.2f}ms {t['flops'] / 1e9:>9.2f} "
          f"{'':>10} {format_bytes(t['saved_bytes']):>10} {format_bytes(t['act_bytes']):>10} {format_bytes(t['param_bytes']):>10}")
