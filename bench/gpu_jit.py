"""First-use cost of the Numba kernels: JIT cold vs from numba's on-disk cache.

    python bench/gpu_jit.py
Runs every registered Numba backend once at small FLUX-like shapes in a *fresh process*, twice:
first with an empty cache directory (cold JIT), then again (on-disk cache).  Prints the wall time
of each process's first calls (import excluded) and per op.
"""
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r'''
import json, os, sys, time
sys.path.insert(0, ROOT)
import _pack; _pack.load()
import torch
from flux_numba_pack.cuda_kernels import registry
t_import = time.time()
dev, bf = "cuda", torch.bfloat16
H, D, C, M = 24, 128, 3072, 12288
x = torch.randn(1, 300, C, device=dev, dtype=bf); y = torch.randn_like(x)
mod = torch.randn(1, 1, 6 * C, device=dev, dtype=bf); sh, sc, g = mod[..., :C], mod[..., C:2*C], mod[..., 2*C:3*C]
qkv_t = torch.randn(1, 40, 3 * C, device=dev, dtype=bf); qkv_i = torch.randn(1, 260, 3 * C, device=dev, dtype=bf)
s = torch.ones(D, device=dev, dtype=bf); pe = torch.randn(1, 1, 300, D // 2, 2, 2, device=dev)
lin1 = torch.randn(1, 300, 3 * C + M, device=dev, dtype=bf); buf = torch.empty(1, 300, C + M, device=dev, dtype=bf)
q = torch.randn(1, H, 300, D, device=dev, dtype=bf)
gn = torch.randn(1, 128, 64, 64, device=dev, dtype=bf); w = torch.ones(128, device=dev, dtype=bf)
calls = {
 "ln_modulate": lambda: registry.call("ln_modulate", x, sh, sc, 1e-6),
 "gated_residual": lambda: registry.call("gated_residual", x, g, y),
 "gated_residual_ln_modulate": lambda: registry.call("gated_residual_ln_modulate", x, g, y, sh, sc, 1e-6),
 "qk_norm_rope": lambda: registry.call("qk_norm_rope", [(qkv_t, s, s), (qkv_i, s, s)], pe, H, 1e-6),
 "gelu_tanh": lambda: registry.call("gelu_tanh", lin1[..., 3 * C:], out=buf[..., C:]),
 "attention": lambda: registry.call("attention", q, q, q, None),
 "attention-8bit": lambda: registry.call("attention", q, q, q, None),
 "groupnorm_silu": lambda: registry.call("groupnorm_silu", gn, 32, w, w, 1e-6, True),
}
per = {}
for name, fn in calls.items():
    op = "attention" if name.startswith("attention") else name
    backend = "numba-8bit" if name == "attention-8bit" else "numba"
    if op not in registry.ops or backend not in registry.backends(op):
        per[name] = None; continue
    t0 = time.time()
    try:
        with registry.force(**{op: backend}):
            fn()
        torch.cuda.synchronize()
        per[name] = time.time() - t0
    except Exception as e:
        per[name] = f"error {type(e).__name__}: {e}"
print("JSON" + json.dumps({"total_s": time.time() - t_import, "per_op_s": per}))
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
