"""The package's import graph is acyclic, and the schedule builders depend one way.

Every ``import`` counts, including those inside functions (a lazy import is
still a dependency; it only hides a cycle until a caller trips on it).
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_seq1f1b"


def _module_files() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


MODULES = _module_files()


def _imports(name: str) -> set[str]:
    """The package modules that `name` imports anywhere in its source."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in MODULES}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                if f"{base}.{alias.name}" in MODULES:  # a submodule
                    found.add(f"{base}.{alias.name}")
                elif base in MODULES:
                    found.add(base)
    found.discard(name)
    return found


GRAPH = {name: _imports(name) for name in MODULES}


def _find_cycle() -> list[str] | None:
    state: dict[str, str] = {}  # "open" while on the stack, "done" after

    def visit(name: str, stack: list[str]) -> list[str] | None:
        state[name] = "open"
        for dep in sorted(GRAPH[name]):
            if state.get(dep) == "open":
                return stack[stack.index(dep):] + [dep]
            if dep not in state:
                cycle = visit(dep, stack + [dep])
                if cycle:
                    return cycle
        state[name] = "done"
        return None

    for name in sorted(GRAPH):
        if name not in state:
            cycle = visit(name, [name])
            if cycle:
                return cycle
    return None


def test_package_import_graph_is_acyclic():
    cycle = _find_cycle()
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_schedule_builders_depend_one_way():
    assert GRAPH["megatron_seq1f1b.actions"] == set()
    assert GRAPH["megatron_seq1f1b.interleaved"] == {"megatron_seq1f1b.actions"}
    assert GRAPH["megatron_seq1f1b.zero_bubble"] == {"megatron_seq1f1b.actions"}
    assert GRAPH["megatron_seq1f1b.schedule"] == {"megatron_seq1f1b.actions",
                                                  "megatron_seq1f1b.interleaved",
                                                  "megatron_seq1f1b.zero_bubble"}


PURE = ["actions", "interleaved", "zero_bubble", "schedule", "plan", "replay", "validate",
        "simulate", "partition"]


@pytest.mark.parametrize("module", PURE)
def test_pure_module_imports_alone_without_megatron(module):
    """In a fresh interpreter, first thing: no half-initialized partner, no Megatron-Core."""
    code = (f"import sys, megatron_seq1f1b.{module}\n"
            "assert not [m for m in sys.modules if m == 'megatron' or m.startswith('megatron.')]\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_schedule_reexports_the_shared_vocabulary():
    from megatron_seq1f1b import actions, schedule

    for name in ("Action", "F", "B", "FORWARD", "BACKWARD", "Schedule", "ScheduleError",
                 "DeadlockError", "format_actions", "format_schedule", "parse_schedule",
                 "schedule_shape", "one_forward_one_backward"):
        assert getattr(schedule, name) is getattr(actions, name), name


# Core modules that still reach into trainer/ or bench/, and why (each one is a debt: the
# test fails when a new one appears, and when one listed here is cleaned up).
CORE_EXCEPTIONS: dict[str, str] = {}


def test_core_never_imports_bench_or_trainer():
    """Core modules (``megatron_seq1f1b/*.py``) stand alone: ``bench/`` and ``trainer/``
    build on them, never the reverse (function-level imports count too)."""
    core = {name for name, path in MODULES.items() if path.parent == PACKAGE}
    assert "megatron_seq1f1b.planner" in core and "megatron_seq1f1b.bench.fit" not in core
    outside = ("megatron_seq1f1b.bench", "megatron_seq1f1b.trainer")
    reaching = {name: sorted(dep for dep in GRAPH[name]
                             if any(dep == o or dep.startswith(o + ".") for o in outside))
                for name in core}
    reaching = {name: deps for name, deps in reaching.items() if deps}
    assert set(reaching) == set(CORE_EXCEPTIONS), reaching
