"""Helpers shared by the tests (no tests here): importable as ``helpers.<module>`` from any test
folder (``pythonpath = ["tests"]`` in pyproject.toml).

- ``distributed``: ``run_workers``, a function on N local gloo processes, as torchrun would start.
- ``reference``: ``train_reference``, the one-process run that exactness tests compare against.
- ``exactness``: two small models, their data and optimizer, and ``compare`` (N ranks vs one).
- ``problems``: random partitioning problems and brute-force references for the solvers.
- ``profiler_models``: small models for the profiler tests.
- ``image_files``: a seeded image as TIFF, zarr and HDF5 files.
- ``run_cli``: ``nowdl run`` under torchrun and the losses it prints.
- ``monai_zoo``: the MONAI networks nowdl is checked against.
- ``multinode_worker``: one rank of a multi-node job, run as a script.
- ``dying_data``: a seeded Dataset whose rank SIGKILLs itself at a chosen read (restart tests).
- ``nan_data``: a seeded Dataset one of whose samples is NaN (non-finite steps).
"""

__all__: list[str] = []
