#!/usr/bin/env bash
# tools/gpu_check.sh -- issue 26's one prepared GPU check, as one command, for a machine
# with one GPU (H100/H200) and torch 2.11.0 installed (and numpy, setuptools: nothing is
# downloaded).  Builds cfsdp's C core in place, then, in at most 8 minutes, runs the steps of
# tools/gpu_check.py, each under its own time limit, and writes one report:
#
#   parity   both faces at world 1 on NCCL under TORCH_CUDA_SANITIZER=1, losses bitwise
#            against torch FSDP1 / FSDP2                                          (150 s)
#   probe    2 ranks sharing the GPU over gloo with CUDA tensors                  (30 s)
#   gloo2    the same comparison at world 2 over gloo (only if the probe passed)  (90 s)
#   bench    step time and peak memory of both faces and FSDP1/FSDP2, small-unit
#            and GPT-2-like models, world 1                                       (150 s)
#   profile  torch.profiler: the stream of each collective, all-gather overlap    (60 s)
#
# Output: $OUT (or ./gpu_check_out)/gpu_check_report.md plus each step's JSON and log.
# Exit status: 2 at once on a machine without a GPU (nothing is run), 3 if the build fails,
# 1 if any step failed or a comparison was not bitwise, 0 otherwise.
# GPU_CHECK_DRY_RUN=1 runs every step on the CPU with gloo and tiny sizes instead: a check
# of this script's plumbing on a machine without a GPU; its report says it is a dry run.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${OUT:-gpu_check_out}
PY=${PYTHON:-python3}
DRY=${GPU_CHECK_DRY_RUN:-0}
mkdir -p "$OUT_DIR"
start=$(date +%s)

if [ "$DRY" != 1 ] && ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_check: no GPU on this machine (torch.cuda.is_available() is False, or torch is missing): nothing was run"
    exit 2
fi
flag=()
[ "$DRY" = 1 ] && flag=(--dry-run)
echo "gpu_check: $("$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU (dry run)")')"

if ! CFSDP_WERROR=1 "$PY" setup.py -q build_ext --inplace > "$OUT_DIR/build.log" 2>&1; then
    echo "gpu_check: the C build failed:"; tail -20 "$OUT_DIR/build.log"; exit 3
fi
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}

status=0
# step NAME LIMIT_S NPROC [ENV=VALUE...]: one step under torchrun, its log kept
step() {
    local name=$1 limit=$2 nproc=$3 sub=$1; shift 3
    local t0; t0=$(date +%s)
    env "$@" timeout -k 5 "$limit" "$PY" -m torch.distributed.run --standalone \
        --nproc_per_node "$nproc" tools/gpu_check.py "$sub" --dir "$OUT_DIR" "${flag[@]}" \
        > "$OUT_DIR/$name.log" 2>&1
    local rc=$?
    echo "gpu_check: $name: exit $rc after $(( $(date +%s) - t0 )) s"
    [ $rc -ne 0 ] && tail -15 "$OUT_DIR/$name.log"
    return $rc
}

san=(TORCH_CUDA_SANITIZER=1)  # (torch turns it on for any value: none in a dry run)
[ "$DRY" = 1 ] && san=(GPU_CHECK_DRY_RUN=1)
step parity 150 1 "${san[@]}" || status=1
if step probe 30 2; then
    step gloo2 90 2 || status=1
else
    echo "gpu_check: gloo2 skipped: gloo did not carry CUDA tensors between 2 ranks within 30 s"
fi
step bench 150 1 || status=1
step profile 60 1 || status=1
"$PY" tools/gpu_check.py report --dir "$OUT_DIR" "${flag[@]}" || status=1
echo "gpu_check: done in $(( $(date +%s) - start )) s, exit $status; report: $OUT_DIR/gpu_check_report.md"
exit $status
