"""Megatron-LM integration: the patches, the applier, megatron_seq1f1b.megatron_lm.

The applier is ``python -m megatron_seq1f1b.patch`` (``megatron_seq1f1b/megatron_lm/patch.py``;
also the ``seq1f1b-patch`` command and ``scripts/apply_patches.sh``); its
patches are ``megatron_seq1f1b/megatron_lm/patches/megatron-lm/<tag>/``.

* Real Megatron-LM sources, in both states: from a Megatron-LM git repository
  (MEGATRON_LM_REPO, a clone or mirror with the release tags; on this
  project's machines the bare mirror below is found by itself), each
  supported tag is made into an unpatched and an already-patched checkout;
  MEGATRON_LM_DIR / MEGATRON_LM_DIRS (os.pathsep-separated) add checkouts of
  your own, patched or not. On copies of each, the patches are applied (as an
  unpacked archive with GNU patch, and as a git checkout tagged with the
  detected tag, with `git apply`), compiled and reverted byte for byte; an
  already-patched checkout says "already applied", is reverted to the tag's
  sources and patched again. The anchors the hunks rely on are checked, and
  the patched ``forward_step`` cuts each segment's batch where the Python
  version the tag needs and Megatron-LM's own dependencies are installed
  (skipped otherwise, with the reason: run pytest with -rs).
* Always: the applier on synthetic checkouts of every supported tag (version
  refusal with the nearest tag, the 0.19.1 alias, --force-version, usage
  errors, apply/re-apply/revert, a partly applied tree completed or reverted,
  nothing changed when one patch conflicts or a file is missing),
  scripts/apply_patches.sh as a wrapper of it, the patches' form, and the
  shim's argument handling, validation, model preparation and batch slicing.
  tests/test_wheel.py installs a wheel into a fresh environment and patches
  with it.
"""

from __future__ import annotations

import argparse
import ast
import copy
import inspect
import json
import os
import py_compile
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

import pytest

from megatron_seq1f1b.megatron_lm import hooks as megatron_lm  # what the package forwards to
from megatron_seq1f1b.base.checks import ConfigError
from megatron_seq1f1b.megatron_lm import patch as applier

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "apply_patches.sh"
PATCH_ROOT = ROOT / "megatron_seq1f1b" / "megatron_lm" / "patches" / "megatron-lm"
TAGS = ["core_v0.16.1", "core_v0.17.1", "core_v0.18.2", "core_v0.19.0"]
PATCHES_OF = {tag: sorted((PATCH_ROOT / tag).glob("*.patch")) for tag in TAGS}
VERSION = "core_v0.16.1"  # the tag the single-tag synthetic tests use
PATCHES = PATCHES_OF[VERSION]
# What megatron/core/package_info.py says in each tag's sources (core_v0.19.0 says 0.19.1:
# the applier's alias table maps it back).
REPORTED = {"core_v0.16.1": (0, 16, 1), "core_v0.17.1": (0, 17, 1),
            "core_v0.18.2": (0, 18, 2), "core_v0.19.0": (0, 19, 1)}
# Each tag's pyproject.toml requires-python (read from the sources where they have one).
REQUIRES_PYTHON = {"core_v0.16.1": (3, 10), "core_v0.17.1": (3, 12),
                   "core_v0.18.2": (3, 12), "core_v0.19.0": (3, 12)}
# The shim functions each tag's hunks call (the adapters differ per tag).
# (Every tag: context_parallel_cut, rebinding get_batch's CP cut, and layer_spec in the GPT
# builder: gpt_builders.py to core_v0.18, megatron/training/models/gpt.py in core_v0.19.)
_CP = {"context_parallel_cut", "layer_spec"}
SHIM_CALLS = {
    "core_v0.16.1": {"extra_args_provider", "help_with_flags", "validate_args", "wrap_model_provider",
                     "slice_gpt_batch", *_CP},
    "core_v0.17.1": {"extra_args_provider", "help_with_flags", "validate_args", "wrap_model_provider",
                     "slice_gpt_batch", *_CP},
    "core_v0.18.2": {"extra_args_provider", "help_with_flags", "validate_args", "wrap_model_provider",
                     "slice_gpt_batch_fields", *_CP},
    "core_v0.19.0": {"extra_args_provider", "help_with_flags", "validate_args", "add_post_wrap_hook",
                     "slice_gpt_batch_fields", *_CP},
}
# The file whose GPT builder builds pretrain_gpt.py's model (layer_spec's hunk goes there).
BUILDER = {"core_v0.16.1": "gpt_builders.py", "core_v0.17.1": "gpt_builders.py",
           "core_v0.18.2": "gpt_builders.py", "core_v0.19.0": "megatron/training/models/gpt.py"}
# The hybrid builders (core_v0.18+), patched as BUILDER for context parallelism (0005).
HYBRID_BUILDER = {"core_v0.18.2": "hybrid_builders.py",
                  "core_v0.19.0": "megatron/training/models/hybrid.py"}
# The tags whose patches add --seq1f1b to pretrain_hybrid.py too (Megatron-Core's HybridModel,
# from core_v0.18; the same hooks as pretrain_gpt.py's, in a patch of its own).
HYBRID_TAGS = ["core_v0.18.2", "core_v0.19.0"]
# The scripts each tag's patches add --seq1f1b to.
SCRIPTS = {tag: ["pretrain_gpt.py"] + (["pretrain_hybrid.py"] if tag in HYBRID_TAGS else [])
           for tag in TAGS}
HAVE_PATCH = shutil.which("patch") is not None
HAVE_GIT = shutil.which("git") is not None
TOOLS = [pytest.param("patch", marks=pytest.mark.skipif(not HAVE_PATCH, reason="no patch")),
         pytest.param("git", marks=pytest.mark.skipif(not HAVE_GIT, reason="no git"))]


def _env(tool: str | None, **extra) -> dict:
    env = dict(os.environ, **extra)
    env.pop("SEQ1F1B_PATCH_TOOL", None)
    env.pop(applier.PROG_ENV, None)
    if tool:
        env["SEQ1F1B_PATCH_TOOL"] = tool
    return env


def run_script(*args, tool: str | None = None) -> subprocess.CompletedProcess:
    """``python -m megatron_seq1f1b.patch ARGS`` with this checkout's package."""
    pythonpath = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "megatron_seq1f1b.patch", *map(str, args)],
                          capture_output=True, text=True, env=_env(tool, PYTHONPATH=pythonpath),
                          timeout=300)


def run_wrapper(*args, tool: str | None = None, **extra) -> subprocess.CompletedProcess:
    """``scripts/apply_patches.sh ARGS`` (the wrapper)."""
    return subprocess.run(["bash", str(SCRIPT), *map(str, args)], capture_output=True,
                          text=True, env=_env(tool, **extra), timeout=300)


def touched_files(patches=PATCHES) -> list[str]:
    files = []
    for patch in patches:
        for line in patch.read_text().splitlines():
            if line.startswith("+++ "):
                files.append(line[4:].split("\t")[0].split("/", 1)[1])
    return sorted(set(files))


def snapshot(tree: Path) -> dict[str, bytes]:
    """Every file (and symlink target) under `tree`, by relative path, .git excluded."""
    out = {}
    for path in sorted(tree.rglob("*")):
        rel = path.relative_to(tree)
        if rel.parts[0] == ".git":
            continue
        if path.is_symlink():
            out[str(rel)] = b"->" + os.readlink(path).encode()
        elif path.is_file():
            out[str(rel)] = path.read_bytes()
    return out


def compile_all(tree: Path, files, tmp: Path) -> None:
    """py_compile without writing __pycache__ into the tree."""
    for i, rel in enumerate(files):
        if rel.endswith(".py"):
            py_compile.compile(str(tree / rel), cfile=str(tmp / f"c{i}.pyc"), doraise=True)


def git(tree: Path, *args) -> str:
    return subprocess.run(
        ["git", "-C", str(tree), "-c", "user.name=t", "-c", "user.email=t@t", *args],
        check=True, capture_output=True, text=True,
    ).stdout


def write_package_info(tree: Path, major: int, minor: int, patch: int, pre: str = "") -> None:
    info = tree / "megatron" / "core" / "package_info.py"
    info.parent.mkdir(parents=True, exist_ok=True)
    info.write_text(f'MAJOR = {major}\nMINOR = {minor}\nPATCH = {patch}\nPRE_RELEASE = "{pre}"\n'
                    "VERSION = (MAJOR, MINOR, PATCH, PRE_RELEASE)\n")


def skeleton_checkout(tree: Path, tag: str = VERSION, version=None) -> None:
    """A fake `tag` tree whose files hold exactly the hunks' original lines.

    Patches apply at an offset, so each touched file is the pre-image of its
    hunks (context and removed lines) separated by filler lines. This lets CI
    exercise the script without a Megatron-LM checkout. package_info.py says
    `version` (default: what the tag's own sources say, REPORTED).
    """
    write_package_info(tree, *(version or REPORTED[tag]))
    bodies: dict[str, list[str]] = {}
    current = None
    for patch in PATCHES_OF[tag]:
        in_hunk = False
        for line in patch.read_text().splitlines():
            if line.startswith("+++ "):
                current = line[4:].split("\t")[0].split("/", 1)[1]
                bodies.setdefault(current, [])
                in_hunk = False
            elif line.startswith("@@"):
                bodies[current].append("# (filler between hunks)")
                in_hunk = True
            elif in_hunk and line[:1] in (" ", "-"):
                bodies[current].append(line[1:])
            elif in_hunk and line.startswith("\\"):
                raise AssertionError("patches should not touch files without final newline")
    for rel, lines in bodies.items():
        path = tree / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines + ["# end"]) + "\n")


def apply_cycle(tree: Path, tmp: Path, tool: str, is_git: bool, compile_: bool = True,
                tag: str = VERSION, extra=()) -> None:
    """--check, apply, re-apply, compile, --check, revert, revert again: tree restored."""
    before = snapshot(tree)
    patches = PATCHES_OF[tag]
    files = touched_files(patches)

    check = run_script(tree, "--check", *extra, tool=tool)
    assert check.returncode == 0, check.stderr
    assert "apply cleanly" in check.stdout and f"Megatron-LM {tag} (" in check.stdout
    assert snapshot(tree) == before, "--check changed the tree"

    first = run_script(tree, *extra, tool=tool)
    assert first.returncode == 0, first.stderr
    for patch in patches:
        assert f"applied {patch.name}" in first.stdout
    after = snapshot(tree)
    assert sorted(k for k in after if after[k] != before.get(k)) == files
    assert set(after) == set(before), "apply must not add or remove files"
    for rel in files:
        assert b"[Seq1F1B]" in after[rel]
    if compile_:  # skeleton files are not valid Python
        compile_all(tree, files, tmp)

    again = run_script(tree, *extra, tool=tool)
    assert again.returncode == 0, again.stderr
    assert "already applied" in again.stdout
    assert snapshot(tree) == after

    assert "already applied" in run_script(tree, "--check", *extra, tool=tool).stdout

    revert = run_script(tree, "--revert", *extra, tool=tool)
    assert revert.returncode == 0, revert.stderr
    assert "restored" in revert.stdout
    assert snapshot(tree) == before, "revert did not restore the tree byte for byte"
    if is_git:
        assert git(tree, "status", "--porcelain") == ""

    twice = run_script(tree, "--revert", *extra, tool=tool)
    assert twice.returncode == 0 and "nothing to revert" in twice.stdout


def make_git_checkout(tree: Path, tag: str = VERSION) -> None:
    git(tree, "init", "-q")
    git(tree, "add", "-A")
    git(tree, "commit", "-q", "-m", "checkout")
    git(tree, "tag", tag)


# --------------------------------------------------------------------------- (a)
# Real Megatron-LM sources: from a git repository of Megatron-LM (both states of every tag)
# and from the checkouts MEGATRON_LM_DIR(S) name (in whatever state they are).

REPO_ENV = "MEGATRON_LM_REPO"
# Where this project's machines keep a bare mirror of github.com/NVIDIA/Megatron-LM.
DEFAULT_REPOS = ("/work/.mirror/NVIDIA+Megatron-LM/repo",)
STATES = ("unpatched", "patched")


def _megatron_lm_repo() -> Path | None:
    """MEGATRON_LM_REPO (set but empty: none), else a default mirror that exists."""
    if REPO_ENV in os.environ:
        return Path(os.environ[REPO_ENV]) if os.environ[REPO_ENV] else None
    return next((Path(d) for d in DEFAULT_REPOS if Path(d).exists()), None)


def _repo_tags(repo: Path | None) -> set[str]:
    if repo is None or not HAVE_GIT:
        return set()
    out = subprocess.run(["git", "-C", str(repo), "tag", "--list", "core_v*"],
                         capture_output=True, text=True)
    return set(out.stdout.split()) if out.returncode == 0 else set()


def _checkout_dirs() -> list[str]:
    """MEGATRON_LM_DIRS (os.pathsep-separated), then MEGATRON_LM_DIR; duplicates once."""
    dirs = [d for d in os.environ.get("MEGATRON_LM_DIRS", "").split(os.pathsep) if d]
    if os.environ.get("MEGATRON_LM_DIR"):
        dirs.append(os.environ["MEGATRON_LM_DIR"])
    return list(dict.fromkeys(dirs))


REPO = _megatron_lm_repo()
REPO_TAGS = _repo_tags(REPO)
CHECKOUTS = _checkout_dirs()


def _source_params(tags=TAGS) -> list:
    """Every tag of `tags` in both states (from the repository), then MEGATRON_LM_DIR(S)."""
    params = []
    for tag in tags:
        for state in STATES:
            if tag in REPO_TAGS:
                params.append(pytest.param(("repo", tag, state), id=f"{tag}-{state}"))
    if not params:
        if REPO is None:
            why = (f"no Megatron-LM git repository: set {REPO_ENV} to a clone of "
                   "https://github.com/NVIDIA/Megatron-LM with its tags "
                   f"({', '.join(tags)}) to test the patches on the real sources")
        else:
            why = f"{REPO_ENV}={REPO} has none of the tags {', '.join(tags)}"
        params.append(pytest.param(("skip", why, None), id="no-megatron-lm-repo"))
    else:
        for tag in sorted(set(tags) - REPO_TAGS):
            params.append(pytest.param(("skip", f"{REPO} has no tag {tag}", None),
                                       id=f"{tag}-missing"))
    for d in CHECKOUTS:
        params.append(pytest.param(("dir", d, None), id=Path(d).name))
    return params


class Source(NamedTuple):
    path: Path        # the checkout (tests work on copies)
    tag: str          # the tag whose patches apply
    state: str        # "unpatched" or "patched"
    original: dict    # touched file -> the tag's bytes (sources from the repository), or {}


def detect(path: Path) -> tuple[str, str]:
    """(tag, state) as the applier sees `path` (git tag at HEAD or package_info.py)."""
    result = run_script(path, "--check")
    found = re.search(r"^Megatron-LM (\S+) \(", result.stdout, re.MULTILINE)
    if not found or result.returncode != 0:
        pytest.fail(f"{path}: the applier found no supported version, or the patches "
                    f"neither apply nor are applied:\n{result.stdout}{result.stderr}")
    assert found.group(1) in TAGS, found.group(1)
    state = "patched" if "check: already applied" in result.stdout else "unpatched"
    return found.group(1), state


def git_archive(tag: str, dest: Path) -> None:
    """The parts of Megatron-LM `tag` that pretrain_gpt.py runs from: megatron/ and the
    top-level Python files (and pyproject.toml)."""
    names = subprocess.run(["git", "-C", str(REPO), "ls-tree", "--name-only", tag],
                           check=True, capture_output=True, text=True).stdout.split()
    paths = [n for n in names if n == "megatron" or n.endswith(".py") or n == "pyproject.toml"]
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", tag, *paths],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)


# (kind, value, state) -> Source: the checkouts made from the repository, shared by the
# fixtures below (they are only read; tests work on copies).
_SOURCES: dict = {}


