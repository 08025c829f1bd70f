#!/usr/bin/env bash
# Apply (or check, or revert) the Seq1F1B patches to a Megatron-LM checkout.
#
#   scripts/apply_patches.sh MEGATRON_LM_DIR            apply (idempotent)
#   scripts/apply_patches.sh MEGATRON_LM_DIR --check    report only, change nothing
#   scripts/apply_patches.sh MEGATRON_LM_DIR --revert   restore the original files
#   ... --force-version TAG       use TAG's patches, whatever version the checkout reports
#
# The version comes from the git tag at HEAD (git checkouts) or from
# megatron/core/package_info.py (e.g. an unpacked release archive); patches
# live in patches/megatron-lm/<tag>/ (one folder per supported Megatron-LM
# tag) and apply in name order. A version without a folder of its own goes
# through the alias table below; any other version is refused, naming the
# nearest supported tag, whose patches --force-version TAG tries anyway (they
# still apply only where their context matches exactly).
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

# Version aliases, "REPORTED FOLDER": a version that a checkout reports -> the
# patch folder made for it. A folder named like the reported version itself
# would win over its alias.
#   core_v0.19.1: the core_v0.19.0 tag's megatron/core/package_info.py says
#                 0.19.1, so an unpacked core_v0.19.0 archive reads as 0.19.1.
ALIASES=(
    "core_v0.19.1 core_v0.19.0"
)

# usage [FD]: to stderr (errors) or the given descriptor (--help: 1).
usage() {
    cat >&"${1:-2}" <<EOF
usage: $PROG MEGATRON_LM_DIR [--check|--revert] [--force-version TAG]

  (no option)          apply the Seq1F1B patches (prints "already applied" if they are)
  --check              report whether the patches would apply or are already applied
  --revert             reverse the patches, restoring the original files
  --force-version TAG  use the patches made for Megatron-LM tag TAG, whatever version
                       the checkout reports (a newer release, a fork); they still
                       apply only where their context matches exactly
  -h, --help           show this message

The version is the git tag at HEAD, or megatron/core/package_info.py.
supported Megatron-LM tags: $(supported_list)
EOF
}

die() { echo "$PROG: $*" >&2; exit 1; }
usage_error() { echo "$PROG: $*" >&2; usage; exit 2; }

supported() {
    local d
    for d in "$PATCH_ROOT"/*/; do
        [ -d "$d" ] && basename "$d"
    done
    return 0
}

# "REPORTED FOLDER" lines: every folder as itself, then the aliases.
candidates() {
    local t line
    for t in $(supported); do echo "$t $t"; done
    for line in "${ALIASES[@]}"; do echo "$line"; done
}

# One line: the tags, then the aliases ("core_v0.19.1 = core_v0.19.0").
supported_list() {
    local out reported folder
    out="$(supported | tr '\n' ' ' | sed 's/ $//')"
    while read -r reported folder; do
        [ "$reported" = "$folder" ] || [ ! -d "$PATCH_ROOT/$folder" ] \
            || out="$out (and $reported = $folder)"
    done < <(candidates)
    echo "$out"
}

# resolve VERSION: the patch folder for VERSION (its own, or its alias's), or nothing.
resolve() {
    local reported folder
    [ -n "$1" ] || return 0
    while read -r reported folder; do
        if [ "$reported" = "$1" ] && [ -d "$PATCH_ROOT/$folder" ]; then
            echo "$folder"; return 0
        fi
    done < <(candidates)
    return 0
}

# version_key VERSION: "MAJOR MINOR PATCH" of core_vX.Y.Z[anything], or nothing.
version_key() {
    echo "$1" | sed -n 's/^core_v\([0-9]\{1,5\}\)\.\([0-9]\{1,5\}\)\.\([0-9]\{1,5\}\).*/\1 \2 \3/p'
}

