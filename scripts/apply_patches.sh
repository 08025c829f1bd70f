#!/usr/bin/env bash
# Apply (or check, or revert) the Seq1F1B patches to a Megatron-LM checkout.
#
#   scripts/apply_patches.sh MEGATRON_LM_DIR            apply (idempotent)
#   scripts/apply_patches.sh MEGATRON_LM_DIR --check    report only, change nothing
#   scripts/apply_patches.sh MEGATRON_LM_DIR --revert   restore the original files
#
# The version comes from the git tag at HEAD (git checkouts) or from
# megatron/core/package_info.py (e.g. an unpacked release archive); patches
# live in patches/megatron-lm/<version>/ and apply in name order.
#
# Nothing is changed unless every patch applies: the patches are first run on
# a scratch copy of the files they touch (in order, so two patches may touch
# one file), and only the verified result is copied into the checkout.
# Context must match exactly (no fuzz), so a patch never lands twice.
# Uses GNU patch, or `git apply` where patch is missing.
#
# Exit status: 0 done / already in the requested state (--check: applicable or
# already applied); 1 patches do not apply or version unsupported; 2 usage.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PATCH_ROOT="$ROOT/patches/megatron-lm"
PROG="$(basename "$0")"

# usage [FD]: to stderr (errors) or the given descriptor (--help: 1).
usage() {
    cat >&"${1:-2}" <<EOF
usage: $PROG MEGATRON_LM_DIR [--check|--revert]

  (no option)  apply the Seq1F1B patches (prints "already applied" if they are)
  --check      report whether the patches would apply or are already applied
  --revert     reverse the patches, restoring the original files
  -h, --help   show this message

supported Megatron-LM versions: $(supported | tr '\n' ' ' | sed 's/ $//')
EOF
}

die() { echo "$PROG: $*" >&2; exit 1; }

supported() {
    local d
    for d in "$PATCH_ROOT"/*/; do
        [ -d "$d" ] && basename "$d"
    done
    return 0
}

# --- arguments -------------------------------------------------------------
mode=apply
dir=""
for arg in "$@"; do
    case "$arg" in
        -h|--help) usage 1; exit 0 ;;
        --check|--revert)
            [ "$mode" = apply ] || { echo "$PROG: give at most one of --check, --revert" >&2; usage; exit 2; }
            mode="${arg#--}" ;;
        -*) echo "$PROG: unknown option: $arg" >&2; usage; exit 2 ;;
        *) [ -z "$dir" ] || { echo "$PROG: more than one directory given" >&2; usage; exit 2; }
           dir="$arg" ;;
    esac
done
[ -n "$dir" ] || { echo "$PROG: missing MEGATRON_LM_DIR" >&2; usage; exit 2; }
[ -d "$dir" ] || die "not a directory: $dir"
dir="$(cd "$dir" && pwd)"

# --- version ---------------------------------------------------------------
version=""
source_of_version=""
if command -v git >/dev/null 2>&1 \
    && [ "$(git -C "$dir" rev-parse --show-toplevel 2>/dev/null || true)" = "$dir" ]; then
    exact="$(git -C "$dir" describe --tags --exact-match HEAD 2>/dev/null || true)"
    # Several tags may name one commit: take the first one we have patches for.
    for tag in $exact $(git -C "$dir" tag --points-at HEAD 2>/dev/null || true); do
        if [ -d "$PATCH_ROOT/$tag" ]; then version="$tag"; source_of_version="git tag"; break; fi
    done
    # Any other tag (a fork's, or an unsupported release): package_info.py decides.
    [ -n "$version" ] || [ -z "$exact" ] || echo "note: no patches for git tag $exact; reading megatron/core/package_info.py" >&2
fi
if [ -z "$version" ]; then
    info="$dir/megatron/core/package_info.py"
    [ -f "$info" ] || die "$dir is not a Megatron-LM checkout (no git tag at HEAD and no megatron/core/package_info.py)"
    field() { sed -n "s/^$1[[:space:]]*=[[:space:]]*['\"]\{0,1\}\([^'\"[:space:]]*\)['\"]\{0,1\}.*/\1/p" "$info" | head -n1; }
    major="$(field MAJOR)"; minor="$(field MINOR)"; patchlevel="$(field PATCH)"; pre="$(field PRE_RELEASE)"
    [ -n "$major" ] && [ -n "$minor" ] && [ -n "$patchlevel" ] \
        || die "cannot read MAJOR/MINOR/PATCH from $info"
    version="core_v$major.$minor.$patchlevel$pre"
    source_of_version="megatron/core/package_info.py"
fi

patch_dir="$PATCH_ROOT/$version"
if [ ! -d "$patch_dir" ]; then
    echo "$PROG: Megatron-LM $version (from $source_of_version) is not supported." >&2
    echo "$PROG: supported versions: $(supported | tr '\n' ' ' | sed 's/ $//')" >&2
    exit 1
fi
patches=()
for p in "$patch_dir"/*.patch; do [ -f "$p" ] && patches+=("$p"); done
[ "${#patches[@]}" -gt 0 ] || die "no .patch files in $patch_dir"

# --- helpers ---------------------------------------------------------------
# Files a patch touches (the "+++ b/path" lines, -p1).
touched() {
    sed -n 's/^+++ [^/]*\/\([^[:space:]]*\).*/\1/p' "$1"
}

all_files() {
    local p
    for p in "${patches[@]}"; do touched "$p"; done | sort -u
}

