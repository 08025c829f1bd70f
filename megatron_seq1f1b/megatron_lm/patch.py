"""Apply (or check, or revert) the Seq1F1B patches to a Megatron-LM checkout.

::

    python -m megatron_seq1f1b.patch MEGATRON_LM_DIR            apply (idempotent)
    python -m megatron_seq1f1b.patch MEGATRON_LM_DIR --check    report only, change nothing
    python -m megatron_seq1f1b.patch MEGATRON_LM_DIR --revert   restore the original files
    ... --force-version TAG       use TAG's patches, whatever version the checkout reports

The same program is installed as the ``seq1f1b-patch`` command, and
``scripts/apply_patches.sh`` in a clone of this repository runs it.

The version comes from the git tag at HEAD (git checkouts) or from
``megatron/core/package_info.py`` (e.g. an unpacked release archive); the
patches ship inside this package, in ``patches/megatron-lm/<tag>/`` next to
this file (one folder per supported Megatron-LM tag), and apply in name order.
A version without a folder of its own goes through :data:`ALIASES`; any other
version is refused, naming the nearest supported tag, whose patches
``--force-version TAG`` tries anyway (they still apply only where their
context matches exactly).

Each patch is "applied", "not applied" or "conflicts" (neither applies nor
reverts); a partly applied checkout (some applied, the others not, e.g. after
``git checkout pretrain_gpt.py``) is completed by applying the patches not
applied, or undone by ``--revert`` reverting the applied ones; the others are
left as they are. The states are found in sequence on scratch copies of the
files the patches touch (reverse order to revert, then in order to apply, so
two patches may touch one file), and only the verified result is copied into
the checkout: nothing is changed if any patch conflicts, touches a missing
file, or would both apply and revert. Context must match exactly (no fuzz), so
a patch never lands twice. Uses GNU ``patch``, or ``git apply`` where ``patch``
is missing (``SEQ1F1B_PATCH_TOOL=patch|git`` forces one).

Exit status: 0 done / already in the requested state (``--check``: applicable
or already applied); 1 a patch conflicts or version unsupported; 2 usage;
3 (``--check`` only) partly applied: applying, or ``--revert``, completes it.

Only the standard library is used: this runs without torch or Megatron.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, NamedTuple, NoReturn, Optional, Sequence, Tuple

PATCH_ROOT = Path(__file__).resolve().parent / "patches" / "megatron-lm"
MODULE_PROG = "python -m megatron_seq1f1b.patch"
# The name messages give the program; scripts/apply_patches.sh sets it to its own.
PROG_ENV = "SEQ1F1B_PATCH_PROG"
TOOL_ENV = "SEQ1F1B_PATCH_TOOL"

# Version aliases, (REPORTED, FOLDER): a version that a checkout reports -> the
# patch folder made for it. A folder named like the reported version itself
# would win over its alias.
#   core_v0.19.1: the core_v0.19.0 tag's megatron/core/package_info.py says
#                 0.19.1, so an unpacked core_v0.19.0 archive reads as 0.19.1.
ALIASES: Tuple[Tuple[str, str], ...] = (
    ("core_v0.19.1", "core_v0.19.0"),
)

PACKAGE_INFO = "megatron/core/package_info.py"

# A patch's state in a checkout (see Applier.survey).
NOT_APPLIED, APPLIED, CONFLICTS = "not applied", "applied", "conflicts"
AMBIGUOUS = "both applies and reverts"
# --check's exit status for a partly applied checkout.
PARTLY = 3


class Survey(NamedTuple):
    """What Applier.survey found: each patch's state (and, for a conflict, why), and the
    scratch trees with the applied patches reverted and with every patch applied."""

    states: List[str]
    reasons: List[str]
    reverted: str
    patched: str


class Exit(Exception):
    """Stop with this exit status (the messages are already printed)."""

    def __init__(self, status: int):
        super().__init__(status)
        self.status = status


def _out(text: str = "") -> None:
    print(text, flush=True)


def _err(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# --- patch folders and versions --------------------------------------------

def supported(root: Path = PATCH_ROOT) -> List[str]:
    """The tags with a patch folder, in name order."""
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if p.is_dir())


def candidates(root: Path = PATCH_ROOT) -> List[Tuple[str, str]]:
    """(REPORTED, FOLDER) pairs: every folder as itself, then the aliases."""
    return [(t, t) for t in supported(root)] + list(ALIASES)


def supported_list(root: Path = PATCH_ROOT) -> str:
    """One line: the tags, then the aliases ("(and core_v0.19.1 = core_v0.19.0)")."""
    out = " ".join(supported(root))
    for reported, folder in candidates(root):
        if reported != folder and (root / folder).is_dir():
            out += f" (and {reported} = {folder})"
    return out


def resolve(version: str, root: Path = PATCH_ROOT) -> str:
    """The patch folder for `version` (its own, or its alias's), or ""."""
    if not version:
        return ""
    for reported, folder in candidates(root):
        if reported == version and (root / folder).is_dir():
            return folder
    return ""


def version_key(version: str) -> Optional[Tuple[int, int, int]]:
    """(MAJOR, MINOR, PATCH) of core_vX.Y.Z[anything], or None."""
    found = re.match(r"core_v([0-9]{1,5})\.([0-9]{1,5})\.([0-9]{1,5})", version)
    return tuple(int(x) for x in found.groups()) if found else None  # type: ignore[return-value]


def _order(key: Tuple[int, int, int]) -> int:
    return (key[0] * 100000 + key[1]) * 100000 + key[2]


def nearest(version: str, root: Path = PATCH_ROOT) -> str:
    """The supported tag closest to `version`, or "" if it is not core_vX.Y.Z[...].

    Only the two neighbours in version order compete (the newest tag for a
    newer release, the oldest for an older one); between them the closer wins:
    same major first, then the smaller minor gap, then the smaller patch gap,
    and on a tie the newer one. Aliases count with the version they stand for
    (0.19.1 is core_v0.19.0's).
    """
    key = version_key(version)
    if key is None:
        return ""
    want = _order(key)
    lo = hi = None  # (order, reported, folder)
    for reported, folder in candidates(root):
        ckey = version_key(reported)
        if ckey is None or not (root / folder).is_dir():
            continue
        order = _order(ckey)
        if order <= want and (lo is None or order > lo[0]):
            lo = (order, reported, folder)
        if order >= want and (hi is None or order < hi[0]):
            hi = (order, reported, folder)
    best, best_distance = "", None
    for pick in (lo, hi):
        if pick is None:
            continue
        ckey = version_key(pick[1])
        assert ckey is not None
        gaps = [abs(c - w) for c, w in zip(ckey, key)]
        older = 0 if pick[0] >= want else 1  # a candidate before `version` loses a tie
        distance = _order(tuple(gaps)) * 2 + older  # type: ignore[arg-type]
        if best_distance is None or distance < best_distance:
            best, best_distance = pick[2], distance
    return best


def package_info_fields(path: Path) -> Dict[str, str]:
    """MAJOR, MINOR, PATCH, PRE_RELEASE as written in package_info.py (first assignment)."""
    fields: Dict[str, str] = {}
    for line in path.read_text(errors="replace").splitlines():
        for name in ("MAJOR", "MINOR", "PATCH", "PRE_RELEASE"):
            if name in fields:
                continue
            found = re.match(rf"{name}\s*=\s*['\"]?([^'\"\s]*)['\"]?", line)
            if found:
                fields[name] = found.group(1)
    return fields


def touched(patch: Path) -> List[str]:
    """Files a patch touches (its "+++ b/path" lines, -p1)."""
    files = []
    for line in patch.read_text(errors="replace").splitlines():
        found = re.match(r"\+\+\+ [^/]*/(\S+)", line)
        if found:
            files.append(found.group(1))
    return files


# --- the program -----------------------------------------------------------

class Applier:
    """One run: parse the arguments, find the version, check/apply/revert."""

    def __init__(self, prog: str, root: Path = PATCH_ROOT):
        self.prog = prog
        self.root = root
        self.tool = ""
        self.patches: List[Path] = []
        self.dir = ""
        self.scratch: Optional[str] = None

    # messages
    def usage(self, to_stdout: bool = False) -> None:
        text = f"""usage: {self.prog} MEGATRON_LM_DIR [--check|--revert] [--force-version TAG]

  (no option)          apply the Seq1F1B patches (prints "already applied" if they are)
  --check              report whether the patches would apply, are applied, or partly
  --revert             reverse the applied patches, restoring the original files
  --force-version TAG  use the patches made for Megatron-LM tag TAG, whatever version
                       the checkout reports (a newer release, a fork); they still
                       apply only where their context matches exactly
  -h, --help           show this message

A partly applied checkout (some patches applied, the others not): applying applies
the others, --revert reverts the applied ones. Nothing is changed if a patch conflicts.
The version is the git tag at HEAD, or megatron/core/package_info.py.
exit status: 0 done, or already so (--check: the patches apply, or are applied);
  1 a patch conflicts, or the version is not supported; 2 usage;
  3 (--check) partly applied: applying, or --revert, completes it
supported Megatron-LM tags: {supported_list(self.root)}"""
        print(text, file=sys.stdout if to_stdout else sys.stderr, flush=True)

    def die(self, message: str) -> NoReturn:
        _err(f"{self.prog}: {message}")
        raise Exit(1)

    def usage_error(self, message: str) -> NoReturn:
        _err(f"{self.prog}: {message}")
        self.usage()
        raise Exit(2)

    # arguments
    def parse(self, argv: Sequence[str]) -> Tuple[str, str, str]:
        mode, directory, forced = "apply", "", ""
        args = list(argv)
        while args:
            arg = args.pop(0)
            if arg in ("-h", "--help"):
                self.usage(to_stdout=True)
                raise Exit(0)
            if arg in ("--check", "--revert"):
                if mode != "apply":
                    self.usage_error("give at most one of --check, --revert")
                mode = arg[2:]
            elif arg == "--force-version" or arg.startswith("--force-version="):
                if forced:
                    self.usage_error("--force-version given twice")
                if arg == "--force-version":
                    if not args:
                        self.usage_error("--force-version needs a TAG")
                    forced = args.pop(0)
                else:
                    forced = arg[len("--force-version="):]
                if not forced:
                    self.usage_error("--force-version needs a TAG")
            elif arg.startswith("-"):
                self.usage_error(f"unknown option: {arg}")
            else:
                if directory:
                    self.usage_error("more than one directory given")
                directory = arg
        if not directory:
            self.usage_error("missing MEGATRON_LM_DIR")
        if forced and not resolve(forced, self.root):
            self.usage_error(f"--force-version {forced}: no patches for that tag; "
                             f"supported: {supported_list(self.root)}")
        if not os.path.isdir(directory):
            self.die(f"not a directory: {directory}")
        return mode, os.path.abspath(directory), forced

    # version
    def git_tags(self) -> Tuple[str, List[str]]:
        """(exact tag at HEAD or "", every tag at HEAD) if `dir` is a git work tree's top."""
        if shutil.which("git") is None:
            return "", []

        def git(*args: str) -> str:
            result = subprocess.run(["git", "-C", self.dir, *args], capture_output=True,
                                    text=True)
            return result.stdout.strip() if result.returncode == 0 else ""

        top = git("rev-parse", "--show-toplevel")
        if not top or os.path.realpath(top) != os.path.realpath(self.dir):
            return "", []
        exact = git("describe", "--tags", "--exact-match", "HEAD")
        return exact, exact.split() + git("tag", "--points-at", "HEAD").split()

    def find_version(self, forced: str) -> Tuple[str, str]:
        """(patch folder, how it was chosen); prints the refusal and stops if none."""
        reported = version = source = ""
        exact, tags = self.git_tags()
        for tag in tags:
            folder = resolve(tag, self.root)
            if folder:
                reported, version, source = tag, folder, "git tag"
                break
        if not version and exact and not forced:
            # Any other tag (a fork's, or an unsupported release): package_info.py decides.
            _err(f"note: no patches for git tag {exact}; reading {PACKAGE_INFO}")
        if not version:
            info = Path(self.dir) / PACKAGE_INFO
            if not info.is_file():
                if not forced:
                    self.die(f"{self.dir} is not a Megatron-LM checkout (no git tag at HEAD "
                             f"and no {PACKAGE_INFO})")
            else:
                fields = package_info_fields(info)
                major, minor, level = (fields.get(k, "") for k in ("MAJOR", "MINOR", "PATCH"))
                if major and minor and level:
                    reported = f"core_v{major}.{minor}.{level}{fields.get('PRE_RELEASE', '')}"
                    version = resolve(reported, self.root)
                    source = PACKAGE_INFO
                elif not forced:
                    self.die(f"cannot read MAJOR/MINOR/PATCH from {info}")

        if forced:
            version = resolve(forced, self.root)
            if reported:
                return version, (f"forced with --force-version {forced}; "
                                 f"{source} says {reported}")
            return version, (f"forced with --force-version {forced}; "
                             "no version found in the checkout")
        if not version:
            _err(f"{self.prog}: Megatron-LM {reported} (from {source}) is not supported.")
            _err(f"{self.prog}: supported versions: {supported_list(self.root)}")
            near = nearest(reported, self.root)
            if near:
                _err(f"{self.prog}: nearest supported version: {near}; to try its patches "
                     "anyway (they apply only where their context matches exactly):")
                _err(f"{self.prog}:   {self.prog} '{self.dir}' --force-version {near}")
            raise Exit(1)
        if reported == version:
            return version, f"from {source}"
        return version, f"from {source}: {reported}, an alias of {version}"

    def pick_tool(self) -> str:
        """GNU patch if present, else git apply; SEQ1F1B_PATCH_TOOL=patch|git forces one."""
        tool = os.environ.get(TOOL_ENV, "")
        if not tool:
            if shutil.which("patch") is not None and "GNU patch" in _output(["patch",
                                                                              "--version"]):
                tool = "patch"
            elif shutil.which("git") is not None:
                tool = "git"
            else:
                self.die("neither patch nor git is installed")
        if tool not in ("patch", "git"):
            self.die(f"{TOOL_ENV} must be patch or git, not {tool}")
        if shutil.which(tool) is None:
            self.die(f"{tool} is not installed")
        return tool

    # applying
    def all_files(self) -> List[str]:
        return sorted({f for p in self.patches for f in touched(p)})

    def run_one(self, target: str, patch: Path, reverse: bool = False,
                dry_run: bool = False) -> Optional[str]:
        """Apply one patch in `target`, exact context: None, or the tool's output on failure.
        With `dry_run` nothing is written (the tool only checks)."""
        flag = ["-R"] if reverse else []
        if self.tool == "patch":
            command = ["patch", "-d", target, "-p1", "-F0", "-f", "-s", "--no-backup-if-mismatch",
                       "-r", "-", *flag, *(["--dry-run"] if dry_run else []), "-i", str(patch)]
            result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, text=True)
        else:
            # Scratch copies only (never inside another repository): plain-directory mode.
            env = dict(os.environ, GIT_CEILING_DIRECTORIES=os.path.dirname(target))
            result = subprocess.run(["git", "apply", "-p1", *flag,
                                     *(["--check"] if dry_run else []), str(patch)],
                                    cwd=target, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True)
        return None if result.returncode == 0 else result.stdout.rstrip("\n")

    def cleanup(self) -> None:
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch = None

    def scratch_copy(self, name: str) -> str:
        """A scratch copy of the touched files that the checkout has, as scratch/`name`."""
        if self.scratch is None:
            self.scratch = tempfile.mkdtemp(prefix="seq1f1b-patch.")
        tree = os.path.join(self.scratch, name)
        for rel in self.all_files():
            source = os.path.join(self.dir, rel)
            if os.path.isfile(source):
                os.makedirs(os.path.dirname(os.path.join(tree, rel)), exist_ok=True)
                shutil.copy2(source, os.path.join(tree, rel))
        os.makedirs(tree, exist_ok=True)
        return tree

    def survey(self) -> Survey:
        """Each patch's state, found in sequence on scratch copies (so that patches touching
        one file are judged in the order they apply), and the two verified results.

        1. From the last patch to the first, on a copy that becomes the reverted tree:
           a patch whose reverse applies there (and forward does not) is "applied" and is
           reversed in the copy; one whose forward applies (and reverse does not) is
           "not applied"; one where both work is ambiguous.
        2. From the first patch to the last, on a copy that becomes the patched tree:
           the patches not found applied are applied in order (each after a dry run);
           one that does not apply conflicts, as does one touching a missing file.
           (A patch that applied in neither direction in step 1, since it needs an
           earlier one not applied yet, is tried in both here.)
        """
        self.cleanup()
        n = len(self.patches)
        states: List[str] = [""] * n
        reasons: List[str] = [""] * n
        for i, patch in enumerate(self.patches):
            gone = [rel for rel in touched(patch)
                    if not os.path.isfile(os.path.join(self.dir, rel))]
            if gone:
                states[i], reasons[i] = CONFLICTS, f"missing file {gone[0]}"
        reverted = self.scratch_copy("reverted")
        forward_ok = set()
        for i in reversed(range(n)):
            if states[i]:
                continue
            backward = self.run_one(reverted, self.patches[i], reverse=True, dry_run=True)
            forward = self.run_one(reverted, self.patches[i], dry_run=True)
            if forward is None:
                forward_ok.add(i)
            if backward is None and forward is None:
                states[i] = AMBIGUOUS
            elif backward is None:
                states[i] = APPLIED
                failure = self.run_one(reverted, self.patches[i], reverse=True)
                if failure is not None:
                    self.die(f"internal error: {self.patches[i].name} reverses in a dry run "
                             f"only:\n{failure}")
            # else: not applied (if it applies in step 2), or a conflict
        patched = self.scratch_copy("patched")
        for i, patch in enumerate(self.patches):
            if states[i]:
                continue
            # A dry run first: a failing run may still write the hunks that did apply.
            failure = self.run_one(patched, patch, dry_run=True)
            if failure is None and i not in forward_ok and \
                    self.run_one(patched, patch, reverse=True, dry_run=True) is None:
                states[i] = AMBIGUOUS  # (not tried both ways in step 1)
            elif failure is None:
                states[i] = NOT_APPLIED
                failure = self.run_one(patched, patch)
                if failure is not None:
                    self.die(f"internal error: {patch.name} applies in a dry run only:\n"
                             f"{failure}")
            else:
                states[i], reasons[i] = CONFLICTS, failure or "(the patch tool said nothing)"
        return Survey(states, reasons, reverted, patched)

    def commit(self, tree: str) -> List[str]:
        """Copy the verified scratch tree's files that differ into the checkout (contents
        only: modes stay); the files written."""
        written = []
        for rel in self.all_files():
            source, target = os.path.join(tree, rel), os.path.join(self.dir, rel)
            if not os.path.isfile(source):
                continue
            data = Path(source).read_bytes()
            if Path(target).read_bytes() != data:
                with open(target, "wb") as out:
                    out.write(data)
                written.append(rel)
        return written

    def state_lines(self, states: List[str]) -> List[str]:
        return [f"  {patch.name} ({' '.join(touched(patch))}): {state}"
                for patch, state in zip(self.patches, states)]

    def refuse(self, version: str, patch_dir: Path, survey: Survey) -> int:
        """The report for a tree where some patch conflicts (or is ambiguous): exit 1."""
        p = self.prog
        _err(f"{p}: the {version} patches can neither be applied nor reverted in {self.dir}")
        _err(f"{p}: (local changes, or not exactly {version}?)")
        for line in self.state_lines(survey.states):
            _err(f"{p}: {line}")
        first = next(i for i, s in enumerate(survey.states) if s in (CONFLICTS, AMBIGUOUS))
        if survey.states[first] == AMBIGUOUS:
            _err(f"{p}: {self.patches[first].name} would both apply and revert; "
                 "refusing to guess")
        else:
            reason = survey.reasons[first]
            if reason.startswith("missing file ") and "\n" not in reason:
                _err(f"{p}: first failure, {self.patches[first].name}: {reason}")
            else:
                _err(f"{p}: first failure, {self.patches[first].name}:")
                _err("\n".join("    " + line for line in reason.split("\n")))
        _err(f"{p}: nothing was changed; to undo one applied patch by hand: "
             f"patch -d '{self.dir}' -p1 -R -i PATCH (the patches: {patch_dir})")
        return 1

    def run(self, argv: Sequence[str]) -> int:
        mode, self.dir, forced = self.parse(argv)
        version, description = self.find_version(forced)
        patch_dir = self.root / version
        self.patches = sorted(p for p in patch_dir.glob("*.patch") if p.is_file())
        if not self.patches:
            self.die(f"no .patch files in {patch_dir}")
        self.tool = self.pick_tool()
        files_list = " ".join(self.all_files())

        survey = self.survey()
        _out(f"Megatron-LM {version} ({description}) at {self.dir}")
        if CONFLICTS in survey.states or AMBIGUOUS in survey.states:
            return self.refuse(version, patch_dir, survey)
        applied = [p for p, s in zip(self.patches, survey.states) if s == APPLIED]
        pending = [p for p, s in zip(self.patches, survey.states) if s == NOT_APPLIED]
        if mode == "check":
            if not applied:
                _out(f"check: {len(self.patches)} patch(es) apply cleanly, not applied yet "
                     f"({files_list})")
            elif not pending:
                _out("check: already applied")
            else:
                _out(f"check: partly applied: {len(applied)} of {len(self.patches)} "
                     "patch(es) applied, the others apply cleanly")
                for line in self.state_lines(survey.states):
                    _out(line)
                again = f"{self.prog} '{self.dir}'" + (f" --force-version {forced}"
                                                        if forced else "")
                _out(f"check: run {again} to apply the rest, or {again} --revert to revert "
                     "the applied ones")
                return PARTLY
        elif mode == "apply":
            if pending:
                written = self.commit(survey.patched)
                for patch in self.patches:
                    if patch in pending:
                        _out(f"applied {patch.name}")
                    else:
                        _out(f"already applied: {patch.name} (left as is)")
                _out(f"patched: {' '.join(written)}")
            else:
                _out("already applied; nothing to do")
        else:  # revert
            if applied:
                written = self.commit(survey.reverted)
                for patch in reversed(self.patches):
                    if patch in applied:
                        _out(f"reverted {patch.name}")
                    else:
                        _out(f"not applied: {patch.name} (left as is)")
                _out(f"restored: {' '.join(written)}")
            else:
                _out("not applied; nothing to revert")
        return 0


def _output(command: List[str]) -> str:
    try:
        result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, text=True)
    except OSError:
        return ""
    return result.stdout


def default_prog() -> str:
    """What messages call the program: $SEQ1F1B_PATCH_PROG, the command's name, or
    ``python -m megatron_seq1f1b.patch``."""
    prog = os.environ.get(PROG_ENV, "")
    if prog:
        return prog
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    if not name or name in ("-c", "-m") or name.endswith(".py"):
        return MODULE_PROG
    return name


def main(argv: Optional[Sequence[str]] = None, prog: Optional[str] = None) -> int:
    """The ``seq1f1b-patch`` command; returns the exit status."""
    applier = Applier(prog or default_prog())
    try:
        return applier.run(sys.argv[1:] if argv is None else argv)
    except Exit as stop:
        return stop.status
    finally:
        applier.cleanup()


if __name__ == "__main__":
    sys.exit(main())
