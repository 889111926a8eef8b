"""The distributed runtime: what runs a Plan on torch.distributed ranks.

* ``pipeline``: the engine that runs one rank's schedule, its transfers and gradient sync;
* ``spatial``: a stage run on image tiles with exact halo exchange and tile norms;
* ``data``: readers of large images, datasets, a DataLoader every rank agrees on, read-ahead;
* ``launch``: who am I, joining the process group, the job's nodes, one error report per job;
* ``training``: the trainer behind ``CompiledModel.train_step``, its state, checkpoints, metrics;
* ``predict``: whole images in exact windows on a plan, written as OME-Zarr, TIFF or NIfTI.

Nothing here is imported by ``import nowdl`` or by planning; it loads on the first train,
eval or run.
"""

__all__: list[str] = []
