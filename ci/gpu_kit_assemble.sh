#!/usr/bin/env bash
# The GPU kit on the machine it was carried to (ci/gpu_kit.sh builds it here).
# Needs bash, coreutils and `python3 -m pip` only: no network, no index.
#
#   bash ci/gpu_kit_assemble.sh check [--probe]   check the sha256 of every piece of every
#                                                 part that has arrived, list the missing
#                                                 parts; --probe also prints the machine's
#                                                 Python, GPU and the versions the kit
#                                                 relies on there
#   bash ci/gpu_kit_assemble.sh assemble DEST     rebuild the wheels of every complete group
#                                                 into DEST (cat of the pieces, in order) and
#                                                 check each wheel's sha256
#   bash ci/gpu_kit_assemble.sh install SITE      assemble into a temporary folder, then
#                                                 pip install --no-index --no-deps --target SITE
#                                                 (skipped when SITE already holds this kit)
#
# Parts are read from $GPUKIT_PARTS (default .gpukit/parts), one folder each,
# holding pieces, SHA256SUMS and PIECES.  The interpreter is ${PYTHON:-python3};
# $GPUKIT_PIP_ARGS is added to pip's arguments (ci/gpu_kit.sh --verify uses it to
# install the Python 3.12 wheels from another Python).
# Exit status: 0 fine, 1 a piece or wheel is damaged, parts disagree, or a
# requested group is incomplete, 2 wrong usage.
set -euo pipefail
cd "$(dirname "$0")/.."
PARTS=${GPUKIT_PARTS:-.gpukit/parts}
PYTHON=${PYTHON:-python3}

die() { echo "gpu_kit_assemble: $*" >&2; exit 1; }
mib() { local b=$1; echo "$((b / 1048576)).$(((b % 1048576) * 10 / 1048576)) MiB"; }

declare -A PIECE_PATH=() WHEEL_SHA=() WHEEL_COUNT=() WHEEL_GROUP=() WHEEL_BYTES=() PRESENT=()
declare -a WHEELS=() EXPECTED=() KIT_IDS=()
LOADED=0

