"""What recomputing only a segment of a stage costs and saves.

[Note: recompute segments] A recomputed stage may recompute only a prefix of its nodes (the
nodes before global node index ``cut``, ``Candidate.segments``; the plan's
``recompute_segment`` [0, n) over the stage's node list; the runtime in [Note: recompute
segment] of runtime/pipeline/segment.py). Its prefix nodes cost as in [Note: recompute cost]
(costs/levers.py): one micro-batch's saved bytes held at the peak, their forward time added;
its other nodes keep their saved bytes for every micro-batch in flight and add no time. In the
Problem the stage's ``inflight`` becomes 1 (as for the whole stage) and the kept nodes' saved
bytes are multiplied by the old ``inflight``, so the peak is ``inflight x kept + segment``; the
recompute's pending sends ([Note: recompute pending sends]) are charged as for the whole stage.
The variant's nodes past ``cut`` are those of the stage's suffix only where the stage holds
them, which is all the solvers ever read of it. Which prefix: [Note: shorter recompute] in
search/segments.py.
"""

from __future__ import annotations

from collections.abc import Sequence

from nowdl.partitioner.costs.problem import NodeVectors
from nowdl.profiler.cost import Profile

__all__ = ["SEGMENT_TAG", "segment_vectors", "segment_variant", "segment_figures"]

SEGMENT_TAG = "<"  # "<variant>+rc<inflight><<cut>"


def segment_vectors(base: NodeVectors, whole: NodeVectors, inflight: int, cut: int, prof: Profile) -> NodeVectors:
    """``whole`` (the recomputed stage's vectors) for the nodes before ``cut``, ``base`` with its
    saved bytes held ``inflight`` times from ``cut`` on ([Note: recompute segments])."""
    act = [w if v < cut or n.op == "placeholder" else b * inflight
           for v, (n, w, b) in enumerate(zip(prof.nodes, whole.act, base.act, strict=True))]
    time = [w if v < cut else b for v, (w, b) in enumerate(zip(whole.time, base.time, strict=True))]
    fwd = None if base.fwd is None else list(base.fwd)
    return NodeVectors(act=act, time=time, workspace=base.workspace, out=base.out, fwd=fwd)


def segment_variant(prof: Profile, variants: dict[str, NodeVectors], base: str, whole: str, inflight: int,
                    cut: int) -> str:
    """The key of the segment's variant (added to ``variants``), from the stage's ``base``
    variant and its whole-stage recompute variant ``whole``."""
    key = f"{whole}{SEGMENT_TAG}{cut}"
    if key not in variants:
        variants[key] = segment_vectors(variants[base], variants[whole], inflight, cut, prof)
    return key


def segment_figures(prof: Profile, segments: Sequence[tuple[int, int]], stage_of: Sequence[int],
                    inflight: Sequence[int], figures: list[dict[str, float]]) -> list[list[int]]:
    """Per stage, its ``recompute_segment`` [0, n) ([] where it recomputes whole or not at all);
    ``figures`` (``levers.lever_figures``) get the segment's bytes: ``recomputed_bytes`` (its
    saved bytes times ``inflight - 1``) and ``segment_bytes`` (one micro-batch's)."""
    out: list[list[int]] = [[] for _ in figures]
    for s, cut in segments:
        nodes = [v for v, t in enumerate(stage_of) if t == s]
        n = sum(1 for v in nodes if v < cut)
        seg = float(sum(prof.nodes[v].act_bytes for v in nodes if v < cut and prof.nodes[v].op != "placeholder"))
        if 0 < n < len(nodes):
            out[s] = [0, n]
            figures[s].update(recomputed_bytes=(inflight[s] - 1) * seg, segment_bytes=seg)
    return out
