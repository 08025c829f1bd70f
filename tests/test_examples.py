"""examples/: every script runs as its docstring's command says (torchrun, 2 CPU ranks) and
finds Seq1F1B's losses and gradients equal to Megatron-Core's own schedule."""

from __future__ import annotations

import importlib.util
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
# script -> a module it needs (skipped where the installed megatron-core lacks it)
SCRIPTS = {"gpt_packed_pp2.py": None, "hybrid_pp2.py": "megatron.core.models.hybrid",
           "variable_lengths_pp2.py": None}
TIMEOUT_S = 300


def test_every_example_is_listed_and_tested():
    on_disk = {p.name for p in EXAMPLES.glob("*.py")}
    assert on_disk == set(SCRIPTS), on_disk ^ set(SCRIPTS)
    listed = (EXAMPLES / "README.md").read_text()
    for name in SCRIPTS:
        assert f"`torchrun --nproc-per-node 2 examples/{name}`" in listed, name


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_example_runs_as_written(name):
    needs = SCRIPTS[name]
    if needs is not None and importlib.util.find_spec(needs) is None:
        pytest.skip(f"{name} needs {needs} (megatron-core 0.18 and later)")
    command = f"torchrun --nproc-per-node 2 examples/{name}"
    assert re.search(rf"^\s+{re.escape(command)}$", (EXAMPLES / name).read_text(), re.M), \
        f"{name}'s docstring does not give {command!r}"
    torchrun = Path(sys.executable).with_name("torchrun")
    # the command as written; a free port so that it cannot meet another torchrun's ranks
    run = subprocess.run(
        [str(torchrun), "--nproc-per-node", "2", "--master-port", str(_free_port()),
         f"examples/{name}"],
        cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    tail = (run.stdout + run.stderr)[-3000:]
    assert run.returncode == 0, tail
    assert "Megatron loss  Seq1F1B loss" in run.stdout, tail
    assert re.search(r"^equal within 1e-05", run.stdout, re.M), tail
