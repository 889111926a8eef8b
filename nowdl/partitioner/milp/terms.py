"""PuLP building blocks of the partitioning MILP: variables, names, sparse sums, constraints.

Constants (0 and 1, for y entries fixed by pins and precedence) mix with variables in the
same terms; a constraint left with constants only is checked, not added.
"""

from __future__ import annotations

import re
from typing import Any

import pulp

from nowdl.partitioner.costs.problem import Problem

__all__ = ["Lin", "Y", "ConstantViolation", "new_var", "clean_name", "lp_names", "add_term", "add_constraint"]

Lin = dict[Any, float]  # variable -> coefficient
Y = Any  # an int constant (0 or 1) or a pulp.LpVariable


def new_var(
    prob: pulp.LpProblem, name: str, lo: float | None, hi: float | None,
    cat: str = pulp.LpContinuous,
) -> pulp.LpVariable:
    """A new variable of ``prob`` (PuLP >= 3.3 attaches it; older PuLP builds it free)."""
    if hasattr(prob, "add_variable"):
        return prob.add_variable(name, lowBound=lo, upBound=hi, cat=cat)
    return pulp.LpVariable(name, lowBound=lo, upBound=hi, cat=cat)  # pragma: no cover


def clean_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", name)[:60]


def lp_names(problem: Problem) -> list[str]:
    seen: set[str] = set()
    out = []
    for i, name in enumerate(problem.names):
        c = clean_name(str(name)) or f"n{i}"
        if c in seen:
            c = f"{c}_{i}"
        seen.add(c)
        out.append(c)
    return out


def add_term(lin: Lin, e: Y, coef: float) -> float:
    """Add coef * e to lin; return the constant part."""
    if isinstance(e, int):
        return coef * e
    lin[e] = lin.get(e, 0.0) + coef
    return 0.0


class ConstantViolation(RuntimeError):
    """A constraint with no variables left is false (e.g. a cap below a fully pinned stage)."""


def add_constraint(
    prob: pulp.LpProblem, terms: list[tuple[Y, float]], sense: int, rhs: float, name: str
) -> None:
    """Add sum(coef * e) (sense) rhs unless it holds trivially (constants only)."""
    lin: Lin = {}
    const = 0.0
    for e, c in terms:
        const += add_term(lin, e, c)
    lin = {k: c for k, c in lin.items() if c != 0.0}
    if not lin:
        ok = {pulp.LpConstraintLE: const <= rhs + 1e-12, pulp.LpConstraintGE: const >= rhs - 1e-12,
              pulp.LpConstraintEQ: abs(const - rhs) <= 1e-12}[sense]
        if not ok:  # only a memory cap can be broken by constants (all nodes pinned)
            raise ConstantViolation(f"constraint {name} is violated by constants")
        return
    expr = pulp.LpAffineExpression(list(lin.items()))
    prob.addConstraint(pulp.LpConstraint(expr, sense, name=name, rhs=rhs - const))
