"""The min-max DP over a chain of stages, shared by the exact DPs, the MASTER pairing and the
MILP: ``chain_dp`` holds the chain costs protocol, the DP, the lexicographic levels and the rule
that every stage gets work.
"""

from typing import TYPE_CHECKING

from nowdl.lazy import lazy_exports

if TYPE_CHECKING:
    from nowdl.partitioner.chain.chain_dp import ChainCosts, lexicographic, minmax_path, spread_ok

__all__ = ["ChainCosts", "minmax_path", "lexicographic", "spread_ok"]

__getattr__ = lazy_exports(__name__, {"ChainCosts": "chain_dp", "minmax_path": "chain_dp", "lexicographic": "chain_dp",
                                      "spread_ok": "chain_dp"})
