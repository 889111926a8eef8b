"""The manual stays short, says what the code does now, and every figure names the command that makes it.

Rules (README.md and docs/**/*.md):

* README.md has at most 250 lines, docs/benchmarks.md at most 700 (figures live in docs/results/,
  written by the benchmark scripts themselves with ``--results``).
* No history: none of :data:`HISTORY` (history goes in CHANGELOG.md).
* A table of measured figures names the command that makes it: in a results file, its header's
  ``Command`` line or code block names a script in benchmarks/; elsewhere, the section the table
  sits in (from the heading above it) shows, before the table, a `benchmarks/<script>.py` that
  exists or a ``nowdl <command>`` the CLI has. A table is *measured* when one of its body cells is
  a figure (a number, alone or with a unit: ``1.23``, ``4.5 GiB``, ``0.9x``, ``12%``); tables of
  names, options and formulas are reference tables and need no command.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
HISTORY = re.compile(r"\b(sessions?|was|earlier runs?|re-made|used to|previously)\b", re.I)
FIGURE = re.compile(r"^\s*[~≈<>≤≥]?\s*[-+]?\d[\d,]*(\.\d+)?\s*(%|x|×|s|ms|µs|GiB|MiB|KiB|GB|MB|B|GB/s|TFLOP/s)?\s*$")
SCRIPT = re.compile(r"benchmarks/(\w+)\.py")
CLI = re.compile(r"\bnowdl (\w+)")


def _cli_commands() -> set[str]:
    text = "\n".join(p.read_text() for p in (ROOT / "nowdl" / "cli").glob("*.py"))
    return set(re.findall(r'add_parser\(\s*"(\w+)"', text))


def _tables(lines: list[str]) -> list[tuple[int, list[list[str]]]]:
    """(first line index, rows of cells) of every Markdown table outside code blocks."""
    out, i, fence = [], 0, False
    while i < len(lines):
        if lines[i].lstrip().startswith("```"):
            fence = not fence
        if not fence and lines[i].lstrip().startswith("|") and i + 1 < len(lines) and re.match(r"^\s*\|[\s:|-]+\|\s*$", lines[i + 1]):
            start, rows = i, []
            while i < len(lines) and lines[i].lstrip().startswith("|"):
                rows.append([c.strip() for c in lines[i].strip().strip("|").split("|")])
                i += 1
            out.append((start, rows))
            continue
        i += 1
    return out


def _measured(rows: list[list[str]]) -> bool:
    return any(FIGURE.match(c) for row in rows[2:] for c in row[1:])


def _names_command(text: str, commands: set[str]) -> bool:
    if any((ROOT / "benchmarks" / f"{s}.py").is_file() for s in SCRIPT.findall(text)):
        return True
    return any(c in commands for c in CLI.findall(text))


def test_manual_lengths() -> None:
    readme = len((ROOT / "README.md").read_text().splitlines())
    bench = len((ROOT / "docs" / "benchmarks.md").read_text().splitlines())
    assert readme <= 250, f"README.md has {readme} lines (at most 250): move detail to docs/"
    assert bench <= 700, f"docs/benchmarks.md has {bench} lines (at most 700): figures go in docs/results/"


def test_no_history_in_the_manual() -> None:
    bad = []
    for path in DOCS:
        fence = False
        for n, line in enumerate(path.read_text().splitlines(), 1):
            fence ^= line.lstrip().startswith("```")
            m = None if fence else HISTORY.search(line)
            if m:
                bad.append(f"{path.relative_to(ROOT)}:{n}: {m.group(0)!r} in {line.strip()[:100]!r}")
    assert not bad, "history wording in the docs (it goes in CHANGELOG.md):\n" + "\n".join(bad)


def test_every_table_of_figures_names_its_command() -> None:
    commands = _cli_commands()
    assert {"plan", "run", "predict", "show"} <= commands
    bad = []
    for path in DOCS:
        lines = path.read_text().splitlines()
        results = path.parent.name == "results"
        for start, rows in _tables(lines):
            if not _measured(rows):
                continue
            if results:
                context = "\n".join(lines[:start])
            else:
                head = max((i for i in range(start) if lines[i].startswith("#")), default=0)
                context = "\n".join(lines[head:start])
            if not _names_command(context, commands):
                bad.append(f"{path.relative_to(ROOT)}:{start + 1}: {' | '.join(rows[0])[:80]}")
    assert not bad, "tables of figures with no command before them in their section:\n" + "\n".join(bad)


def test_the_checks_fire() -> None:
    assert _measured([["a", "b"], ["-", "-"], ["x", "4.5 GiB"]]) and not _measured([["a", "b"], ["-", "-"], ["x", "y"]])
    assert HISTORY.search("the plan was made") and not HISTORY.search("the plan washes")
    assert _names_command("run `benchmarks/bench_planner.py --quick`", {"plan"})
    assert not _names_command("run `benchmarks/no_such_bench.py`", {"plan"})
    assert _names_command("nowdl plan unet --gpus 8", {"plan"})


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_links_between_docs_resolve() -> None:
    """Every link to a Markdown file of the repository (with its #anchor) points at a file and heading that exist."""
    bad = []
    for path in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
            if re.match(r"^[a-z]+://", target) or target.startswith("#") and not target[1:]:
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if file and not dest.exists():
                bad.append(f"{path.relative_to(ROOT)}: {target} (no such file)")
                continue
            if anchor and dest.suffix == ".md":
                slugs = {_slug(h) for h in re.findall(r"^#+ (.+)$", dest.read_text(), re.M)}
                if anchor not in slugs:
                    bad.append(f"{path.relative_to(ROOT)}: {target} (no such heading)")
    assert not bad, "dead links in the docs:\n" + "\n".join(bad)
