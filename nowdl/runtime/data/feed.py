"""What ``nowdl run --data`` feeds each step: the source, its checks, and the seconds spent waiting.

``--data`` kinds: ``synthetic``, ``imagefolder:PATH``, the large-image readers ``zarr:``,
``tiff:``, ``h5:``, ``geotiff:``, ... (seeded crops, masks from ``--labels``, per-band
``--normalize``: given, or ``auto`` from 16 crops), or ``package.module:callable``
returning a torch Dataset (``--data-args JSON``). Datasets load through
``nowdl.runtime.data.loader.loader`` (seeded, ``--workers`` processes); with a spatial plan the
large-image readers hand each rank a lazy batch, and a rank reads only the window it runs
(one step ahead, ``nowdl.runtime.data.prefetch``).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from typing import Any

import torch

from nowdl.errors import NowdlError
from nowdl.runtime.data.batches import ImageFolderData, SyntheticData
from nowdl.runtime.data.datasets import CropDataset, check_sample, dataset_from_callable, label_loss
from nowdl.runtime.data.keyed import KeyedDataset, parse_keys
from nowdl.runtime.data.loader import StepSampler, default_workers, loader
from nowdl.runtime.data.pixels import Normalize, parse_normalize
from nowdl.runtime.data.prefetch import TileReadAhead
from nowdl.runtime.data.readers import READERS, ReadCounter, is_reader_spec, open_images

__all__ = ["Feed", "make_feed", "check_data_spec", "label_loss"]

_FORMS = ("synthetic, imagefolder:PATH, zarr:PATH[:ARRAY], tiff:PATH[:level=N], h5:PATH:DATASET, geotiff:PATH or "
          "package.module:callable (returning a torch Dataset)")


def check_data_spec(spec: str) -> str:
    """The kind of a ``--data`` spec (``synthetic``, ``imagefolder``, a reader, or ``dataset``)."""
    kind, _, rest = spec.partition(":")
    if spec == "synthetic":
        return "synthetic"
    if kind == "imagefolder" and rest:
        return "imagefolder"
    if is_reader_spec(spec):
        return kind
    if rest and "." not in kind and kind not in ("synthetic", "imagefolder", *READERS) and rest.isidentifier():
        return "dataset"  # a top-level module: pkg:fn
    if rest and all(p.isidentifier() for p in kind.split(".")) and all(p.isidentifier() for p in rest.split(".")):
        return "dataset"
    raise NowdlError(f"--data {spec}: use {_FORMS}")


class Feed:
    """Global batches of ``nowdl run``, step by step, with the seconds the loop waited for each."""

    def __init__(self, kind: str, label: str, *, synthetic: SyntheticData | None = None, dataset: Any = None,
                 name: str = "", sample_shape: tuple[int, ...] = (), label_shape: tuple[int, ...] | None = None,
                 seed: int = 0, workers: int = 0, classes: int | None = None) -> None:
        self.kind, self.label, self.synthetic, self.dataset, self.name = kind, label, synthetic, dataset, name
        self.classes = classes  # labels are checked against it (None: not)
        self.sample_shape, self.label_shape, self.seed, self.workers = sample_shape, label_shape, seed, workers
        self.lazy = False
        #: per-band normalisation of a reader's crops (None: none), ``auto``: whether it was computed here
        self.normalize: Normalize | None = dataset.normalize if isinstance(dataset, CropDataset) else None
        self.auto = 0  # crops --normalize auto was computed from (0: given, or none)
        self._it: Iterator[Any] | None = None
        self._ahead: TileReadAhead | None = None
        self._held: tuple[int, Any, Any] | None = None
        self._batch = 0
        self._stop: int | None = None

    @property
    def counter(self) -> ReadCounter | None:
        """What this process read from image files (large-image readers read in this process only)."""
        return self.dataset.counter if isinstance(self.dataset, CropDataset) else None

    def read_seconds(self) -> float:
        """Seconds the loop has waited so far for lazy reads inside its steps (0: batches come whole)."""
        return self._ahead.blocked if self._ahead is not None else 0.0

    def start(self, step: int, batch: int, *, lazy: bool, stop: int | None = None) -> None:
        """Serve steps ``step, .., stop - 1`` of ``batch`` samples (lazy: TiledInput batches, read ahead)."""
        self._batch, self._stop = batch, stop
        self.lazy = lazy and isinstance(self.dataset, CropDataset)
        if self.dataset is None:
            return
        if self.lazy:
            self._ahead = TileReadAhead(self.dataset, StepSampler(len(self.dataset), batch, seed=self.seed), stop)
            return
        self._it = iter(loader(self.dataset, batch, seed=self.seed, workers=self.workers, start_step=step,
                               sample_shape=self.sample_shape, label_shape=self.label_shape, name=self.name,
                               classes=self.classes if self.label_shape is not None else None))

    def relayout(self, step: int, *, lazy: bool) -> None:
        """Serve from ``step`` on as :meth:`start` with ``lazy`` would (a re-planned run whose new plan
        has or lacks a spatial stage); nothing changes when the batches keep their kind."""
        if (lazy and isinstance(self.dataset, CropDataset)) != self.lazy:
            self.close()
            self._held = None
            self.start(step, self._batch, lazy=lazy, stop=self._stop)

    def next(self, step: int) -> tuple[Any, Any, float]:
        """``(x, y, seconds waited)`` of ``step`` (steps in order; the same step again is cached)."""
        if self._held is not None and self._held[0] == step:
            _, x, y = self._held
            return x, y, 0.0
        t0 = time.perf_counter()
        if self.synthetic is not None:
            x, y = self.synthetic.batch(step, self._batch)
        elif self._ahead is not None:
            x, y = self._ahead.batch(step)
        else:
            assert self._it is not None
            try:
                x, y = next(self._it)
            except Exception as e:  # a worker's error arrives with its traceback: keep its last line
                if isinstance(e, NowdlError) and "\n" not in str(e):
                    raise
                last = ([ln for ln in str(e).strip().splitlines() if ln.strip()][-1:] or [type(e).__name__])[0]
                if "NowdlError: " in last:
                    raise NowdlError(last.split("NowdlError: ", 1)[1].strip()) from None
                raise NowdlError(f"loading step {step + 1} from {self.name} failed: {last.strip()}") from None
        self._held = (step, x, y)
        return x, y, time.perf_counter() - t0

    def nonfinite_samples(self, step: int, x: Any) -> str:
        """'': the batch of ``step`` is finite; else which of its samples hold NaN or infinity, with
        their file and region where the data says so (``describe``), for a non-finite step's message."""
        if not isinstance(x, torch.Tensor) or bool(torch.isfinite(x).all()):
            return "; its input batch is finite"
        rows = [i for i in range(x.shape[0]) if not bool(torch.isfinite(x[i]).all())]
        describe = getattr(self.dataset, "describe", None)
        if self.dataset is not None and not self.lazy and self.synthetic is None:
            order = StepSampler(len(self.dataset), self._batch, seed=self.seed).indices(step)
            where = [f"sample {order[i]} of {self.name or 'the data'}" + (f" ({describe(order[i])})" if describe else "")
                     for i in rows[:3] if i < len(order)]
        else:
            where = [f"sample {i} of step {step + 1}'s batch" for i in rows[:3]]
        more = f" and {len(rows) - 3} more" if len(rows) > 3 else ""
        return f"; NaN or infinity in the input: {', '.join(where)}{more}"

    def close(self) -> None:
        """Stop the read-ahead thread (loader workers stop with their iterator)."""
        if self._ahead is not None:
            self._ahead.close()
        self._it = None


