#!/usr/bin/env bash
# The GPU checks in one run: the final `run` call on the lent GPU machine
# (after the kit's parts arrived, see .gpukit/PLAN.txt), or any GPU runner.
#
#   bash ci/gpu_run.sh RESULTS_DIR [--no-kit] [--steps test_gpu,bench,device_check,ucx]
#
# 1. kit: reassemble and check the kit's parts (.gpukit/parts, ci/gpu_kit_assemble.sh)
#    and install them into $GPUKIT_SITE (/tmp/site), first on PYTHONPATH after this tree.
#    --no-kit: use ${PYTHON:-python3}'s own environment (a GPU runner with the gpu
#    extras installed, or CI's CPU check of this script).
# 2. env: Python, versions and where each package imports from, pip check, nvidia-smi.
#    Then probes: a CUDA allocation (cupy), cuDF on the device, UCX importable.
# 3. steps, each under its own timeout so that one failure keeps the others:
#    rapids        ci/test_rapids.sh in $PYTHON's environment: seconds, no device; says
#                  at once whether the environment is the one CI checked (every RAPIDS
#                  name resolves, device-free checks, the GPU tests collect)
#    test_gpu      pytest tests/test_gpu.py -rs, junit XML to RESULTS_DIR/test_gpu.xml
#    bench         benchmarks/gpu_bench.py: cuDF, two workers on GPU 0, gpushuffle vs p2p
#                  vs tasks, results checked, with the device's copy rates
#    device_check  ci/device_check.sh: the store's device tier with cupy buffers
#    ucx           benchmarks/gpu_bench.py over protocol="ucx", gpushuffle vs tasks, and
#                  gpushuffle's shards must travel as device frames
#    A step whose prerequisite is missing (no GPU, no cuDF, no UCX wheels) is skipped
#    with the reason.  All steps together keep to GPU_RUN_BUDGET_S (420 s).
# RESULTS_DIR gets three files: gpu_run.log (everything printed), test_gpu.xml and
# gpu-<device>-<date>.json (every step's status, reason, time and results).
# Exit status: 0 when no step failed (skipped ones are fine), 1 otherwise, 2 bad usage,
# 3 when no GPU is usable (every GPU step skipped: a run that tested nothing is no pass).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD

usage() { head -n 28 "$0" | tail -n +2 >&2; exit 2; }
RESULTS="" USE_KIT=yes STEPS="rapids,test_gpu,bench,device_check,ucx"
while [ $# -gt 0 ]; do
    case $1 in
    --no-kit) USE_KIT=no ;;
    --steps) [ $# -ge 2 ] || usage; STEPS=$2; shift ;;
    --steps=*) STEPS=${1#--steps=} ;;
    -h | --help) usage ;;
    -*) echo "gpu_run: unknown option $1" >&2; usage ;;
    *) [ -z "$RESULTS" ] || usage; RESULTS=$1 ;;
    esac
    shift
done
[ -n "$RESULTS" ] || usage
for step in ${STEPS//,/ }; do
    case $step in rapids | test_gpu | bench | device_check | ucx) ;; *) echo "gpu_run: unknown step $step" >&2; usage ;; esac
done
mkdir -p "$RESULTS"
RESULTS=$(cd "$RESULTS" && pwd)
PYTHON=${PYTHON:-python3}
BUDGET=${GPU_RUN_BUDGET_S:-420}
SITE=${GPUKIT_SITE:-/tmp/site}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_run.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
START=$SECONDS
export PYTHONUNBUFFERED=1

