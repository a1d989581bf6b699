#!/bin/bash
# compute-sanitizer over the kernel tests on a real GPU (the tests' tiny shapes, poisoned outputs,
# checks against the torch references): memcheck over every kernel test file, racecheck and
# synccheck over the shared-memory kernels (attention, VAE GroupNorm, the row reductions).
#   SAN=/path/to/compute-sanitizer bash bench/sanitize.sh [OUTDIR]
# compute-sanitizer ships in the `nvidia-cuda-sanitizer-api` wheel (nvidia/cu13/compute-sanitizer/).
set -u
SAN=${SAN:-compute-sanitizer}
OUTDIR=${1:-out/sanitize}
# checked before anything is written: without it every run below would end in "rc=127"
command -v "$SAN" > /dev/null 2>&1 || {
    echo "sanitize.sh: error: $SAN not found (set SAN=/path/to/compute-sanitizer)" >&2; exit 2; }
mkdir -p "$OUTDIR"
export FLUX_NUMBA_REAL_GPU=1
run() {
    tool=$1; shift
    timeout "${T:-240}" "$SAN" --tool "$tool" --error-exitcode 9 --print-limit 100 --report-api-errors no \
        python -m pytest -q -p no:cacheprovider "$@" > "$OUTDIR/$tool.log" 2>&1
    rc=$?
    echo "$tool rc=$rc: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|SYNCCHECK SUMMARY| passed| failed' "$OUTDIR/$tool.log" | tail -3 | tr '\n' ' ')"
}
# the default kernels (and the opt-in variants under memcheck); -k filters the variant tests
# out of the slow tools: racecheck replays every shared-memory access
DEFAULT_ONLY="not wgmma and not w32 and not compile"
# (--report-api-errors no: cuda-python / torch probe cuGetProcAddress with a newer cudaVersion
# than the driver's on purpose; those failed host calls are not kernel errors)
KERNELS="tests/test_kernels_fused.py tests/test_kernels_quant8.py"
ATTN="tests/test_attention.py tests/test_attention_numba.py tests/test_attention_mma.py"
VAE="tests/test_vae.py tests/test_vae_decoder.py"
run memcheck $KERNELS $ATTN $VAE -k "not compile"
run racecheck $ATTN $KERNELS $VAE -k "$DEFAULT_ONLY"
# cuDNN's SDPA trips synccheck (mbarrier "already initialized", then a launch failure): the
# references use the math SDPA backend there
FLUX_TEST_MATH_SDPA=1 run synccheck $ATTN $KERNELS -k "$DEFAULT_ONLY"
