"""The background kernel build (cuda_kernels.prebuild / prebuild_worker): planning records what the
ops would compile and launches nothing; every planned kernel has a recipe a worker can rebuild; a
worker compiles a kernel without a GPU into numba's cache payload; a failing job is reported and
the others still build; a compile waits for a running build."""
import json
import os
import pickle
import subprocess
import sys
import threading
import time

import pytest
import torch

from flux_numba_pack.cuda_kernels import launching
from flux_numba_pack.cuda_kernels import prebuild, prebuild_worker, warmup
from flux_numba_pack.cuda_kernels import ln_modulate as LM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNELS = os.path.join(ROOT, "cuda_kernels")


def _resolve(recipe):
    import importlib
    mod, qn, args = recipe
    f = importlib.import_module(mod)
    for part in qn.split("."):
        f = getattr(f, part)
    return f, args


def test_collecting_records_and_launches_nothing():
    x = torch.randn(1, 8, 64).to(torch.bfloat16)
    sh, sc = torch.randn(1, 1, 64).to(torch.bfloat16), torch.randn(1, 1, 64).to(torch.bfloat16)
    out = LM.numba_ln_modulate(x, sh, sc)  # compiles nothing in the simulator; a reference run
    assert torch.isfinite(out.float()).all()
    poison = torch.full_like(x, float("nan"))
    with launching.collecting() as jobs:
        B = x.shape[0]
        VEC, VW, (xw, ow, shw, scw) = LM.vec_views(x, poison, sh, sc)
        LM.launch_rows(0, VEC, VW, xw, xw, shw, shw, scw, ow, 1e-6)
    assert torch.isnan(poison.float()).all(), "a planning pass must not launch"
    assert jobs and all(isinstance(la, launching.Launcher) for la, _ in jobs)
    la, sig = jobs[0]
    assert len(sig) == 8 and str(sig[-1]) == "float32" and sig[0].ndim == 3
    assert not launching.planning()


def test_recipes_rebuild_the_same_factory():
    la = LM._launcher(4, 0, 2, 0)
    rec = la.recipe()
    assert rec is not None and rec[1] == "make_row_kernel"
    f, args = _resolve(rec)
    assert f is LM.make_row_kernel and args == la.args
    assert launching.Launcher(lambda: None).recipe() is None  # a lambda cannot be rebuilt elsewhere


def test_plan_covers_the_default_ops_with_recipes():
    jobs = prebuild.plan("cpu")
    assert jobs, "the warm-up calls planned no kernel"
    mods = {j.recipe[0].rsplit(".", 1)[-1] for j in jobs}
    for m in ("ln_modulate", "gated_residual", "qk_norm_rope", "gelu_tanh", "groupnorm_silu_nhwc",
              "upsample_nearest2x", "bias_residual_nhwc", "vae_attention", "fp8_rows"):
        assert m in mods, f"{m} not planned ({sorted(mods)})"
    assert not any("attention/" in j.recipe[0].replace(".", "/") for j in jobs)  # built on use
    keys = set()
    for j in jobs:
        f, args = _resolve(j.recipe)
        assert callable(f)
        json.dumps(j.spec())  # what goes to the workers is plain JSON
        keys.add((j.recipe, tuple(map(str, j.sig))))
    assert len(keys) == len(jobs), "a kernel was planned twice"
    # the VAE decoder's three channel counts and both pre-bias variants of its GroupNorm
    gn = {j.recipe[2] for j in jobs if j.recipe[1] == "make_part_kernel"}
    assert len(gn) >= 4, gn


def test_plan_leaves_no_state_behind():
    before = dict(LM._occupancy)
    prebuild.plan("cpu")
    assert LM._occupancy == before  # no occupancy answer is cached from a planning pass
    assert not launching.planning()


def test_gate_waits_for_a_running_build(monkeypatch):
    class FakeBuild:
        def __init__(self):
            self.done = threading.Event()
            self.thread = None
            self.waited = 0

        def wait(self, timeout, on_progress=None):
            self.waited += 1
            return self.done.wait(timeout)

    b = FakeBuild()
    monkeypatch.setattr(prebuild, "_build", b)
    t = threading.Timer(0.2, b.done.set)
    t.start()
    t0 = time.perf_counter()
    prebuild._gate()
    assert b.done.is_set() and time.perf_counter() - t0 >= 0.15 and b.waited == 1
    prebuild._gate()  # done: no wait
    assert b.waited == 1
    b2 = FakeBuild()
    b2.thread = threading.current_thread()  # the build's own thread never waits for itself
    monkeypatch.setattr(prebuild, "_build", b2)
    prebuild._gate()
    assert b2.waited == 0


def test_start_declines_without_a_gpu():
    assert prebuild.start() is None  # the simulator / no CUDA: nothing started, nothing gated
    assert launching.compile_gate is launching._no_gate or prebuild.current() is None


