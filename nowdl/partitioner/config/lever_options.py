"""The user's recompute and offload settings: "auto", "on", "off" or a list of stage indices.

[Note: lever settings] ``recompute`` and ``offload`` (``compile()``, ``--recompute``,
``--offload``) each take "auto" (the planner uses it on a stage only where the candidate does
not fit the memory cap otherwise: [Note: choosing levers] in search/levers.py), "on" (every
stage), "off" (never) or a list of stage indices (those stages, never the others). True and
False mean "on" and "off"; an empty list means "off". A stage is recomputed or offloaded, not
both: two settings that force both on one stage are refused.
"""

from __future__ import annotations

from collections.abc import Sequence

from nowdl.errors import NowdlError

__all__ = ["LEVER_CHOICES", "LeverSetting", "check_lever", "check_lever_pair", "forced_stages", "recompute_setting"]

LEVER_CHOICES = ("auto", "on", "off")
LeverSetting = str | tuple[int, ...]

_HELP = {
    "recompute": "recompute a stage's forward in its backward instead of keeping its saved activations",
    "offload": "keep a stage's saved activations in host memory between its forward and backward",
}


def check_lever(name: str, value: object) -> LeverSetting:
    """``value`` as "auto", "on", "off" or a sorted tuple of distinct stage indices.

    Raises:
        NowdlError: anything else (the message names the value and what to pass).
    """
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, str) and value.strip().lower() in LEVER_CHOICES:
        return value.strip().lower()
    if isinstance(value, (list, tuple, range)) and all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value):
        stages = tuple(sorted(set(value)))
        return stages if stages else "off"
    raise NowdlError(f"{name}={value!r} is not a valid {name} setting: pass 'auto' (the planner does it only on stages "
                     f"that do not fit the memory cap otherwise), 'on' (every stage), 'off' (never) or a list of "
                     f"stage indices such as [0, 1] (--{name} 0,1 on the command line); {name}: {_HELP.get(name, _HELP['recompute'])}")


def check_lever_pair(recompute: LeverSetting, offload: LeverSetting, *, gpus: int, stages: int | None) -> None:
    """Refuse stage indices no plan can have and a stage both recomputed and offloaded.

    Raises:
        NowdlError: an index >= the pinned stage count (or >= ``gpus`` when unpinned), or one
            stage forced both ways.
    """
    limit = stages if stages is not None else gpus
    for name, v in (("recompute", recompute), ("offload", offload)):
        if isinstance(v, tuple) and v and v[-1] >= limit:
            bad = [i for i in v if i >= limit]
            what = f"the plan is pinned to {stages} stages" if stages is not None else f"{gpus} GPUs hold at most {gpus} stages"
            raise NowdlError(f"{name}={list(v)} names stage(s) {bad}, but {what} (stages 0..{limit - 1}): "
                             f"give indices below {limit}, or pin more stages (--stages)")
    if recompute == "off" or offload == "off" or "auto" in (recompute, offload):
        return
    both = sorted(set(forced_stages(recompute, limit)) & set(forced_stages(offload, limit)))
    if both:
        raise NowdlError(f"recompute={_show(recompute)} and offload={_show(offload)} both name stage(s) {both}: a "
                         "stage either recomputes its activations or offloads them; give each stage to one of them")


def recompute_setting(recompute: object, activation_checkpointing: bool | Sequence[int]) -> LeverSetting:
    """``recompute`` with the older ``activation_checkpointing`` folded in: True means "on", a
    list of stages that list; it only fills a ``recompute`` left at "auto".

    Raises:
        NowdlError: a bad ``recompute``, or the two naming different stages.
    """
    rc = check_lever("recompute", recompute)
    ckpt = activation_checkpointing
    if ckpt is False or (not isinstance(ckpt, bool) and not tuple(ckpt)):
        return rc
    alias = check_lever("activation_checkpointing", ckpt)
    if rc in ("auto", alias):
        return alias
    raise NowdlError(f"activation_checkpointing={_show(ckpt) if not isinstance(ckpt, bool) else ckpt} and "
                     f"recompute={_show(rc)} disagree: activation_checkpointing is the older name of recompute "
                     "(True: 'on', a list: those stages); give only recompute")


def forced_stages(setting: LeverSetting, k: int) -> tuple[int, ...]:
    """The stages of a K-stage plan the setting forces ("on": all; a list: those; else none)."""
    if setting == "on":
        return tuple(range(k))
    if isinstance(setting, tuple):
        return tuple(i for i in setting if i < k)
    return ()


def _show(v: LeverSetting | Sequence[int]) -> str:
    return repr(v) if isinstance(v, str) else repr(list(v))
