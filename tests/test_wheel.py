"""The package as pip installs it: a wheel of this repository, in a fresh environment
(no torch, no Megatron, not this clone on the path), patches and reverts Megatron-LM
checkouts with ``python -m megatron_seq1f1b.patch`` and the ``seq1f1b-patch`` command.

The wheel is built offline (``pip wheel --no-build-isolation --no-index``, with the
setuptools of the Python running the tests; where it has none, pip fetches setuptools)
from a copy of the package's files, so no build output lands in this clone. Real
checkouts come from the Megatron-LM git repository tests/test_patches.py uses
(MEGATRON_LM_REPO); a synthetic one always runs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from test_patches import (
    HAVE_GIT, PATCHES_OF, REPO, REPO_ENV, REPO_TAGS, TAGS, git_archive,
    make_git_checkout, skeleton_checkout, snapshot,
)

ROOT = Path(__file__).resolve().parents[1]
# What a wheel is built from: the package and the files setup.py reads.
SOURCES = ["setup.py", "README.md", "setup.cfg", "pyproject.toml", "MANIFEST.in"]


def _run(command, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in command], capture_output=True, text=True,
                          timeout=600, **kw)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    if _run([sys.executable, "-m", "pip", "--version"]).returncode != 0:
        pytest.skip(f"building a wheel needs pip in {sys.executable}")
    base = tmp_path_factory.mktemp("wheel")
    src = base / "src"
    shutil.copytree(ROOT / "megatron_seq1f1b", src / "megatron_seq1f1b",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in SOURCES:
        if (ROOT / name).is_file():
            shutil.copy2(ROOT / name, src / name)
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", base / "dist", src]
    if _run([sys.executable, "-c", "import setuptools"]).returncode == 0:
        built = _run([*build, "--no-build-isolation", "--no-index"])  # offline
        assert built.returncode == 0, built.stdout + built.stderr
    else:  # (Python 3.12+ environments have no setuptools of their own) pip fetches it
        built = _run(build)
        if built.returncode != 0:
            pytest.skip(f"no setuptools in {sys.executable}, and pip could not fetch it: "
                        f"{built.stderr.strip().splitlines()[-1:]}")
    wheels = list((base / "dist").glob("megatron_seq1f1b-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def test_wheel_holds_the_patches_and_the_command(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        entry_points = next(archive.read(n).decode() for n in names
                            if n.endswith(".dist-info/entry_points.txt"))
    for tag in TAGS:
        for patch in PATCHES_OF[tag]:
            rel = patch.relative_to(ROOT).as_posix()
            assert rel in names, rel
    assert "megatron_seq1f1b/megatron_lm/patch.py" in names
    assert "seq1f1b-patch = megatron_seq1f1b.megatron_lm.patch:main" in entry_points


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A fresh environment with only the wheel installed (no torch, no Megatron)."""
    env_dir = tmp_path_factory.mktemp("venv") / "env"
    python = env_dir / "bin" / "python"
    made = _run([sys.executable, "-m", "venv", "--without-pip", env_dir])
    assert made.returncode == 0, made.stderr
    install = ["install", "--no-deps", "--no-index", "-q", wheel]
    done = _run([sys.executable, "-m", "pip", "--python", python, *install])
    if done.returncode != 0 and "--python" in done.stderr:  # pip < 22.3: the venv's own pip
        shutil.rmtree(env_dir)
        made = _run([sys.executable, "-m", "venv", env_dir])
        assert made.returncode == 0, made.stderr
        done = _run([python, "-m", "pip", *install])
    assert done.returncode == 0, done.stdout + done.stderr
    return env_dir