# Read every arrived part's PIECES.
load() {
    local dir kind rest a b d e f g h i
    [ $LOADED = 1 ] && return 0
    LOADED=1
    shopt -s nullglob
    for dir in "$PARTS"/*/; do
        dir=${dir%/}
        [ -f "$dir/PIECES" ] || continue
        PRESENT[${dir##*/}]=$dir
        while read -r kind rest; do
            case $kind in
            kit) [[ " ${KIT_IDS[*]} " == *" $rest "* ]] || KIT_IDS+=("$rest") ;;
            parts) read -r -a EXPECTED <<<"$rest" ;;
            piece)
                # piece FILE SHA BYTES WHEEL INDEX COUNT WHEEL_SHA WHEEL_BYTES GROUP
                read -r a b _ d e f g h i <<<"$rest"
                PIECE_PATH["$d#$e"]=$dir/$a
                if [ -z "${WHEEL_SHA[$d]:-}" ]; then
                    WHEELS+=("$d")
                    WHEEL_SHA[$d]=$g WHEEL_COUNT[$d]=$f WHEEL_BYTES[$d]=$h WHEEL_GROUP[$d]=$i
                elif [ "${WHEEL_SHA[$d]}" != "$g" ]; then
                    die "parts disagree on $d (two kit builds mixed): send every part of one build"
                fi
                ;;
            esac
        done <"$dir/PIECES"
    done
    shopt -u nullglob
    [ ${#PRESENT[@]} -gt 0 ] || die "no parts in $PARTS: build them with 'bash ci/gpu_kit.sh' and carry them (see .gpukit/PLAN.txt)"
    [ ${#KIT_IDS[@]} -le 1 ] || die "parts from ${#KIT_IDS[@]} kit builds (${KIT_IDS[*]}): send every part of one build"
}

# Groups whose every part has arrived.
complete_groups() {
    local group name missing
    for group in $(for name in "${EXPECTED[@]}"; do echo "${name%%[0-9]*}"; done | sort -u); do
        missing=0
        for name in "${EXPECTED[@]}"; do
            [ "${name%%[0-9]*}" = "$group" ] && [ -z "${PRESENT[$name]:-}" ] && missing=1
        done
        [ $missing = 0 ] && echo "$group"
    done
    return 0
}

check() {
    local probe=${1:-} name dir f bytes missing=() bad=0 total=0
    load
    for name in "${EXPECTED[@]}"; do
        dir=${PRESENT[$name]:-}
        if [ -z "$dir" ]; then
            missing+=("$name")
            continue
        fi
        bytes=0
        for f in "$dir"/*; do bytes=$((bytes + $(stat -c %s "$f"))); done
        total=$((total + bytes))
        if (cd "$dir" && sha256sum --quiet --strict -c SHA256SUMS); then
            echo "part $name: $(mib "$bytes"), $(($(wc -l <"$dir/SHA256SUMS"))) pieces, sha256 ok"
        else
            echo "part $name: sha256 MISMATCH (the file above); send it again" >&2
            bad=1
        fi
    done
    echo "kit ${KIT_IDS[0]:0:12}: ${#PRESENT[@]} of ${#EXPECTED[@]} parts here ($(mib $total)); missing: ${missing[*]:-none}; complete groups: $(complete_groups | tr '\n' ' ')"
    if [ "$probe" = --probe ]; then
        probe_machine
    fi
    return $bad
}

probe_machine() {
    echo "--- machine"
    "$PYTHON" --version
    "$PYTHON" -m pip --version
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader 2>&1 || echo "nvidia-smi failed"
    else
        echo "nvidia-smi: not found"
    fi
    local smi
    smi=$(nvidia-smi 2>/dev/null || true)
    [[ $smi =~ CUDA\ Version:\ *[0-9.]+ ]] && echo "driver's ${BASH_REMATCH[0]}"
    echo "--- versions the kit relies on there (ci/gpu_kit.lock 'device' lines), and what the kit carries"
    "$PYTHON" - ci/gpu_kit.lock <<'EOF' || true
import importlib.metadata as md, sys
lines = [l.split() for l in open(sys.argv[1])]
names = [l[2].split("==")[0] for l in lines if l[:1] == ["wheel"]]
names += [l[1] for l in lines if l[:1] == ["device"]]
names += ["torch", "pytest", "pytest-timeout", "hypothesis"]
for name in names:
    try:
        print(f"  {name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"  {name} -")
EOF
    df -h /tmp | tail -1
}

assemble() {
    local dest=$1 group wheel index path out sha groups
    load
    check >/dev/null || die "a part is damaged: run 'bash ci/gpu_kit_assemble.sh check' to see which"
    groups=$(complete_groups | tr '\n' ' ')
    [[ " $groups " == *" core "* ]] || die "the core group is incomplete: missing parts $(for n in "${EXPECTED[@]}"; do [ -n "${PRESENT[$n]:-}" ] || printf '%s ' "$n"; done)- send them (.gpukit/PLAN.txt)"
    mkdir -p "$dest"
    local count=0 bytes=0
    for wheel in "${WHEELS[@]}"; do
        group=${WHEEL_GROUP[$wheel]}
        [[ " $groups " == *" $group "* ]] || continue
        out=$dest/$wheel
        : >"$out.tmp"
        for ((index = 0; index < WHEEL_COUNT[$wheel]; index++)); do
            path=${PIECE_PATH["$wheel#$index"]:-}
            [ -n "$path" ] || die "$wheel: piece $index is not in any part that arrived"
            cat "$path" >>"$out.tmp"
        done
        sha=$(sha256sum "$out.tmp")
        sha=${sha%% *}
        [ "$sha" = "${WHEEL_SHA[$wheel]}" ] || die "$wheel: reassembled sha256 $sha, expected ${WHEEL_SHA[$wheel]}"
        mv "$out.tmp" "$out"
        count=$((count + 1))
        bytes=$((bytes + WHEEL_BYTES[$wheel]))
    done
    echo "assembled $count wheels ($(mib $bytes)) of groups: $groups into $dest; every sha256 matches"
}

install_site() {
    local site=$1 tmp stamp
    tmp=$(mktemp -d "${TMPDIR:-/tmp}/gpukit-wheels.XXXXXX")
    trap 'rm -rf "$tmp"' RETURN
    assemble "$tmp"
    local f n=0
    stamp=$(for f in "$tmp"/*.whl; do echo "${f##*/} ${WHEEL_SHA[${f##*/}]}"; done | sha256sum)
    stamp=${stamp%% *}
    for f in "$tmp"/*.whl; do n=$((n + 1)); done
    if [ -f "$site/.gpukit-installed" ] && [ "$(cat "$site/.gpukit-installed")" = "$stamp" ]; then
        echo "install: $site already holds these wheels"
        return 0
    fi
    mkdir -p "$site"
    # shellcheck disable=SC2086  # GPUKIT_PIP_ARGS is a list of options
    PIP_ROOT_USER_ACTION=ignore "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --disable-pip-version-check --target "$site" ${GPUKIT_PIP_ARGS:-} "$tmp"/*.whl
    echo "$stamp" >"$site/.gpukit-installed"
    echo "installed $n wheels into $site (PYTHONPATH=$site)"
}

case "${1:-}" in
check) check "${2:-}" ;;
assemble) [ $# = 2 ] || { echo "usage: $0 assemble DEST" >&2; exit 2; }; assemble "$2" ;;
install) [ $# = 2 ] || { echo "usage: $0 install SITE" >&2; exit 2; }; install_site "$2" ;;
*) head -n 24 "$0" | tail -n +2 >&2; exit 2 ;;
esac