def _source(param, tmp_path_factory) -> Source:
    kind, value, state = param
    if kind == "skip":
        print(f"SKIP: {value}")
        pytest.skip(value)
    if kind == "dir":
        path = Path(value)
        if not (path / "pretrain_gpt.py").is_file():
            pytest.fail(f"{path} is not a Megatron-LM checkout (no pretrain_gpt.py)")
        return Source(path, *detect(path), {})
    if param in _SOURCES:
        return _SOURCES[param]
    tag = value
    path = tmp_path_factory.mktemp(f"{tag}-{state}") / "Megatron-LM"
    git_archive(tag, path)
    original = {rel: (path / rel).read_bytes() for rel in touched_files(PATCHES_OF[tag])}
    if state == "patched":
        result = run_script(path)
        assert result.returncode == 0 and "patched:" in result.stdout, result.stderr
    assert detect(path) == (tag, state)
    _SOURCES[param] = Source(path, tag, state, original)
    return _SOURCES[param]


@pytest.fixture(scope="module", params=_source_params())
def lm_checkout(request, tmp_path_factory) -> Source:
    """A Megatron-LM checkout of a supported tag: from the repository in both states, or
    one of MEGATRON_LM_DIR(S)."""
    return _source(request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=_source_params(HYBRID_TAGS))
def hybrid_checkout(request, tmp_path_factory) -> Source:
    """As lm_checkout, for the tags whose patches add --seq1f1b to pretrain_hybrid.py
    (a checkout of MEGATRON_LM_DIR(S) of another tag is skipped)."""
    lm = _source(request.param, tmp_path_factory)
    if lm.tag not in HYBRID_TAGS:
        pytest.skip(f"{lm.path} is Megatron-LM {lm.tag}: no pretrain_hybrid.py patch "
                    f"(tags with one: {', '.join(HYBRID_TAGS)})")
    return lm


def copy_checkout(source: Path, tree: Path) -> None:
    shutil.copytree(source, tree, symlinks=True,
                    ignore=shutil.ignore_patterns(".git", "__pycache__"))


