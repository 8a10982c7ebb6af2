#!/usr/bin/env bash
# Build the GPU kit: every wheel the lent H200 machine lacks for gpushuffle's
# cuDF path (ci/gpu_kit.lock: cuDF/RMM for CUDA 13, dask/distributed 2026.7.1,
# dask-cuda; the UCX wheels as an optional group; gpushuffle's own wheel built
# from this tree), for CPython 3.12 on manylinux x86-64, cut into parts of at
# most 60 MiB under the ignored .gpukit/parts/, with sha256 sums; then print
# the device plan (also in .gpukit/PLAN.txt): which `run` call carries which
# part, and the final command (ci/gpu_run.sh).
#
#   bash ci/gpu_kit.sh            build (downloads only wheels not in .gpukit/cache)
#   bash ci/gpu_kit.sh --verify   build if the lock or gpushuffle changed, then reassemble the
#                                 parts in a temporary folder as the device will
#                                 (ci/gpu_kit_assemble.sh), compare every wheel, and install
#                                 them with pip --no-index --no-deps --target into a
#                                 temporary folder; last line: N parts, largest X MiB, M wheels intact
#   bash ci/gpu_kit.sh --plan     print the plan of the kit built last
#
# Needs network (PyPI) for wheels not yet cached, and ${PYTHON:-python3} with pip.
set -euo pipefail
cd "$(dirname "$0")/.."
KIT=.gpukit
LOCK=ci/gpu_kit.lock
PYTHON=${PYTHON:-python3}
PLATFORMS="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64"
TARGET="--python-version 3.12 --implementation cp --only-binary=:all: $PLATFORMS"
PART_LIMIT=$((60 * 1048576))

die() { echo "gpu_kit: $*" >&2; exit 1; }
sha() { local s; s=$(sha256sum "$1"); echo "${s%% *}"; }

# What the built kit depends on: the lock, the builder, gpushuffle's sources.
source_stamp() {
    {
        sha256sum "$LOCK" ci/gpu_kit.py pyproject.toml
        find gpushuffle -type f \( -name '*.py' -o -name '*.yaml' -o -name py.typed \) -print0 |
            sort -z | xargs -0 sha256sum
    } | sha256sum | cut -c1-64
}

build() {
    local start=$SECONDS _group kind req file want got fetched=0 reused=0
    mkdir -p "$KIT/cache" "$KIT/build"
    while read -r kind _group req file want; do
        [ "$kind" = wheel ] || continue
        if [ -f "$KIT/cache/$file" ] && [ "$(sha "$KIT/cache/$file")" = "$want" ]; then
            reused=$((reused + 1))
            continue
        fi
        rm -f "$KIT/cache/$file"
        echo "gpu_kit: downloading $req"
        # shellcheck disable=SC2086  # TARGET is a list of options
        "$PYTHON" -m pip download -q --no-deps --disable-pip-version-check $TARGET \
            -d "$KIT/cache" "$req" ||
            die "pip could not download $req for Python 3.12 manylinux x86-64 (network? a wrong pin in $LOCK?)"
        [ -f "$KIT/cache/$file" ] ||
            die "pip downloaded $req, but not as $file: $(ls -t "$KIT/cache" | head -1); update the line in $LOCK"
        got=$(sha "$KIT/cache/$file")
        [ "$got" = "$want" ] ||
            die "$file: sha256 $got, $LOCK says $want (a re-upload, or a wrong lock line): check it on PyPI and update $LOCK"
        fetched=$((fetched + 1))
    done <"$LOCK"
    echo "gpu_kit: wheels: $fetched downloaded, $reused reused from $KIT/cache"

    rm -f "$KIT"/build/gpushuffle-*.whl
    "$PYTHON" -m pip wheel -q --no-deps --disable-pip-version-check -w "$KIT/build" . >/dev/null ||
        die "could not build gpushuffle's wheel (pip wheel .)"
    local own
    own=$(ls "$KIT"/build/gpushuffle-*.whl)

    "$PYTHON" ci/gpu_kit.py closure "$LOCK" "$KIT/cache" "$own"
    local kit_id
    kit_id=$(sha256sum "$LOCK" ci/gpu_kit.py | sha256sum | cut -c1-16)
    "$PYTHON" ci/gpu_kit.py pack "$LOCK" "$KIT/cache" "$KIT" "$kit_id" "$own"
    source_stamp >"$KIT/STAMP"
    echo "gpu_kit: built in $((SECONDS - start)) s"
}