# GNU patch if present, else git apply; SEQ1F1B_PATCH_TOOL=patch|git forces one.
tool="${SEQ1F1B_PATCH_TOOL:-}"
if [ -z "$tool" ]; then
    if patch --version 2>/dev/null | grep -q "GNU patch"; then tool=patch
    elif command -v git >/dev/null 2>&1; then tool=git
    else die "neither patch nor git is installed"; fi
fi
case "$tool" in patch|git) command -v "$tool" >/dev/null 2>&1 || die "$tool is not installed" ;;
    *) die "SEQ1F1B_PATCH_TOOL must be patch or git, not $tool" ;; esac

# run_one DIR PATCH [-R]: apply one patch in DIR, exact context; output on failure.
run_one() {
    local target="$1" p="$2" reverse="${3:-}" out
    if [ "$tool" = patch ]; then
        out="$(patch -d "$target" -p1 -F0 -f -s --no-backup-if-mismatch -r - $reverse -i "$p" 2>&1)" \
            || { echo "$out"; return 1; }
    else
        # Scratch copies only (never inside another repository): plain-directory mode.
        out="$(cd "$target" && GIT_CEILING_DIRECTORIES="$(dirname "$target")" \
            git apply -p1 $reverse "$p" 2>&1)" || { echo "$out"; return 1; }
    fi
}

scratch=""
cleanup() { [ -z "$scratch" ] || rm -rf "$scratch"; }
trap cleanup EXIT

# try DIRECTION: run all patches (forward in order, or -R in reverse order) on
# a fresh scratch copy of the touched files. Sets $failed_patch and $failure.
try() {
    local direction="$1" f p i
    cleanup
    scratch="$(mktemp -d "${TMPDIR:-/tmp}/seq1f1b-patch.XXXXXX")"
    mkdir -p "$scratch/tree"
    while IFS= read -r f; do
        [ -f "$dir/$f" ] || { failed_patch="(checkout)"; failure="missing file $f"; return 1; }
        mkdir -p "$scratch/tree/$(dirname "$f")"
        cp -p "$dir/$f" "$scratch/tree/$f"
    done < <(all_files)
    if [ "$direction" = forward ]; then
        for p in "${patches[@]}"; do
            failure="$(run_one "$scratch/tree" "$p")" || { failed_patch="$p"; return 1; }
        done
    else
        for ((i=${#patches[@]}-1; i>=0; i--)); do
            p="${patches[$i]}"
            failure="$(run_one "$scratch/tree" "$p" -R)" || { failed_patch="$p"; return 1; }
        done
    fi
    return 0
}

# state_of PATCH: "not applied", "applied" or "conflicts", for that patch alone.
state_of() {
    local p="$1" probe result=conflicts f
    for reverse in "" -R; do
        probe="$(mktemp -d "${TMPDIR:-/tmp}/seq1f1b-probe.XXXXXX")"
        while IFS= read -r f; do
            [ -f "$dir/$f" ] || continue
            mkdir -p "$probe/$(dirname "$f")" && cp -p "$dir/$f" "$probe/$f"
        done < <(touched "$p")
        if run_one "$probe" "$p" $reverse >/dev/null; then
            rm -rf "$probe"
            [ -z "$reverse" ] && result="not applied" || result=applied
            break
        fi
        rm -rf "$probe"
    done
    echo "$result"
}

# Copy the verified scratch files into the checkout (contents only: modes stay).
commit_scratch() {
    local f
    while IFS= read -r f; do
        cat "$scratch/tree/$f" > "$dir/$f"
    done < <(all_files)
}

files_list="$(all_files | tr '\n' ' ' | sed 's/ $//')"
failed_patch=""; failure=""
# Both directions are tried: a tree where both work is ambiguous and refused.
# The scratch copy keeps the result of the last try (forward).
reverse_ok=0; forward_ok=0
if try reverse; then reverse_ok=1; fi
if try forward; then forward_ok=1; fi
forward_failed_patch="$failed_patch"; forward_failure="$failure"
case "$forward_ok$reverse_ok" in
    10) state=unapplied ;;
    01) state=applied ;;
    11) die "the $version patches would both apply and revert in $dir; refusing to guess" ;;
    *) state=conflict ;;
esac

echo "Megatron-LM $version (from $source_of_version) at $dir"
case "$mode:$state" in
    check:unapplied)
        echo "check: ${#patches[@]} patch(es) apply cleanly, not applied yet ($files_list)" ;;
    check:applied)
        echo "check: already applied" ;;
    apply:unapplied)
        commit_scratch
        for p in "${patches[@]}"; do echo "applied $(basename "$p")"; done
        echo "patched: $files_list" ;;
    apply:applied)
        echo "already applied; nothing to do" ;;
    revert:applied)
        try reverse || die "internal error: the reverse dry run no longer succeeds"
        commit_scratch
        for ((i=${#patches[@]}-1; i>=0; i--)); do echo "reverted $(basename "${patches[$i]}")"; done
        echo "restored: $files_list" ;;
    revert:unapplied)
        echo "not applied; nothing to revert" ;;
    *:conflict)
        echo "$PROG: the $version patches neither apply nor are fully applied in $dir" >&2
        echo "$PROG: (local changes, a partly applied tree, or not exactly $version?)" >&2
        for p in "${patches[@]}"; do
            echo "$PROG:   $(basename "$p") ($(touched "$p" | tr '\n' ' ' | sed 's/ $//')): $(state_of "$p")" >&2
        done
        echo "$PROG: first failure, $(basename "$forward_failed_patch"):" >&2
        [ -z "$forward_failure" ] || echo "$forward_failure" | sed 's/^/    /' >&2
        echo "$PROG: nothing was changed; to undo one applied patch by hand:" \
            "patch -d '$dir' -p1 -R -i PATCH" >&2
        exit 1 ;;
esac
