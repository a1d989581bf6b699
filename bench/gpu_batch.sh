#!/usr/bin/env bash
# One GPU call, several measurements in a row, each under its own time limit; everything written
# to $OUT/r and packed into $OUT/results.tgz (the device tool brings back at most 8 files).
# On the GPU machine, repo root as cwd, .whl and .gpu carried:
#   PARTS="server033 bench vae" bash bench/gpu_batch.sh
# Parts:
#   server033 / server080   real servers (gpu_server.py, default flags), stock / patched (per-block or
#                           whole graphs) / patched_eager (cuda_graph off) interleaved, then profiles
#                           (cprofile, torch busy share + idle gaps, trace) of each case
#   srvmatrix               the #23 server matrix (CASES, FLAGS env: see below)
#   bench                   bench.py step times (v0.8.0's Flux module) for every variant of VARIANTS
#                           (BENCH_ENV: NAME=value words for its environment, e.g. NUMBA_CACHE_DIR=/tmp/empty
#                           to time a first run after an install)
#   vae                     bench/ops/gpu_vae.py --decoder-only (v0.8.0 and v0.33.0)
#   servers                 one server per SERVERS entry (TAG|TREE|FLAGS|CASES|REPEAT|EXTRA ARGS;...; @R@ in
#                           EXTRA ARGS is this call's result folder, e.g. --profile @R@/prof_x)
#   h2d                     bench/ops/gpu_h2d.py (host-to-device copy bandwidth: pinned, pageable, registered)
#   launch                  bench/ops/gpu_launch_cost.py (host us per kernel launch by route)
#   attn                    bench/ops/gpu_attn_kernels.py (attention kernels at [1,24,4608,128])
#   pytest                  tests on the GPU (PYTEST_ARGS files / options, PYTEST_K a -k expression)
set -u
OUT=${OUT:-/tmp/out}
. bench/gpu_setup.sh > "$OUT/setup.txt" 2>&1; set +e
R=$OUT/r; mkdir -p "$R"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv > "$R/gpu.txt" 2>&1
nproc >> "$R/gpu.txt"
S="python3 bench/e2e/gpu_server.py --steps 28 --res 1024 --prompt-timeout 150"
for part in ${PARTS:-server033 bench vae}; do
  t0=$(date +%s)
  case $part in
    server033|server080)
      tree=$COMFY033; [ $part = server080 ] && tree=$COMFY080
      timeout ${SRV_T:-330} $S --comfy "$tree" --flags= --cases ${SRV_CASES:-stock,patched,patched_eager} \
        --repeat ${SRV_REP:-3} --interleave --json "$R/$part.json" --logs "$R/logs_$part" \
        --profile "$R/prof_$part" --profile-kinds ${PROF_KINDS:-cprofile,torch,trace} > "$R/$part.txt" 2>&1;;
    srvmatrix)
      timeout ${MAT_T:-400} $S --comfy ${MAT_TREE:-$COMFY033} --flags="${MAT_FLAG:-}" --cases ${MAT_CASES:-stock,patched} \
        --repeat ${MAT_REP:-3} --interleave ${MAT_ARGS:-} --json "$R/matrix_${MAT_TAG:-x}.json" --logs "$R/logs_matrix_${MAT_TAG:-x}" \
        ${MAT_PROF:+--profile "$R/prof_matrix_${MAT_TAG:-x}" --profile-kinds $MAT_PROF} \
        > "$R/matrix_${MAT_TAG:-x}.txt" 2>&1;;
    srvmatrix2)  # a second matrix in the same call (MAT2_* as MAT_*)
      timeout ${MAT2_T:-300} $S --comfy ${MAT2_TREE:-$COMFY033} --flags="${MAT2_FLAG:-}" --cases ${MAT2_CASES:-stock,patched} \
        --repeat ${MAT2_REP:-3} --interleave ${MAT2_ARGS:-} --json "$R/matrix_${MAT2_TAG:-y}.json" --logs "$R/logs_matrix_${MAT2_TAG:-y}" \
        ${MAT2_PROF:+--profile "$R/prof_matrix_${MAT2_TAG:-y}" --profile-kinds $MAT2_PROF} \
        > "$R/matrix_${MAT2_TAG:-y}.txt" 2>&1;;
    servers)  # SERVERS="TAG|TREE(033/080)|FLAGS|CASES|REPEAT|EXTRA ARGS;..." -- one server per entry, each under SRVS_T s
      IFS=';' read -ra specs <<< "${SERVERS:-}"
      for spec in "${specs[@]}"; do
        IFS='|' read -r tag tv flag cases rep extra <<< "$spec"
        extra=${extra//@R@/$R}  # (@R@ in EXTRA ARGS: this call's result folder, e.g. --profile @R@/prof_x)
        tree=$COMFY033; [ "$tv" = 080 ] && tree=$COMFY080
        t1=$(date +%s)
        timeout ${SRVS_T:-200} $S --comfy "$tree" --flags="$flag" --cases "$cases" --repeat "${rep:-2}" --interleave $extra \
          --json "$R/srv_$tag.json" --logs "$R/logs_srv_$tag" > "$R/srv_$tag.txt" 2>&1
        echo "  server $tag rc=$? $(( $(date +%s) - t1 )) s; $(free -g | awk 'NR==2{print "host used " $3 " GB of " $2}')" >> "$R/parts.txt"
        tar -czf "$OUT/results.tgz" -C "$OUT" r setup.txt
      done;;
    h2d)
      timeout ${H2D_T:-60} python3 bench/ops/gpu_h2d.py > "$R/h2d.txt" 2>&1;;
    launch)
      timeout ${LAUNCH_T:-60} python3 bench/ops/gpu_launch_cost.py --n ${LAUNCH_N:-20000} > "$R/launch.txt" 2>&1;;
    bench)
      env ${BENCH_ENV:-} COMFYUI_PATH=$COMFY080 timeout ${BENCH_T:-220} python3 bench.py \
        --variants ${VARIANTS:-stock,exact,exact+graph,fast,fast+graph,fast-cached,fast-cached+graph,attn8} \
        --reps 5 ${BENCH_ARGS:-} --json "$R/bench.json" > "$R/bench.txt" 2>&1;;
    attn)     # the attention kernels at the FLUX shape (bench/ops/gpu_attn_kernels.py)
      OUT=$R timeout ${ATTN_T:-200} python3 bench/ops/gpu_attn_kernels.py > "$R/attn.txt" 2>&1;;
    pytest)   # GPU runs of tests (PYTEST_ARGS: files / options without spaces inside one; PYTEST_K: a -k expression)
      FLUX_NUMBA_REAL_GPU=1 COMFYUI_PATH=$COMFY080 timeout ${PYTEST_T:-300} python3 -m pytest -q -x ${PYTEST_ARGS:-tests/test_attention.py tests/test_attention_numba.py tests/test_attention_mma.py} ${PYTEST_K:+-k "$PYTEST_K"} \
        > "$R/pytest.txt" 2>&1;;
    vae)
      FLUX_NUMBA_REAL_GPU=1 COMFYUI_PATH=$COMFY080 timeout ${VAE_T:-100} python3 bench/ops/gpu_vae.py --decoder-only > "$R/vae080.txt" 2>&1;;
    *) echo "unknown part $part" > "$R/$part.txt";;
  esac
  echo "$part rc=$? $(( $(date +%s) - t0 )) s" >> "$R/parts.txt"
  { free -g | sed -n 2p; df -h /dev/shm | tail -1; } >> "$R/parts.txt" 2>&1  # host memory after each part
  tail -1 "$R/parts.txt"
  tar -czf "$OUT/results.tgz" -C "$OUT" r setup.txt  # after every part: a call cut short keeps what it has
done
for f in "$R"/*.txt; do echo "=== $f"; tail -n ${TAIL:-14} "$f"; done