def unpatched_copy(lm: Source, tree: Path, files=None) -> Path:
    """A copy of the checkout (only `files` and package_info.py, if given), reverted to the
    tag's sources if it was patched."""
    if files is None:
        copy_checkout(lm.path, tree)
    else:
        for rel in [*files, "megatron/core/package_info.py"]:
            if (lm.path / rel).is_file():
                (tree / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(lm.path / rel, tree / rel)
    if lm.state == "patched":
        revert = run_script(tree, "--revert", "--force-version", lm.tag)
        assert revert.returncode == 0 and "restored:" in revert.stdout, revert.stderr
    for rel, data in lm.original.items():
        assert (tree / rel).read_bytes() == data, f"{rel} differs from {lm.tag}'s"
    return tree


@pytest.mark.parametrize("layout,tool", [
    pytest.param("archive", "patch",
                 marks=pytest.mark.skipif(not HAVE_PATCH, reason="no patch")),
    pytest.param("git", "git", marks=pytest.mark.skipif(not HAVE_GIT, reason="no git")),
])
def test_real_checkout(lm_checkout, tmp_path, layout, tool):
    lm = lm_checkout
    tree = tmp_path / "Megatron-LM"
    copy_checkout(lm.path, tree)
    if lm.state == "patched":
        patched = snapshot(tree)
        check = run_script(tree, "--check", tool=tool)
        assert check.returncode == 0 and "check: already applied" in check.stdout, check.stderr
        again = run_script(tree, tool=tool)
        assert again.returncode == 0, again.stderr
        assert "already applied; nothing to do" in again.stdout
        assert snapshot(tree) == patched
        revert = run_script(tree, "--revert", tool=tool)
        assert revert.returncode == 0 and "restored:" in revert.stdout, revert.stderr
        for rel, data in lm.original.items():
            assert (tree / rel).read_bytes() == data, f"{rel}: not the tag's sources"
    if layout == "git":
        make_git_checkout(tree, lm.tag)
        assert "from git tag" in run_script(tree, "--check", tool=tool).stdout
    else:
        assert "package_info" in run_script(tree, "--check", tool=tool).stdout
    apply_cycle(tree, tmp_path, tool, is_git=layout == "git", tag=lm.tag)
    if lm.state == "patched":  # and patched again: the checkout's files, byte for byte
        assert run_script(tree, tool=tool).returncode == 0
        assert snapshot(tree) == patched


def _guarded_imports(imports: str) -> str:
    """A probe's imports: a missing Megatron-LM dependency (or too old a Python) prints
    ``{"missing": ...}`` and exits 0, so the test can skip with the reason."""
    body = "".join(f"    {line}\n" for line in imports.splitlines())
    return "try:\n" + body + """except ImportError as exc:  # a missing dependency, or a Python older than the tag needs
    if "seq1f1b" in str(exc):
        raise
    print(json.dumps({"missing": f"{exc} (Python {sys.version.split()[0]})"}))
    sys.exit(0)
"""


FORWARD_STEP_PROBE = r"""
import importlib, inspect, json, os, sys
import torch
sys.argv = [SCRIPT, "--num-layers", "2", "--hidden-size", "64",
            "--num-attention-heads", "4", "--seq-length", "16", "--max-position-embeddings", "16",
            "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "1",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
            "--seq1f1b", "--seq1f1b-splits", "2", "--seq1f1b-partition", "uniform"]
""" + _guarded_imports("""script = importlib.import_module(SCRIPT[:-len(".py")])
from megatron.training import global_vars
from megatron.training.arguments import parse_args""") + r"""
from megatron_seq1f1b import megatron_lm
from megatron_seq1f1b.segments.run import SegmentRun

args = parse_args(megatron_lm.extra_args_provider(None))
global_vars.set_args(args)
global_vars._set_timers(args)
script.args = args  # as __main__ sets it (core_v0.19's pretrain_hybrid.forward_step reads it)
b, s = 2, 16
tokens = torch.arange(b * s).view(b, s)
fields = dict(tokens=tokens, labels=tokens + 1, loss_mask=torch.ones(b, s),
              attention_mask=torch.ones(b, 1, s, s, dtype=torch.bool), position_ids=tokens % s)
if "cu_seqlens_padded" in inspect.getsource(script.forward_step):  # core_v0.18+
    full = [fields.get(key) for key in megatron_lm.GPT_BATCH_KEYS]
else:
    full = (fields["tokens"], fields["labels"], fields["loss_mask"], fields["attention_mask"],
            fields["position_ids"], None)
script.get_batch = lambda data_iterator, vp_stage: full  # as after the TP broadcast
script.get_attr_wrapped_model = lambda model, attr: None
seen = []

def model(tokens, position_ids, attention_mask, labels=None, loss_mask=None,
          packed_seq_params=None):
    seen.append([list(tokens.shape), list(attention_mask.shape), int(position_ids[0, 0]),
                 list(labels.shape)])
    return torch.zeros(tokens.shape)

run = SegmentRun([8, 8])
tokens_per_segment = []
for segment in range(2):
    with run.forward(0, segment):
        output, loss_func = script.forward_step(iter(()), model)
        tokens_per_segment.append(int(loss_func(output)[1]))
script.forward_step(iter(()), model)

# Context parallelism, CP rank 1 of 2: get_batch's CP cut is the shim's; inside a segment it
# keeps the whole micro-batch, which forward_step then cuts to this rank's part of the segment.
class Group:
    def size(self):
        return 2

    def rank(self):
        return 1

cp_cut = script.get_batch_on_this_cp_rank
cp_seen = []

def model(tokens, position_ids, attention_mask, labels=None, loss_mask=None,
          packed_seq_params=None):
    cp_seen.append([tokens[0].tolist(), list(attention_mask.shape), position_ids[0].tolist()])
    return torch.zeros(tokens.shape)

run = SegmentRun([8, 8], cp_group=Group())
cp_kept = []
for segment in range(2):
    with run.forward(0, segment):
        whole = {"tokens": fields["tokens"]}
        cp_kept.append(cp_cut(whole) is whole)
        script.forward_step(iter(()), model)
cp = {"wrapped": getattr(cp_cut, "seq1f1b_cut", None) is not None, "kept": cp_kept,
      "seen": cp_seen}

# A packed (THD) micro-batch (--sft): documents [0, 5), [5, 12), [12, 16) in segments of 6, 10.
from megatron.core.packed_seq_params import PackedSeqParams
from megatron_seq1f1b.segments.documents import Documents

tokens = torch.arange(16).view(1, 16)
cu = torch.tensor([[0, 5, 12, 16]], dtype=torch.int32)
fields = dict(tokens=tokens, labels=tokens + 1, loss_mask=torch.ones(1, 16),
              position_ids=tokens.clone(), cu_seqlens=cu, cu_seqlens_padded=cu,
              max_seqlen=torch.tensor([7], dtype=torch.int32))
if "cu_seqlens_padded" in inspect.getsource(script.forward_step):  # core_v0.18+
    full = [fields.get(key) for key in megatron_lm.GPT_BATCH_KEYS]
else:  # get_batch builds PackedSeqParams (get_thd_batch_on_this_cp_rank)
    full = (fields["tokens"], fields["labels"], fields["loss_mask"], None,
            fields["position_ids"], PackedSeqParams(
                qkv_format="thd", cu_seqlens_q=cu[0], cu_seqlens_kv=cu[0],
                max_seqlen_q=7, max_seqlen_kv=7))
packed, packed_extra = [], []

def model(tokens, position_ids, attention_mask, labels=None, loss_mask=None,
          packed_seq_params=None):
    p = packed_seq_params
    packed.append([p.qkv_format, p.cu_seqlens_q.tolist(), p.cu_seqlens_kv.tolist(),
                   int(p.max_seqlen_q), list(tokens.shape), int(position_ids[0, 0])])
    packed_extra.append([getattr(p, "total_tokens", None), getattr(p, "tokens_per_sample", None)])
    return torch.zeros(tokens.shape)

run = SegmentRun([6, 10], documents=[Documents(((0, 5, 12),), 16)])
for segment in range(2):
    with run.forward(0, segment):
        script.forward_step(iter(()), model)
print(json.dumps({"seen": seen, "tokens": tokens_per_segment, "packed": packed, "cp": cp,
                  "packed_extra": packed_extra,
                  "flags": [args.seq1f1b, args.seq1f1b_splits, args.seq1f1b_partition]}))
"""


def requires_python(tree: Path, tag: str) -> tuple[int, int]:
    """The Python the tag needs: its pyproject.toml's requires-python, else REQUIRES_PYTHON."""
    pyproject = tree / "pyproject.toml"
    if pyproject.is_file():
        found = re.search(r'requires-python\s*=\s*">=\s*(\d+)\.(\d+)', pyproject.read_text())
        if found:
            return int(found.group(1)), int(found.group(2))
    return REQUIRES_PYTHON[tag]


def run_probe(lm: Source, tmp_path: Path, probe: str) -> dict:
    """Run `probe` in a patched copy of the checkout; its last line of JSON. Skips where the
    tag needs a newer Python or Megatron-LM's own dependencies are missing."""
    needed = requires_python(lm.path, lm.tag)
    if sys.version_info[:2] < needed:
        pytest.skip(f"Megatron-LM {lm.tag} needs Python >= {needed[0]}.{needed[1]} "
                    f"(this is {sys.version.split()[0]})")
    tree = tmp_path / "Megatron-LM"
    copy_checkout(lm.path, tree)
    applied = run_script(tree)
    assert applied.returncode == 0, applied.stderr
    assert ("already applied" if lm.state == "patched" else "patched:") in applied.stdout
    # The checkout, then this package, then what PYTHONPATH adds (e.g. Megatron-LM's deps).
    pythonpath = os.pathsep.join(filter(None, [str(tree), str(ROOT),
                                               os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=pythonpath, WORLD_SIZE="1", RANK="0")
    out = subprocess.run([sys.executable, "-c", probe], cwd=tree, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if "missing" in result:
        pytest.skip(f"Megatron-LM {lm.tag}'s own dependencies are not installed here: "
                    f"{result['missing']}")
    return result


# The builder probes' set-up: the patched script's arguments parsed and set as Megatron-LM's
# global args, one gloo rank, Megatron's parallel state (on CPU with the package's patches).
ONE_RANK = r"""
from megatron_seq1f1b import megatron_lm
from megatron_seq1f1b.runtime import cpu

if not torch.cuda.is_available():
    cpu.enable()
args = parse_args(megatron_lm.extra_args_provider(None))
args.padded_vocab_size = 128
global_vars.set_args(args)
with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
parallel_state.initialize_model_parallel()
"""


BUILDER_PROBE = r"""
import json, socket, sys
sys.argv = ["pretrain_gpt.py", "--num-layers", "2", "--hidden-size", "64",
            "--num-attention-heads", "4", "--seq-length", "16", "--max-position-embeddings", "16",
            "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
            "--transformer-impl", "local", "--context-parallel-size", "2",
            "--seq1f1b", "--seq1f1b-splits", "2"]
""" + _guarded_imports("""import pretrain_gpt  # noqa: F401 (the patched script's imports)
from megatron.training import global_vars
from megatron.training.arguments import parse_args""") + r"""
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer import TransformerConfig

""" + ONE_RANK + r"""# The model's config says CP 2 (this one process stands for a CP rank; building needs no peer).
config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                           context_parallel_size=2, use_cpu_initialization=True)
if BUILDER == "gpt_builders.py":  # core_v0.16-0.18: pretrain_gpt.py's gpt_builder
    from gpt_builders import gpt_builder

    def build():
        return gpt_builder(args, True, True, None, config=config)
else:  # core_v0.19: pretrain_gpt.py's GPTModelConfig, built by its GPTModelBuilder
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.argument_utils import gpt_config_from_args
    from megatron.training.models.gpt import GPTModelBuilder

    config.transformer_impl = "local"  # what core_transformer_config_from_args takes from args

    def build():
        model_config = gpt_config_from_args(args, config=config)
        return GPTModelBuilder(model_config).build_model(
            ProcessGroupCollection.use_mpu_process_groups(), True, True)
built = {}
for backend in ("auto", "flash"):
    args.attention_backend = backend
    model = build()
    built[backend] = sorted({type(layer.self_attention.core_attention).__name__
                             for layer in model.decoder.layers})
args.seq1f1b = False
try:
    build()
    built["without --seq1f1b"] = "built"
except AssertionError as exc:  # Megatron's own: local attention asserts CP 1
    built["without --seq1f1b"] = "refused: " + str(exc).splitlines()[0][:60]
print(json.dumps(built))
"""


HELP_PROBE = r"""
import contextlib, importlib, io, json, runpy, sys
sys.argv = [SCRIPT, "--help"]
""" + _guarded_imports("""importlib.import_module(SCRIPT[:-len(".py")])  # its imports""") + r"""
out = io.StringIO()
with contextlib.redirect_stdout(out):
    try:
        runpy.run_path(SCRIPT, run_name="__main__")
        code = "returned"
    except SystemExit as exc:
        code = exc.code
text = out.getvalue()
print(json.dumps({"code": code, "megatron": "--num-layers" in text,
                  "seq1f1b": [flag for flag in ("--seq1f1b", "--seq1f1b-splits",
                                                "--seq1f1b-partition") if flag in text]}))
"""


def for_script(script: str, probe: str) -> str:
    """`probe` for the patched `script` (pretrain_gpt.py, pretrain_hybrid.py): it reads SCRIPT."""
    return f"SCRIPT = {script!r}\n" + probe


def check_help(result: dict) -> None:
    assert result == {"code": 0, "megatron": True,
                      "seq1f1b": ["--seq1f1b", "--seq1f1b-splits", "--seq1f1b-partition"]}, result


def test_patched_help_lists_the_seq1f1b_flags(lm_checkout, tmp_path):
    """``pretrain_gpt.py --help`` on a patched checkout lists Megatron's flags and ours, and
    exits 0, on every tag (upstream's own help stops on a bare '%' from core_v0.18.2 on; the
    hook makes it printable). Same needs as test_patched_forward_step."""
    check_help(run_probe(lm_checkout, tmp_path, for_script("pretrain_gpt.py", HELP_PROBE)))


def test_patched_hybrid_help_lists_the_seq1f1b_flags(hybrid_checkout, tmp_path):
    """``pretrain_hybrid.py --help`` likewise (core_v0.18.2, core_v0.19.0)."""
    check_help(run_probe(hybrid_checkout, tmp_path, for_script("pretrain_hybrid.py", HELP_PROBE)))


def test_patched_builder_with_context_parallel(lm_checkout, tmp_path):
    """The patched builder of pretrain_gpt.py's model (gpt_builder in core_v0.16-0.18,
    GPTModelBuilder from the GPTModelConfig of the arguments in core_v0.19) builds, with
    --seq1f1b --context-parallel-size 2 --transformer-impl local, Megatron's local core
    attention as Seq1F1B's CP subclass, or the flash attention with --attention-backend
    flash; without --seq1f1b Megatron refuses as before. Same needs as
    test_patched_forward_step."""
    probe = f"BUILDER = {BUILDER[lm_checkout.tag]!r}\n" + BUILDER_PROBE
    result = run_probe(lm_checkout, tmp_path, probe)
    assert result["auto"] == ["ContextParallelDotProductAttention"], result
    assert result["flash"] == ["FlashDotProductAttention"], result
    assert result["without --seq1f1b"].startswith("refused: Context parallelism"), result


HYBRID_BUILDER_PROBE = r"""
import json, runpy, socket, sys, types
# A hybrid pattern (PATTERN, with FLAGS; NUM_EXPERTS for its MoE layers, set before this
# text); our local (non-TE) stack spec through --spec (core_v0.18.2's hybrid_builder requires
# one; core_v0.19.0's builder would take Transformer Engine's); no fusions, dropout or linear
# biases (CPU, exact comparison).
sys.argv = ["pretrain_hybrid.py", "--hybrid-layer-pattern", PATTERN, "--hidden-size", "64",
            "--num-attention-heads", "4", "--seq-length", "16", "--max-position-embeddings", "16",
            "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
            "--transformer-impl", "local", "--use-cpu-initialization",
            "--position-embedding-type", "rope", "--no-rope-fusion", "--no-persist-layer-norm",
            "--no-gradient-accumulation-fusion", "--no-bias-gelu-fusion",
            "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion", "--no-masked-softmax-fusion",
            "--disable-bias-linear", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--spec", "seq1f1b_probe_spec", "spec", "--seq1f1b", "--seq1f1b-splits", "2", *FLAGS]
""" + _guarded_imports("""import pretrain_hybrid  # noqa: F401 (the patched script's imports)
import megatron.training
from megatron.training import training""") + r"""
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_seq1f1b import ConfigError
from megatron_seq1f1b.megatron_lm import GPT_BATCH_KEYS, prepare_model
from megatron_seq1f1b.runtime import cpu
from megatron_seq1f1b.runtime.model_hooks import is_prepared, unwrap

if not torch.cuda.is_available():
    cpu.enable()  # the reference kernels in Megatron's recurrent mixers too (this checkout's)
from megatron_seq1f1b.runtime.hybrid_spec import local_hybrid_stack_spec

spec_module = types.ModuleType("seq1f1b_probe_spec")
spec_module.spec = local_hybrid_stack_spec(attention="local", num_experts=NUM_EXPERTS)
sys.modules["seq1f1b_probe_spec"] = spec_module

# The patched __main__ (flags, validate_args, the model hook), up to its pretrain() call.
called = []
megatron.training.pretrain = lambda *args, **kwargs: called.append(args)
runpy.run_path("pretrain_hybrid.py", run_name="__main__")
(call,) = called

with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
parallel_state.initialize_model_parallel()
tensor_parallel.model_parallel_cuda_manual_seed(1234)
pg_collection = ProcessGroupCollection.use_mpu_process_groups()
try:
    if len(call) == 5:  # core_v0.18: pretrain(config, datasets, partial(model_provider, ...))
        provider = call[2]
        hooked = getattr(provider.func, "seq1f1b_wrapped", None) is not None
        # as get_model calls it (one chunk)
        chunks = [provider(pre_process=True, post_process=True, config=None,
                           pg_collection=pg_collection)]
    else:  # core_v0.19: pretrain(config, ...): the HybridModelConfig's builder, as
        # setup_model_and_optimizer runs it (its post-wrap hooks after building the chunks)
        model_config = call[0].model
        hooked = prepare_model in model_config.post_wrap_hooks
        chunks = model_config.get_builder_cls()(model_config).build_distributed_models(
            pg_collection=pg_collection, wrap_with_ddp=False)
except ConfigError as exc:  # the model hook's enable() refuses what it cannot run
    print(json.dumps({"refused": str(exc)}))
    sys.exit(0)
model = unwrap(chunks[0])
func = training.get_forward_backward_func()

# One micro-batch through the installed Seq1F1B function (2 segments) and through Megatron's
# own schedule, both with the forward_step that __main__ passed to pretrain() (the module
# __main__ ran in: core_v0.19's forward_step reads its global args).
forward_step = call[-1]
torch.manual_seed(0)
tokens = torch.randint(0, 128, (1, 16))
fields = dict(tokens=tokens, labels=torch.roll(tokens, -1, 1), loss_mask=torch.ones(1, 16),
              position_ids=torch.arange(16).view(1, 16))
batch = [fields.get(key) for key in GPT_BATCH_KEYS]
forward_step.__globals__["get_batch"] = lambda data_iterator, vp_stage: batch
runs = {}
for name, schedule in (("seq1f1b", func), ("megatron", forward_backward_no_pipelining)):
    for param in model.parameters():
        param.grad = None
    store = schedule(forward_step_func=forward_step, data_iterator=iter(()), model=chunks,
                     num_microbatches=1, seq_length=16, micro_batch_size=1)
    runs[name] = {"loss": [sum(float(report["lm loss"][i]) for report in store) for i in (0, 1)],
                  "grads": {n: p.grad.clone() for n, p in model.named_parameters()
                            if p.grad is not None}}
ours, megatron = runs["seq1f1b"], runs["megatron"]
print(json.dumps({
    "hooked": hooked, "model": type(model).__name__,
    "layers": [type(layer).__name__ for layer in model.decoder.layers],
    "mixers": [type(getattr(layer, "mixer", getattr(layer, "self_attention", layer))).__name__
               for layer in model.decoder.layers],
    # the kernels that enable() wrapped to carry state, in this checkout's modules
    "carrying": sorted(f"{type(m).__name__}.{name}" for m in model.modules()
                       for name, value in vars(sys.modules[type(m).__module__]).items()
                       if getattr(value, "seq1f1b_carry", False)
                       and type(m).__name__ in ("MambaMixer", "GatedDeltaNet")),
    "prepared": is_prepared(chunks), "installed": getattr(func, "num_splits", None),
    "loss": [ours["loss"], megatron["loss"]],
    "grads": [sorted(ours["grads"]) == sorted(megatron["grads"]), len(megatron["grads"]),
              len(list(model.parameters()))],
    "grad_diff": max(float((ours["grads"][n] - g).abs().max())
                     for n, g in megatron["grads"].items())}))
"""


HYBRID_CP_BUILDER_PROBE = r"""
import json, socket, sys
sys.argv = ["pretrain_hybrid.py", "--hybrid-layer-pattern", "*-*-",
            "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16",
            "--max-position-embeddings", "16", "--micro-batch-size", "1",
            "--global-batch-size", "1", "--train-iters", "1", "--mock-data",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
            "--transformer-impl", "local", "--context-parallel-size", "2",
            "--spec", "megatron_seq1f1b.megatron_lm.hybrid_spec", "local", "--seq1f1b",
            "--seq1f1b-splits", "2"]
""" + _guarded_imports("""import pretrain_hybrid  # noqa: F401 (the patched script's imports)
from megatron.training import global_vars
from megatron.training.arguments import parse_args""") + r"""
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig

""" + ONE_RANK + r"""pg_collection = ProcessGroupCollection.use_mpu_process_groups()
# The model's config says CP 2 (this one process stands for a CP rank; building needs no peer).
config = TransformerConfig(num_layers=4, hidden_size=64, num_attention_heads=4,
                           context_parallel_size=2, use_cpu_initialization=True)
if BUILDER == "hybrid_builders.py":  # core_v0.18: pretrain_hybrid.py's hybrid_builder
    from hybrid_builders import hybrid_builder

    def build():
        return hybrid_builder(args, True, True, None, config=config, pg_collection=pg_collection)
else:  # core_v0.19: pretrain_hybrid.py's HybridModelConfig, built by its HybridModelBuilder
    from megatron.training.argument_utils import hybrid_config_from_args

    config.transformer_impl = "local"  # what core_transformer_config_from_args takes from args

    def build():
        model_config = hybrid_config_from_args(args, config=config)
        return model_config.get_builder_cls()(model_config).build_model(
            pg_collection, True, True)
built = {}
for backend in ("auto", "flash"):
    args.attention_backend = backend
    model = build()
    built[backend] = sorted({type(layer.self_attention.core_attention).__name__
                             for layer in model.decoder.layers
                             if hasattr(getattr(layer, "self_attention", None), "core_attention")})
args.seq1f1b = False
try:
    build()
    built["without --seq1f1b"] = "built"
except AssertionError as exc:  # Megatron's own: local attention asserts CP 1
    built["without --seq1f1b"] = "refused: " + str(exc).splitlines()[0][:60]
print(json.dumps(built))
"""


def test_patched_hybrid_builder_with_context_parallel(hybrid_checkout, tmp_path):
    """The patched hybrid builder (core_v0.18.2's hybrid_builder, core_v0.19.0's
    HybridModelBuilder from the HybridModelConfig of the arguments) builds, with --seq1f1b
    --context-parallel-size 2 --transformer-impl local and our local stack spec (--spec
    megatron_seq1f1b.megatron_lm.hybrid_spec local, as docs/megatron_lm.md says),
    Megatron's local core attention as Seq1F1B's CP subclass, or the flash attention with
    --attention-backend flash; without --seq1f1b Megatron refuses as before. Same needs as
    test_patched_forward_step."""
    probe = f"BUILDER = {HYBRID_BUILDER[hybrid_checkout.tag]!r}\n" + HYBRID_CP_BUILDER_PROBE
    result = run_probe(hybrid_checkout, tmp_path, probe)
    assert result["auto"] == ["ContextParallelDotProductAttention"], result
    assert result["flash"] == ["FlashDotProductAttention"], result
    assert result["without --seq1f1b"].startswith("refused: Context parallelism"), result


def test_patched_hybrid_builder_prepares_the_model(hybrid_checkout, tmp_path):
    """The patched pretrain_hybrid.py's __main__ (core_v0.18.2: the model provider it passes
    to pretrain(), partial(model_provider, hybrid_builder); core_v0.19.0: the post-wrap hook on
    its HybridModelConfig, run by HybridModelBuilder.build_distributed_models) prepares the
    HybridModel it builds ('*-*E', our local stack spec through --spec): enable()d and the
    Seq1F1B function installed, which then trains one micro-batch in two segments with the
    script's own forward_step to Megatron's loss and gradients. Same needs as
    test_patched_forward_step."""
    result = run_probe(hybrid_checkout, tmp_path, hybrid_builder_probe("*-*E", num_experts=4))
    assert result["layers"] == ["TransformerLayer", "MLPLayer", "TransformerLayer",
                                "MoETransformerLayer"], result
    check_hybrid_training(result)


# Megatron-LM's flags for Mamba-2 and gated-delta-net sizes, small (16 Mamba heads of 8 in 2
# groups, state 8; 2 key and 4 value heads of 8), and --swiglu: GatedDeltaNet's convolution
# asserts silu, which Megatron-LM sets with it.
RECURRENT_FLAGS = ["--mamba-state-dim", "8", "--mamba-head-dim", "8", "--mamba-num-groups", "2",
                   "--linear-key-head-dim", "8", "--linear-value-head-dim", "8",
                   "--linear-num-key-heads", "2", "--linear-num-value-heads", "4",
                   "--linear-conv-kernel-dim", "4", "--swiglu", "--normalization", "RMSNorm"]


def test_patched_hybrid_builder_carries_mamba_and_gated_delta_net_state(hybrid_checkout,
                                                                          tmp_path):
    """As test_patched_hybrid_builder_prepares_the_model, with Mamba-2 (M) and gated delta net
    (G) layers sized by Megatron-LM's flags ('M-G*': the checkout's own MambaMixer and
    GatedDeltaNet, on CPU with megatron_seq1f1b's reference kernels, which cpu.enable() puts
    into this checkout's megatron.core.ssm modules): Seq1F1B's two segments, the second
    starting from the first's convolution windows and recurrent states, train the
    micro-batch to Megatron's loss and gradients. Both tags: core_v0.18.2's GatedDeltaNet
    already calls fla's causal_conv1d and chunk_gated_delta_rule, which the hooks wrap (it is
    0.16 and 0.17's, which call causal-conv1d's kernel, that recurrent_hooks.problems
    refuses; those tags have no pretrain_hybrid.py patch)."""
    result = run_probe(hybrid_checkout, tmp_path, hybrid_builder_probe("M-G*", RECURRENT_FLAGS))
    assert result["layers"] == ["MambaLayer", "MLPLayer", "TransformerLayer",
                                "TransformerLayer"], result
    assert result["mixers"] == ["MambaMixer", "IdentityOp", "GatedDeltaNet", "SelfAttention"], \
        result
    assert {"MambaMixer.mamba_split_conv1d_scan_combined", "GatedDeltaNet.causal_conv1d"} \
        <= set(result["carrying"]), result
    check_hybrid_training(result)


def hybrid_builder_probe(pattern: str, flags: list[str] = (), num_experts: int | None = None,
                         ) -> str:
    """HYBRID_BUILDER_PROBE for `pattern`, with `flags` (and --num-experts for MoE layers)."""
    flags = [*flags, *(["--num-experts", str(num_experts)] if num_experts else [])]
    # Megatron's MambaMixer needs einops (one of Megatron-LM's dependencies): skip without it
    needs = _guarded_imports("import einops") if "M" in pattern else ""
    return (f"import json, sys\n{needs}PATTERN = {pattern!r}\nFLAGS = {flags!r}\n"
            f"NUM_EXPERTS = {num_experts!r}\n" + HYBRID_BUILDER_PROBE)


def check_hybrid_training(result: dict) -> None:
    """The patched __main__ prepared the HybridModel and installed Seq1F1B (2 segments), which
    trained one micro-batch to Megatron's loss and gradients, every parameter's."""
    assert "refused" not in result, result
    assert result["hooked"] and result["prepared"], result
    assert result["model"] == "HybridModel" and result["installed"] == 2, result
    (ours_sum, ours_tokens), (megatron_sum, megatron_tokens) = result["loss"]
    assert ours_tokens == megatron_tokens == 16, result
    assert ours_sum == pytest.approx(megatron_sum, rel=1e-5), result
    same_names, with_grads, params = result["grads"]
    assert same_names and with_grads == params, result
    assert result["grad_diff"] < 1e-5, result


def test_patched_forward_step(lm_checkout, tmp_path):
    """The patched pretrain_gpt.forward_step cuts each segment's batch, packed (THD) ones too,
    and with context parallelism this CP rank's part of it (get_batch's own CP cut keeps the
    whole micro-batch inside a segment).

    Needs the Python version the tag requires (3.12 from core_v0.17) and Megatron-LM's own
    dependencies (its training package imports more than Megatron-Core: pydantic, ...).
    """
    result = run_probe(lm_checkout, tmp_path, for_script("pretrain_gpt.py", FORWARD_STEP_PROBE))
    check_forward_step(result)


def test_patched_hybrid_forward_step(hybrid_checkout, tmp_path):
    """The patched pretrain_hybrid.forward_step (core_v0.18.2, core_v0.19.0) cuts each segment's
    batch as pretrain_gpt's does: the same ten get_batch fields, packed batches, context
    parallelism. Its PackedSeqParams also carries total_tokens (Mamba's seq_idx: the segment's
    pieces) and, in core_v0.19, tokens_per_sample from the module's global args (__main__'s)."""
    result = run_probe(hybrid_checkout, tmp_path,
                       for_script("pretrain_hybrid.py", FORWARD_STEP_PROBE))
    check_forward_step(result)
    per_sample = 16 if hybrid_checkout.tag == "core_v0.19.0" else None  # --seq-length
    assert result["packed_extra"] == [[6, per_sample], [10, per_sample]], result


def check_forward_step(result: dict) -> None:
    assert result["flags"] == [True, 2, "uniform"]
    assert result["seen"] == [[[2, 8], [2, 1, 8, 8], 0, [2, 8]],
                              [[2, 8], [2, 1, 8, 16], 8, [2, 8]],
                              [[2, 16], [2, 1, 16, 16], 0, [2, 16]]]
    assert result["tokens"] == [16, 16]
    # context parallelism: segment 0 is tokens 0..7, segment 1 tokens 8..15, each in 4 chunks
    # of 2; CP rank 1 holds chunks 1 and 2 (its queries' mask rows, keys up to the segment end)
    assert result["cp"] == {"wrapped": True, "kept": [True, True], "seen": [
        [[2, 3, 4, 5], [2, 1, 4, 8], [2, 3, 4, 5]],
        [[10, 11, 12, 13], [2, 1, 4, 16], [10, 11, 12, 13]]]}
    # packed batches: each segment's PackedSeqParams holds its own document pieces
    assert result["packed"] == [["thd", [0, 5, 6], [0, 5, 6], 5, [1, 6], 0],
                                ["thd", [0, 6, 10], [0, 6, 10], 6, [1, 10], 6]]


def call_keywords(source: str, func_name: str) -> list[set[str]]:
    """The keyword names of every call `func_name(...)` in `source`."""
    return [{k.arg for k in node.keywords}
            for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == func_name]


def test_real_checkout_calls_exist(lm_checkout, tmp_path):
    """The unpatched sources still hold what the hunks and the shim rely on."""
    tag = lm_checkout.tag
    source = unpatched_copy(lm_checkout, tmp_path / "Megatron-LM", files=[
        *touched_files(PATCHES_OF[tag]), "megatron/training/training.py",
        "megatron/training/models/gpt.py"])
    text = (source / "pretrain_gpt.py").read_text()
    patch_text = "".join(p.read_text() for p in PATCHES_OF[tag])
    assert "= get_batch(data_iterator, vp_stage)" in text
    assert "extra_args_provider=add_modelopt_args if has_nvidia_modelopt else None" in text
    # core_v0.18+: get_batch returns its BATCH_KEYS in order; slice_gpt_batch_fields knows them.
    keys = [node.value for node in ast.walk(ast.parse(text))
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "BATCH_KEYS"
                                                    for t in node.targets)]
    assert bool(keys) == ("slice_gpt_batch_fields" in patch_text)
    for value in keys:
        assert tuple(ast.literal_eval(value)) == megatron_lm.GPT_BATCH_KEYS
    # core_v0.19: the model comes from a GPTModelConfig whose builder runs post_wrap_hooks.
    builds_from_config = "gpt_config_from_args(" in text
    assert builds_from_config == ("add_post_wrap_hook" in patch_text)
    if builds_from_config:
        gpt = (source / "megatron" / "training" / "models" / "gpt.py").read_text()
        assert "compose_hooks(self._model_config.post_wrap_hooks)" in gpt
    else:
        assert "partial(model_provider, gpt_builder)" in text
        assert "from gpt_builders import gpt_builder" in text
    # Context parallelism under --seq1f1b: get_batch's CP cut goes through the module-level
    # name the patch rebinds (imported above model_provider's import, where the hunk adds
    # the rebinding), and the spec that layer_spec changes is the one the model is built from.
    assert text.count("batch = get_batch_on_this_cp_rank(") == 1
    tree = ast.parse(text)
    imported = [node.lineno for node in tree.body if isinstance(node, ast.ImportFrom)
                and any(alias.name == "get_batch_on_this_cp_rank" for alias in node.names)]
    provider = [node.lineno for node in tree.body if isinstance(node, ast.ImportFrom)
                and node.module == "model_provider"]
    assert len(imported) == 1 and provider and imported[0] < provider[0]
    builder = (source / BUILDER[tag]).read_text()
    assert BUILDER[tag] in touched_files(PATCHES_OF[tag])
    assert builder.count("model = GPTModel(") == 1 and builder.count(
        "transformer_layer_spec=transformer_layer_spec,") == 1
    assert builder.index("model = GPTModel(") < builder.index(
        "transformer_layer_spec=transformer_layer_spec,")
    if tag == "core_v0.19.0":  # --attention-backend local sets Megatron's attention first
        assert builder.index("= MCoreDotProductAttention") < builder.index("model = GPTModel(")

    training = (source / "megatron" / "training" / "training.py").read_text()
    # install() patches this module-level name; train() and evaluate() look it up at call time.
    assert "from megatron.core.pipeline_parallel import get_forward_backward_func" in training
    getter_calls = call_keywords(training, "get_forward_backward_func")
    assert len(getter_calls) == 2
    import megatron_seq1f1b.api as api_mod

    assert set().union(*getter_calls) <= set(api_mod.GETTER_KEYWORDS)
    # Every keyword train_step and evaluate pass is one the Seq1F1B function takes.
    import megatron_seq1f1b as s1

    accepted = set(inspect.signature(s1.get_forward_backward_func(2)).parameters)
    schedule_calls = call_keywords(training, "forward_backward_func")
    assert len(schedule_calls) == 3  # train_step, evaluate (loss), evaluate (non-loss data)
    assert set().union(*schedule_calls) <= accepted, set().union(*schedule_calls) - accepted


def _function(source: str, name: str) -> ast.FunctionDef:
    (found,) = [node for node in ast.parse(source).body
                if isinstance(node, ast.FunctionDef) and node.name == name]
    return found


def _stored_names(function: ast.FunctionDef, name: str) -> int:
    """How often `function` assigns the local `name`."""
    return sum(isinstance(node, ast.Name) and node.id == name and isinstance(node.ctx, ast.Store)
               for node in ast.walk(function))


def test_real_checkout_hybrid_calls_exist(hybrid_checkout, tmp_path):
    """pretrain_hybrid.py's unpatched sources hold what its hunks rely on, as pretrain_gpt.py's
    do: get_batch returns the same ten BATCH_KEYS (in the order forward_step unpacks them), the
    anchors of the hunks, the model provider (core_v0.18.2) or the HybridModelConfig whose
    builder runs post_wrap_hooks (core_v0.19.0); pretrain_mamba.py runs pretrain_hybrid.py.
    Patched, forward_step's `args` is still what it was (core_v0.19: the module's global)."""
    tag = hybrid_checkout.tag
    source = unpatched_copy(hybrid_checkout, tmp_path / "Megatron-LM", files=[
        *touched_files(PATCHES_OF[tag]), "megatron/training/models/hybrid.py",
        "pretrain_mamba.py"])
    assert "pretrain_hybrid.py" in touched_files(PATCHES_OF[tag])
    text = (source / "pretrain_hybrid.py").read_text()
    assert text.count("= get_batch(data_iterator, vp_stage)") == 1
    assert text.count("extra_args_provider=add_modelopt_args if has_nvidia_modelopt else None") == 1
    assert text.count("pretrain, store = inprocess_restart.maybe_wrap_for_inprocess_restart(") == 1
    keys = [node.value for node in ast.walk(ast.parse(text))
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "BATCH_KEYS"
                                                    for t in node.targets)]
    assert len(keys) == 1 and tuple(ast.literal_eval(keys[0])) == megatron_lm.GPT_BATCH_KEYS
    forward_step = _function(text, "forward_step")
    unpacked = [[element.id for element in node.targets[0].elts]
                for node in ast.walk(forward_step) if isinstance(node, ast.Assign)
                and isinstance(node.value, ast.Call) and getattr(node.value.func, "id", "")
                == "get_batch"]
    assert unpacked == [list(megatron_lm.GPT_BATCH_KEYS)]
    if tag == "core_v0.19.0":  # the model comes from a HybridModelConfig (post-wrap hooks)
        assert text.count("model_cfg = hybrid_config_from_args(args") == 2  # (and ModelOpt's)
        assert "pretrain_cfg_container_from_args(args, model_cfg)" in text
        assert "model_provider, hybrid_builder" not in text
        hybrid = (source / "megatron" / "training" / "models" / "hybrid.py").read_text()
        assert "compose_hooks(self._model_config.post_wrap_hooks)" in hybrid
        assert _stored_names(forward_step, "args") == 0 and "args.seq_length" in \
            ast.unparse(forward_step)
    else:  # pretrain() gets the model provider
        assert "partial(model_provider, hybrid_builder)" in text
        assert "from hybrid_builders import hybrid_builder" in text
    # get_batch's CP cut goes through the module-level name the hunk rebinds after the imports
    assert text.count("batch = get_batch_on_this_cp_rank(") == 1
    tree = ast.parse(text)
    imported = [node.lineno for node in tree.body if isinstance(node, ast.ImportFrom)
                and any(alias.name == "get_batch_on_this_cp_rank" for alias in node.names)]
    provider = [node.lineno for node in tree.body if isinstance(node, ast.ImportFrom)
                and node.module == "model_provider"]
    assert len(imported) == 1 and provider and imported[0] < provider[0]
    mamba = (source / "pretrain_mamba.py").read_text()
    assert 'runpy.run_path(os.path.join(_this_dir, "pretrain_hybrid.py"), run_name="__main__")' \
        in mamba

    applied = run_script(source)
    assert applied.returncode == 0 and "patched:" in applied.stdout, applied.stderr
    patched = _function((source / "pretrain_hybrid.py").read_text(), "forward_step")
    assert _stored_names(patched, "args") == _stored_names(forward_step, "args")


# --------------------------------------------------------------------------- (b)

def test_unsupported_version_is_refused(tmp_path):
    write_package_info(tmp_path, 0, 12, 0)
    (tmp_path / "pretrain_gpt.py").write_text("# not 0.16.1\n")
    before = snapshot(tmp_path)
    result = run_script(tmp_path)
    assert result.returncode == 1
    assert "core_v0.12.0" in result.stderr and "not supported" in result.stderr
    for tag in TAGS:  # the supported versions are listed
        assert tag in result.stderr
    assert "nearest supported version: core_v0.16.1" in result.stderr
    assert snapshot(tmp_path) == before
    check = run_script(tmp_path, "--check")
    assert check.returncode == 1 and VERSION in check.stderr


@pytest.mark.parametrize("version,nearest", [
    ((0, 20, 0), "core_v0.19.0"),   # newer than all: the newest
    ((1, 0, 0), "core_v0.19.0"),
    ((0, 19, 3), "core_v0.19.0"),   # through the alias 0.19.1
    ((0, 18, 0), "core_v0.18.2"),   # same minor beats the closer-looking 0.17.1
    ((0, 17, 5), "core_v0.17.1"),
    ((0, 16, 0), "core_v0.16.1"),
    ((0, 12, 0), "core_v0.16.1"),   # older than all: the oldest
])
def test_nearest_version_is_named(tmp_path, version, nearest):
    skeleton_checkout(tmp_path, nearest, version=version)
    before = snapshot(tmp_path)
    result = run_script(tmp_path, "--check")
    assert result.returncode == 1
    reported = "core_v{}.{}.{}".format(*version)
    assert f"Megatron-LM {reported} (from megatron/core/package_info.py) is not supported" \
        in result.stderr
    assert f"nearest supported version: {nearest};" in result.stderr
    assert f"--force-version {nearest}" in result.stderr
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("tool", TOOLS)
def test_force_version(tmp_path, tool):
    """A release the script does not know, whose files match a supported tag's."""
    tree = tmp_path / "fake"
    skeleton_checkout(tree, "core_v0.18.2", version=(0, 20, 0))
    assert run_script(tree, tool=tool).returncode == 1
    check = run_script(tree, "--check", "--force-version", "core_v0.18.2", tool=tool)
    assert check.returncode == 0, check.stderr
    assert ("Megatron-LM core_v0.18.2 (forced with --force-version core_v0.18.2; "
            "megatron/core/package_info.py says core_v0.20.0)") in check.stdout
    apply_cycle(tree, tmp_path, tool, is_git=False, compile_=False, tag="core_v0.18.2",
                extra=("--force-version=core_v0.18.2",))
    # Forcing the wrong tag changes nothing: the context has to match exactly.
    before = snapshot(tree)
    wrong = run_script(tree, "--force-version", "core_v0.16.1", tool=tool)
    assert wrong.returncode == 1 and "nothing was changed" in wrong.stderr
    assert snapshot(tree) == before


def test_force_version_through_alias_and_without_version(tmp_path):
    tree = tmp_path / "fake"
    skeleton_checkout(tree, "core_v0.19.0")
    (tree / "megatron" / "core" / "package_info.py").unlink()
    assert "not a Megatron-LM checkout" in run_script(tree, "--check").stderr
    result = run_script(tree, "--check", "--force-version", "core_v0.19.1")
    assert result.returncode == 0, result.stderr
    assert "Megatron-LM core_v0.19.0 (forced with --force-version core_v0.19.1; " \
        "no version found in the checkout)" in result.stdout


@pytest.mark.parametrize("tool", TOOLS)
def test_alias_0_19_1_is_core_v0_19_0(tmp_path, tool):
    """The core_v0.19.0 tag's package_info.py says 0.19.1: its patches are chosen."""
    tree = tmp_path / "fake"
    skeleton_checkout(tree, "core_v0.19.0")  # package_info.py: 0.19.1, as in the tag
    check = run_script(tree, "--check", tool=tool)
    assert check.returncode == 0, check.stderr
    assert ("Megatron-LM core_v0.19.0 (from megatron/core/package_info.py: core_v0.19.1, "
            "an alias of core_v0.19.0)") in check.stdout
    apply_cycle(tree, tmp_path, tool, is_git=False, compile_=False, tag="core_v0.19.0")


@pytest.mark.skipif(not HAVE_GIT, reason="no git")
def test_alias_applies_to_git_tags(tmp_path):
    skeleton_checkout(tmp_path, "core_v0.19.0", version=(0, 0, 0))
    make_git_checkout(tmp_path, tag="core_v0.19.1")
    result = run_script(tmp_path, "--check")
    assert result.returncode == 0, result.stderr
    assert "(from git tag: core_v0.19.1, an alias of core_v0.19.0)" in result.stdout


@pytest.mark.skipif(not HAVE_GIT, reason="no git")
def test_unsupported_git_tag_falls_back_to_package_info(tmp_path):
    write_package_info(tmp_path, 0, 17, 0)
    make_git_checkout(tmp_path, tag="core_v0.17.0")
    result = run_script(tmp_path, "--check")
    assert result.returncode == 1
    assert "core_v0.17.0" in result.stderr and VERSION in result.stderr
    assert "no patches for git tag core_v0.17.0" in result.stderr
    assert "nearest supported version: core_v0.17.1" in result.stderr


@pytest.mark.parametrize("args,message", [
    ((), "missing MEGATRON_LM_DIR"),
    (("{tree}", "--frobnicate"), "unknown option"),
    (("{tree}", "--check", "--revert"), "at most one"),
    (("{tree}", "{tree}"), "more than one directory"),
    (("{tree}", "--force-version"), "--force-version needs a TAG"),
    (("{tree}", "--force-version="), "--force-version needs a TAG"),
    (("{tree}", "--force-version", "core_v0.99.0"), "no patches for that tag"),
    (("{tree}", "--force-version", "core_v0.16.1", "--force-version", "core_v0.16.1"),
     "given twice"),
])
def test_usage_errors(tmp_path, args, message):
    result = run_script(*(a.format(tree=tmp_path) for a in args))
    assert result.returncode == 2
    assert message in result.stderr and "usage:" in result.stderr


def test_help_and_not_a_checkout(tmp_path):
    help_ = run_script("--help")
    assert help_.returncode == 0 and "usage:" in help_.stdout and "--force-version" in help_.stdout
    for tag in TAGS:
        assert tag in help_.stdout
    assert "core_v0.19.1 = core_v0.19.0" in help_.stdout
    assert "3 (--check) partly applied" in help_.stdout
    missing = run_script(tmp_path / "nope")
    assert missing.returncode == 1 and "not a directory" in missing.stderr
    empty = run_script(tmp_path)
    assert empty.returncode == 1 and "not a Megatron-LM checkout" in empty.stderr


def test_wrapper_is_the_module(tmp_path):
    """scripts/apply_patches.sh runs the module: the same output, under the script's name as
    it was called (what a hint says to type again)."""
    tree = tmp_path / "fake"
    skeleton_checkout(tree, "core_v0.18.2", version=(0, 18, 9))
    python = {"SEQ1F1B_PYTHON": sys.executable}
    for args in [("--help",), (tree,), (tree, "--check", "--revert"),
                 (tree, "--check", "--force-version", "core_v0.18.2")]:
        module, wrapper = run_script(*args), run_wrapper(*args, **python)
        assert wrapper.returncode == module.returncode, (args, wrapper.stderr)
        for ours, theirs in ((wrapper.stdout, module.stdout), (wrapper.stderr, module.stderr)):
            assert ours == theirs.replace(applier.MODULE_PROG, str(SCRIPT)), args
    refused = run_wrapper(tree, **python)
    assert f"{SCRIPT} '{tree}' --force-version core_v0.18.2" in refused.stderr
    apply_cycle(tree, tmp_path, None, is_git=False, compile_=False, tag="core_v0.18.2",
                extra=("--force-version", "core_v0.18.2"))
    # Without SEQ1F1B_PYTHON the wrapper finds a Python itself (this clone's .venv, python3).
    found = run_wrapper("--help")
    assert found.returncode == 0 and "--force-version" in found.stdout, found.stderr


def test_applier_in_process(tmp_path, capsys, monkeypatch):
    """main() returns the exit status; the command's name is what messages call it."""
    tree = tmp_path / "fake"
    skeleton_checkout(tree, "core_v0.16.1")
    assert applier.main([str(tree), "--check"], prog="seq1f1b-patch") == 0
    assert "apply cleanly" in capsys.readouterr().out
    assert applier.main([str(tree), "--bogus"], prog="seq1f1b-patch") == 2
    assert capsys.readouterr().err.startswith("seq1f1b-patch: unknown option: --bogus\n")
    monkeypatch.delenv(applier.PROG_ENV, raising=False)
    for argv0, prog in [("/venv/bin/seq1f1b-patch", "seq1f1b-patch"),
                        ("/site-packages/megatron_seq1f1b/megatron_lm/patch.py", applier.MODULE_PROG),
                        ("-c", applier.MODULE_PROG)]:
        monkeypatch.setattr(sys, "argv", [argv0])
        assert applier.default_prog() == prog
    monkeypatch.setenv(applier.PROG_ENV, "apply_patches.sh")
    assert applier.default_prog() == "apply_patches.sh"


def test_applier_needs_only_the_standard_library():
    code = ("import sys; import megatron_seq1f1b.megatron_lm.patch as p; "
            "print(sorted(m for m in ('torch', 'megatron', 'megatron_seq1f1b.api', 'numpy') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.stdout.strip() == "[]"
    assert applier.PATCH_ROOT == PATCH_ROOT


def test_every_patch_folder_is_tested():
    assert sorted(p.name for p in PATCH_ROOT.iterdir() if p.is_dir()) == sorted(TAGS)


@pytest.mark.parametrize("tag", TAGS)
def test_patches_are_well_formed(tag):
    patches = PATCHES_OF[tag]
    assert patches, f"no patches in {PATCH_ROOT / tag}"
    files = touched_files(patches)
    assert "pretrain_gpt.py" in files and "megatron/training/arguments.py" in files
    assert [f for f in files if f.startswith("pretrain_")] == SCRIPTS[tag]
    assert not [f for f in files if f.startswith("megatron/core/")], "no hunks in megatron/core"
    for patch in patches:
        text = patch.read_text()
        assert "\r" not in text
        header = text.split("\n--- ", 1)[0]
        assert header.startswith(f"Seq1F1B for Megatron-LM {tag}"), header[:80]
        assert len(header.strip().splitlines()) >= 3, "a short header explains the patch"
        for line in text.splitlines():
            if line.startswith(("--- ", "+++ ")):
                assert re.match(r"^(---|\+\+\+) [ab]/\S+$", line), line
        # Hunks add calls into the shim; the one line they replace is the
        # extra_args_provider argument (now chained through the shim).
        for hunk in re.split(r"^@@.*$", text, flags=re.MULTILINE)[1:]:
            lines = [ln for ln in hunk.splitlines() if not ln.startswith(("+++ ", "--- "))]
            added = "\n".join(ln[1:] for ln in lines if ln.startswith("+"))
            removed = [ln[1:].strip() for ln in lines if ln.startswith("-")]
            assert "[Seq1F1B]" in added
            assert "megatron_seq1f1b" in added or "seq1f1b_megatron_lm" in added
            assert set(removed) <= {
                "extra_args_provider=add_modelopt_args if has_nvidia_modelopt else None,"}, removed


@pytest.mark.parametrize("tag", TAGS)
@pytest.mark.parametrize("tool", TOOLS)
def test_skeleton_checkout_cycle(tmp_path, tool, tag):
    tree = tmp_path / "fake"
    skeleton_checkout(tree, tag)
    apply_cycle(tree, tmp_path, tool, is_git=False, compile_=False, tag=tag)


@pytest.mark.parametrize("tool", TOOLS)
def test_conflict_changes_nothing(tmp_path, tool):
    """One patch would apply, the last one cannot: the tree stays as it was."""
    tree = tmp_path / "fake"
    skeleton_checkout(tree)
    last = touched_files(PATCHES[-1:])[0]
    (tree / last).write_text((tree / last).read_text().replace("\n", "\n# local edit\n", 3))
    before = snapshot(tree)
    result = run_script(tree, tool=tool)
    assert result.returncode == 1
    assert "nothing was changed" in result.stderr
    assert snapshot(tree) == before
    if len(PATCHES) > 1:
        assert "not applied" in result.stderr and "conflicts" in result.stderr
    assert run_script(tree, "--check", tool=tool).returncode == 1
    assert run_script(tree, "--revert", tool=tool).returncode == 1
    assert snapshot(tree) == before


def lines(text: str) -> list[str]:
    return text.splitlines()


def partly_applied(tree: Path, pristine: dict, undone, tool: str | None = None) -> None:
    """Put the `pristine` files in `tree`, apply every patch, then put back the pristine
    files of the patches `undone` (as `git checkout FILE` would): those patches are no
    longer applied."""
    for rel, data in pristine.items():
        (tree / rel).write_bytes(data)
    result = run_script(tree, tool=tool)
    assert result.returncode == 0 and "patched:" in result.stdout, result.stderr
    for patch in undone:
        for rel in touched_files([patch]):
            (tree / rel).write_bytes(pristine[rel])


def check_partly_applied(tree: Path, patches, undone, tool: str | None = None) -> None:
    """--check on a partly applied tree: exit 3, every patch's state, nothing changed."""
    before = snapshot(tree)
    check = run_script(tree, "--check", tool=tool)
    assert check.returncode == applier.PARTLY == 3, check.stdout + check.stderr
    assert (f"check: partly applied: {len(patches) - len(undone)} of {len(patches)} "
            "patch(es) applied, the others apply cleanly") in lines(check.stdout)
    for patch in patches:
        state = "not applied" if patch in undone else "applied"
        assert f"  {patch.name} ({' '.join(touched_files([patch]))}): {state}" \
            in lines(check.stdout)
    assert "--revert to revert the applied ones" in check.stdout
    assert snapshot(tree) == before, "--check changed the tree"


def repair_and_revert(tree: Path, patches, undone, pristine: dict, patched: dict,
                      tool: str | None = None) -> None:
    """A partly applied tree (the patches `undone` not applied): --check says so; applying
    applies exactly those and gives the cleanly patched tree; --revert on the partly
    applied tree reverts exactly the others and gives the pristine tree."""
    files = touched_files(patches)
    partly_applied(tree, pristine, undone, tool)
    check_partly_applied(tree, patches, undone, tool)
    result = run_script(tree, tool=tool)
    assert result.returncode == 0, result.stdout + result.stderr
    out = lines(result.stdout)
    for patch in patches:
        if patch in undone:
            assert f"applied {patch.name}" in out
        else:
            assert f"already applied: {patch.name} (left as is)" in out
    assert f"patched: {' '.join(touched_files(undone))}" in out
    assert {rel: (tree / rel).read_bytes() for rel in files} == patched
    assert lines(run_script(tree, "--check", tool=tool).stdout)[-1] == "check: already applied"

    partly_applied(tree, pristine, undone, tool)
    revert = run_script(tree, "--revert", tool=tool)
    assert revert.returncode == 0, revert.stdout + revert.stderr
    out = lines(revert.stdout)
    for patch in patches:
        if patch in undone:
            assert f"not applied: {patch.name} (left as is)" in out
        else:
            assert f"reverted {patch.name}" in out
    reverted = [line for line in out if line.startswith("reverted ")]
    assert reverted == [f"reverted {p.name}" for p in reversed(patches) if p not in undone]
    assert {rel: (tree / rel).read_bytes() for rel in files} == pristine
    again = run_script(tree, "--revert", tool=tool)
    assert again.returncode == 0 and "not applied; nothing to revert" in again.stdout


@pytest.mark.parametrize("tag", [VERSION, "core_v0.19.0"])
@pytest.mark.parametrize("tool", TOOLS)
def test_partly_applied_tree_is_repaired_or_reverted(tmp_path, tool, tag):
    """Some patches applied, the others not (a file checked out again, or patched by hand):
    applying applies the others, --revert reverts the applied ones, --check exits 3."""
    patches = PATCHES_OF[tag]
    tree = tmp_path / "fake"
    skeleton_checkout(tree, tag)
    files = touched_files(patches)
    pristine = {rel: (tree / rel).read_bytes() for rel in files}
    clean = tmp_path / "clean"
    skeleton_checkout(clean, tag)
    assert run_script(clean, tool=tool).returncode == 0
    patched = {rel: (clean / rel).read_bytes() for rel in files}
    for undone in (patches[:1], patches[1:], patches[1:2]):  # first undone, only first applied
        repair_and_revert(tree, patches, undone, pristine, patched, tool)


def test_real_checkout_partly_applied(lm_checkout, tmp_path):
    """The walkthrough: patch a real checkout, `git checkout pretrain_gpt.py` (0001 no
    longer applied); --check says partly applied (exit 3), applying applies 0001 alone
    (the result is the cleanly patched tree), --revert reverts 0002.. (the tag's sources)."""
    lm = lm_checkout
    if not lm.original:
        pytest.skip(f"{lm.path}: no pristine sources of {lm.tag} to compare with")
    patches = PATCHES_OF[lm.tag]
    files = touched_files(patches)
    tree = unpatched_copy(lm, tmp_path / "Megatron-LM", files)
    clean = unpatched_copy(lm, tmp_path / "clean", files)
    assert run_script(clean).returncode == 0
    patched = {rel: (clean / rel).read_bytes() for rel in files}
    assert touched_files(patches[:1]) == ["pretrain_gpt.py"]
    repair_and_revert(tree, patches, patches[:1], lm.original, patched)


def one_file_patches(root: Path) -> list[Path]:
    """A patch folder (root/core_v0.16.1) of three patches: 0001 on one.py; 0002 and 0003
    on two.py, 0003's context holding 0002's added line and 0003's added line falling in
    0002's context: 0003 applies only after 0002, and 0002 reverts only after 0003."""
    folder = root / VERSION
    folder.mkdir(parents=True)
    (folder / "0001-one.patch").write_text(
        "--- a/one.py\n+++ b/one.py\n@@ -1,3 +1,4 @@\n a = 1\n+# [Seq1F1B] one\n b = 2\n"
        " c = 3\n")
    (folder / "0002-two.patch").write_text(
        "--- a/two.py\n+++ b/two.py\n@@ -1,6 +1,7 @@\n l1\n l2\n l3\n+# [Seq1F1B] B\n l4\n"
        " l5\n l6\n")
    (folder / "0003-two-again.patch").write_text(
        "--- a/two.py\n+++ b/two.py\n@@ -2,6 +2,7 @@\n l2\n l3\n # [Seq1F1B] B\n+# [Seq1F1B] C\n"
        " l4\n l5\n l6\n")
    return sorted(folder.glob("*.patch"))


def run_in_process(root: Path, capsys, *args) -> tuple[int, str, str]:
    """The applier with the patch folders under `root`: (status, stdout, stderr)."""
    run = applier.Applier("seq1f1b-patch", root=root)
    try:
        status = run.run([str(a) for a in args])
    except applier.Exit as stop:
        status = stop.status
    finally:
        run.cleanup()
    captured = capsys.readouterr()
    return status, captured.out, captured.err


@pytest.mark.parametrize("tool", TOOLS)
def test_patches_on_one_file_are_judged_in_order(tmp_path, capsys, monkeypatch, tool):
    """Two patches of one file, each depending on the other's lines (one way to apply, the
    other to revert): their states are found in sequence, so a tree with only the first
    file patched gets the rest, and one with only the second file patched reverts."""
    monkeypatch.setenv("SEQ1F1B_PATCH_TOOL", tool)
    root = tmp_path / "patches"
    patches = one_file_patches(root)
    tree = tmp_path / "fake"
    write_package_info(tree, *REPORTED[VERSION])
    pristine = {"one.py": b"a = 1\nb = 2\nc = 3\n",
                "two.py": "".join(f"l{i}\n" for i in range(1, 8)).encode()}
    patched = {"one.py": b"a = 1\n# [Seq1F1B] one\nb = 2\nc = 3\n",
               "two.py": b"l1\nl2\nl3\n# [Seq1F1B] B\n# [Seq1F1B] C\nl4\nl5\nl6\nl7\n"}

    def files() -> dict:
        return {rel: (tree / rel).read_bytes() for rel in pristine}

    def put(state: dict) -> None:
        for rel, data in state.items():
            (tree / rel).write_bytes(data)

    for undone, mixed in ((patches[1:], {"one.py": patched["one.py"], "two.py": pristine["two.py"]}),
                          (patches[:1], {"one.py": pristine["one.py"], "two.py": patched["two.py"]})):
        put(mixed)
        status, out, err = run_in_process(root, capsys, tree, "--check")
        assert status == 3, out + err
        for patch in patches:
            state = "not applied" if patch in undone else "applied"
            assert f"  {patch.name} ({touched_files([patch])[0]}): {state}" in lines(out)
        assert files() == mixed
        status, out, err = run_in_process(root, capsys, tree)
        assert status == 0 and files() == patched, out + err
        assert [line for line in lines(out) if line.startswith("applied ")] == \
            [f"applied {p.name}" for p in undone]
        put(mixed)
        status, out, err = run_in_process(root, capsys, tree, "--revert")
        assert status == 0 and files() == pristine, out + err
        assert [line for line in lines(out) if line.startswith("reverted ")] == \
            [f"reverted {p.name}" for p in reversed(patches) if p not in undone]
    # All applied and none applied: the usual cycle.
    put(pristine)
    assert run_in_process(root, capsys, tree)[0] == 0 and files() == patched
    assert "check: already applied" in run_in_process(root, capsys, tree, "--check")[1]
    assert run_in_process(root, capsys, tree, "--revert")[0] == 0 and files() == pristine


@pytest.mark.parametrize("tool", TOOLS)
def test_patch_both_applying_and_reverting_is_refused(tmp_path, capsys, monkeypatch, tool):
    """A file where a patch both applies (its context is there twice) and reverts: no
    guess, nothing changed, in any mode."""
    monkeypatch.setenv("SEQ1F1B_PATCH_TOOL", tool)
    folder = tmp_path / "patches" / VERSION
    folder.mkdir(parents=True)
    (folder / "0001-one.patch").write_text(
        "--- a/one.py\n+++ b/one.py\n@@ -2,2 +2,3 @@\n a = 1\n+# [Seq1F1B]\n b = 2\n")
    tree = tmp_path / "fake"
    write_package_info(tree, *REPORTED[VERSION])
    (tree / "one.py").write_text("c = 3\na = 1\n# [Seq1F1B]\nb = 2\nd = 4\na = 1\nb = 2\n"
                                 "e = 5\n")
    before = snapshot(tree)
    for args in ((), ("--check",), ("--revert",)):
        status, out, err = run_in_process(tmp_path / "patches", capsys, tree, *args)
        assert status == 1, out + err
        assert "0001-one.patch would both apply and revert; refusing to guess" in err
        assert "0001-one.patch (one.py): both applies and reverts" in err
        assert snapshot(tree) == before


@pytest.mark.parametrize("tag", [VERSION, "core_v0.19.0"])
def test_missing_file_is_named_with_its_patch(tmp_path, tag):
    """A checkout without a patched file: the headline names the first patch that touches
    a missing file, and that file; nothing is changed in any mode."""
    patches = PATCHES_OF[tag]
    tree = tmp_path / "fake"
    skeleton_checkout(tree, tag)
    second = touched_files(patches[1:2])[0]
    assert second == "megatron/training/arguments.py"
    (tree / second).unlink()
    before = snapshot(tree)
    for args in ((), ("--check",), ("--revert",)):
        result = run_script(tree, *args)
        assert result.returncode == 1, result.stdout
        assert (f"{applier.MODULE_PROG}: first failure, {patches[1].name}: missing file "
                f"{second}") in lines(result.stderr)
        assert f"{patches[0].name} (pretrain_gpt.py): not applied" in result.stderr
        assert f"{patches[1].name} ({second}): conflicts" in result.stderr
        assert snapshot(tree) == before
    for rel in touched_files(patches):  # every patched file missing: 0001's is named
        (tree / rel).unlink(missing_ok=True)
    result = run_script(tree)
    assert result.returncode == 1
    assert f"first failure, {patches[0].name}: missing file pretrain_gpt.py" in result.stderr


@pytest.mark.skipif(not HAVE_PATCH, reason="no patch")
@pytest.mark.parametrize("tag", HYBRID_TAGS)
def test_checkout_patched_before_pretrain_hybrid(tmp_path, tag):
    """A checkout patched before pretrain_hybrid.py and the hybrid builder had their patches
    (0001-0003 applied): --check names the patches not applied (exit 3), and applying
    applies those two only; the checkout is then fully patched (and reverts as usual)."""
    tree = tmp_path / "fake"
    skeleton_checkout(tree, tag)
    earlier = [p for p in PATCHES_OF[tag] if p.name < "0004"]
    later = PATCHES_OF[tag][len(earlier):]
    assert [touched_files([p]) for p in later] == [["pretrain_hybrid.py"], [HYBRID_BUILDER[tag]]]
    for patch in earlier:
        subprocess.run(["patch", "-s", "-d", str(tree), "-p1", "-i", str(patch)], check=True)
    check_partly_applied(tree, PATCHES_OF[tag], later)
    result = run_script(tree)
    assert result.returncode == 0, result.stderr
    assert [line for line in lines(result.stdout) if line.startswith("applied ")] == \
        [f"applied {p.name}" for p in later]
    assert f"patched: {' '.join(touched_files(later))}" in result.stdout
    assert "check: already applied" in run_script(tree, "--check").stdout
    assert "restored:" in run_script(tree, "--revert").stdout


@pytest.mark.parametrize("tag", TAGS)
def test_hunks_call_existing_shim_functions(tag):
    """Every megatron_lm name the hunks use exists (guards renames in the package)."""
    names = set()
    for patch in PATCHES_OF[tag]:
        added = "\n".join(line[1:] for line in patch.read_text().splitlines()
                          if line.startswith("+") and not line.startswith("+++"))
        names |= set(re.findall(r"seq1f1b_megatron_lm\.(\w+)", added))
        names |= set(re.findall(r"from megatron_seq1f1b\.megatron_lm import (\w+)", added))
        assert "megatron_seq1f1b" in added or not added.strip()
    assert names == SHIM_CALLS[tag]
    for name in names:
        assert callable(getattr(megatron_lm, name)), name
        assert getattr(megatron_lm, name).__doc__, name


# --------------------------------------------------------------------------- (c)

def parser_with_seq1f1b() -> argparse.ArgumentParser:
    return megatron_lm.add_arguments(argparse.ArgumentParser(allow_abbrev=False))


def test_arguments_defaults_and_values():
    args = parser_with_seq1f1b().parse_args([])
    assert (args.seq1f1b, args.seq1f1b_splits, args.seq1f1b_partition) == (False, None, "balanced")
    assert megatron_lm.segment_splits(args) == 4  # unset: the default count
    args = parser_with_seq1f1b().parse_args(
        ["--seq1f1b", "--seq1f1b-splits", "8", "--seq1f1b-partition", "uniform"])
    assert (args.seq1f1b, args.seq1f1b_splits, args.seq1f1b_partition) == (True, 8, "uniform")
    parser = parser_with_seq1f1b()
    assert any(g.title == "seq1f1b" for g in parser._action_groups)
    assert megatron_lm.add_arguments(parser) is parser  # twice: no argparse conflict


@pytest.mark.parametrize("argv", [["--seq1f1b-partition", "random"], ["--seq1f1b-splits", "x"]])
def test_arguments_rejected_by_argparse(argv, capsys):
    with pytest.raises(SystemExit):
        parser_with_seq1f1b().parse_args(argv)
    assert "seq1f1b" in capsys.readouterr().err


def test_extra_args_provider_chains():
    calls = []

    def modelopt_like(parser):
        calls.append("other")
        parser.add_argument("--export-model-type", default="GPTModel")
        return parser

    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser = megatron_lm.extra_args_provider(modelopt_like)(parser)
    args = parser.parse_args(["--seq1f1b", "--export-model-type", "X"])
    assert calls == ["other"] and args.seq1f1b and args.export_model_type == "X"

    def returns_none(parser):  # a provider that forgets to return the parser
        parser.add_argument("--foo", type=int, default=1)

    parser = megatron_lm.extra_args_provider(returns_none)(argparse.ArgumentParser())
    assert parser.parse_args(["--foo", "2", "--seq1f1b-splits", "3"]).seq1f1b_splits == 3
    assert megatron_lm.extra_args_provider(None)(argparse.ArgumentParser()).parse_args(
        []).seq1f1b is False


def test_flags_listing(capsys):
    """python -m megatron_seq1f1b.megatron_lm: the flags' help where pretrain_gpt.py --help
    fails (core_v0.18.2, core_v0.19.0), and the values given flags take."""
    assert megatron_lm.main([]) == 0
    out = capsys.readouterr().out
    flags = [o for a in parser_with_seq1f1b()._actions for o in a.option_strings
             if o.startswith("--seq1f1b")]
    assert len(flags) >= 8 and all(flag in out for flag in flags)
    assert "--moe-paged-stash-buffer-size-factor-cuda" in out and "values:" not in out
    assert megatron_lm.main(["--seq1f1b", "--seq1f1b-splits", "auto"]) == 0
    assert "seq1f1b=True" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        megatron_lm.main(["--seq1f1b-splits", "x"])
    out = subprocess.run([sys.executable, "-m", "megatron_seq1f1b.megatron_lm", "--help"],
                         capture_output=True, text=True, env=dict(os.environ,
                                                                   PYTHONPATH=str(ROOT)))
    assert out.returncode == 0 and "--seq1f1b-partition" in out.stdout


def megatron_args(**overrides) -> SimpleNamespace:
    """The Megatron-LM attributes the shim reads, as validate_args leaves them (GPT, TP 2)."""
    values = dict(
        seq1f1b=True, seq1f1b_splits=4, seq1f1b_partition="balanced",
        seq_length=4096, decoder_seq_length=None, tensor_model_parallel_size=2,
        pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=None,
        sequence_parallel=True, context_parallel_size=1, hybrid_context_parallel=False,
        overlap_p2p_comm=False, variable_seq_lengths=False, sft=False,
        rl_use_sequence_packing=False, use_legacy_models=False, num_experts=None,
        overlap_moe_expert_parallel_comm=False, mtp_num_layers=None,
        multi_latent_attention=False, experimental_attention_variant=None, window_size=None,
        position_embedding_type="rope", cuda_graph_impl="none",
        fine_grained_activation_offloading=False, reset_attention_mask=False,
        reset_position_ids=False, create_attention_mask_in_dataloader=True,
        dataloader_inter_document_masking=False, logits_load_dir=None, logits_save_dir=None,
        micro_batch_size=1, transformer_impl="local",
    )
    values.update(overrides)
    return SimpleNamespace(**values)


# Packed (THD) batches as Seq1F1B takes them: one sample per micro-batch, RoPE unfused.
PACKED = {"micro_batch_size": 1, "apply_rope_fusion": False}
FLASH = {"transformer_impl": "local", "attention_backend": "flash",
         "create_attention_mask_in_dataloader": False}


@pytest.mark.parametrize("overrides", [
    {},
    {"seq1f1b_splits": 1, "seq1f1b_partition": "uniform"},
    {"virtual_pipeline_model_parallel_size": 2, "overlap_p2p_comm": True},
    {"position_embedding_type": "learned_absolute", "sequence_parallel": False,
     "tensor_model_parallel_size": 1, "seq_length": 5},
    # dense [b,1,s,s] document masks: fine with the local attention (not TE's flash/fused)
    {"reset_attention_mask": True, "reset_position_ids": True},
    {"reset_attention_mask": True, "seq1f1b_partition": "documents"},
    # documents the schedule reads: packed batches (every tag: --sft; 0.19: inter-document
    # masking), end-of-document tokens on the flash attention
    {"sft": True, **PACKED},
    {"sft": True, **PACKED, "transformer_impl": "transformer_engine"},
    {"sft": True, **PACKED, **FLASH, "seq1f1b_partition": "documents"},
    {"dataloader_inter_document_masking": True, **PACKED, "eval_micro_batch_size": 1},
    {"dataloader_inter_document_masking": True, "micro_batch_size": 1,
     "position_embedding_type": "learned_absolute"},  # no RoPE: fusion does not matter
    {"dataloader_inter_document_masking": True, "reset_attention_mask": True, **PACKED,
     "transformer_impl": "transformer_engine"},
    {"reset_attention_mask": True, **FLASH},
    {"reset_attention_mask": True, **FLASH, "seq1f1b_partition": "documents",
     "micro_batch_size": 4},
    {"sft": True, **PACKED, "multi_latent_attention": True, "rope_type": "rope"},
    {"reset_attention_mask": True, "seq1f1b_splits": "auto"},
    {"decoder_seq_length": 4096},
    {"seq_length": 8, "tensor_model_parallel_size": 2, "seq1f1b_splits": 4},
    {"seq1f1b_schedule": "zb-h1", "virtual_pipeline_model_parallel_size": 2,
     "overlap_p2p_comm": True},
    {"seq1f1b_schedule": "zb-h2"},
    {"mtp_num_layers": 2},  # multi-token prediction (pretrain_hybrid.py: '/' in the pattern)
    # context parallelism with Megatron's local attention or the flash one, documents by
    # end-of-document tokens (dense mask, or the flash attention's own)
    {"context_parallel_size": 2},
    {"context_parallel_size": 4, "cp_comm_type": ["all_gather"], "seq_length": 4096},
    {"context_parallel_size": 2, "cp_comm_type": "p2p", "sequence_parallel": False,
     "tensor_model_parallel_size": 1, "seq_length": 8, "seq1f1b_splits": 2},
    {"context_parallel_size": 2, **FLASH, "reset_attention_mask": True},
    {"context_parallel_size": 2, "num_experts": 8, "moe_aux_loss_coeff": 1e-2},
    {"context_parallel_size": 2, "multi_latent_attention": True, **FLASH},
    {"context_parallel_size": 2, "reset_attention_mask": True, "seq1f1b_schedule": "zb-h1",
     "virtual_pipeline_model_parallel_size": 2, "overlap_p2p_comm": True},
])
def test_validate_accepts(overrides):
    megatron_lm.validate_args(megatron_args(**overrides))
    megatron_lm.validate_args(argparse.Namespace(**vars(megatron_args(**overrides))))


def test_validate_accepts_minimal_namespace():
    megatron_lm.validate_args(argparse.Namespace(seq1f1b=True, seq1f1b_splits=2,
                                                 seq1f1b_partition="uniform", seq_length=16))


def test_validate_does_nothing_without_the_flag():
    bad = megatron_args(seq1f1b=False, context_parallel_size=2, num_experts=8, seq1f1b_splits=0)
    megatron_lm.validate_args(bad)
    assert megatron_lm.args_problems(bad) == []
    megatron_lm.validate_args(argparse.Namespace())  # a script that never added the flags


@pytest.mark.parametrize("overrides,flags", [
    ({"seq1f1b_splits": 0}, ["--seq1f1b-splits"]),
    ({"seq1f1b_splits": "4"}, ["--seq1f1b-splits"]),
    ({"seq1f1b_partition": "random"}, ["--seq1f1b-partition"]),
    ({"seq1f1b_schedule": "zb-h3"}, ["--seq1f1b-schedule"]),
    ({"seq1f1b_schedule": "zb-h2", "virtual_pipeline_model_parallel_size": 2,
      "overlap_p2p_comm": True}, ["--seq1f1b-schedule zb-h2", "zb-h1"]),
    ({"seq1f1b_schedule": "zb-h1", "transformer_impl": "transformer_engine"},
     ["--seq1f1b-schedule zb-h1", "--transformer-impl local"]),
    # context parallelism: local attention (or the flash one) only, segments all-gather
    ({"context_parallel_size": 2, "transformer_impl": "transformer_engine"},
     ["--context-parallel-size 2", "--transformer-impl local"]),
    ({"context_parallel_size": 2, "cp_comm_type": ["a2a+p2p"]}, ["--cp-comm-type a2a+p2p"]),
    ({"context_parallel_size": 2, "cp_comm_type": ["p2p", "a2a"]}, ["--cp-comm-type a2a"]),
    ({"context_parallel_size": 2, "sft": True, **PACKED}, ["--context-parallel-size 2", "--sft"]),
    ({"context_parallel_size": 2, "dataloader_inter_document_masking": True, **PACKED},
     ["--context-parallel-size 2", "--dataloader-inter-document-masking"]),
    ({"context_parallel_size": 2, "multi_latent_attention": True},
     ["--context-parallel-size 2", "--multi-latent-attention"]),
    ({"context_parallel_size": 2, "seq_length": 4098},  # 2 x CP chunks, CP x TP with SP: 4
     ["--seq-length 4098", "multiple of 4", "--context-parallel-size"]),
    ({"hybrid_context_parallel": True}, ["--hybrid-context-parallel"]),
    ({"num_experts": 8, "moe_expert_capacity_factor": 1.25}, ["--moe-expert-capacity-factor"]),
    ({"overlap_moe_expert_parallel_comm": True}, ["--overlap-moe-expert-parallel-comm"]),
    # multi-token prediction (served per segment) except with CP or one repeated MTP layer
    ({"mtp_num_layers": 1, "context_parallel_size": 2},
     ["--mtp-num-layers", "--context-parallel-size"]),
    ({"mtp_num_layers": 1, "mtp_use_repeated_layer": True}, ["--mtp-use-repeated-layer"]),
    ({"multi_latent_attention": True, "apply_rope_fusion": True}, ["--no-rope-fusion"]),
    ({"multi_latent_attention": True, "mla_down_proj_fusion": True}, ["--mla-down-proj-fusion"]),
    ({"experimental_attention_variant": "gated_delta_net"}, ["--experimental-attention-variant"]),
    ({"window_size": (128, 4)}, ["--window-size"]),
    ({"position_embedding_type": "mrope"}, ["--position-embedding-type"]),
    ({"use_legacy_models": True}, ["--use-legacy-models"]),
    ({"rl_use_sequence_packing": True}, ["--rl-use-sequence-packing"]),
    ({"cuda_graph_impl": "local"}, ["--cuda-graph-impl"]),
    ({"enable_cuda_graph": True}, ["--enable-cuda-graph"]),
    ({"fine_grained_activation_offloading": True}, ["--fine-grained-activation-offloading"]),
    ({"overlap_p2p_comm": True}, ["--no-overlap-p2p-communication"]),
    ({"decoder_seq_length": 2048}, ["--decoder-seq-length"]),
    ({"modelopt_enabled": True}, ["--modelopt-enabled"]),
    ({"export_kd_teacher_load": "/ckpt/teacher"}, ["--export-kd-teacher-load"]),
    ({"tp_comm_overlap": True}, ["--tp-comm-overlap"]),
    ({"fp8_dot_product_attention": True}, ["--fp8-dot-product-attention"]),
    ({"fp8_multi_head_attention": True}, ["--fp8-multi-head-attention"]),
    # packed documents: one sample per micro-batch, no fused RoPE, no YaRN
    ({"sft": True, **PACKED, "micro_batch_size": 2, "eval_micro_batch_size": 2},  # once
     ["--micro-batch-size 1", "--sft"]),
    ({"dataloader_inter_document_masking": True, **PACKED, "eval_micro_batch_size": 4},
     ["--eval-micro-batch-size 1", "--dataloader-inter-document-masking"]),
    ({"sft": True, **PACKED, "apply_rope_fusion": True}, ["--no-rope-fusion"]),
    ({"sft": True, **PACKED, "multi_latent_attention": True}, ["--rope-type rope"]),
    # a dense document mask that Transformer Engine's flash/fused attention would ignore
    ({"reset_attention_mask": True, "transformer_impl": "transformer_engine"},
     ["--reset-attention-mask", "--transformer-impl local",
                                      "--dataloader-inter-document-masking"]),
    ({"seq1f1b_partition": "documents"}, ["--seq1f1b-partition documents", "--sft",
                                          "--reset-attention-mask"]),
    # the flash attention computes its own mask
    ({"reset_attention_mask": True, **FLASH, "create_attention_mask_in_dataloader": True},
     ["--no-create-attention-mask-in-dataloader"]),
    # core_v0.19: cached-logits distillation
    ({"logits_load_dir": "/cache/logits"}, ["--logits-load-dir"]),
    ({"logits_save_dir": "/cache/logits"}, ["--logits-save-dir"]),
    # FP8: every segment's tokens per rank a multiple of 8 (here TP 2 with SP: 16)
    ({"fp8": "hybrid", "seq_length": 4096 + 4}, ["--fp8-format", "multiple of 16"]),
    # sequence parallel: every segment a multiple of TP
    ({"seq_length": 4097}, ["--seq-length", "--tensor-model-parallel-size", "--sequence-parallel"]),
    ({"seq_length": 16, "tensor_model_parallel_size": 8, "seq1f1b_splits": 4},
     ["--seq1f1b-splits <= 2"]),
    ({"seq_length": 3, "sequence_parallel": False, "seq1f1b_splits": 4},
     ["--seq1f1b-splits <= 3"]),
])
def test_validate_rejects_with_flag_names(overrides, flags):
    with pytest.raises(ConfigError) as info:
        megatron_lm.validate_args(megatron_args(**overrides))
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    for flag in flags:
        assert flag in message, (flag, message)
    assert len(info.value.problems) == 1, info.value.problems


def test_variable_seq_lengths_are_accepted():
    """variable_seq_lengths (which Megatron-LM's own scripts set False) runs under Seq1F1B,
    with a fixed count or a token budget (docs/variable_lengths.md)."""
    for budget in (None, 512):
        assert megatron_lm.args_problems(megatron_args(
            variable_seq_lengths=True, seq1f1b_segment_tokens=budget)) == []


def test_validate_reports_everything_at_once():
    problems = megatron_lm.args_problems(
        megatron_args(hybrid_context_parallel=True, num_experts=4, moe_expert_capacity_factor=1.0,
                      seq1f1b_splits=-1))
    assert len(problems) == 3


def test_prepare_model(monkeypatch):
    """enable() gets the model (all chunks), install() the flags; the LM holder is patched."""
    import megatron.core.pipeline_parallel as pipeline_parallel
    import megatron_seq1f1b.runtime.model_hooks as model_mod

    enabled = []
    monkeypatch.setattr(model_mod, "enable", lambda model: enabled.append(model) or model)
    holder = SimpleNamespace(get_forward_backward_func=pipeline_parallel.get_forward_backward_func)
    monkeypatch.setitem(sys.modules, "megatron.training.training", holder)
    chunks = [object(), object()]
    try:
        out = megatron_lm.prepare_model(chunks, megatron_args(seq1f1b_splits=3,
                                                              seq1f1b_partition="uniform"))
        assert out is chunks and enabled == [chunks]
        for getter in (holder.get_forward_backward_func,
                       pipeline_parallel.get_forward_backward_func):
            func = getter()
            assert (func.num_splits, func.partition) == (3, "uniform")
            # core_v0.19's train() and evaluate() pass schedule_pg_collection
            assert getter(schedule_pg_collection=None) is func
            assert getter(pp_size=2, vp_size=None, schedule_pg_collection=None) is func
    finally:
        import megatron_seq1f1b as s1

        s1.uninstall()
    assert not hasattr(holder.get_forward_backward_func, "seq1f1b")


@pytest.mark.parametrize("splits,cap", [(None, 16), (6, 6)], ids=["no-cap", "capped"])
def test_segment_tokens_flag_installs_a_budget(monkeypatch, splits, cap):
    """--seq1f1b-segment-tokens 256 at --seq-length 4096: the installed function cuts by the
    budget; without --seq1f1b-splits no cap (ceil(4096 / 256) = 16, not the default 4), with
    it the given cap."""
    import megatron.core.pipeline_parallel as pipeline_parallel
    import megatron_seq1f1b.runtime.model_hooks as model_mod

    monkeypatch.setattr(model_mod, "enable", lambda model: model)
    argv = ["--seq1f1b", "--seq1f1b-segment-tokens", "256"]
    parsed = parser_with_seq1f1b().parse_args(
        argv + ([] if splits is None else ["--seq1f1b-splits", str(splits)]))
    assert (parsed.seq1f1b_segment_tokens, parsed.seq1f1b_splits) == (256, splits)
    try:
        megatron_lm.prepare_model([object()], megatron_args(
            seq1f1b_splits=parsed.seq1f1b_splits, seq1f1b_segment_tokens=256))
        func = pipeline_parallel.get_forward_backward_func()
        assert (func.num_splits, func.segment_tokens, func.partition) == (cap, 256, "balanced")
    finally:
        import megatron_seq1f1b as s1

        s1.uninstall()


def test_split_lengths_flag_installs_that_cut(monkeypatch):
    """--seq1f1b-split-lengths (the planner's lengths for a measured cut): the installed
    function cuts every micro-batch so, as many segments as lengths."""
    import megatron.core.pipeline_parallel as pipeline_parallel
    import megatron_seq1f1b.runtime.model_hooks as model_mod

    monkeypatch.setattr(model_mod, "enable", lambda model: model)
    parsed = parser_with_seq1f1b().parse_args(["--seq1f1b", "--seq1f1b-split-lengths",
                                               "2048,1152,896"])
    assert parsed.seq1f1b_split_lengths == (2048, 1152, 896)
    args = megatron_args(seq1f1b_splits=None, seq1f1b_split_lengths=parsed.seq1f1b_split_lengths)
    assert megatron_lm.args_problems(args) == []
    try:
        megatron_lm.prepare_model([object()], args)
        func = pipeline_parallel.get_forward_backward_func()
        assert (func.num_splits, tuple(func.split_lengths)) == (3, (2048, 1152, 896))
    finally:
        import megatron_seq1f1b as s1

        s1.uninstall()


def test_backward_by_documents_flag_installs_it(monkeypatch):
    """--seq1f1b-backward-by-documents with packed documents and per-token loss: the installed
    function runs a micro-batch's runs of documents apart."""
    import megatron.core.pipeline_parallel as pipeline_parallel
    import megatron_seq1f1b.runtime.model_hooks as model_mod

    monkeypatch.setattr(model_mod, "enable", lambda model: model)
    parsed = parser_with_seq1f1b().parse_args(["--seq1f1b", "--seq1f1b-backward-by-documents"])
    assert parsed.seq1f1b_backward_by_documents
    try:
        megatron_lm.prepare_model([object()], megatron_args(
            seq1f1b_backward_by_documents=True, calculate_per_token_loss=True, sft=True,
            micro_batch_size=1))
        func = pipeline_parallel.get_forward_backward_func()
        assert func.backward_by_documents
    finally:
        import megatron_seq1f1b as s1

        s1.uninstall()


def test_prepare_model_with_auto_installs_the_planning_function(monkeypatch):
    """--seq1f1b-splits auto: the installed function plans on its first call (tested on
    ranks in tests/test_auto.py) with the budget flags given."""
    import megatron.core.pipeline_parallel as pipeline_parallel
    import megatron_seq1f1b.planner.auto as auto_mod
    import megatron_seq1f1b.runtime.model_hooks as model_mod

    monkeypatch.setattr(model_mod, "enable", lambda model: model)
    made = []
    original = auto_mod.auto_forward_backward_func
    monkeypatch.setattr(auto_mod, "auto_forward_backward_func",
                        lambda **kw: made.append(kw) or original(**kw))
    try:
        megatron_lm.prepare_model([object()], megatron_args(
            seq1f1b_splits="auto", seq1f1b_memory_budget=40.0, seq1f1b_min_segment_length=256,
            seq1f1b_segment_multiple=128))
        func = pipeline_parallel.get_forward_backward_func()
        assert func.num_splits == "auto" and func.choice is None
        assert made == [dict(memory_budget_gib=40.0, memory_budget_microbatches=None,
                             min_segment_length=256, segment_multiple=128, documents=None)]
    finally:
        import megatron_seq1f1b as s1

        s1.uninstall()


def test_prepare_model_off_and_rejected(monkeypatch):
    import megatron_seq1f1b.api as api_mod
    import megatron_seq1f1b.runtime.model_hooks as model_mod

    def fail(*a, **k):
        raise AssertionError("must not be called")

    monkeypatch.setattr(model_mod, "enable", fail)
    monkeypatch.setattr(api_mod, "install", fail)
    model = object()
    assert megatron_lm.prepare_model(model, megatron_args(seq1f1b=False)) is model
    with pytest.raises(ConfigError, match="--modelopt-enabled"):
        # get_model() turns ModelOpt on after validate_args: prepare_model checks again.
        megatron_lm.prepare_model(model, megatron_args(modelopt_enabled=True))


@pytest.mark.parametrize("overrides,documents", [
    ({}, None),
    ({"sft": True, **PACKED}, "cu_seqlens"),
    ({"dataloader_inter_document_masking": True, **PACKED, "seq1f1b_partition": "documents"},
     "cu_seqlens"),
    ({"reset_attention_mask": True, **FLASH}, 50256),  # the tokenizer's end-of-document id
    ({"reset_attention_mask": True, "seq1f1b_partition": "documents"}, 50256),
    ({"reset_attention_mask": True}, None),  # the dense mask, cut per segment, as before
    # no dense mask from the data: Megatron's local attention alone would be causal across
    # documents; the schedule keeps them apart
    ({"reset_attention_mask": True, "create_attention_mask_in_dataloader": False}, 50256),
])
def test_prepare_model_passes_the_documents(monkeypatch, overrides, documents):
    """The schedule learns where each micro-batch's documents are from the flags."""
    import megatron_seq1f1b.api as api_mod
    import megatron_seq1f1b.runtime.model_hooks as model_mod

    installed = []
    monkeypatch.setattr(model_mod, "enable", lambda model: model)
    monkeypatch.setattr(api_mod, "install", lambda *a, **k: installed.append((a, k)))
    monkeypatch.setattr(megatron_lm, "use_flash_attention", lambda model, args: model)
    monkeypatch.setattr(megatron_lm, "end_of_document_id", lambda: 50256)
    args = megatron_args(seq1f1b_splits=2, **overrides)
    megatron_lm.prepare_model([object()], args)
    (positional, keywords), = installed
    assert positional == (2, args.seq1f1b_partition)
    assert keywords["documents"] == documents
    # what install() hands over is a valid source for the schedule
    import megatron_seq1f1b as s1

    s1.get_forward_backward_func(2, args.seq1f1b_partition, documents=documents)


def test_end_of_document_id_is_the_tokenizers(monkeypatch):
    tokenizer = SimpleNamespace(eod=50256)
    monkeypatch.setitem(sys.modules, "megatron.training",
                        SimpleNamespace(get_tokenizer=lambda: tokenizer))
    assert megatron_lm.end_of_document_id() == 50256


def test_flash_reset_attention_mask_needs_seq1f1b(monkeypatch):
    """Without --seq1f1b the flash attention has no documents: refused when the model is
    prepared (nothing swapped); with --seq1f1b the schedule gives them."""
    monkeypatch.setattr(megatron_lm, "_megatron_args", lambda: None)
    args = megatron_args(seq1f1b=False, reset_attention_mask=True, **FLASH)
    with pytest.raises(ConfigError, match="add --seq1f1b"):
        megatron_lm.prepare_model(object(), args)
    assert megatron_lm.flash_attention_problems(megatron_args(reset_attention_mask=True,
                                                              **FLASH)) == []


def _core_attentions(spec) -> list:
    layers = getattr(spec, "layer_specs", None) or [spec]
    found = []
    for layer in layers:
        core = layer.submodules.self_attention.submodules.core_attention
        found.append(getattr(core, "module", core))
    return found


@pytest.mark.parametrize("block", [False, True])
def test_layer_spec_for_context_parallel(block):
    """What the builder hunks call: with --seq1f1b and CP > 1 Megatron's local core attention
    becomes the CP-buildable subclass (the flash one with --attention-backend flash); the
    same spec object otherwise, or where Megatron-LM's arguments are not set."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_seq1f1b.attention.flash import FlashDotProductAttention

    spec = get_gpt_layer_local_spec()
    if block:  # a block spec (MoE, --spec), as 0.19's --attention-backend local leaves it too
        from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

        layer = copy.deepcopy(spec)
        layer.submodules.self_attention.submodules.core_attention = DotProductAttention
        spec = TransformerBlockSubmodules(layer_specs=[spec, layer])
    assert set(_core_attentions(spec)) == {DotProductAttention}
    for args in (megatron_args(), megatron_args(seq1f1b=False, context_parallel_size=2)):
        assert megatron_lm.layer_spec(spec, args) is spec
    cp = megatron_lm.layer_spec(spec, megatron_args(context_parallel_size=2))
    (kind,) = set(_core_attentions(cp))
    assert issubclass(kind, DotProductAttention) and kind.seq1f1b_context_parallel
    assert set(_core_attentions(spec)) == {DotProductAttention}  # a copy was changed
    flash = megatron_lm.layer_spec(spec, megatron_args(context_parallel_size=2, **FLASH))
    assert set(_core_attentions(flash)) == {FlashDotProductAttention}
    assert megatron_lm.layer_spec(None, megatron_args(context_parallel_size=2)) is None
    assert isinstance(spec, ModuleSpec) != block


def test_layer_spec_without_megatron_lm_arguments(monkeypatch):
    """Megatron-LM's get_args() asserts when no script parsed arguments: unchanged spec."""
    def unset():
        raise AssertionError("args is not initialized.")

    monkeypatch.setattr(megatron_lm, "_megatron_args", unset)
    spec = object()
    assert megatron_lm.layer_spec(spec) is spec


def test_context_parallel_cut_keeps_the_sequence_inside_cp_segments():
    """The rebound get_batch_on_this_cp_rank: Megatron's cut outside a segment (or with CP 1),
    the whole micro-batch inside a Seq1F1B segment with CP > 1, which slice_gpt_batch then
    cuts into this CP rank's part of the segment."""
    import torch

    from megatron_seq1f1b.segments.run import SegmentRun

    calls = []

    def megatrons(batch, **kwargs):  # keeps chunks r and 2cp-1-r of the whole sequence
        calls.append(kwargs)
        return {key: value[:, :2] for key, value in batch.items()}

    cut = megatron_lm.context_parallel_cut(megatrons)
    assert megatron_lm.context_parallel_cut(cut) is cut and cut.seq1f1b_cut is megatrons
    tokens = torch.arange(16).view(1, 16)
    assert cut({"tokens": tokens}, cp_group="g")["tokens"].shape == (1, 2)
    with SegmentRun([8, 8]).forward(0, 1):  # no CP: Megatron's (identity there) runs
        assert cut({"tokens": tokens})["tokens"].shape == (1, 2)
    assert calls == [{"cp_group": "g"}, {}]

    class Group:  # CP rank 1 of 2
        def size(self):
            return 2

        def rank(self):
            return 1

    with SegmentRun([8, 8], cp_group=Group()).forward(0, 1):
        whole = cut({"tokens": tokens}, cp_group="g")
        assert whole["tokens"] is tokens and len(calls) == 2
        fields = megatron_lm.slice_gpt_batch(whole["tokens"], tokens + 1, None, None, None, None)
    # segment 1 is tokens 8..15, in 4 chunks of 2: CP rank 1 holds chunks 1 and 2
    assert fields[0].tolist() == [[10, 11, 12, 13]] and fields[1].tolist() == [[11, 12, 13, 14]]


def test_wrap_model_provider(monkeypatch):
    prepared = []
    monkeypatch.setattr(megatron_lm, "_megatron_args", lambda: megatron_args(seq1f1b=False))
    monkeypatch.setattr(megatron_lm, "prepare_model",
                        lambda model, args=None: prepared.append(model) or model)

    def model_provider(builder, pre_process=True, post_process=True, vp_stage=None,
                       config=None, pg_collection=None):
        """Builds the model."""
        return ("model", builder, pre_process, post_process, vp_stage)

    wrapped = megatron_lm.wrap_model_provider(model_provider)
    assert megatron_lm.wrap_model_provider(wrapped) is wrapped
    assert wrapped.__name__ == "model_provider" and wrapped.__doc__ == model_provider.__doc__
    from functools import partial

    out = partial(wrapped, "gpt_builder")(pre_process=False, post_process=True, vp_stage=1,
                                          config=None, pg_collection=None)
    assert out == ("model", "gpt_builder", False, True, 1) and prepared == [out]


def test_wrap_model_provider_uses_megatron_args(monkeypatch):
    import megatron_seq1f1b.runtime.model_hooks as model_mod

    monkeypatch.setattr(model_mod, "enable", lambda m: (_ for _ in ()).throw(AssertionError()))
    monkeypatch.setattr(megatron_lm, "_megatron_args", lambda: megatron_args(seq1f1b=False))
    assert megatron_lm.wrap_model_provider(lambda: "m")() == "m"


def test_add_post_wrap_hook(monkeypatch):
    """core_v0.19: the GPTModelConfig's builder calls prepare_model on the built chunks."""
    prepared = []
    monkeypatch.setattr(megatron_lm, "prepare_model",
                        lambda model, args=None: prepared.append(model) or model)
    config = SimpleNamespace(post_wrap_hooks=[])
    assert megatron_lm.add_post_wrap_hook(config, megatron_args(seq1f1b=False)) is config
    assert config.post_wrap_hooks == []
    monkeypatch.setattr(megatron_lm, "_megatron_args", lambda: megatron_args(seq1f1b=False))
    assert megatron_lm.add_post_wrap_hook(config).post_wrap_hooks == []

    first = lambda model: model  # noqa: E731 (a hook someone added before)
    config.post_wrap_hooks.append(first)
    for _ in range(2):  # once only
        assert megatron_lm.add_post_wrap_hook(config, megatron_args()) is config
    assert config.post_wrap_hooks == [first, megatron_lm.prepare_model]
    # as GPTModelBuilder.build_distributed_models runs them (compose_hooks)
    chunks = ["chunk0", "chunk1"]
    model = chunks
    for hook in config.post_wrap_hooks:
        model = hook(model)
    assert model is chunks and prepared == [chunks]


def test_post_wrap_hook_prepares_the_chunks(monkeypatch):
    """The real prepare_model as a post-wrap hook: the list of chunks gets enabled."""
    import megatron_seq1f1b.api as api_mod
    import megatron_seq1f1b.runtime.model_hooks as model_mod

    calls = []
    monkeypatch.setattr(model_mod, "enable", lambda model: calls.append(("enable", model)))
    monkeypatch.setattr(api_mod, "install",
                        lambda *a, **k: calls.append(("install", a)) or (lambda **kw: None))
    monkeypatch.setattr(megatron_lm, "_megatron_args", lambda: megatron_args(seq1f1b_splits=2))
    config = megatron_lm.add_post_wrap_hook(SimpleNamespace(post_wrap_hooks=[]))
    chunks = ["chunk0", "chunk1"]
    assert config.post_wrap_hooks[0](chunks) is chunks
    assert calls == [("enable", chunks), ("install", (2, "balanced"))]


def test_slice_gpt_batch():
    import torch

    from megatron_seq1f1b.segments.run import SegmentRun

    b, s = 2, 8
    tokens = torch.arange(b * s).view(b, s)
    labels, loss_mask, position_ids = tokens + 1, torch.ones(b, s), tokens % s
    mask = torch.tril(torch.ones(b, 1, s, s)) < 0.5
    batch = (tokens, labels, loss_mask, mask, position_ids, None)
    outside = megatron_lm.slice_gpt_batch(*batch)
    assert all(x is y for x, y in zip(outside, batch))

    run = SegmentRun([5, 3])
    with run.forward(0, 1):
        t, la, lm, am, pos, packed = megatron_lm.slice_gpt_batch(*batch)
        assert torch.equal(t, tokens[:, 5:]) and torch.equal(la, labels[:, 5:])
        assert torch.equal(lm, loss_mask[:, 5:]) and torch.equal(pos, position_ids[:, 5:])
        assert torch.equal(am, mask[:, :, 5:8, :8]) and packed is None
        # pretrain_gpt's loss_func calls loss_mask.view(-1): slices must be contiguous
        assert all(x.is_contiguous() for x in (t, la, lm, am, pos))
        assert lm.view(-1).shape == (b * 3,)
        # middle pipeline stages get Nones from get_batch
        assert megatron_lm.slice_gpt_batch(None, None, None, None, None, None) == (None,) * 6
        # first stage on TP ranks > 0: labels/loss_mask None, no mask
        t, la, lm, am, pos, _ = megatron_lm.slice_gpt_batch(tokens, None, None, None,
                                                              position_ids, None)
        assert t.shape == (b, 3) and la is None and lm is None and am is None
        with pytest.raises(ConfigError, match="qkv_format='thd'"):
            megatron_lm.slice_gpt_batch(*batch[:5], SimpleNamespace(qkv_format="sbhd"))
    with run.forward(0, 0):
        assert megatron_lm.slice_gpt_batch(*batch)[0].shape == (b, 5)
    run.close()


def test_slice_gpt_batch_fields():
    """core_v0.18+: get_batch's ten fields in BATCH_KEYS order, cut like the 6-tuple."""
    import torch

    from megatron_seq1f1b.segments.run import SegmentRun

    b, s = 2, 8
    tokens = torch.arange(b * s).view(b, s)
    fields = dict(tokens=tokens, labels=tokens + 1, loss_mask=torch.ones(b, s),
                  attention_mask=torch.tril(torch.ones(b, 1, s, s)) < 0.5,
                  position_ids=tokens % s)
    values = tuple(fields.get(key) for key in megatron_lm.GPT_BATCH_KEYS)
    assert megatron_lm.GPT_BATCH_KEYS == tuple(sorted(megatron_lm.GPT_BATCH_KEYS))
    outside = megatron_lm.slice_gpt_batch_fields(*values)
    assert len(outside) == 10 and all(x is y for x, y in zip(outside, values))

    run = SegmentRun([5, 3])
    with run.forward(0, 1):
        out = dict(zip(megatron_lm.GPT_BATCH_KEYS, megatron_lm.slice_gpt_batch_fields(*values)))
        for key in ("tokens", "labels", "loss_mask", "position_ids"):
            assert torch.equal(out[key], fields[key][:, 5:]) and out[key].is_contiguous(), key
        assert torch.equal(out["attention_mask"], fields["attention_mask"][:, :, 5:8, :8])
        for key in ("cu_seqlens", "cu_seqlens_padded", "hybrid_cp_group", "local_cp_size",
                    "max_seqlen"):
            assert out[key] is None
        # the same cut as the 6-tuple adapter
        six = megatron_lm.slice_gpt_batch(*(fields[k] for k in (
            "tokens", "labels", "loss_mask", "attention_mask", "position_ids")), None)
        for key, value in zip(("tokens", "labels", "loss_mask", "attention_mask",
                               "position_ids"), six):
            assert torch.equal(out[key], value)
        # middle pipeline stages: all None
        assert megatron_lm.slice_gpt_batch_fields(*[None] * 10) == (None,) * 10
        # hybrid context parallelism carries these: refused inside a segment
        for key in ("hybrid_cp_group", "local_cp_size"):
            hybrid = dict(zip(megatron_lm.GPT_BATCH_KEYS, values), **{key: torch.tensor([2])})
            with pytest.raises(ConfigError, match=f"hybrid context parallelism \\({key}"):
                megatron_lm.slice_gpt_batch_fields(*hybrid.values())
        # a packed batch needs the schedule to know its documents (prepare_model passes them)
        packed = dict(zip(megatron_lm.GPT_BATCH_KEYS, values),
                      cu_seqlens=torch.tensor([[0, 8]], dtype=torch.int32))
        with pytest.raises(ValueError, match="documents='cu_seqlens'"):
            megatron_lm.slice_gpt_batch_fields(*packed.values())
    with pytest.raises(TypeError, match="ten|10"):
        megatron_lm.slice_gpt_batch_fields(*values[:6])
    run.close()


# One packed (THD) micro-batch of 16 tokens holding documents [0, 5), [5, 12), [12, 16), cut
# into segments of 6 and 10 tokens: the document [5, 12) crosses from segment 0 into segment 1.
PACKED_STARTS, PACKED_LENGTHS = (0, 5, 12), (6, 10)
# Each segment's pieces of documents (cu_seqlens) and the longest piece (max_seqlen).
PACKED_PIECES = [([0, 5, 6], 5), ([0, 6, 10], 6)]


def packed_run():
    from megatron_seq1f1b.segments.documents import Documents
    from megatron_seq1f1b.segments.run import SegmentRun

    return SegmentRun(PACKED_LENGTHS, documents=[Documents((PACKED_STARTS,), 16)])


def packed_tensors():
    import torch

    tokens = torch.arange(16).view(1, 16)
    cu = torch.tensor([[0, 5, 12, 16]], dtype=torch.int32)
    return tokens, cu


@pytest.mark.parametrize("squeezed", [False, True], ids=["core_v0.16.1", "core_v0.17.1"])
def test_slice_gpt_batch_packed(squeezed):
    """--sft in core_v0.16/0.17: get_batch's packed_seq_params, built from the whole
    micro-batch's cu_seqlens ([1, n] in 0.16.1, 1-D in 0.17.1), becomes the segment's: its
    document pieces, 1-D, the rest kept; middle stages (0.17.1: packed_seq_params alone)."""
    import torch
    from megatron.core.packed_seq_params import PackedSeqParams

    tokens, cu = packed_tensors()
    cu = cu[0] if squeezed else cu
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu,
                             max_seqlen_q=7, max_seqlen_kv=7)
    batch = (tokens, tokens + 1, torch.ones(1, 16), None, tokens.clone(), params)
    assert megatron_lm.slice_gpt_batch(*batch)[5] is params  # outside a segment: as it was
    run = packed_run()
    for segment, (pieces, longest) in enumerate(PACKED_PIECES):
        start = sum(PACKED_LENGTHS[:segment])
        end = start + PACKED_LENGTHS[segment]
        with run.forward(0, segment):
            t, la, lm, am, pos, cut = megatron_lm.slice_gpt_batch(*batch)
            assert torch.equal(t, tokens[:, start:end])
            assert torch.equal(la, tokens[:, start:end] + 1)
            assert lm.shape == (1, end - start) and am is None
            assert type(cut) is PackedSeqParams and cut.qkv_format == "thd"
            for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded",
                         "cu_seqlens_kv_padded"):
                value = getattr(cut, name)
                assert value.dim() == 1 and value.dtype == torch.int32, name
                assert value.tolist() == pieces, name
            assert (cut.max_seqlen_q, cut.max_seqlen_kv) == (longest, longest)
            # a middle pipeline stage: core_v0.17.1 gives packed_seq_params alone (unpadded)
            middle = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                     max_seqlen_q=7, max_seqlen_kv=7)
            out = megatron_lm.slice_gpt_batch(None, None, None, None, None, middle)
            assert out[:5] == (None,) * 5 and out[5].cu_seqlens_q.tolist() == pieces
            assert out[5].cu_seqlens_q_padded is None and out[5].max_seqlen_q == longest
            # core_v0.16.1's middle stages get nothing (the schedule's documents still apply)
            assert megatron_lm.slice_gpt_batch(*[None] * 6) == (None,) * 6
        run.forget(0)
    # hybrid context parallelism builds its own packed_seq_params: refused in a segment
    with run.forward(0, 0):
        hybrid = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                 max_seqlen_q=7, max_seqlen_kv=7, local_cp_size=2)
        with pytest.raises(ConfigError, match="hybrid context parallelism"):
            megatron_lm.slice_gpt_batch(*batch[:5], hybrid)
    run.close()


