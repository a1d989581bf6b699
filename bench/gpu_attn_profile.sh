#!/usr/bin/env bash
# One GPU call for the 8-bit wgmma attention kernel: A/B timing of source trees (gpu_attn_ab.py),
# Nsight Compute on one launch, compute-sanitizer on its GPU tests.  Repo root as cwd, .gpu carried.
#   AB="new=cuda_kernels old=.gpu/old/cuda_kernels" NCU=new SAN="memcheck synccheck racecheck" \
#     PYTEST_K="8bit_default_hopper" [PYTEST_FILES="tests/a.py tests/b.py"] bash bench/gpu_attn_profile.sh
# Everything lands in $OUT/r (packed into $OUT/results.tgz after each part).
set -u
OUT=${OUT:-/tmp/out}; R=$OUT/r; mkdir -p "$R"
export PYTHONUNBUFFERED=1 FLUX_NUMBA_REAL_GPU=1
pack() { tar -czf "$OUT/results.tgz" -C "$OUT" r; }
NCUB=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
SANB=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer /usr/local/cuda*/compute-sanitizer/compute-sanitizer 2>/dev/null | head -1)
{ nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv; echo "ncu: $NCUB"; echo "sanitizer: $SANB"; } > "$R/tools.txt" 2>&1
if [ -n "${AB:-}" ]; then
  t0=$(date +%s)
  timeout ${AB_T:-240} python3 bench/ops/gpu_attn_ab.py $AB --rounds ${ROUNDS:-5} ${AB_ARGS:-} > "$R/ab.txt" 2>&1
  echo "ab rc=$? $(( $(date +%s) - t0 )) s" >> "$R/parts.txt"; pack
fi
if [ -n "${PYTEST_K:-}" ]; then   # correctness on the GPU first (tests/test_attention*.py -k PYTEST_K)
  t0=$(date +%s)
  timeout ${PYTEST_T:-200} python3 -m pytest -q -p no:cacheprovider ${PYTEST_FILES:-tests/test_attention.py tests/test_attention_numba.py tests/test_attention_mma.py} -k "$PYTEST_K" > "$R/pytest.txt" 2>&1
  echo "pytest rc=$? $(( $(date +%s) - t0 )) s: $(tail -1 "$R/pytest.txt")" >> "$R/parts.txt"; pack
fi
for v in ${NCU:-}; do   # LABEL (a tree of AB) -> full section set of one warm launch
  t0=$(date +%s); path=$(tr ' ' '\n' <<< "$AB" | sed -n "s/^$v=//p")
  timeout ${NCU_T:-200} "$NCUB" --clock-control none --kernel-name-base mangled --kernel-name regex:int8_wgmma \
    --launch-skip 2 --launch-count 1 --set full --import-source no -f -o "$R/ncu_$v" \
    python3 bench/ops/gpu_attn_ab.py "$v=$path" --profile "$v" > "$R/ncu_run_$v.txt" 2>&1
  echo "ncu $v rc=$? $(( $(date +%s) - t0 )) s" >> "$R/parts.txt"
  "$NCUB" --import "$R/ncu_$v.ncu-rep" --page details --print-details all > "$R/ncu_details_$v.txt" 2>&1
  "$NCUB" --import "$R/ncu_$v.ncu-rep" --page raw --csv > "$R/ncu_raw_$v.csv" 2>&1
  "$NCUB" --import "$R/ncu_$v.ncu-rep" --page source --csv --print-source sass > "$R/ncu_sass_$v.csv" 2>&1
  pack
done
for tool in ${SAN:-}; do   # the 8-bit wgmma kernel's GPU tests under each tool
  t0=$(date +%s)
  extra=""; [ "$tool" = synccheck ] && export FLUX_TEST_MATH_SDPA=1
  timeout ${SAN_T:-150} "$SANB" --tool "$tool" --error-exitcode 9 --print-limit 50 --report-api-errors no \
    python3 -m pytest -q -p no:cacheprovider ${PYTEST_FILES:-tests/test_attention.py tests/test_attention_numba.py tests/test_attention_mma.py} \
    -k "${SAN_K:-8bit_default_hopper}" > "$R/san_$tool.txt" 2>&1
  echo "sanitizer $tool rc=$? $(( $(date +%s) - t0 )) s: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|SYNCCHECK SUMMARY| passed| failed' "$R/san_$tool.txt" | tail -3 | tr '\n' ' ')" >> "$R/parts.txt"
  pack
done
cat "$R/parts.txt"; tail -n 20 "$R/ab.txt" 2>/dev/null
