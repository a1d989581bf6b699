"""Kernels built before they are needed: in worker processes, in parallel, in the background.

numba compiles a kernel in Python (typing, lowering) and then through NVVM and nvJitLink, one
kernel after another, under its global compiler lock: on a machine with no on-disk cache the
pack's first prompt waited for every kernel in turn.  This module moves that work off the
critical path:

  * ``plan(device)`` runs the warm-up calls (``warmup.warm_calls``) in *planning* mode
    (``intrinsics.collecting``): every Launcher records ``(launcher, numba signature)`` and
    launches nothing, so the list is exactly what the ops' host code asks for on this GPU
    (alignment variants, channel counts, fp8 support).  Kernels already in numba's on-disk cache
    are left out.
  * ``start()`` (called when ComfyUI imports the pack) plans in a background thread and, when
    something is missing, starts worker processes (``python prebuild.py --worker DIR``; at most
    ``MAX_WORKERS``, one core left free, lowered priority).  A worker imports the pack's
    ``cuda_kernels`` under the same package name, rebuilds each kernel from its launcher's recipe
    (module-level factory + plain arguments) and compiles it for the GPU's compute capability
    without touching the GPU (``CUDA_VISIBLE_DEVICES`` empty: no context, no VRAM); jobs are
    claimed one at a time (``O_EXCL`` files), so the load balances itself.
  * The background thread stores each result the way numba's own cache does (the dispatcher's
    index key, its cache file) and adds it to the dispatcher in memory.  Until then any compile
    in this process waits (``intrinsics.compile_gate``): no kernel is built twice, no index file
    is written by two processes.
  * ``wait()`` is what the patch node calls before its warm-up, with progress on the node.

Everything here is best effort: a failed plan, worker or job is logged and the kernel is then
compiled where it is first used, as before.  No ComfyUI imports.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable, List, Optional

from . import intrinsics as ik
from . import runtime
from .prebuild_worker import sig_spec

log = logging.getLogger("flux_numba")

HERE = os.path.dirname(os.path.abspath(__file__))
MAX_WORKERS = 8
WAIT_LIMIT_S = 900.0  # a compile waiting for the build gives up after this (then compiles itself)
# what start() builds: the default FLUX path's kernels, the fast profile's (where fp8 runs) and the
# NHWC VAE decoder's; the pack's own attention kernels and the NCHW GroupNorm are built on use
PLAN_SKIP = ("attention", "groupnorm_silu")
ENABLED = True  # tests and benches switch the background build off here


class Job:
    __slots__ = ("launcher", "sig", "recipe")

    def __init__(self, launcher, sig, recipe):
        self.launcher, self.sig, self.recipe = launcher, sig, recipe

    def spec(self):
        mod, qn, args = self.recipe
        return [mod, qn, list(args), sig_spec(self.sig)]


def _direct_call(op_name, *args, **kw):
    """Run an op's numba backend itself (planning: no registry choice, no autotune, no usage)."""
    from .registry import registry
    b = registry.ops[op_name].backends.get("numba")
    if b is None or (b.check is not None and b.check(*args, **kw) is not None):
        return None
    return b.fn(*args, **kw)


def is_cached(launcher, sig) -> bool:
    """True when numba's on-disk cache holds this kernel for the current GPU."""
    try:
        disp = launcher.dispatcher()
        cache = disp._cache
        key = cache._index_key(sig, disp.targetctx.codegen())
        return key in cache._cache_file._load_index()
    except Exception:
        return False


def plan(device="cuda", skip=PLAN_SKIP, ops=None) -> List[Job]:
    """The kernels the warm-up calls would compile on ``device`` and that are not cached yet (those
    without a recipe are left to be compiled on use)."""
    import torch

    from . import warmup
    from .registry import registry
    seen, out = set(), []
    with registry.force("torch"), ik.collecting() as found:  # any nested op call: its reference
        for op, backend, fn in warmup.warm_calls(device, call=_direct_call):
            if backend != "numba" or op in skip or (ops is not None and op not in ops):
                continue
            try:
                fn()
            except Exception as e:  # this op is compiled where it is used
                log.info("[flux_numba] prebuild: planning %s failed (%s: %s)", op, type(e).__name__, e)
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()
    for la, sig in found:
        k = (id(la), sig)
        if k in seen:
            continue
        seen.add(k)
        rec = la.recipe()
        if rec is not None and not is_cached(la, sig):
            out.append(Job(la, sig, rec))
    return out


def _package_of(module: str) -> str:
    i = module.rfind(".cuda_kernels")
    return module[:i] if i >= 0 else ""


