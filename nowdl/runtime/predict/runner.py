"""Predict whole images on a plan: stream windows, run the exact spatially parallel forward, write.

[Note: predict runner] Every rank runs :func:`predict_images` with the same arguments. Per
image it lays out windows (``windows.layout_windows``: one window when the image fits the
window size), gets a plan for the window shape through :func:`plan_for` (the one place predict
asks for a plan: an inference plan, ``cm.plan(x, train=False)``; a plan file given to predict
must be one), and runs each window as a batch of one through the engine built for that plan
(``Trainer._eval_engine``, forward only, as ``cm.evaluate`` runs): the
window is a :class:`~nowdl.runtime.spatial.tiles.TiledInput`, so each rank of a spatial first
stage reads only its tile (the halo comes from its neighbours). The ranks of the last stage
each get the window's output and write their share of its exact core, whole chunks each
(``writers``) on a background thread while the next window computes; before the next window's
writes start, the ranks agree that this window's are done (an error on any rank, such as a full
disk, stops every rank; [Note: predict writes] in ``agreement``). The pyramid levels are built in
parallel, rank 0 converts to TIFF or NIfTI, and the temporary output is renamed to OUT. A window's pixels are the model's input by
[Note: input values] (``pixels``); a georeferenced source's grid and nodata go into the output
([Note: georeferenced outputs] in ``georef``).
"""

from __future__ import annotations

import dataclasses
import functools
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nowdl.errors import NowdlError
from nowdl.plan.plan import Plan
from nowdl.runtime.data.pixels import Normalize, pixels
from nowdl.runtime.data.readers import ImageArray
from nowdl.runtime.launch import faults
from nowdl.runtime.pipeline.engine import PipelineEngine
from nowdl.runtime.predict.agreement import Writes, guard, rank_world
from nowdl.runtime.predict.memory import WindowGuard, with_gpu_memory
from nowdl.runtime.predict.passes import CachedInputs, gather_statistics
from nowdl.runtime.predict.shares import chunk_share, tile_piece, window_piece
from nowdl.runtime.predict.summary import PredictSummary
from nowdl.runtime.predict.windows import Reach, Window, cached_reach, layout_windows
from nowdl.runtime.predict.writers import (
    LevelStore,
    build_level,
    discard,
    ngff_attributes,
    pyramid_shapes,
)
from nowdl.runtime.spatial.tiles import TiledInput, TileGrid
from nowdl.runtime.training.evaluate import copy_state
from nowdl.runtime.training.plan_share import plan_on_rank0
from nowdl.runtime.training.trainer import Trainer

__all__ = ["plan_for", "predict_images", "discard_targets", "OUTPUTS", "Target"]

OUTPUTS = ("logits", "probabilities", "argmax")


def plan_for(cm: Any, example: torch.Tensor) -> Plan:
    """The inference plan predict runs for one window shaped like ``example`` (batch 1):
    ``cm.plan(example, train=False)``, which counts the forward's live activations and no
    gradients, optimizer state or saved activations. PlanError: the model was compiled from a
    plan file that is a training plan (or for another model or shape)."""
    req = getattr(cm, "request", None)
    if req is not None and req.global_batch is None:
        cm.request = dataclasses.replace(req, global_batch=int(example.shape[0]))
    return cm.plan(example, train=False, single=True)  # one window per step, whatever compile() pinned


class _Planner:
    """What :class:`Trainer` needs of a compiled model, with plans from :func:`plan_for`."""

    def __init__(self, cm: Any) -> None:
        self.cm = cm
        self.model, self.plan_path, self.request = cm.model, cm.plan_path, None
        self.precision, self.device = cm.precision, cm.device
        self.activation_checkpointing: bool | list[int] = False
        self.charged: Any = None  # after a re-plan for memory: ``cm`` planning for less ([Note: re-plan on memory])

    def trace(self, *example_inputs: torch.Tensor) -> Any:
        return self.cm.trace(*example_inputs)

    def plan(self, *example_inputs: torch.Tensor, target: Any = None) -> Plan:
        return plan_for(self.charged or self.cm, example_inputs[0])

    def inference_plan(self, *example_inputs: torch.Tensor) -> Plan:
        return self.plan(*example_inputs)