def test_slice_gpt_batch_fields_packed():
    """--sft / --dataloader-inter-document-masking in core_v0.18+: cu_seqlens and
    cu_seqlens_padded ([1, n], as get_batch returns them) and max_seqlen ([1]) describe the
    segment's document pieces; middle stages carry only those three."""
    import torch

    tokens, cu = packed_tensors()
    fields = dict.fromkeys(megatron_lm.GPT_BATCH_KEYS)
    fields.update(tokens=tokens, labels=tokens + 1, loss_mask=torch.ones(1, 16),
                  position_ids=tokens.clone(), cu_seqlens=cu, cu_seqlens_padded=cu.clone(),
                  max_seqlen=torch.tensor([7], dtype=torch.int32))
    middle = {key: (value if key in ("cu_seqlens", "cu_seqlens_padded", "max_seqlen") else None)
              for key, value in fields.items()}
    run = packed_run()
    for segment, (pieces, longest) in enumerate(PACKED_PIECES):
        start = sum(PACKED_LENGTHS[:segment])
        end = start + PACKED_LENGTHS[segment]
        with run.forward(0, segment):
            for given in (fields, middle):
                out = dict(zip(megatron_lm.GPT_BATCH_KEYS,
                               megatron_lm.slice_gpt_batch_fields(*given.values())))
                for key in ("cu_seqlens", "cu_seqlens_padded"):
                    assert out[key].shape == (1, len(pieces)) and out[key].dtype == torch.int32
                    assert out[key].tolist() == [pieces], key
                assert out["max_seqlen"].tolist() == [longest]
                if given is fields:
                    for key in ("tokens", "labels", "loss_mask", "position_ids"):
                        assert torch.equal(out[key], fields[key][:, start:end]), key
                else:
                    assert out["tokens"] is None and out["labels"] is None
        run.forget(0)
    run.close()


def test_shim_import_is_light():
    code = ("import sys; import megatron_seq1f1b.megatron_lm; "
            "print(sorted(m for m in ('torch', 'megatron.core', 'megatron.training') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