section() { echo; echo "=== $1 (+$((SECONDS - START)) s)"; }
# record NAME STATUS SECONDS RC REASON
record() {
    local reason=${5//$'\t'/ }
    printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "${reason//$'\n'/ }" >>"$WORK/steps.tsv"
    echo "--- $1: $2${5:+ ($5)}"
}
probe() { printf '%s\t%s\t%s\n' "$1" "$2" "${3//$'\n'/ }" >>"$WORK/probes.tsv"; }

kit() {
    section "kit"
    local t0=$SECONDS out rc=0 pyver
    export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
    UCX_NOTE="the UCX wheels are not installed"
    if [ $USE_KIT = no ]; then
        record kit skipped 0 "" "--no-kit: the steps use $PYTHON's own environment"
        return 0
    fi
    if ! compgen -G "${GPUKIT_PARTS:-.gpukit/parts}/*/PIECES" >/dev/null; then
        record kit failed 0 "" "no kit parts in ${GPUKIT_PARTS:-.gpukit/parts}: build them with 'bash ci/gpu_kit.sh' and carry them as .gpukit/PLAN.txt says, or pass --no-kit to use $PYTHON's own environment"
        return 0
    fi
    pyver=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    if [ "$pyver" != 3.12 ]; then
        out=$(timeout 120 bash ci/gpu_kit_assemble.sh check 2>&1) || rc=$?
        echo "$out"
        if [ $rc = 0 ]; then
            record kit skipped $((SECONDS - t0)) "" "parts checked (${out##*$'\n'}); not installed: the kit is for Python 3.12 and $PYTHON is $pyver, so the steps use its own environment"
        else
            record kit failed $((SECONDS - t0)) $rc "ci/gpu_kit_assemble.sh check exited $rc: ${out##*$'\n'}"
        fi
        return 0
    fi
    out=$(timeout 300 bash ci/gpu_kit_assemble.sh install "$SITE" 2>&1) || rc=$?
    echo "$out"
    export PYTHONPATH=$REPO:$SITE${PYTHONPATH#"$REPO"}
    if [ $rc = 0 ]; then
        record kit passed $((SECONDS - t0)) 0 "${out##*$'\n'}"
    else
        record kit failed $((SECONDS - t0)) $rc "ci/gpu_kit_assemble.sh install exited $rc: ${out##*$'\n'}"
    fi
    if [[ $out == *"of groups: "*ucx* ]]; then
        UCX_NOTE=""
    else
        UCX_NOTE="the UCX group of the kit did not travel (part ucx1)"
    fi
}

env_and_probes() {
    section "env"
    local t0=$SECONDS rc=0 out
    timeout 150 "$PYTHON" ci/gpu_run.py env "$WORK/env.json" "$SITE" || rc=$?
    echo "--- nvidia-smi"
    timeout 30 nvidia-smi 2>&1 || echo "nvidia-smi: not available"
    if [ $rc = 0 ]; then record env passed $((SECONDS - t0)) 0 ""; else record env failed $((SECONDS - t0)) $rc "ci/gpu_run.py env exited $rc"; fi

    section "probes"
    rc=0
    out=$(timeout 90 "$PYTHON" ci/gpu_run.py probe-gpu 2>&1) || rc=$?
    [ $rc = 124 ] && out="no usable CUDA device: the probe timed out (90 s)"
    out=${out##*$'\n'}
    echo "gpu: $out"
    if [ $rc = 0 ]; then GPU=1 GPU_REASON=""; else GPU=0 GPU_REASON=$out; fi
    probe gpu $GPU "$out"
    CUDF=0 CUDF_REASON=$GPU_REASON
    if [ $GPU = 1 ]; then
        rc=0
        out=$(timeout 180 "$PYTHON" ci/gpu_run.py probe-cudf 2>&1) || rc=$?
        [ $rc = 124 ] && out="cuDF not usable: the probe timed out (180 s)"
        out=${out##*$'\n'}
        if [ $rc = 0 ]; then CUDF=1 CUDF_REASON=""; else CUDF_REASON=$out; fi
    fi
    echo "cudf: ${CUDF_REASON:-ok}"
    probe cudf $CUDF "${CUDF_REASON:-ok}"
    rc=0
    out=$(timeout 90 "$PYTHON" ci/gpu_run.py probe-ucx 2>&1) || rc=$?
    out=${out##*$'\n'}
    if [ $rc = 0 ]; then UCX=1 UCX_REASON=""; else UCX=0 UCX_REASON="$out${UCX_NOTE:+; $UCX_NOTE}"; fi
    echo "ucx: ${UCX_REASON:-ok}"
    probe ucx $UCX "${UCX_REASON:-ok}"
    RAPIDS_REASON=""
    if ! "$PYTHON" -c 'import importlib.util as u, sys; sys.exit(not (u.find_spec("cudf") and u.find_spec("pylibcudf")))' 2>/dev/null; then
        RAPIDS_REASON="cuDF is not installed in $PYTHON's environment"
    fi
}

selected() { [[ ",$STEPS," == *",$1,"* ]]; }

# step NAME DEFAULT_TIMEOUT RESERVE_FOR_LATER_STEPS SKIP_REASON -- COMMAND...
step() {
    local name=$1 default=$2 reserve=$3 skip=$4 t rc=0 t0
    shift 5
    section "$name"
    if ! selected "$name"; then
        record "$name" skipped 0 "" "not selected (--steps $STEPS)"
        return 0
    fi
    if [ -n "$skip" ]; then
        record "$name" skipped 0 "" "$skip"
        return 0
    fi
    t=$((BUDGET - (SECONDS - START) - reserve - 10))
    [ $t -gt "$default" ] && t=$default
    if [ "$t" -lt 20 ]; then
        record "$name" skipped 0 "" "no time left: GPU_RUN_BUDGET_S=$BUDGET s, $((SECONDS - START)) s used"
        return 0
    fi
    echo "timeout ${t} s: $*"
    t0=$SECONDS
    # gpu_bench.py starts no repeat it cannot finish, checks included, by then.
    GPU_BENCH_DEADLINE_S=$((t - 10)) timeout --kill-after=15 "$t" "$@" || rc=$?
    case $rc in
    0) record "$name" passed $((SECONDS - t0)) 0 "" ;;
    124 | 137) record "$name" timeout $((SECONDS - t0)) $rc "killed after its ${t} s timeout" ;;
    *) record "$name" failed $((SECONDS - t0)) $rc "exited $rc (see gpu_run.log)" ;;
    esac
}

# Time the later selected steps need at least, so an early one cannot eat the budget.
reserve_after() {
    local total=0 s
    for s in "$@"; do
        selected "$s" || continue
        case $s in bench) total=$((total + 60)) ;; device_check) total=$((total + 30)) ;; ucx) total=$((total + 45)) ;; esac
    done
    echo $total
}

