"""First-use cost of the Numba kernels: JIT cold vs from numba's on-disk cache.

    python bench/gpu_jit.py
Runs ``cuda_kernels.warmup.warm_all`` (every Numba backend once, small FLUX-width shapes) in a
*fresh process*, twice: first with an empty cache directory (cold JIT), then again (on-disk cache).
Prints each process's total (import excluded) and per-op seconds.
"""
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r'''
import json, sys, time
sys.path.insert(0, ROOT)
import _pack; _pack.load()
from flux_numba_pack.cuda_kernels import warmup
t0 = time.time()
res = warmup.warm_all("cuda")
print("JSON" + json.dumps({"total_s": time.time() - t0, "per_op": res}))
'''


def child(cache):
    env = dict(os.environ, NUMBA_CACHE_DIR=cache)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    p = subprocess.run([sys.executable, "-c", "ROOT=%r\n" % ROOT + CHILD], env=env, capture_output=True, text=True, timeout=300)
    line = [l for l in p.stdout.splitlines() if l.startswith("JSON")]
    if not line:
        return {"error": (p.stdout + p.stderr)[-2000:]}
    return json.loads(line[0][4:])


def main():
    cache = tempfile.mkdtemp(prefix="numba_cache_")
    cold = child(cache)
    warm = child(cache)
    print(json.dumps({"cold": cold, "warm": warm}, indent=1))
    if os.environ.get("OUT"):
        json.dump({"cold": cold, "warm": warm}, open(os.path.join(os.environ["OUT"], "gpu_jit.json"), "w"), indent=1)
    print(f"\nJIT of all kernels: cold {cold.get('total_s', float('nan')):.2f} s, "
          f"from the on-disk cache {warm.get('total_s', float('nan')):.2f} s   (bar: <= 20 s / <= 2 s)")


if __name__ == "__main__":
    main()
