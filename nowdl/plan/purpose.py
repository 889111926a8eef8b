"""What a plan is for: training (the default) or inference (``config["inference"]: true``).

An inference plan counts no gradients, optimizer state or saved activations and its schedule
has no backward ([Note: inference memory] in partitioner/costs/inference.py), so it cannot
train; a training plan runs inference correctly but holds memory inference does not need.
"""

from __future__ import annotations

from nowdl.errors import PlanError
from nowdl.plan.plan import Plan

__all__ = ["is_inference", "require_training", "require_inference"]


def is_inference(plan: Plan) -> bool:
    """Whether ``plan`` was made for inference (``nowdl plan --inference``, ``cm.plan(x, train=False)``)."""
    return bool(plan.config.get("inference", False))


def require_training(plan: Plan, source: str = "the plan") -> None:
    """Refuse an inference plan where training needs one.

    Raises:
        PlanError: ``plan`` is an inference plan.
    """
    if is_inference(plan):
        raise PlanError(
            f"{source} is an inference plan (config.inference: true, {plan.config.get('gpus')} GPUs, schedule "
            f"{plan.config.get('schedule')!r}): it counts no gradients, optimizer state or saved activations and has "
            "no backward, so it cannot train. Plan for training (nowdl plan without --inference, or "
            "cm.plan(x, train=True)) and train on that plan")


def require_inference(plan: Plan, source: str = "the plan") -> None:
    """Refuse a training plan where an inference plan is needed (``nowdl predict``).

    Raises:
        PlanError: ``plan`` is a training plan.
    """
    if not is_inference(plan):
        raise PlanError(
            f"{source} is a training plan ({plan.config.get('gpus')} GPUs, schedule {plan.config.get('schedule')!r}): "
            "its memory figures count gradients, optimizer state and saved activations that inference does not hold. "
            "Make an inference plan (nowdl plan MODEL --inference ..., or cm.plan(x, train=False)) and pass that")