plan() { "$PYTHON" ci/gpu_kit.py plan "$KIT"; }

VERIFY_TMP=
verify() {
    local start=$SECONDS tmp part size largest=0 nparts=0 name wheels=0 file
    if [ ! -f "$KIT/STAMP" ] || [ "$(cat "$KIT/STAMP")" != "$(source_stamp)" ] || [ ! -d "$KIT/parts" ]; then
        echo "gpu_kit: kit missing or out of date: building"
        build
        plan >/dev/null
    fi
    for part in "$KIT"/parts/*/; do
        size=0
        for file in "$part"*; do size=$((size + $(stat -c %s "$file"))); done
        nparts=$((nparts + 1))
        [ $size -gt $largest ] && largest=$size
        [ $size -le $PART_LIMIT ] || die "$part is $size bytes, over 60 MiB"
    done
    tmp=$(mktemp -d "${TMPDIR:-/tmp}/gpukit-verify.XXXXXX")
    VERIFY_TMP=$tmp
    trap 'rm -rf "$VERIFY_TMP"' EXIT
    # Exactly what the device does, from a copy of the parts (as carried).
    cp -r "$KIT/parts" "$tmp/parts"
    GPUKIT_PARTS=$tmp/parts bash ci/gpu_kit_assemble.sh check
    GPUKIT_PARTS=$tmp/parts bash ci/gpu_kit_assemble.sh assemble "$tmp/wheels"
    for file in "$tmp"/wheels/*.whl; do
        name=${file##*/}
        if [ -f "$KIT/cache/$name" ]; then
            cmp -s "$file" "$KIT/cache/$name" || die "$name: reassembled wheel differs from $KIT/cache/$name"
        else
            cmp -s "$file" "$KIT/build/$name" || die "$name: reassembled wheel differs from $KIT/build/$name"
        fi
        wheels=$((wheels + 1))
    done
    local expected
    expected=$(($(grep -c '^wheel ' "$LOCK") + 1))
    [ $wheels = "$expected" ] || die "$wheels wheels reassembled, the kit has $expected"
    # The device's install: its own python3 (3.12) and pip.  Here, a python3.12
    # if there is one; otherwise this Python's pip installs the 3.12 wheels for
    # 3.12 (--python-version), which pip allows with --target.
    local py=$PYTHON pipargs=""
    if command -v python3.12 >/dev/null && python3.12 -m pip --version >/dev/null 2>&1; then
        py=python3.12
    elif [ "$("$PYTHON" -c 'import sys; print(sys.version_info[:2] == (3, 12))')" != True ]; then
        pipargs=$TARGET
        echo "gpu_kit: no python3.12 here: installing with $("$PYTHON" --version)'s pip for Python 3.12 (--python-version 3.12)"
    fi
    local t0=$SECONDS
    PYTHON=$py GPUKIT_PIP_ARGS=$pipargs GPUKIT_PARTS=$tmp/parts \
        bash ci/gpu_kit_assemble.sh install "$tmp/site"
    for file in cudf pylibcudf rmm dask distributed dask_cuda dask_cudf pandas gpushuffle distributed_ucxx ucxx; do
        [ -d "$tmp/site/$file" ] || die "$file is not in the installed site ($tmp/site)"
    done
    echo "gpu_kit: install into a --target folder took $((SECONDS - t0)) s ($(du -sh "$tmp/site" | cut -f1) installed)"
    echo "gpu_kit: verify took $((SECONDS - start)) s"
    echo "$nparts parts, largest $((largest / 1048576)).$(((largest % 1048576) * 10 / 1048576)) MiB, $wheels wheels intact"
}

case "${1:-}" in
"") build && plan ;;
--verify) verify ;;
--plan) [ -f "$KIT/MANIFEST.json" ] || die "no kit built yet: run 'bash ci/gpu_kit.sh'"; plan ;;
*) head -n 18 "$0" | tail -n +2 >&2; exit 2 ;;
esac