class _WindowRunner(Trainer):
    """A trainer without optimizer that runs windows on an inference plan's engine; its loss
    function hands each window's output (whole, on every rank of the last stage) to predict."""

    optimizer = None

    def __init__(self, cm: Any, timeout_s: float, backend: str | None,
                 weights: dict[str, torch.Tensor] | None = None) -> None:
        self.weights = weights
        self.group: Any = None  # the process group it was built in
        self.outputs: list[torch.Tensor] = []
        self.grid: tuple[TileGrid, Any] | None = None  # the output's tile grid and group, when kept as a tile
        self.planner = _Planner(cm)
        super().__init__(self.planner, loss_fn=self._keep, timeout_s=timeout_s, backend=backend)

    def _keep(self, out: Any, _y: Any) -> torch.Tensor:
        from torch.utils._pytree import tree_leaves

        t = next(v for v in tree_leaves(out) if isinstance(v, torch.Tensor))
        self.grid = (self.engine.runner.kept_tiles or {}).get(id(t)) if self.engine is not None else None
        self.outputs.append(t.detach())
        return t.new_zeros(()).float()

    def run_window(self, x: TiledInput, measure: bool) -> tuple[torch.Tensor | None, int | None]:
        """The window's output on the ranks of the last stage (None elsewhere; this rank's tile of it when
        ``self.grid`` is set), and this rank's peak bytes."""
        eng = self._window_engine(x)
        eng.runner.kept_tiles = {}
        self.outputs, self.grid = [], None
        y = torch.zeros(1)
        peak = None
        if eng.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(eng.device)
            eng.run(x, y, train=False)
            peak = int(torch.cuda.max_memory_allocated(eng.device))
        elif measure:
            from nowdl.runtime.training.metrics import peak_of

            _, peak = peak_of(lambda: eng.run(x, y, train=False), [eng.stages[s].module for _, s in eng.held], None)
        else:
            eng.run(x, y, train=False)
        return (self.outputs[0] if self.outputs else None), peak

    def _window_engine(self, x: TiledInput) -> PipelineEngine:
        """The engine of the inference plan for windows shaped like ``x`` (rank 0 plans, every rank builds
        its stages once)."""
        if self.engine is not None:
            return self.engine
        self.join_group()
        example = x.meta()
        plan = plan_on_rank0(lambda: self.cm.plan(example), rank=self.rank, world=self.world)
        if plan.config["gpus"] != self.world:
            raise NowdlError(f"the inference plan for windows of {'x'.join(map(str, x.shape[2:]))} pixels needs "
                             f"{plan.config['gpus']} ranks but the job has {self.world}: launch with torchrun "
                             f"--nproc-per-node {plan.config['gpus']} (or compile with gpus={self.world})")
        self.plan = plan
        self.engine = self._eval_engine(plan, (example,))
        copy_state(self.engine, self.weights)  # weights trained or loaded in this process since compile()
        return self.engine

    def replan(self, gpu_memory: int, x: TiledInput) -> None:
        """Plan windows like ``x`` again for ``gpu_memory`` bytes per GPU and build that engine
        (collective); the old engine's stages go back to the host."""
        if self.engine is not None:
            for _, s in self.engine.held:
                self.engine.stages[s].module.to("cpu")
        self.engine = self.plan = None
        self.planner.charged = with_gpu_memory(self.planner.cm, gpu_memory)
        self._window_engine(x)

    def writer_share(self) -> tuple[int, int]:
        """(this rank's index among the ranks that write each window, how many write)."""
        eng = self._require()
        last = len(eng.plan.stages) - 1
        for rep, s in eng.held:
            if s == last:
                return eng.part[(rep, s)], eng.parts[s]
        return 0, 1


