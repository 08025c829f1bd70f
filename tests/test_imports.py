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
    room = "megatron_seq1f1b.schedules"
    assert GRAPH[f"{room}.actions"] == set()
    assert GRAPH[f"{room}.order"] == {f"{room}.actions"}
    assert GRAPH[f"{room}.interleaved"] == {f"{room}.actions", f"{room}.order"}
    assert GRAPH[f"{room}.zero_bubble"] == {f"{room}.actions"}
    assert GRAPH[f"{room}.schedule"] == {f"{room}.actions", f"{room}.order",
                                         f"{room}.interleaved", f"{room}.zero_bubble"}


# The schedules room is pure: every module in it imports alone, without Megatron-Core.
PURE = sorted(name.rpartition(".")[2] for name, path in MODULES.items()
              if path.parent == PACKAGE / "schedules" and path.name != "__init__.py")


@pytest.mark.parametrize("module", PURE)
def test_pure_module_imports_alone_without_megatron(module):
    """In a fresh interpreter, first thing: no half-initialized partner, no Megatron-Core,
    no torch.distributed."""
    code = (f"import sys, megatron_seq1f1b.schedules.{module}\n"
            "assert not [m for m in sys.modules if m == 'megatron' or m.startswith('megatron.')]\n"
            "assert 'torch.distributed' not in sys.modules or "
            "not sys.modules['torch.distributed'].is_initialized()\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_schedule_reexports_the_shared_vocabulary():
    from megatron_seq1f1b.schedules import actions, schedule

    for name in ("Action", "F", "B", "FORWARD", "BACKWARD", "Schedule", "ScheduleError",
                 "DeadlockError", "format_actions", "format_schedule", "parse_schedule",
                 "schedule_shape", "one_forward_one_backward"):
        assert getattr(schedule, name) is getattr(actions, name), name


# ---------------------------------------------------------------- the rooms and their floors

from megatron_seq1f1b import ROOMS  # noqa: E402 - the floors, bottom first
FRONT_DOOR = {"megatron_seq1f1b", "megatron_seq1f1b.moved"}  # lazy: they import by name


def _room(name: str) -> str:
    return name.split(".")[1]


def test_every_module_lives_in_a_room():
    homeless = sorted(name for name in MODULES
                      if name not in FRONT_DOOR and _room(name) not in ROOMS)
    assert not homeless, f"modules outside the rooms of megatron_seq1f1b.ROOMS: {homeless}"


def test_no_import_runs_upward():
    """A module imports only from its own room and the rooms below it (function-level
    imports count too); the floors are :data:`megatron_seq1f1b.ROOMS`, bottom first."""
    import megatron_seq1f1b

    floor = {room: i for i, room in enumerate(ROOMS)}
    # The front door (``import megatron_seq1f1b as s1``) stands as high as what it serves.
    door = max(floor[_room(module)] for module, _ in megatron_seq1f1b._LAZY.values())

    def floor_of(name: str) -> int:
        return door if name in FRONT_DOOR else floor[_room(name)]

    upward = sorted(f"{name} -> {dep}" for name, deps in GRAPH.items() if name not in FRONT_DOOR
                    for dep in deps if floor_of(dep) > floor_of(name))
    assert not upward, "imports that run upward:\n" + "\n".join(upward)


def test_the_rooms_are_few_and_say_what_they_hold():
    top_modules = [p.stem for p in PACKAGE.glob("*.py") if p.name != "__init__.py"]
    assert len(top_modules) <= 8, top_modules
    rooms = [p.parent.name for p in PACKAGE.glob("*/__init__.py")]
    assert len(set(rooms) - {"bench", "trainer"}) >= 5, rooms
    for room in rooms:
        doc = ast.get_docstring(ast.parse((PACKAGE / room / "__init__.py").read_text())) or ""
        assert len(doc.split()) >= 25, f"{room}/__init__.py: a docstring saying what it holds"
        if room not in ("bench", "trainer"):
            assert "May import" in doc, f"{room}/__init__.py: say what the room may import"


def test_design_map_lists_the_rooms_in_floor_order():
    design = (PACKAGE.parent / "docs" / "design.md").read_text()
    start = design.index("## The package's rooms")
    section = design[start:design.index("\n## ", start + 1)]
    positions = [section.find(f"`{room}/`" if room != "api" else "`api.py`") for room in ROOMS]
    assert -1 not in positions, dict(zip(ROOMS, positions))
    assert positions == sorted(positions, reverse=True), "the map lists the top floor first"


def test_earlier_module_names_still_import_and_run():
    """Scripts written before the rooms keep working: an earlier name is the same module,
    and ``python -m`` with a documented earlier name runs it."""
    import importlib
    import warnings

    from megatron_seq1f1b import moved

    for old, new in moved.MOVED.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module = importlib.import_module(f"megatron_seq1f1b.{old}")
        assert module is importlib.import_module(f"megatron_seq1f1b.{new}"), old
        deprecated = [w for w in caught if issubclass(w.category, DeprecationWarning)]
        assert bool(deprecated) == (old not in moved.DOCUMENTED), (old, caught)
    out = subprocess.run([sys.executable, "-m", "megatron_seq1f1b.simulate", "--pp", "2",
                          "--microbatches", "2", "--splits", "2"],
                         capture_output=True, text=True, check=True).stdout
    assert "bubble" in out


# Core modules that still reach into trainer/ or bench/, and why (each one is a debt: the
# test fails when a new one appears, and when one listed here is cleaned up).
CORE_EXCEPTIONS: dict[str, str] = {}


def test_core_never_imports_bench_or_trainer():
    """Core modules (every room but ``bench/`` and ``trainer/``) stand alone: ``bench/`` and
    ``trainer/`` build on them, never the reverse (function-level imports count too)."""
    outside = ("megatron_seq1f1b.bench", "megatron_seq1f1b.trainer")
    core = {name for name in MODULES if not any(name.startswith(o) for o in outside)}
    assert "megatron_seq1f1b.planner" in core and "megatron_seq1f1b.bench.fit" not in core
    reaching = {name: sorted(dep for dep in GRAPH[name]
                             if any(dep == o or dep.startswith(o + ".") for o in outside))
                for name in core}
    reaching = {name: deps for name, deps in reaching.items() if deps}
    assert set(reaching) == set(CORE_EXCEPTIONS), reaching