main() {
    echo "gpu_run: $(date -Is), $(uname -n), repo $REPO, results $RESULTS, budget ${BUDGET} s, python $PYTHON"
    : >"$WORK/steps.tsv"
    : >"$WORK/probes.tsv"
    kit
    env_and_probes
    # The reason a step cannot run, empty when it can.
    local need_gpu=$GPU_REASON need_cudf=$CUDF_REASON need_ucx=${CUDF_REASON:-$UCX_REASON}

    # No device needed: seconds that tell whether the environment is CI's.
    step rapids 90 "$(reserve_after bench device_check ucx)" "$RAPIDS_REASON" -- \
        env PYTHON="$PYTHON" bash ci/test_rapids.sh
    # GPUSHUFFLE_REQUIRE_GPU: the tests fail, not skip, if cuDF cannot compute.
    # A first CUDA context, JIT and two dask-cuda workers take a minute or more.
    step test_gpu 240 "$(reserve_after bench device_check ucx)" "$need_gpu" -- \
        env GPUSHUFFLE_REQUIRE_GPU=1 "$PYTHON" -m pytest tests/test_gpu.py -rs -p no:cacheprovider \
        --junitxml="$RESULTS/test_gpu.xml" -o junit_family=xunit2
    # shellcheck disable=SC2086  # GPU_BENCH_ARGS: extra options, e.g. "--rows 50000000"
    step bench 120 "$(reserve_after device_check ucx)" "$need_cudf" -- \
        "$PYTHON" -m benchmarks.gpu_bench --json "$WORK/bench.json" ${GPU_BENCH_ARGS:-}
    step device_check 45 "$(reserve_after ucx)" "$need_gpu" -- \
        env OUT="$WORK" bash ci/device_check.sh
    step ucx 75 0 "$need_ucx" -- \
        "$PYTHON" -m benchmarks.gpu_bench --protocol ucx --rows 4000000 --partitions 8 \
        --repeat 1 --methods gpushuffle,tasks --rmm pool:4GiB --expect-device-frames \
        --json "$WORK/ucx.json"

    section "report"
    local mode=kit
    [ $USE_KIT = no ] && mode=no-kit
    "$PYTHON" ci/gpu_run.py report "$WORK" "$RESULTS" "$BUDGET" "$mode"
    echo "gpu_run: done in $((SECONDS - START)) s"
    if cut -f2 "$WORK/steps.tsv" | grep -qE '^(failed|timeout)$'; then
        return 1
    fi
    if [ "$GPU" = 0 ]; then
        echo "gpu_run: no GPU: $GPU_REASON" >&2
        return 3
    fi
}

set +e
main 2>&1 | tee "$RESULTS/gpu_run.log"
status=${PIPESTATUS[0]}
set -e
# At most 16 MiB a file comes back from the device machine: keep the log's ends.
log=$RESULTS/gpu_run.log
if [ "$(stat -c %s "$log")" -gt $((15 * 1048576)) ]; then
    { head -c $((5 * 1048576)) "$log"; printf '\n[... cut to fit 16 MiB ...]\n'; tail -c $((9 * 1048576)) "$log"; } >"$log.cut"
    mv "$log.cut" "$log"
fi
exit "$status"
