"""Launching: who am I, how many are we, joining the process group, and failing as one job.

``launcher`` reads torchrun/srun/mpirun's environment (rank, world, node layout); ``group``
joins; ``attempt`` keeps each restart's rendezvous keys apart; ``group_exit`` ends a rank (the
group destroyed at exit, a job's rank gone before finalization); ``nodes`` checks the job's
nodes against the plan; ``failure`` reports the first failing rank's error once and watches
every rank's beat; ``where`` records the step and action in flight; ``lost`` names the rank a
failed exchange lost; ``comm`` is where every tensor crosses ranks (host staging where gloo
meets CUDA tensors); ``faults`` holds the named kill points of the fault-injection tests.
"""

from typing import TYPE_CHECKING

from nowdl.lazy import lazy_exports

if TYPE_CHECKING:
    from nowdl.runtime.launch.group import (
        LaunchEnv,
        PeerError,
        default_backend,
        init_distributed,
        launch_env,
        wait,
    )

__all__ = ["LaunchEnv", "PeerError", "launch_env", "default_backend", "init_distributed", "wait"]

__getattr__ = lazy_exports(__name__, {
    "LaunchEnv": "group", "PeerError": "group", "default_backend": "group",
    "init_distributed": "group", "launch_env": "group", "wait": "group",
})