class Build:
    """One background build: ``state`` planning -> building -> done (or failed / nothing)."""

    def __init__(self, device, workers=None, ops=None):
        self.device, self.ops = device, ops
        self.max_workers = workers
        self.state = "planning"
        self.total = self.built = self.failed = self.cached_before = 0
        self.workers = 0
        self.t0 = time.perf_counter()
        self.seconds = None
        self.errors: List[str] = []
        self.done = threading.Event()
        self._folder = None
        self._procs: List[subprocess.Popen] = []
        self.thread = threading.Thread(target=self._run, name="flux_numba_prebuild", daemon=True)

    # -- progress
    def progress(self):
        """(kernels finished, kernels to build): counted from the workers' result files."""
        if self.done.is_set() or self._folder is None:
            return self.built + self.failed, self.total
        try:
            n = sum(1 for f in os.listdir(self._folder) if f.endswith((".bin", ".err")))
        except OSError:
            n = 0
        return n, self.total

    def wait(self, timeout: float = WAIT_LIMIT_S, on_progress: Optional[Callable[[int, int], None]] = None) -> bool:
        """Block until the build is done (True) or ``timeout`` passed (False)."""
        end = time.perf_counter() + timeout
        last = None
        while not self.done.wait(0.25):
            if on_progress is not None:
                p = self.progress()
                if p != last:
                    last = p
                    try:
                        on_progress(*p)
                    except Exception:
                        pass
            if time.perf_counter() > end:
                return False
        return True

    # -- the thread
    def _run(self):
        try:
            self._build()
        except Exception as e:
            self.state = "failed"
            self.errors.append(f"{type(e).__name__}: {e}")
            log.warning("[flux_numba] background kernel build failed (%s: %s); kernels compile where "
                        "they are first used", type(e).__name__, e)
        finally:
            self.seconds = time.perf_counter() - self.t0
            self._cleanup()
            self.done.set()

    def _build(self):
        import torch
        from numba import cuda
        torch.cuda.set_device(torch.device(self.device))
        jobs = plan(self.device, ops=self.ops)
        if not jobs:
            self.state = "nothing"
            return
        cc = cuda.get_current_device().compute_capability  # what numba itself compiles for
        self.total = len(jobs)
        n = self.max_workers or min(MAX_WORKERS, max(1, (os.cpu_count() or 2) - 1))
        n = max(1, min(n, len(jobs)))
        self.workers = n
        self.state = "building"
        self._folder = tempfile.mkdtemp(prefix="flux_numba_build_")
        payload = {"package": _package_of(jobs[0].recipe[0]), "root": os.path.dirname(HERE), "cc": list(cc),
                   "jobs": [j.spec() for j in jobs]}
        log.info("[flux_numba] building %d kernels for sm_%d%d in %d background processes (first start "
                 "after an install or update; later starts load them from numba's cache)", len(jobs), cc[0], cc[1], n)
        with open(os.path.join(self._folder, "plan.json"), "w") as f:
            json.dump(payload, f)
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
        for w in range(n):  # each worker starts at its own place in the list, then claims what is left
            self._procs.append(subprocess.Popen(
                [sys.executable, os.path.join(HERE, "prebuild_worker.py"), self._folder, str((w * len(jobs)) // n)],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        outs = []
        for p in self._procs:
            out, err = p.communicate()
            outs.append((p.returncode, out, err))
        for rc, out, err in outs:
            if rc not in (0, None) and not out:
                self.errors.append(f"worker exit {rc}: {(err or '').strip()[-300:]}")
        self._store(jobs, cc)
        self.state = "done"
        log.info("[flux_numba] background kernel build: %d of %d kernels built in %.1f s by %d processes%s",
                 self.built, self.total, time.perf_counter() - self.t0, n,
                 f"; {self.failed} left to compile on use ({self.errors[0]})" if self.failed else "")

    def _store(self, jobs, cc):
        import pickle
        for i, job in enumerate(jobs):
            path = os.path.join(self._folder, f"{i}.bin")
            if not os.path.exists(path):
                self.failed += 1
                err = os.path.join(self._folder, f"{i}.err")
                if os.path.exists(err):
                    with open(err) as f:
                        self.errors.append(f.read())
                continue
            try:
                with open(path, "rb") as f:
                    payload = pickle.loads(f.read())
                _install(job.launcher.dispatcher(), job.sig, payload)
                self.built += 1
            except Exception as e:
                self.failed += 1
                self.errors.append(f"storing {job.recipe[1]}: {type(e).__name__}: {e}")

    def _cleanup(self):
        for p in self._procs:
            if p.poll() is None:
                p.kill()
        if self._folder:
            shutil.rmtree(self._folder, ignore_errors=True)


def _install(disp, sig, payload):
    """Store a worker's kernel in numba's on-disk cache (its index key, its file) and in the
    dispatcher, as ``Dispatcher.compile`` would after compiling it here."""
    cache = disp._cache
    try:
        if getattr(cache, "_enabled", False):
            cache._impl.locator.ensure_cache_path()
            cache._cache_file.save(cache._index_key(sig, disp.targetctx.codegen()), payload)
    except Exception as e:  # a read-only install: the kernel still serves this process
        log.info("[flux_numba] prebuild: on-disk cache not written (%s: %s)", type(e).__name__, e)
    kernel = cache._impl.rebuild(disp.targetctx, payload)
    if sig not in disp.overloads:
        disp.add_overload(kernel, sig)


_build: Optional[Build] = None


def _gate():
    """``intrinsics.compile_gate``: a compile in any other thread waits for the running build."""
    b = _build
    if b is None or b.done.is_set() or threading.current_thread() is b.thread:
        return
    if not b.wait(WAIT_LIMIT_S):
        log.warning("[flux_numba] background kernel build still running after %.0f s; compiling here", WAIT_LIMIT_S)


def start(device=None, workers=None, ops=None) -> Optional[Build]:
    """Start the background build for ``device`` (torch's current CUDA device) once per process;
    None where there is nothing to do (no CUDA GPU, numba unusable, the simulator, ``ENABLED``
    off)."""
    global _build
    if _build is not None:
        return _build
    if not ENABLED or runtime.SIMULATOR or runtime.numba_status() is not None or not ik.NUMBA_OK:
        return None
    import torch
    if not torch.cuda.is_available():
        return None
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device())
    _build = Build(device, workers, ops)
    ik.compile_gate = _gate
    _build.thread.start()
    return _build


def current() -> Optional[Build]:
    return _build


def wait(timeout: float = WAIT_LIMIT_S, on_progress=None) -> Optional[Build]:
    """Wait for the background build, if one runs (``on_progress(done, total)`` while waiting)."""
    b = _build
    if b is not None and not b.done.is_set() and threading.current_thread() is not b.thread:
        b.wait(timeout, on_progress)
    return b
