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

Nothing is changed unless every patch applies: the patches are first run on a
scratch copy of the files they touch (in order, so two patches may touch one
file), and only the verified result is copied into the checkout. Context must
match exactly (no fuzz), so a patch never lands twice. Uses GNU ``patch``, or
``git apply`` where ``patch`` is missing (``SEQ1F1B_PATCH_TOOL=patch|git``
forces one).

Exit status: 0 done / already in the requested state (``--check``: applicable
or already applied); 1 patches do not apply or version unsupported; 2 usage.

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
from typing import Dict, List, NoReturn, Optional, Sequence, Tuple

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
  --check              report whether the patches would apply or are already applied
  --revert             reverse the patches, restoring the original files
  --force-version TAG  use the patches made for Megatron-LM tag TAG, whatever version
                       the checkout reports (a newer release, a fork); they still
                       apply only where their context matches exactly
  -h, --help           show this message

The version is the git tag at HEAD, or megatron/core/package_info.py.
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

    def run_one(self, target: str, patch: Path, reverse: bool = False) -> Optional[str]:
        """Apply one patch in `target`, exact context: None, or the tool's output on failure."""
        flag = ["-R"] if reverse else []
        if self.tool == "patch":
            command = ["patch", "-d", target, "-p1", "-F0", "-f", "-s", "--no-backup-if-mismatch",
                       "-r", "-", *flag, "-i", str(patch)]
            result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, text=True)
        else:
            # Scratch copies only (never inside another repository): plain-directory mode.
            env = dict(os.environ, GIT_CEILING_DIRECTORIES=os.path.dirname(target))
            result = subprocess.run(["git", "apply", "-p1", *flag, str(patch)], cwd=target,
                                    env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, text=True)
        return None if result.returncode == 0 else result.stdout.rstrip("\n")

    def cleanup(self) -> None:
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch = None

    def try_all(self, reverse: bool) -> Tuple[str, str]:
        """Run all patches (forward in order, or -R in reverse order) on a fresh scratch
        copy of the touched files: ("", "") or (failed patch, failure)."""
        self.cleanup()
        self.scratch = tempfile.mkdtemp(prefix="seq1f1b-patch.")
        tree = os.path.join(self.scratch, "tree")
        for rel in self.all_files():
            source = os.path.join(self.dir, rel)
            if not os.path.isfile(source):
                return "(checkout)", f"missing file {rel}"
            os.makedirs(os.path.dirname(os.path.join(tree, rel)), exist_ok=True)
            shutil.copy2(source, os.path.join(tree, rel))
        for patch in (reversed(self.patches) if reverse else self.patches):
            failure = self.run_one(tree, patch, reverse)
            if failure is not None:
                return str(patch), failure
        return "", ""

    def state_of(self, patch: Path) -> str:
        """"not applied", "applied" or "conflicts", for that patch alone."""
        for reverse in (False, True):
            probe = tempfile.mkdtemp(prefix="seq1f1b-probe.")
            try:
                for rel in touched(patch):
                    source = os.path.join(self.dir, rel)
                    if os.path.isfile(source):
                        os.makedirs(os.path.dirname(os.path.join(probe, rel)), exist_ok=True)
                        shutil.copy2(source, os.path.join(probe, rel))
                if self.run_one(probe, patch, reverse) is None:
                    return "applied" if reverse else "not applied"
            finally:
                shutil.rmtree(probe, ignore_errors=True)
        return "conflicts"

    def commit_scratch(self) -> None:
        """Copy the verified scratch files into the checkout (contents only: modes stay)."""
        assert self.scratch is not None
        for rel in self.all_files():
            data = Path(self.scratch, "tree", rel).read_bytes()
            with open(os.path.join(self.dir, rel), "wb") as out:
                out.write(data)

    def run(self, argv: Sequence[str]) -> int:
        mode, self.dir, forced = self.parse(argv)
        version, description = self.find_version(forced)
        patch_dir = self.root / version
        self.patches = sorted(p for p in patch_dir.glob("*.patch") if p.is_file())
        if not self.patches:
            self.die(f"no .patch files in {patch_dir}")
        self.tool = self.pick_tool()
        files_list = " ".join(self.all_files())

        # Both directions are tried: a tree where both work is ambiguous and refused.
        # The scratch copy keeps the result of the last try (forward).
        reverse_ok = self.try_all(reverse=True) == ("", "")
        failed_patch, failure = self.try_all(reverse=False)
        forward_ok = not failed_patch
        if forward_ok and reverse_ok:
            self.die(f"the {version} patches would both apply and revert in {self.dir}; "
                     "refusing to guess")
        state = ("unapplied" if forward_ok else "applied" if reverse_ok else "conflict")

        _out(f"Megatron-LM {version} ({description}) at {self.dir}")
        if state == "conflict":
            p = self.prog
            _err(f"{p}: the {version} patches neither apply nor are fully applied in {self.dir}")
            _err(f"{p}: (local changes, a partly applied tree, or not exactly {version}?)")
            for patch in self.patches:
                _err(f"{p}:   {patch.name} ({' '.join(touched(patch))}): "
                     f"{self.state_of(patch)}")
            _err(f"{p}: first failure, {os.path.basename(failed_patch)}:")
            if failure:
                _err("\n".join("    " + line for line in failure.split("\n")))
            _err(f"{p}: nothing was changed; to undo one applied patch by hand: "
                 f"patch -d '{self.dir}' -p1 -R -i PATCH (the patches: {patch_dir})")
            return 1
        if mode == "check":
            if state == "unapplied":
                _out(f"check: {len(self.patches)} patch(es) apply cleanly, not applied yet "
                     f"({files_list})")
            else:
                _out("check: already applied")
        elif mode == "apply":
            if state == "unapplied":
                self.commit_scratch()
                for patch in self.patches:
                    _out(f"applied {patch.name}")
                _out(f"patched: {files_list}")
            else:
                _out("already applied; nothing to do")
        else:  # revert
            if state == "applied":
                if self.try_all(reverse=True) != ("", ""):
                    self.die("internal error: the reverse dry run no longer succeeds")
                self.commit_scratch()
                for patch in reversed(self.patches):
                    _out(f"reverted {patch.name}")
                _out(f"restored: {files_list}")
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
