"""Property: a damaged plan file (a field removed, a wrong type, a wrong count, cut short) is
refused with one clear PlanError when loaded, and `nowdl show` on it prints one paragraph and
writes nothing; a change that leaves a valid plan shows as usual."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import tempfile
from pathlib import Path
from typing import Any

from helpers.properties import count, examples
from hypothesis import given, settings
from hypothesis import strategies as st

from nowdl.cli.commands import main
from nowdl.errors import NowdlError, PlanError
from nowdl.plan.plan import Plan

ROOT = Path(__file__).resolve().parents[2]
BASES = {name: json.loads((ROOT / "experiments" / name).read_text()) for name in (
    "unet_2048_8gpu_searched.json", "unet_8192_sp4x2.json", "resnet110v2_1024_4gpu_master.json")}
WRONG = [None, "x", -1, 0, 7, 1.5, True, [], {}, [1, "a"], {"a": 1}, float("inf")]


def _paths(obj: Any, here: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [here] if here else []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, (*here, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:3]):  # the first entries of long lists are enough
            out += _paths(v, (*here, i))
    return out


PATHS = {name: _paths(d) for name, d in BASES.items()}


Mutation = tuple[str, str, tuple[Any, ...], Any]  # base plan, kind, path (or cut position), new value


@st.composite
def mutations(draw: st.DrawFn) -> Mutation:
    """A damage to one of the base plans: what to do where (applied by :func:`_apply`)."""
    name = draw(st.sampled_from(sorted(BASES)))
    kind = draw(st.sampled_from(["remove", "type", "count", "cut"]))
    if kind == "cut":
        return name, kind, (draw(st.integers(0, len(json.dumps(BASES[name], indent=1)) - 1)),), None
    path = draw(st.sampled_from(PATHS[name]))
    old = _at(BASES[name], path)
    new: Any = None
    if kind == "type":
        new = draw(st.sampled_from([w for w in WRONG if type(w) is not type(old)]))
    elif kind == "count" and isinstance(old, list):
        new = old[:-1] if old and draw(st.booleans()) else old + old[-1:]
    elif kind == "count" and isinstance(old, int) and not isinstance(old, bool):
        new = old + draw(st.sampled_from([-2, -1, 1, 2, 1000]))
    elif kind == "count":
        new = draw(st.sampled_from(WRONG))
    return name, kind, path, new


def _at(d: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        d = d[key]
    return d


def _apply(m: Mutation) -> str:
    name, kind, path, new = m
    if kind == "cut":
        return json.dumps(BASES[name], indent=1)[: path[0]]
    d = copy.deepcopy(BASES[name])
    parent = _at(d, path[:-1])
    if kind == "remove":
        del parent[path[-1]]
    else:
        parent[path[-1]] = new
    return json.dumps(d, indent=1)


@settings(max_examples=examples(300))
@given(mutations())
def test_damaged_plan_files_are_refused_clearly(case: Mutation) -> None:
    text = _apply(case)
    name, what = case[0], case[1:]
    count("plan mutations")
    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp) / "plan.json"
        f.write_text(text)
        before = sorted(Path(tmp).rglob("*"))
        try:
            plan: Plan | None = Plan.load(f)
        except PlanError as e:
            msg, plan = str(e), None
            assert msg.startswith(str(f)) and "\n" not in msg, (name, what, msg)
        err, out = io.StringIO(), io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            rc = main(["show", str(f), "--nodes", "--schedule"])
        assert sorted(Path(tmp).rglob("*")) == before, (name, what)  # nothing written
    if plan is None:
        assert rc == 2, (name, what, out.getvalue())
        lines = err.getvalue().splitlines()
        assert len(lines) == 1 and lines[0].startswith("nowdl show: error: "), (name, what, err.getvalue())
        assert "(unexpected:" not in lines[0], (name, what, lines[0])
    else:  # the change left a valid plan (a number changed, an optional field gone): it shows
        assert rc == 0 or "(unexpected:" not in err.getvalue(), (name, what, err.getvalue())
        if rc != 0:
            raise NowdlError(f"{name} / {what}: loaded but `nowdl show` refused it: {err.getvalue()}")