@dataclasses.dataclass
class Target:
    """Where one image's prediction goes: the work store, and the file converted from it (or None)."""

    work: Path
    kind: str  # zarr, tiff, nifti
    name: str = ""  # the output's final name (OME-Zarr multiscales name)
    file: Path | None = None
    affine: np.ndarray | None = None
    spacing: tuple[float, ...] | None = None
    geo: Any = None  # the source's GeoRef (a geotiff: source)
    nodata: bool = False  # mask the outputs of nodata inputs (the source declares a nodata value)
    grid: Any = None  # the output's GeoRef (geo at the output's resolution), set when the store is made
    fill: float | None = None  # the output's nodata value (with ``nodata``)


def _finish(out: torch.Tensor, output: str) -> np.ndarray:
    out = out.float()
    if output == "argmax":
        labels = out.argmax(dim=0, keepdim=True) if out.shape[0] > 1 else (out > 0).long()
        return labels.numpy().astype(np.uint8 if out.shape[0] <= 255 else np.int32)  # 255: nodata (georef)
    if output == "probabilities":
        out = out.softmax(dim=0) if out.shape[0] > 1 else out.sigmoid()
    return out.numpy()


def _create_store(target: Target, spatial: Sequence[int], reach: Reach, output: str, rank: int) -> int:
    """Rank 0 creates the work store's levels (collective); returns how many levels it has."""
    from nowdl.runtime.predict.georef import output_nodata, zarr_geo_attributes

    out_sp = tuple(s // f for s, f in zip(spatial, reach.scale, strict=True))
    levels = pyramid_shapes(out_sp) if target.kind != "nifti" else [out_sp]
    channels = 1 if output == "argmax" else reach.out_channels
    dtype = np.float32 if output != "argmax" else np.uint8 if reach.out_channels <= 255 else np.int32
    attrs = ngff_attributes(target.name or target.work.name, len(levels), len(out_sp), target.spacing)
    geo = None if target.geo is None else target.geo.scaled(reach.scale)
    fill = output_nodata(output, reach.out_channels) if target.nodata else 0
    target.grid, target.fill = geo, fill if target.nodata else None
    if geo is not None:
        attrs.update(zarr_geo_attributes(geo, out_sp, 0))

    def create() -> None:
        if rank == 0:
            for k, sp in enumerate(levels):
                more = None if geo is None else zarr_geo_attributes(geo, out_sp, k)
                LevelStore.create(target.work, k, (channels, *sp), dtype, attrs if k == 0 else None, fill=fill,
                                  array_attributes=more)

    guard(create, str(target.work))
    return len(levels)


def _write_share(store: LevelStore, share: tuple[tuple[int, int], ...] | None, piece: torch.Tensor | None,
                 output: str, mask: Callable[[Any, np.ndarray], np.ndarray] | None = None) -> None:
    """Write ``piece`` (from :func:`window_piece`) at ``share`` (``mask``: nodata inputs' outputs masked)."""
    if piece is not None and share is not None:
        values = _finish(piece, output)
        store.write(share, values if mask is None else mask(share, values))
        faults.point("predict.write")


def _image_input(image: ImageArray, win: Window, normalize: Normalize | None = None) -> TiledInput:
    def read(idx: tuple[slice, ...]) -> torch.Tensor:
        region = [(lo + s.start, lo + s.stop) for (lo, _), s in zip(win.read, idx[2:], strict=True)]
        return pixels(image.read(region), image.nodata, normalize)[None][:, idx[1]]

    return TiledInput((1, image.shape[0], *(b - a for a, b in win.read)), read)


def predict_images(cm: Any, images: Sequence[ImageArray], targets: Sequence[Target], *, output: str = "logits",
                   window: Sequence[int] | None = None, on_window: Callable[[int, int], None] | None = None,
                   timeout_s: float = 300.0, backend: str | None = None, measure_memory: bool = True,
                   weights: dict[str, torch.Tensor] | None = None, normalize: Normalize | None = None
                   ) -> PredictSummary:
    """Predict every image into its target work store (collective: every rank calls it alike).

    Args:
        cm: the compiled model (``nowdl.CompiledModel``), weights loaded.
        images: the inputs, ``(C, *spatial)`` each.
        targets: one per image; rank 0 writes the work stores' metadata, every rank its share.
        output: ``logits``, ``probabilities`` (softmax over classes; sigmoid for one) or ``argmax``.
        window: the window size per spatial dim (default: the plan's input, else the whole image up
            to 2048 pixels per dim in 2D and 128 in 3D).
        on_window: called with (windows done, windows in all) after each window.
        measure_memory: measure the peak memory (on CPU by tracking allocations, which slows the
            first two windows of each image several times over; CUDA's counter costs nothing).
        weights: the whole model's state (original names) to run instead of the model's own, as
            ``Trainer.full_state`` gives it after training in this process.
        normalize: the per-band normalisation the model was trained with (None: none).

    Raises:
        NowdlError: a window too small for the receptive field, an image the network's stride
            does not divide, a failed write (every rank raises the same message).
    """
    if output not in OUTPUTS:
        raise NowdlError(f"--output {output!r}: use one of {', '.join(OUTPUTS)}")
    rank, world = rank_world()
    summary = PredictSummary(world=world)
    layouts: list[tuple[list[Window], Reach, tuple[int, ...]]] = []
    for image in images:
        win = _window_shape(cm, image, window)
        reach = _reach(cm, image.shape[0], win)
        layouts.append((layout_windows(image.spatial, win, reach), reach, win))
    total = sum(len(w) * (1 + (r.passes if len(w) > 1 else 0)) for w, r, _ in layouts)
    done, t0 = 0, time.perf_counter()
    writes, watcher = Writes(), WindowGuard(rank, world)

    def tick() -> None:
        nonlocal done
        done += 1
        if on_window is not None:
            on_window(done, total)

    try:
        for image, target, (wins, reach, win) in zip(images, targets, layouts, strict=True):
            levels = _create_store(target, image.spatial, reach, output, rank)
            store = LevelStore(target.work, 0)
            mask = None
            if target.nodata:
                from nowdl.runtime.predict.georef import NodataMask, output_nodata

                mask = NodataMask(image, reach.scale, output_nodata(output, reach.out_channels))
            runner = _runner_for(cm, win, timeout_s, backend, weights, watcher.gpu_memory)
            read = CachedInputs(functools.partial(_image_input, image, normalize=normalize))
            passes = gather_statistics(runner, image.spatial, wins, reach, read, tick)  # [Note: statistics passes]
            for i, w in enumerate(wins):
                watch = measure_memory and watcher.watching(runner)  # [Note: re-plan on memory]
                out, peak = runner.run_window(read(w),
                                              measure=measure_memory and i < 2 or watch)
                summary.add_peak(peak)
                core_out = tuple((a // f, b // f) for (a, b), f in zip(w.core, reach.scale, strict=True))
                share, piece = tile_piece(runner.grid, out, core_out, store.chunks[1:], w, reach.scale)
                if share is None and piece is None:  # the tiles do not end on whole chunks: gather them
                    if out is not None and runner.grid is not None:
                        out = runner.grid[0].gather(out, runner.grid[1])
                    part, parts = runner.writer_share()
                    share = chunk_share(core_out, store.chunks[1:], part, parts) if out is not None else None
                    piece = window_piece(share, out, w, reach.scale)
                writes.submit(functools.partial(_write_share, store, share, piece, output, mask), str(target.work))
                tick()
                if watch and peak is not None and i + 1 < len(wins) and watcher.check(
                        runner, peak, done, _image_input(image, wins[i + 1], normalize)):
                    summary.peak = None  # the summary reports the new plan's peaks
                    # the new plan's engine gathers the image's statistics again before it writes on
                    passes = gather_statistics(runner, image.spatial, wins, reach, read) or passes
            writes.wait()
            for k in range(1, levels):
                guard(functools.partial(build_level, target.work, k, output == "argmax", rank, world), str(target.work))
            summary.add_image(image.spatial, len(wins), reach, runner.plan, rank, passes)
    finally:
        writes.close()
    summary.seconds, summary.notes = time.perf_counter() - t0, watcher.notes
    summary.gather()
    return summary


_REACH: weakref.WeakKeyDictionary[Any, dict[tuple[int, ...], Reach]] = weakref.WeakKeyDictionary()
_RUNNERS: weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], _WindowRunner]] = weakref.WeakKeyDictionary()


