"""Convs and pools on a fetched window, with the halo exchange overlapped by compute.

[Note: halo overlap] A tiled conv or pool (:func:`_window_op`) needs this rank's input
*window*: its tile plus halo slabs owned by the neighbours. With overlap on (the default)::

    forward:  post the halo isend/irecv
              window := my tile, ``fill`` where the halo goes          (no communication)
              y := op(window)        interior outputs are final; border outputs read ``fill``
              wait; copy the received slabs into the window
              y[border box] := op(window[box's input])   for each border box (a thin frame)

    backward: g_window := input gradient of the op (conv: ATen's convolution_backward)
              post the return of the halo slabs' gradients to their owners
              weight and bias gradients                                 (no communication)
              wait; add the returned gradients into my tile's gradient

A conv whose window is its tile zero-padded (as many outputs as on the tile padded by ``p``
on both sides, the window starting ``p`` before it: a stride-1 conv's ``k // 2`` halo, a
stride-2 conv on an even tile; :func:`_tile_pad`) builds no window at all::

    forward:  post the halo isend/irecv
              y := conv(my tile, zero padding)  interior final; border outputs read zeros
              wait; y[border box] := conv(thin window of the box's input)  for each border box

    backward: g_slab := input gradient of each received slab, from the outputs that read it
              post the return of the g_slabs to their owners                 (thin strips)
              input gradient of my tile and weight/bias gradients: ATen's backward of the
                  padded conv (weights: the halo read as zeros)          (no communication)
              weight gradient of the halo: the border boxes' outputs on halo-only windows
              wait; add the returned gradients into my tile's gradient

so the return overlaps the whole backward, and neither pass copies the tile into a window.

An output pixel is *interior* when every input it reads is in this rank's tile or outside
the image (padding): along each dim the outputs ``[j_lo, j_hi)`` whose input span lies in
the local part of the window. The border boxes cover the rest of the output tile (per dim,
the part below ``j_lo`` and above ``j_hi``, crossed with the interior ranges of the dims
before it and the full ranges after), and are recomputed on the complete window: every
output pixel is computed by the same op on the same inputs as without overlap, so the result
is exact (the weight gradient is summed in another order: equal up to rounding). The extra
compute is the border frame (one kernel extent deep) only. Pooling has no weight gradient:
its backward returns the halo gradients without overlap.

:func:`set_halo_overlap` (or ``NOWDL_HALO_OVERLAP=0`` in the environment) turns it off: the
exchange then completes before the op, as before (for benchmarks and debugging). Ranks may
differ in the setting: the messages are the same either way.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from nowdl.runtime.spatial import exchange as _ex
from nowdl.runtime.spatial.exchange import Window, _check_tile, _next_tag, _plan
from nowdl.runtime.spatial.precision import autocast_off, conv_operands
from nowdl.runtime.spatial.tiles import TileGrid

__all__ = ["set_halo_overlap", "halo_overlap", "border_boxes"]

Geom = tuple[Sequence[int], Sequence[int], Sequence[int]]
"""(kernel, stride, dilation) per spatial dim of an op run unpadded on its window."""
Box = list[tuple[int, int]]

_OVERLAP: list[bool | None] = [None]  # None: not set yet, NOWDL_HALO_OVERLAP decides at first use


def set_halo_overlap(on: bool) -> bool:
    """Overlap halo exchanges with compute (True, the default) or not; returns the old setting."""
    old = halo_overlap()
    _OVERLAP[0] = bool(on)
    return old


def halo_overlap() -> bool:
    """Whether tiled convs and pools overlap their halo exchange with compute (the environment
    is read at the first call, not at import: a process forked after importing nowdl still
    follows the variable it was given)."""
    on = _OVERLAP[0]
    if on is None:
        on = _OVERLAP[0] = os.environ.get("NOWDL_HALO_OVERLAP", "1").strip() not in ("0", "off", "false")
    return on


def border_boxes(grid: TileGrid, window: Window, geom: Geom) -> tuple[Box, list[Box]] | None:
    """The interior output box of this rank's tile and the border boxes around it.

    Boxes are per-dim ``[start, stop)`` in output-tile coordinates. None when no output pixel
    is interior (a tile narrower than the kernel): the op must then wait for the halo.
    """
    k, s, d = geom
    interior: Box = []
    out_shape: list[int] = []
    for i, ((t0, t1), (w0, w1)) in enumerate(zip(grid.tile_bounds(), window, strict=True)):
        ext = d[i] * (k[i] - 1) + 1
        n_out = (w1 - w0 - ext) // s[i] + 1
        a = max(w0 if t0 == 0 else t0, w0) - w0  # local part of the window: my tile or padding
        b = min(w1 if t1 == grid.shape[i] else t1, w1) - w0
        j_lo = min(n_out, max(0, -(-a // s[i])))
        j_hi = max(0, min(n_out, (b - ext) // s[i] + 1))
        if j_hi <= j_lo:
            return None
        interior.append((j_lo, j_hi))
        out_shape.append(n_out)
    boxes: list[Box] = []
    for i in range(len(interior)):
        for j0, j1 in ((0, interior[i][0]), (interior[i][1], out_shape[i])):
            if j1 > j0:
                box = [interior[m] if m < i else (0, out_shape[m]) for m in range(len(interior))]
                box[i] = (j0, j1)
                boxes.append(box)
    return interior, boxes


def _out_slices(box: Box) -> tuple[slice, ...]:
    return (slice(None), slice(None)) + tuple(slice(a, b) for a, b in box)


def _in_slices(box: Box, geom: Geom) -> tuple[slice, ...]:
    k, s, d = geom
    return (slice(None), slice(None)) + tuple(
        slice(a * s[i], (b - 1) * s[i] + d[i] * (k[i] - 1) + 1) for i, (a, b) in enumerate(box))


class _WindowOp(torch.autograd.Function):
    """``op(window)`` that saves only the tile and the received halo slabs, not the window.

    A conv or pool on the fetched window would save the window: a second copy of the tile (the
    op before usually saved the tile already) plus the halo. This function rebuilds the window
    in backward from what it saved (a copy, no communication). Convolutions then run ATen's
    ``convolution_backward`` on it (no recomputation); other ops are recomputed on the window
    (pooling: cheap). The exchange overlaps compute: [Note: halo overlap].
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: Tensor, weight: Tensor | None, bias: Tensor | None, grid: TileGrid,
        windows: tuple[Window, ...], group: dist.ProcessGroup | None, fill: float, tag: int,
        op: Callable[..., Tensor], conv: tuple[Any, ...] | None, geom: Geom | None,
    ) -> Tensor:
        plan = _plan(grid, windows)
        win = windows[grid.index]
        pending = _ex._post_exchange(x, grid, plan, group, tag)
        split = border_boxes(grid, win, geom) if halo_overlap() and plan[0] and geom is not None else None
        pad = _tile_pad(grid, win, geom) if split is not None and conv is not None and fill == 0.0 else None  # type: ignore[arg-type]
        if pad is not None:  # no window copy: the tile zero-padded is the window without its halo
            stride, dilation, groups = conv  # type: ignore[misc]
            assert weight is not None
            y = torch.convolution(x, weight, bias, list(stride), pad, list(dilation), False, [0] * len(pad), groups)
            pending.wait()
            for box in split[1]:  # type: ignore[index]
                y[_out_slices(box)] = op(_ex._sub_window(x, pending.bufs, grid, win, plan, fill, _span(box, geom)),
                                         weight, bias)
        elif split is not None:
            xw = _ex._local_window(x, grid, win, plan, fill)
            y = op(xw, weight, bias)  # interior final; the border is recomputed below
            pending.wait()
            _ex._put_received(xw, pending.bufs, win, plan)
            for box in split[1]:
                y[_out_slices(box)] = op(xw[_in_slices(box, geom)], weight, bias)  # type: ignore[arg-type]
        elif halo_overlap() and not plan[0]:  # nothing to receive: the sends overlap the op
            y = op(_ex._local_window(x, grid, win, plan, fill), weight, bias)
            pending.wait()
        else:
            pending.wait()
            y = op(_ex._assemble(x, pending.bufs, grid, win, plan, fill), weight, bias)
        bufs = pending.bufs
        del pending
        ctx.grid, ctx.window, ctx.group, ctx.tag, ctx.plan, ctx.fill = grid, win, group, tag, plan, fill
        ctx.op, ctx.conv, ctx.has_bias = op, conv, bias is not None
        ctx.pad, ctx.geom, ctx.border = pad, geom, (split[1] if split is not None else [])
        ctx.bias_shape = tuple(bias.shape) if bias is not None else None
        ctx.save_for_backward(x, weight, *bufs)
        return y

    @staticmethod
    def backward(ctx: Any, gy: Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        x, weight, *bufs = ctx.saved_tensors
        need = [bool(ctx.needs_input_grad[0]), bool(ctx.needs_input_grad[1]), bool(ctx.needs_input_grad[2])]
        if ctx.pad is not None:
            return (*_padded_backward(ctx, gy.contiguous(), x, weight, bufs, need),) + (None,) * 8
        xw = _ex._assemble(x, bufs, ctx.grid, ctx.window, ctx.plan, ctx.fill)
        gw = gb = None
        if ctx.conv is not None and halo_overlap() and need[0]:
            gy = gy.contiguous()
            (gxw, _, _) = _conv_backward(ctx, gy, xw, weight, [True, False, False])
            gx, pending = _ex._post_return(gxw, x.shape, ctx.grid, ctx.window, ctx.plan, ctx.group, ctx.tag + 1,
                                           own=True)
            del gxw
            if need[1] or need[2]:  # the weight gradient overlaps the halo gradients' return
                _, gw, gb = _conv_backward(ctx, gy, xw, weight, [False, need[1], need[2]])
            del xw
            return _ex._finish_return(gx, pending, ctx.grid), gw, gb, None, None, None, None, None, None, None, None
        if ctx.conv is not None:
            gxw, gw, gb = _conv_backward(ctx, gy.contiguous(), xw, weight, need)
        elif not need[0]:
            gxw = None
        else:
            with torch.enable_grad():
                xr = xw.detach().requires_grad_(True)
                (gxw,) = torch.autograd.grad(ctx.op(xr, weight, None), xr, gy)
        del xw
        # no input gradient (the input is data): every rank of the group skips the exchange alike
        gxt = None if gxw is None else _ex._return_grads(gxw, x.shape, ctx.grid, ctx.window, ctx.plan, ctx.group,
                                                         ctx.tag + 1, own=True)
        return gxt, gw, gb, None, None, None, None, None, None, None, None


def _conv_backward(ctx: Any, gy: Tensor, xw: Tensor, weight: Tensor, mask: list[bool],
                   pad: Sequence[int] | None = None, bias: bool = True) -> tuple[Any, Any, Any]:
    """ATen's convolution backward of the op on ``xw`` zero-padded by ``pad`` (None: unpadded)."""
    stride, dilation, groups = ctx.conv
    n = xw.dim() - 2
    out: tuple[Any, Any, Any] = torch.ops.aten.convolution_backward(
        gy, xw, weight, list(ctx.bias_shape) if ctx.has_bias and bias else None, list(stride),
        list(pad) if pad is not None else [0] * n, list(dilation), False, [0] * n, groups, mask)
    return out


def _tile_pad(grid: TileGrid, window: Window, geom: Geom) -> list[int] | None:
    """Per-dim zero padding ``p`` such that the conv on my tile padded by ``p`` on both sides
    computes exactly the outputs of my window: the window starts ``p`` before the tile and ends
    at most ``p`` after it, with as many outputs (a stride-1 conv's ``k // 2`` halo, a stride-2
    conv's ``(k - 1) // 2`` on an even tile); else None."""
    pads = []
    for (t0, t1), (w0, w1), k, s, d in zip(grid.tile_bounds(), window, *geom, strict=True):
        lo, hi, ext = t0 - w0, w1 - t1, d * (k - 1) + 1
        if lo < 0 or hi > lo or (t1 - t0 + 2 * lo - ext) // s != (w1 - w0 - ext) // s:
            return None
        pads.append(lo)
    return pads


def _span(box: Box, geom: Geom | None) -> list[tuple[int, int]]:
    """The input span (window coordinates) that the outputs ``box`` read."""
    return [(sl.start, sl.stop) for sl in _in_slices(box, geom)[2:]]  # type: ignore[arg-type]


def _halo_grad(ctx: Any, gy: Tensor, x: Tensor, weight: Tensor, box: Window) -> Tensor:
    """The input gradient over the received slab ``box`` (image coordinates), from the outputs
    that read it only (ATen's backward on that thin strip of ``gy``)."""
    k, s, d = ctx.geom
    js: list[slice] = []
    span: list[tuple[int, int]] = []
    out = gy.new_zeros(tuple(x.shape[:2]) + tuple(b - a for a, b in box))
    for i, ((b0, b1), (w0, _)) in enumerate(zip(box, ctx.window, strict=True)):
        ext = d[i] * (k[i] - 1) + 1
        j0, j1 = max(0, -(-(b0 - w0 - ext + 1) // s[i])), min(gy.shape[2 + i], (b1 - w0 - 1) // s[i] + 1)
        if j1 <= j0:
            return out  # no output reads this slab
        js.append(slice(j0, j1))
        span.append((w0 + j0 * s[i], w0 + (j1 - 1) * s[i] + ext))
    g = _conv_backward(ctx, gy[(slice(None), slice(None), *js)], x.new_empty(tuple(x.shape[:2]) + tuple(
        b - a for a, b in span)), weight, [True, False, False], bias=False)[0]
    part = _ex.intersect(box, tuple(span))
    if part is not None:
        out[_ex._rel(part, [a for a, _ in box])] = g[_ex._rel(part, [a for a, _ in span])]
    return out


def _padded_backward(ctx: Any, gy: Tensor, x: Tensor, weight: Tensor, bufs: list[Tensor],
                     need: list[bool]) -> tuple[Any, Any, Any]:
    """Backward of a conv computed on the zero-padded tile: the halo slabs' gradients first (thin),
    their return posted, then ATen's backward on the padded tile (input gradient of the tile,
    weight gradient without the halo) and the halo's part of the weight gradient from the border
    outputs, then wait and add what came back. No window is built."""
    pending = None
    if need[0]:  # the input is data: every rank of the group skips the exchange alike
        slabs = [_halo_grad(ctx, gy, x, weight, box) for _, box in ctx.plan[0]]
        pending = _ex._post_slabs(slabs, x, ctx.grid, ctx.plan, ctx.group, ctx.tag + 1)
    gx, gw, gb = _conv_backward(ctx, gy, x, weight, need, pad=ctx.pad)
    if need[1]:
        for box in ctx.border:  # only border outputs read the halo: add the halo's weight gradient
            xh = _ex._sub_window(x, bufs, ctx.grid, ctx.window, ctx.plan, 0.0, _span(box, ctx.geom), local=False)
            gw = gw + _conv_backward(ctx, gy[_out_slices(box)], xh, weight, [False, True, False], bias=False)[1]
    return (None if pending is None else _ex._finish_return(gx, pending, ctx.grid)), gw, gb


def _window_op(x_tile: Tensor, grid: TileGrid, windows: Sequence[Window], group: dist.ProcessGroup | None,
               op: Callable[..., Tensor], geom: Geom | None, *, weight: Tensor | None = None, bias: Tensor | None = None,
               fill: float = 0.0, conv: tuple[Any, ...] | None = None) -> Tensor:
    """``op(window, weight, bias)`` over this rank's fetched window, saving no window copy.

    ``op`` runs unpadded with the kernel, stride and dilation of ``geom`` (its window geometry,
    used to find the outputs that need no halo: [Note: halo overlap]; None: no overlap). A conv
    (``conv`` given) runs in the autocast dtype, anything else in ``x_tile``'s dtype (the caller
    casts it): [Note: tiles under autocast].
    """
    _check_tile(x_tile, grid, "window op")
    if conv is not None:
        x_tile, weight, bias = conv_operands(x_tile, weight, bias)
    with autocast_off(x_tile):
        out: Tensor = _WindowOp.apply(x_tile, weight, bias, grid, tuple(tuple(w) for w in windows), group,
                                      float(fill), _next_tag(grid), op, conv, geom)
    return out