def in_venv(venv: Path, *command, cwd: Path) -> subprocess.CompletedProcess:
    """Run in the fresh environment, away from this clone (no PYTHONPATH, cwd elsewhere)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "SEQ1F1B_PATCH_PROG", "SEQ1F1B_PATCH_TOOL")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return _run(command, cwd=cwd, env=env)


def test_installed_package_stands_alone(venv, tmp_path):
    code = ("import importlib.util, megatron_seq1f1b.megatron_lm.patch as p; print(p.__file__); "
            "print(importlib.util.find_spec('torch'), importlib.util.find_spec('megatron'))")
    out = in_venv(venv, venv / "bin" / "python", "-c", code, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    where, missing = out.stdout.splitlines()
    assert Path(where).is_relative_to(venv) and missing == "None None"
    for command in ([venv / "bin" / "python", "-m", "megatron_seq1f1b.patch", "--help"],
                    [venv / "bin" / "seq1f1b-patch", "--help"]):
        shown = in_venv(venv, *command, cwd=tmp_path)
        assert shown.returncode == 0, shown.stderr
        assert all(tag in shown.stdout for tag in TAGS)
    # The --seq1f1b flags' help (Megatron-LM's own --help fails in core_v0.18/0.19).
    flags = in_venv(venv, venv / "bin" / "python", "-m", "megatron_seq1f1b.megatron_lm",
                    cwd=tmp_path)
    assert flags.returncode == 0 and "--seq1f1b-splits" in flags.stdout, flags.stderr


def _checkout_params() -> list:
    params = [pytest.param(("skeleton", "core_v0.19.0"), id="synthetic-core_v0.19.0")]
    for tag, layout in (("core_v0.19.0", "archive"), ("core_v0.16.1", "git")):
        marks = []
        if tag not in REPO_TAGS:
            why = (f"{REPO} has no tag {tag}" if REPO else
                   f"no Megatron-LM git repository: set {REPO_ENV} to a clone of "
                   "https://github.com/NVIDIA/Megatron-LM with its tags")
            marks = [pytest.mark.skip(reason=why)]
        elif layout == "git" and not HAVE_GIT:
            marks = [pytest.mark.skip(reason="no git")]
        params.append(pytest.param((layout, tag), id=f"{tag}-{layout}", marks=marks))
    return params


@pytest.mark.parametrize("case", _checkout_params())
def test_installed_applier_patches_and_reverts(venv, tmp_path, case):
    kind, tag = case
    tree = tmp_path / "Megatron-LM"
    if kind == "skeleton":
        skeleton_checkout(tree, tag)
    else:
        git_archive(tag, tree)
        if kind == "git":
            make_git_checkout(tree, tag)
    before = snapshot(tree)
    module = [venv / "bin" / "python", "-m", "megatron_seq1f1b.patch"]
    command = [venv / "bin" / "seq1f1b-patch"]
    elsewhere = tmp_path  # not this clone

    check = in_venv(venv, *module, tree, "--check", cwd=elsewhere)
    assert check.returncode == 0 and "apply cleanly" in check.stdout, check.stderr
    assert f"Megatron-LM {tag} (" in check.stdout
    applied = in_venv(venv, *module, tree, cwd=elsewhere)
    assert applied.returncode == 0, applied.stderr
    assert [f"applied {p.name}" for p in PATCHES_OF[tag]] == \
        [line for line in applied.stdout.splitlines() if line.startswith("applied ")]
    patched = snapshot(tree)
    assert patched != before and all(b"[Seq1F1B]" in patched[rel] for rel in patched
                                     if patched[rel] != before[rel])
    again = in_venv(venv, *command, tree, "--check", cwd=elsewhere)
    assert again.returncode == 0 and "check: already applied" in again.stdout, again.stderr

    reverted = in_venv(venv, *command, tree, "--revert", cwd=elsewhere)
    assert reverted.returncode == 0 and "restored:" in reverted.stdout, reverted.stderr
    assert snapshot(tree) == before
    if kind == "git":
        assert subprocess.run(["git", "-C", str(tree), "status", "--porcelain"],
                              capture_output=True, text=True).stdout == ""
    # and the other way round: the command applies, the module reverts
    assert in_venv(venv, *command, tree, cwd=elsewhere).returncode == 0
    assert snapshot(tree) == patched
    assert in_venv(venv, *module, tree, "--revert", cwd=elsewhere).returncode == 0
    assert snapshot(tree) == before

    refused = in_venv(venv, *command, tmp_path / "nope", cwd=elsewhere)
    assert refused.returncode == 1 and refused.stderr.startswith("seq1f1b-patch: not a directory")