def _runner_for(cm: Any, win: tuple[int, ...], timeout_s: float, backend: str | None,
                weights: dict[str, torch.Tensor] | None, gpu_memory: int | None = None) -> _WindowRunner:
    """The window runner of ``cm`` for windows of ``win`` pixels, kept across predict calls in the
    same process group (its engine's stages run the model's own parameters, so weights loaded into
    the model in place reach it); ``weights`` (trained in this process) are copied in each call."""
    import torch.distributed as dist

    group = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    cache = _RUNNERS.setdefault(cm, {})
    key = (win, timeout_s, backend)
    runner = cache.get(key)
    if runner is None or runner.group is not group:
        runner = cache[key] = _WindowRunner(cm, timeout_s, backend, weights)
        runner.group = group
    if gpu_memory is not None and runner.planner.charged is None and runner.engine is None:  # re-planned for memory
        runner.planner.charged = with_gpu_memory(cm, gpu_memory)
    elif weights is not None:
        runner.weights = weights
        if runner.engine is not None:
            copy_state(runner.engine, weights)
    return runner


def _reach(cm: Any, channels: int, win: tuple[int, ...]) -> Reach:
    """The network's reach for windows of ``win`` pixels, once per compiled model and shape (on disk too)."""
    cache = _REACH.setdefault(cm, {})
    key = (channels, *win)
    if key not in cache:
        example = torch.empty((1, channels, *win), device="meta")
        cache[key] = cached_reach(cm.trace(example).gm, example, getattr(getattr(cm, "options", None), "cache", False))
    return cache[key]