# nearest VERSION: the supported tag closest to VERSION, or nothing if VERSION
# is not core_vX.Y.Z[...]. Only the two neighbours in version order compete
# (the newest tag for a newer release, the oldest for an older one); between
# them the closer wins: same major first, then the smaller minor gap, then
# the smaller patch gap, and on a tie the newer one. Aliases count with the
# version they stand for (0.19.1 is core_v0.19.0's).
nearest() {
    local key want reported folder ord lo="" lo_f="" hi="" hi_f="" best="" best_d="" f d
    local ma mi pa cma cmi cpa dma dmi dpa older
    key="$(version_key "$1")"
    [ -n "$key" ] || return 0
    read -r ma mi pa <<< "$key"
    want=$(( (10#$ma * 100000 + 10#$mi) * 100000 + 10#$pa ))
    while read -r reported folder; do
        key="$(version_key "$reported")"
        [ -n "$key" ] && [ -d "$PATCH_ROOT/$folder" ] || continue
        read -r cma cmi cpa <<< "$key"
        ord=$(( (10#$cma * 100000 + 10#$cmi) * 100000 + 10#$cpa ))
        if [ "$ord" -le "$want" ] && { [ -z "$lo" ] || [ "$ord" -gt "$lo" ]; }; then
            lo="$ord"; lo_f="$reported $folder"; fi
        if [ "$ord" -ge "$want" ] && { [ -z "$hi" ] || [ "$ord" -lt "$hi" ]; }; then
            hi="$ord"; hi_f="$reported $folder"; fi
    done < <(candidates)
    for f in "$lo_f" "$hi_f"; do
        [ -n "$f" ] || continue
        read -r reported folder <<< "$f"
        read -r cma cmi cpa <<< "$(version_key "$reported")"
        dma=$(( 10#$cma - 10#$ma )); dmi=$(( 10#$cmi - 10#$mi )); dpa=$(( 10#$cpa - 10#$pa ))
        older=0  # the candidate comes before VERSION: loses a tie
        [ "$(( (10#$cma * 100000 + 10#$cmi) * 100000 + 10#$cpa ))" -ge "$want" ] || older=1
        d=$(( ((${dma#-} * 100000 + ${dmi#-}) * 100000 + ${dpa#-}) * 2 + older ))
        if [ -z "$best_d" ] || [ "$d" -lt "$best_d" ]; then best_d="$d"; best="$folder"; fi
    done
    echo "$best"
}

# --- arguments -------------------------------------------------------------
mode=apply
dir=""
forced=""
while [ "$#" -gt 0 ]; do
    arg="$1"; shift
    case "$arg" in
        -h|--help) usage 1; exit 0 ;;
        --check|--revert)
            [ "$mode" = apply ] || usage_error "give at most one of --check, --revert"
            mode="${arg#--}" ;;
        --force-version|--force-version=*)
            [ -z "$forced" ] || usage_error "--force-version given twice"
            if [ "$arg" = --force-version ]; then
                [ "$#" -gt 0 ] || usage_error "--force-version needs a TAG"
                forced="$1"; shift
            else
                forced="${arg#--force-version=}"
            fi
            [ -n "$forced" ] || usage_error "--force-version needs a TAG" ;;
        -*) usage_error "unknown option: $arg" ;;
        *) [ -z "$dir" ] || usage_error "more than one directory given"
           dir="$arg" ;;
    esac
done
[ -n "$dir" ] || usage_error "missing MEGATRON_LM_DIR"
[ -z "$forced" ] || [ -n "$(resolve "$forced")" ] \
    || usage_error "--force-version $forced: no patches for that tag; supported: $(supported_list)"
[ -d "$dir" ] || die "not a directory: $dir"
dir="$(cd "$dir" && pwd)"

# --- version ---------------------------------------------------------------
# $reported: what the checkout says (git tag or package_info.py); $version:
# its patch folder (empty if none); $description: how $version was chosen.
reported=""
version=""
source_of_version=""
if command -v git >/dev/null 2>&1 \
    && [ "$(git -C "$dir" rev-parse --show-toplevel 2>/dev/null || true)" = "$dir" ]; then
    exact="$(git -C "$dir" describe --tags --exact-match HEAD 2>/dev/null || true)"
    # Several tags may name one commit: take the first one we have patches for.
    for tag in $exact $(git -C "$dir" tag --points-at HEAD 2>/dev/null || true); do
        folder="$(resolve "$tag")"
        if [ -n "$folder" ]; then
            reported="$tag"; version="$folder"; source_of_version="git tag"; break
        fi
    done
    # Any other tag (a fork's, or an unsupported release): package_info.py decides.
    [ -n "$version" ] || [ -z "$exact" ] || [ -n "$forced" ] \
        || echo "note: no patches for git tag $exact; reading megatron/core/package_info.py" >&2
fi
if [ -z "$version" ]; then
    info="$dir/megatron/core/package_info.py"
    field() { sed -n "s/^$1[[:space:]]*=[[:space:]]*['\"]\{0,1\}\([^'\"[:space:]]*\)['\"]\{0,1\}.*/\1/p" "$info" | head -n1; }
    if [ ! -f "$info" ]; then
        [ -n "$forced" ] \
            || die "$dir is not a Megatron-LM checkout (no git tag at HEAD and no megatron/core/package_info.py)"
    else
        major="$(field MAJOR)"; minor="$(field MINOR)"; patchlevel="$(field PATCH)"; pre="$(field PRE_RELEASE)"
        if [ -n "$major" ] && [ -n "$minor" ] && [ -n "$patchlevel" ]; then
            reported="core_v$major.$minor.$patchlevel$pre"
            version="$(resolve "$reported")"
            source_of_version="megatron/core/package_info.py"
        else
            [ -n "$forced" ] || die "cannot read MAJOR/MINOR/PATCH from $info"
        fi
    fi
fi

if [ -n "$forced" ]; then
    version="$(resolve "$forced")"
    if [ -n "$reported" ]; then
        description="forced with --force-version $forced; $source_of_version says $reported"
    else
        description="forced with --force-version $forced; no version found in the checkout"
    fi
elif [ -z "$version" ]; then
    echo "$PROG: Megatron-LM $reported (from $source_of_version) is not supported." >&2
    echo "$PROG: supported versions: $(supported_list)" >&2
    near="$(nearest "$reported")"
    if [ -n "$near" ]; then
        echo "$PROG: nearest supported version: $near; to try its patches anyway (they" \
            "apply only where their context matches exactly):" >&2
        echo "$PROG:   $PROG '$dir' --force-version $near" >&2
    fi
    exit 1
elif [ "$reported" = "$version" ]; then
    description="from $source_of_version"
else
    description="from $source_of_version: $reported, an alias of $version"
fi

patch_dir="$PATCH_ROOT/$version"
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

echo "Megatron-LM $version ($description) at $dir"
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
