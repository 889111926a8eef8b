"""Drop computations whose result nothing uses (dead code) from a traced graph.

A model may compute outputs it then throws away: MONAI's ``BasicUNetPlusPlus`` runs its three
deep-supervision heads and returns only the last one unless ``deep_supervision=True``. Such
nodes cost memory and time in every stage that holds them, and, when torch.export leaves them as
bare ATen calls, they stop a fully convolutional network from running on image tiles. Only nodes
whose removal cannot change the model's results or state are dropped: pure functions (no
in-place writes, no random numbers, see ``torch.fx.Node.is_impure``), tensor methods that are
not in-place, and standard ``torch.nn`` modules that hold no buffers (a BatchNorm still updates
its running statistics) and draw no random numbers (dropout).
"""

from __future__ import annotations

import logging

import torch.fx as fx
from torch import nn

from nowdl.trace.exported import is_standard_leaf

__all__ = ["drop_dead_code"]

log = logging.getLogger(__name__)


def _removable(gm: fx.GraphModule, n: fx.Node) -> bool:
    if n.users or n.op in ("placeholder", "output"):
        return False
    if n.op == "get_attr":
        return True
    if n.op == "call_function":
        name = getattr(n.target, "__name__", "")
        return not name.endswith("_") and not n.is_impure(impure_random=True)
    if n.op == "call_method":
        return not str(n.target).endswith("_")
    if n.op == "call_module":
        mod = gm.get_submodule(str(n.target))
        random = isinstance(mod, (nn.modules.dropout._DropoutNd, nn.AlphaDropout, nn.FeatureAlphaDropout))
        return is_standard_leaf(mod) and not random and next(mod.buffers(), None) is None
    return False


def drop_dead_code(gm: fx.GraphModule) -> list[str]:
    """Erase the nodes of ``gm`` whose results are unused and whose removal changes nothing
    else (see the module docstring), repeatedly, last node first; recompile when any went.

    Returns:
        The names of the erased nodes, in graph order.
    """
    dropped: list[str] = []
    for n in reversed(list(gm.graph.nodes)):
        if _removable(gm, n):
            dropped.append(n.name)
            gm.graph.erase_node(n)
    if dropped:
        gm.recompile()
        log.info("dropped %d unused nodes: %s", len(dropped), ", ".join(reversed(dropped[-8:])))
    return dropped[::-1]