def _window_shape(cm: Any, image: ImageArray, window: Sequence[int] | None) -> tuple[int, ...]:
    sp = image.spatial
    if getattr(cm, "plan_path", None) is not None:
        plan = Plan.load(cm.plan_path)
        c = plan.config
        per = int(plan.model["inputs"][0][0]) * int(c["micro_batches"]) * int(c["replicas"]) * int(c["dp"])
        if per != 1:
            raise NowdlError(f"the plan {cm.plan_path} takes {per} samples per step (micro-batch "
                             f"{plan.model['inputs'][0][0]} x micro_batches {c['micro_batches']} x replicas "
                             f"{c['replicas']} x dp {c['dp']}) but predict runs one window per step: re-plan with "
                             "--micro-batches 1 --replicas 1 --dp 1 and a batch of 1, or give MODEL by name (predict "
                             "then plans for the window)")
        planned = tuple(int(s) for s in plan.model["inputs"][0][2:])
        if len(planned) != len(sp) or any(p > s for p, s in zip(planned, sp, strict=True)):
            raise NowdlError(f"the plan {cm.plan_path} is for windows of {'x'.join(map(str, planned))} pixels but "
                             f"{image.path} is {'x'.join(map(str, sp))}: re-plan for a window that fits the image "
                             f"(nowdl plan MODEL --input 1x{image.shape[0]}x{'x'.join(map(str, sp))})")
        return planned
    if window is None:
        cap = 2048 if len(sp) <= 2 else 128
        return tuple(min(s, cap) for s in sp)
    if len(window) == 1:
        window = tuple(window) * len(sp)
    if len(window) != len(sp):
        raise NowdlError(f"--window {'x'.join(map(str, window))} has {len(window)} dims but {image.path} has "
                         f"{len(sp)} spatial dims")
    return tuple(min(int(w), s) for w, s in zip(window, sp, strict=True))


def discard_targets(targets: Sequence[Target]) -> None:
    """Remove every target's work store and file (after a failure)."""
    for t in targets:
        discard(t.work)
        if t.file is not None:
            discard(t.file)
