"""The Plan: a versioned, fingerprinted JSON description of how a model runs on N GPUs.

Written by the partitioner, read by codegen, the runtime, the pictures and the CLI. It holds
the stages and their nodes, every rank's role, the tensors crossing stages and the predicted
memory and time (docs/plan-format.md). ``topology`` describes the cluster a plan is made for
(GPUs per node, the links inside and between nodes) and checks a plan's rank -> node map.
"""

from typing import TYPE_CHECKING

from nowdl.lazy import lazy_exports

if TYPE_CHECKING:
    from nowdl.plan.plan import PLAN_VERSION, Plan, RankPlan, StagePlan, TensorPlan
    from nowdl.plan.purpose import is_inference, require_inference, require_training
    from nowdl.plan.topology import Topology

__all__ = ["Plan", "StagePlan", "TensorPlan", "RankPlan", "PLAN_VERSION", "Topology", "is_inference",
           "require_training", "require_inference"]

__getattr__ = lazy_exports(__name__, {
    "PLAN_VERSION": "plan", "Plan": "plan", "RankPlan": "plan", "StagePlan": "plan",
    "TensorPlan": "plan", "Topology": "topology", "is_inference": "purpose", "require_training": "purpose",
    "require_inference": "purpose",
})