def make_feed(args: argparse.Namespace, sample_shape: tuple[int, ...], out: tuple[int, ...], model_name: str) -> Feed:
    """The data source of ``args.data`` for a model whose output is ``out``; checks it before any step.

    Raises:
        NowdlError: the data does not exist or does not fit the model (names the file or sample and the fix).
    """
    spec = str(args.data)
    kind = check_data_spec(spec)
    channels, label_shape = out[1], tuple(out[2:])
    workers = default_workers() if getattr(args, "workers", None) is None else int(args.workers)
    if workers < 0:
        raise NowdlError(f"--workers must be >= 0, got {workers}")
    labels = getattr(args, "labels", None)
    if labels is not None and kind not in READERS:
        raise NowdlError(f"--labels goes with --data zarr:, tiff: or h5: (masks of the same layout), not --data {spec}")
    norm = parse_normalize(getattr(args, "normalize", None))
    if norm is not None and kind not in READERS:
        raise NowdlError(f"--normalize goes with the large-image readers (--data zarr:, tiff:, h5:, geotiff:, ...), not "
                         f"--data {spec}: normalise inside your Dataset or transforms")
    if getattr(args, "data_args", None) is not None and kind != "dataset":
        raise NowdlError("--data-args goes with --data package.module:callable (the callable's keyword arguments)")
    common = dict(sample_shape=sample_shape, seed=args.seed, workers=workers)
    if kind == "synthetic":
        classes = args.num_classes if args.num_classes is not None else channels
        if classes > channels:
            raise NowdlError(f"--num-classes {classes} but {model_name} outputs {channels} classes: build it with more "
                             f"(--model-args '{{\"num_classes\": {classes}}}')")
        return Feed(kind, kind, synthetic=SyntheticData(sample_shape, label_shape, classes, seed=args.seed), **common)
    if kind == "imagefolder":
        path = spec.partition(":")[2]
        folder = ImageFolderData(path, sample_shape, seed=args.seed)
        if label_shape and not args.eval:
            raise NowdlError(f"{model_name} has dense outputs {out} (segmentation) but imagefolder gives one label per "
                             "image: train it with --data synthetic, a reader with --labels, or use --eval")
        if len(folder.classes) > channels:
            raise NowdlError(f"{path} has {len(folder.classes)} classes but {model_name} outputs {channels}: build it "
                             f"with num_classes={len(folder.classes)} (--model-args / --num-classes)")
        return Feed(kind, kind, dataset=folder, name=f"imagefolder:{path}", label_shape=(), **common)
    if getattr(args, "keys", None) and kind != "dataset":
        raise NowdlError(f"--keys goes with --data package.module:callable returning dictionary samples, not --data {spec}")
    if kind == "dataset":
        ds = dataset_from_callable(spec, args.data_args)
        if getattr(args, "keys", None):  # MONAI dictionary samples
            ds = KeyedDataset(ds, parse_keys(args.keys), f"--data {spec}")
        want = None if args.eval else label_shape
        try:
            first = ds[0]
        except Exception as e:
            raise NowdlError(f"sample 0 of --data {spec} failed to load: {type(e).__name__}: {e}") from None
        check_sample(first, 0, f"--data {spec}", sample_shape, want, None if args.eval else channels)
        return Feed(kind, spec, dataset=ds, name=f"--data {spec}", label_shape=want, classes=channels, **common)
    if not label_shape and not args.eval:
        raise NowdlError(f"--data {spec} gives per-pixel labels (--labels) but {model_name} is a classifier with "
                         f"outputs {out}: use imagefolder or a Dataset (--data package.module:callable)")
    if label_shape and label_shape != sample_shape[1:] and not args.eval:
        raise NowdlError(f"{model_name} outputs {'x'.join(map(str, label_shape))} maps for "
                         f"{'x'.join(map(str, sample_shape[1:]))} inputs: --labels masks need outputs of the input's size")
    if labels is None and not args.eval:
        raise NowdlError(f"--data {spec}: training needs masks: --labels {kind}:MASK (same layout and shape as the "
                         "image), or run --eval")
    images = open_images(spec, sample_shape[0], len(sample_shape) - 1)
    masks = None if labels is None else open_images(labels, 1, len(sample_shape) - 1, label=True,
                                                   stacked=any(im.index is not None for im in images))
    ds = CropDataset(images, masks, sample_shape, seed=args.seed, normalize=norm if isinstance(norm, Normalize) else None)
    if norm == "auto":
        ds.normalize = ds.band_stats()
    feed = Feed(kind, f"{kind} ({len(images)} image{'s' if len(images) > 1 else ''}, {len(ds)} crops/epoch)",
                dataset=ds, name=spec, label_shape=None if args.eval else label_shape, classes=channels, **common)
    feed.auto = min(16, len(ds)) if norm == "auto" else 0
    return feed
