"""First-use cost of the Numba kernels: compiled one after another, built in the background, or
loaded from numba's on-disk cache -- each in a fresh process.

    python bench/ops/gpu_jit.py [--json PATH]

Three children, the kernels of the default graph each time (the FLUX ops of the exact and fast
profiles and the NHWC VAE decoder's; ``prebuild.PLAN_SKIP`` left out):
  * sequential: an empty cache directory, ``warmup.warm_all`` (what the patch node did before the
    background build);
  * prebuild: another empty cache directory, ``prebuild.start()``, ``wait()``, then ``warm_all``;
    then every warm-up call once more with the numba backend and the torch reference on the same
    inputs (the relative error of each op's outputs: the prebuilt kernels compute the right thing);
  * restart: the prebuild's cache directory again (a second ComfyUI start): ``start()`` finds
    everything cached, ``warm_all`` loads it.
Prints one table: seconds to ready, kernels built / failed, new cache files during ``warm_all``.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

CHILD = r'''
import glob, json, os, sys, time
t_import = time.time()
sys.path.insert(0, ROOT)
import _pack; _pack.load()
import torch
from flux_numba_pack.cuda_kernels import prebuild, warmup
from flux_numba_pack.cuda_kernels.registry import registry
torch.zeros(1, device="cuda")
t_import = time.time() - t_import
want = {(op, b) for op, b, _ in warmup.warm_calls("cuda") if b == "numba" and op not in prebuild.PLAN_SKIP}
nbc = lambda: len(glob.glob(os.path.join(os.environ["NUMBA_CACHE_DIR"], "**", "*.nbc"), recursive=True))
out = {"mode": MODE, "import_s": round(t_import, 2)}
t0 = time.time()
if MODE != "sequential":
    b = prebuild.start(workers=WORKERS)
    b.wait()
    out.update(build_state=b.state, built=b.built, failed=b.failed, to_build=b.total, workers=b.workers,
               build_s=round(time.time() - t0, 2), plan_s=round(b.plan_s or 0, 2), errors=b.errors[:5],
               planned=[j.label() for j in b.jobs][:40],
               not_on_disk=[j.label() for j in b.jobs if not prebuild.is_cached(j.launcher, j.sig)])
n0 = nbc()
res = warmup.warm_all("cuda", backends=want)
out["ready_s"] = round(time.time() - t0, 2)
out["new_cache_files_in_warm_all"] = nbc() - n0
out["warm_errors"] = {k: v["error"] for k, v in res.items() if v["error"]}
out["per_op_s"] = {k: round(v["seconds"], 2) for k, v in res.items()}
if MODE == "prebuild":
    errs = {}
    def flat(o):
        if isinstance(o, torch.Tensor):
            return [o]
        if isinstance(o, (tuple, list)):
            return [t for x in o for t in flat(x)]
        return []
    def compare(op, *a, **k):
        def run(backend):
            aa = [x.clone() if isinstance(x, torch.Tensor) else x for x in a]
            kk = {n: (torch.empty_like(v) if n == "out" else v) for n, v in k.items()}
            with registry.force(**{op: backend}):
                r = registry.call(op, *aa, **kk)
            return flat(r) or flat(kk.get("out")) or flat(aa[0])
        got, ref = run("numba"), run("torch")
        e = 0.0
        for g, r in zip(got, ref):
            if g.shape == r.shape and g.is_floating_point():
                g, r = g.float(), r.float()
                e = max(e, float((g - r).norm() / r.norm().clamp_min(1e-12)))
        errs[op] = max(errs.get(op, 0.0), e)
        return got if len(got) != 1 else got[0]
    for op, b, fn in warmup.warm_calls("cuda", call=compare):
        if (op, b) in want and op not in warmup.FP8_OPS:
            fn()
    torch.cuda.synchronize()
    out["rel_err_vs_reference"] = {k: round(v, 5) for k, v in errs.items()}
print("JSON" + json.dumps(out))
'''


def child(mode, cache, workers=None):
    env = dict(os.environ, NUMBA_CACHE_DIR=cache, PYTHONUNBUFFERED="1")
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    code = f"ROOT={ROOT!r}\nMODE={mode!r}\nWORKERS={workers!r}\n" + CHILD
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=500)
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("JSON")]
    if not line:
        return {"mode": mode, "error": (p.stdout + p.stderr)[-3000:]}
    return json.loads(line[-1][4:])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--workers", type=int, default=None, help="background build processes (default: the pack's)")
    a = ap.parse_args()
    if a.json is not None:  # checked before the minutes of building, not after
        sys.path.insert(0, ROOT)
        from _pack import file_out_problem
        why = file_out_problem(a.json, "jit.json")
        if why:
            ap.exit(2, f"gpu_jit.py: error: argument --json: {why}\n")
    cold, pre = tempfile.mkdtemp(prefix="numba_seq_"), tempfile.mkdtemp(prefix="numba_pre_")
    rows = [child("sequential", cold), child("prebuild", pre, a.workers), child("restart", pre, a.workers)]
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    for r in rows:
        print(json.dumps(r)[:1500])
    print(f"\n{'mode':11} {'ready s':>8} {'built':>6} {'failed':>6} {'workers':>7} {'new .nbc':>8}  errors")
    for r in rows:
        print(f"{r['mode']:11} {r.get('ready_s', float('nan')):8.2f} {r.get('built', '-'):>6} {r.get('failed', '-'):>6} "
              f"{r.get('workers', '-'):>7} {r.get('new_cache_files_in_warm_all', '-'):>8}  "
              f"{(r.get('error') or '')[-200:]}{r.get('warm_errors') or ''}")
    errs = rows[1].get("rel_err_vs_reference")
    if errs:
        print("prebuilt kernels vs torch reference (rel. error): " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()))


if __name__ == "__main__":
    main()
