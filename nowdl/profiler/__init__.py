"""The profiler: per-node cost of a traced graph, measured on real tensors or estimated on fake ones.

:func:`profile` walks the graph node by node (``runner``) under a backend: ``measure`` times
real tensors on a device, ``estimate`` runs fake tensors and times them with a roofline on a
:class:`DeviceSpec`. Each node's memory (saved tensors, workspace, parameters) and FLOPs go into a
:class:`Profile`, cached on disk. ``calibrate`` measures a device's links and compute as a
DeviceSpec; ``topology`` describes a cluster's nodes and links.
"""

from typing import TYPE_CHECKING

from nowdl.lazy import lazy_exports

if TYPE_CHECKING:
    from nowdl.profiler.cost import NodeCost, Profile
    from nowdl.profiler.devices import BUILTIN_SPECS, DeviceSpec, get_device_spec
    from nowdl.profiler.flops import count_flops
    from nowdl.profiler.profile_graph import MODES, OPTIMIZERS, PRECISIONS, check_precision, profile

__all__ = [
    "profile",
    "NodeCost",
    "Profile",
    "DeviceSpec",
    "BUILTIN_SPECS",
    "get_device_spec",
    "count_flops",
    "MODES",
    "OPTIMIZERS",
    "PRECISIONS",
    "check_precision",
]

__getattr__ = lazy_exports(__name__, {
    "NodeCost": "cost", "Profile": "cost", "BUILTIN_SPECS": "devices", "DeviceSpec": "devices",
    "get_device_spec": "devices", "count_flops": "flops", "MODES": "profile_graph",
    "OPTIMIZERS": "profile_graph", "PRECISIONS": "profile_graph",
    "check_precision": "profile_graph", "profile": "profile_graph",
})
