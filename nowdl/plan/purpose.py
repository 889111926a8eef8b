"""What a plan is for: training (the default) or inference (``config["inference"]: true``), and
the ops an inference plan records as depending on the whole image (``config["whole_image_ops"]``,
with the statistics passes streaming needs: ``config["statistics_passes"]``).

An inference plan counts no gradients, optimizer state or saved activations and its schedule
has no backward ([Note: inference memory] in partitioner/costs/inference.py), so it cannot
train; a training plan runs inference correctly but holds memory inference does not need.
"""

from __future__ import annotations

from nowdl.errors import PlanError
from nowdl.plan.plan import Plan

__all__ = ["is_inference", "require_training", "require_inference", "format_whole_image_ops"]


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


def format_whole_image_ops(plan: Plan) -> str:
    """The whole-image ops an inference plan records ([Note: whole-image ops] in
    ``nowdl.partitioner.spatial.whole_image``), one line each, for ``nowdl show``; ``""`` for a
    training plan."""
    if not is_inference(plan):
        return ""
    ops = plan.config.get("whole_image_ops")
    if ops is None:
        return ("whole-image ops: not recorded (the plan was made before nowdl recorded them): re-plan with "
                "--inference to list them")
    if not ops:
        return "whole-image ops: none (every output pixel depends on a bounded neighbourhood: windows are exact)"
    passes = plan.config.get("statistics_passes") or {}
    inexact = [op for op in ops if not op.get("pass", 0)]
    cost = ""
    if passes.get("passes"):
        cost = (f"; streamed in several windows: {passes['passes']} statistics pass(es) before the writing pass, each "
                f"over every window the part of the forward its ops read: "
                f"+{float(passes.get('seconds_per_window', 0.0)):.3g} s per window (predicted)")
    lines = [f"whole-image ops: {len(ops)}, {len(ops) - len(inexact)} exact when streamed, {len(inexact)} not "
             f"(exact on one window that covers the image{cost})"]
    for op in ops:
        lines.append(f"  {op.get('node')} ({op.get('op')}, {op.get('kind')}): {op.get('windowed')}")
    return "\n".join(lines)