def test_build_device_gets_its_cuda_index():
    # torch.cuda.set_device refuses torch.device("cuda") (no index): bench.py's --device auto passed one,
    # and the background build failed on the GPU before it planned anything
    calls = []
    cur = lambda: calls.append(1) or 3
    assert prebuild.with_index("cuda", cur) == torch.device("cuda", 3)
    assert prebuild.with_index(None, cur) == torch.device("cuda", 3)
    assert prebuild.with_index(torch.device("cuda"), cur) == torch.device("cuda", 3)
    assert len(calls) == 3
    assert prebuild.with_index("cuda:1", cur) == torch.device("cuda", 1)
    assert prebuild.with_index("cpu", cur) == torch.device("cpu")
    assert len(calls) == 3  # asked only where the index is missing


def _plan_file(tmp_path, jobs, cc=(9, 0)):
    plan = {"package": "flux_numba_pack", "root": ROOT, "cc": list(cc), "jobs": jobs}
    (tmp_path / "plan.json").write_text(json.dumps(plan))


def _run_worker(tmp_path, offset=0):
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0", CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, os.path.join(KERNELS, "prebuild_worker.py"), str(tmp_path), str(offset)],
                          capture_output=True, text=True, env=env, timeout=600)


def test_worker_usage_line():
    r = subprocess.run([sys.executable, os.path.join(KERNELS, "prebuild_worker.py")], capture_output=True, text=True)
    assert r.returncode == 2 and "usage" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_worker_reports_a_bad_job_and_builds_the_rest(tmp_path):
    """Without NVVM the good job fails too (reported the same way); with it, it builds (next test)."""
    jobs = [["flux_numba_pack.cuda_kernels.no_such_module", "make", [], [["int64"]]],
            ["flux_numba_pack.cuda_kernels.ln_modulate", "no_such_factory", [], [["int64"]]]]
    _plan_file(tmp_path, jobs)
    r = _run_worker(tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [json.loads(ln) for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert sorted(rec["job"] for rec in lines) == [0, 1]
    assert all("error" in rec for rec in lines)
    assert (tmp_path / "0.err").exists() and (tmp_path / "1.err").exists()
    assert (tmp_path / "0.claim").exists() and (tmp_path / "1.claim").exists()
    # a second worker finds everything claimed and builds nothing
    r2 = _run_worker(tmp_path, 1)
    assert r2.returncode == 0 and not r2.stdout.strip()


def test_worker_builds_a_kernel_without_a_gpu(tmp_path):
    from _toolkit import missing_toolkit
    why = missing_toolkit()
    if why:
        pytest.skip(f"the worker compiles through NVVM / nvJitLink: {why}")
    from numba.core import types as nt
    la = LM._launcher(4, 0, 2, 0)
    sig = (nt.Array(nt.int64, 3, "A"),) * 7 + (nt.float32,)
    mod, qn, args = la.recipe()
    _plan_file(tmp_path, [[mod, qn, list(args), prebuild_worker.sig_spec(sig)]])
    r = _run_worker(tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    rec = json.loads(r.stdout.strip().splitlines()[-1])
    assert "error" not in rec, rec
    # unpickle in a process with the simulator off (the payload holds numba-cuda objects)
    probe = ("import pickle, sys; sys.path.insert(0, %r); import _pack; _pack.load(); "
             "d = pickle.loads(open(%r, 'rb').read()); cl = d['codelibrary']; "
             "print(sorted(cl._cubin_cache), sorted(cl._ptx_cache), d['name'])"
             % (ROOT, str(tmp_path / "0.bin")))
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0", CUDA_VISIBLE_DEVICES="")
    p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "(9, 0, 'a')" in p.stdout and "15make_row_kernel" in p.stdout, p.stdout


def test_full_cc_matches_numba():
    assert prebuild_worker.full_cc((9, 0)) == (9, 0, "a")
    assert prebuild_worker.full_cc((8, 9)) == (8, 9, "")
    assert prebuild_worker.full_cc((12, 0)) == (12, 0, "a")


def test_warm_calls_route_through_the_given_call():
    seen = []
    for op, backend, fn in warmup.warm_calls("cpu", call=lambda name, *a, **k: seen.append(name)):
        if op in ("ln_modulate", "bias_residual_nhwc"):
            fn()
    assert seen.count("ln_modulate") == 1 and seen.count("bias_residual_nhwc") == 6


_KEY_PROBE = r'''
import hashlib, sys
sys.path.insert(0, ROOT); import _pack; _pack.load()
from flux_numba_pack.cuda_kernels import ln_modulate as LM, gated_residual as GR
from numba.cuda.serialize import dumps
for la in (LM._launcher(4, 0, 2, 0), LM._launcher(4, 1, 2, 0), GR._launcher("gr", 4, 2)):
    c = la.dispatcher()._cache
    f = c._py_func
    cv = tuple(x.cell_contents for x in f.__closure__) if f.__closure__ else ()
    print(hashlib.sha256(dumps(cv)).hexdigest())
'''


def test_cache_key_is_the_same_in_every_process():
    """numba pickles a kernel's closure into its on-disk cache key; a device function captured there
    pickled differently per process, so the LayerNorm row kernels never hit the cache after a restart
    (found by bench/ops/gpu_jit.py's restart run).  The key's closure must not depend on the process."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0", CUDA_VISIBLE_DEVICES="")
    outs = []
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", f"ROOT={ROOT!r}\n" + _KEY_PROBE], capture_output=True, text=True,
                           env=env, timeout=300)
        if r.returncode and "CudaSupportError" in r.stderr:
            pytest.skip("numba-cuda's dispatcher needs a CUDA driver library here")
        assert r.returncode == 0, r.stderr[-2000:]
        outs.append(r.stdout.split())
    assert len(outs[0]) == 3 and outs[0] == outs[1]


def test_build_pending_follows_its_jobs():
    """An op waits (registry.pending) while the build plans, then while any of its kernels is not yet
    stored; a failed kernel stops the wait too (it is compiled on use); launchers are held likewise."""
    b = prebuild.Build("cpu", ops={"ln_modulate", "gelu_tanh"})
    assert b.covers("ln_modulate") and not b.covers("attention")
    assert b.pending("ln_modulate", "numba") and b.holds(object())  # planning: everything waits
    assert b.pending("ln_modulate", "torch") is None and b.pending("attention", "numba") is None
    la1, la2, other = object(), object(), object()
    j1 = prebuild.Job(la1, (), ("m", "f", ()), {"ln_modulate"})
    j2 = prebuild.Job(la2, (), ("m", "g", ()), {"ln_modulate", "gelu_tanh"})
    b.jobs, b.total = [j1, j2], 2
    b._waiting, b._left = {id(la1): 1, id(la2): 1}, {"ln_modulate": 2, "gelu_tanh": 1}
    assert not b.holds(other) and b.holds(la1)
    b._finish(j1, ok=True)
    assert b.pending("ln_modulate", "numba") and b.pending("gelu_tanh", "numba")
    assert not b.holds(la1) and b.holds(la2)
    b._finish(j2, ok=False, err="boom")
    assert b.pending("ln_modulate", "numba") is None and b.pending("gelu_tanh", "numba") is None
    assert (b.built, b.failed, b.errors) == (1, 1, ["boom"]) and b.progress() == (2, 2)
    b.done.set()
    assert not b.holds(la2)


def test_patch_node_warms_each_kernel_once_per_process(monkeypatch):
    """FluxNumbaPatch warms (compiles or loads) its kernels on its first execution only: a re-run
    (alternating workflows re-execute the node every prompt) warms nothing already warmed, and a
    kernel whose warm-up failed is tried again."""
    import contextlib
    from flux_numba_pack.nodes import progress, warm as runner
    monkeypatch.setattr(runner, "_WARMED", set())
    monkeypatch.setattr(prebuild, "current", lambda: None)

    class Prog:
        begin = step = staticmethod(lambda *a, **k: None)
    monkeypatch.setattr(progress, "compile_progress", lambda *a, **k: contextlib.nullcontext(Prog()))
    calls = [("ln_modulate", "numba", None), ("gated_residual", "numba", None), ("attention", "numba-8bit", None)]
    built = []
    monkeypatch.setattr(warmup, "warm_calls", lambda device: built.append(1) or calls)
    monkeypatch.setattr(warmup, "WARM_NAMES", tuple((op, b) for op, b, _ in calls))
    ran, fail = [], {"gated_residual"}

    def warm_all(device, backends=None, on_begin=None, on_step=None):
        ran.append(sorted(backends))
        return {op if b == "numba" else f"{op}/{b}": {"seconds": 0.1, "cached": True,
                                                      "error": "boom" if op in fail else None}
                for op, b in backends}
    monkeypatch.setattr(warmup, "warm_all", warm_all)
    opts = dict(attention="numba-8bit", backend="auto", profile="exact", route_norms=True)
    runner.warm_kernels(None, opts)
    assert ran == [[("attention", "numba-8bit"), ("gated_residual", "numba"), ("ln_modulate", "numba")]]
    runner.warm_kernels(None, opts)
    assert ran[1] == [("gated_residual", "numba")], "only the failed one again"
    fail.clear()
    runner.warm_kernels(None, opts)
    out = runner.warm_kernels(None, opts)
    assert len(ran) == 3 and "warm" in out and not built, "the node itself never builds the test tensors"


def test_warm_names_list_the_warm_calls():
    """``warmup.WARM_NAMES`` (what the patch node checks before building any test tensor) names every
    entry of ``warm_calls``, in order."""
    assert tuple((op, b) for op, b, _ in warmup.warm_calls("cpu", call=lambda *a, **k: None)) == warmup.WARM_NAMES
