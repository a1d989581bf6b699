"""Kernels built before they are needed, in worker processes, in parallel, while ComfyUI already runs.

numba compiles a kernel in Python (typing, lowering) and then through NVVM and nvJitLink, one
kernel after another, under its global compiler lock: on a machine with no on-disk cache the
pack's first prompt waited for every kernel in turn (27 kernels, ~25 s on an H200 host).  Here:

  * ``plan(device)`` runs the warm-up calls (``warmup.warm_calls``) in *planning* mode
    (``launching.collecting``): every Launcher records ``(launcher, numba signature)`` and
    launches nothing, so the list is exactly what the ops' host code asks for on this GPU
    (alignment variants, channel counts, fp8 support), per op.  Kernels already in numba's on-disk
    cache are left out.
  * ``start()`` (called when ComfyUI imports the pack) plans in a background thread and, when
    something is missing, starts worker processes (``prebuild_worker.py``; at most
    ``MAX_WORKERS`` and half the cores, lowered priority).  A worker imports the pack's
    ``cuda_kernels`` under the same package name, rebuilds each kernel from its launcher's recipe
    (module-level factory + plain arguments) and compiles it for the GPU's compute capability
    without touching the GPU (``CUDA_VISIBLE_DEVICES`` empty: no context, no VRAM); jobs are
    claimed one at a time (``O_EXCL`` files), so the load balances itself.
  * The background thread stores each result as it arrives, the way numba's own cache does (the
    dispatcher's index key, its cache file -- the worker's bytes as they are, under numba's
    compiler lock); the kernel is then loaded where it is first used like any cached one.
  * Meanwhile nothing waits: while an op still has kernels in the build, ``registry.pending``
    says so and the registry runs the op's reference (the stock torch math) instead -- sampling
    starts at stock speed at once and each op switches to its kernel when that is built; CUDA
    graphs are not captured until the build is done (``registry.settled``).  A compile of one of
    the build's kernels in another thread waits for it (``launching.compile_gate``); any other
    compile goes ahead.
  * ``Build.wait()`` blocks until the build is done (benchmarks, tests).

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
from typing import Callable, Dict, List, Optional, Set

from . import launching
from .jit import NUMBA_OK
from . import runtime
from .prebuild_worker import sig_spec

log = logging.getLogger("flux_numba")

HERE = os.path.dirname(os.path.abspath(__file__))
MAX_WORKERS = 8  # and at most half the cores: ComfyUI keeps sampling (on the torch ops) meanwhile
WAIT_LIMIT_S = 900.0  # a compile waiting for the build gives up after this (then compiles itself)
BUILD_LIMIT_S = 300.0  # workers still running after this are stopped; their kernels compile on use
# what start() builds: the default FLUX path's kernels, the fast profile's (where fp8 runs) and the
# NHWC VAE decoder's; the pack's own attention kernels and the NCHW GroupNorm are built on use
PLAN_SKIP = ("attention", "groupnorm_silu")
ENABLED = True  # tests and benches switch the background build off here


class Job:
    __slots__ = ("launcher", "sig", "recipe", "ops")

    def __init__(self, launcher, sig, recipe, ops):
        self.launcher, self.sig, self.recipe, self.ops = launcher, sig, recipe, ops

    def spec(self):
        mod, qn, args = self.recipe
        return [mod, qn, list(args), sig_spec(self.sig)]

    def label(self):
        return self.launcher.label()


def _direct_call(op_name, *args, **kw):
    """Run an op's numba backend itself (planning: no registry choice, no autotune, no usage)."""
    from .registry import registry
    b = registry.ops[op_name].backends.get("numba")
    if b is None or (b.check is not None and b.check(*args, **kw) is not None):
        return None
    return b.fn(*args, **kw)


def _index_key(disp, sig):
    """The key numba's on-disk cache files this kernel under (the dispatcher's own, for this GPU)."""
    return disp._cache._index_key(sig, disp.targetctx.codegen())


def is_cached(launcher, sig) -> bool:
    """True when numba's on-disk cache holds this kernel for the current GPU."""
    try:
        disp = launcher.dispatcher()
        return _index_key(disp, sig) in disp._cache._cache_file._load_index()
    except Exception:
        return False


def buildable_ops(ops=None, skip=PLAN_SKIP) -> Set[str]:
    """The ops whose numba kernels a build covers."""
    from .registry import registry
    return {o for o in registry.ops if "numba" in registry.backends(o) and o not in skip
            and (ops is None or o in ops)}


def plan(device="cuda", skip=PLAN_SKIP, ops=None) -> List[Job]:
    """The kernels the warm-up calls would compile on ``device`` and that are not cached yet (those
    without a recipe are left to be compiled on use); each job names the ops that need it."""
    import torch

    from . import warmup
    from .registry import registry
    jobs: Dict[tuple, Job] = {}
    with registry.force("torch"):  # any nested op call: its reference
        for op, backend, fn in warmup.warm_calls(device, call=_direct_call):
            if backend != "numba" or op in skip or (ops is not None and op not in ops):
                continue
            with launching.collecting() as found:
                try:
                    fn()
                except Exception as e:  # this op is compiled where it is used
                    log.info("[flux_numba] prebuild: planning %s failed (%s: %s)", op, type(e).__name__, e)
            for la, sig in found:
                j = jobs.get((id(la), sig))
                if j is not None:
                    j.ops.add(op)
                    continue
                rec = la.recipe()
                if rec is not None:
                    jobs[(id(la), sig)] = Job(la, sig, rec, {op})
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()
    return [j for j in jobs.values() if not is_cached(j.launcher, j.sig)]


def _package_of(module: str) -> str:
    i = module.rfind(".cuda_kernels")
    return module[:i] if i >= 0 else ""


class Build:
    """One background build: ``state`` planning -> building -> done (or nothing / failed)."""

    def __init__(self, device, workers=None, ops=None):
        self.device, self.ops = device, ops
        self.max_workers = workers
        self.state = "planning"
        self.total = self.built = self.failed = 0
        self.workers = 0
        self.t0 = time.perf_counter()
        self.plan_s = None
        self.jobs: List[Job] = []
        self.errors: List[str] = []
        self.done = threading.Event()
        self._covered = buildable_ops(ops)
        self._left: Optional[Dict[str, int]] = None  # op -> jobs not yet stored (None: planning)
        self._waiting: Optional[Dict[int, int]] = None  # id(launcher) -> its jobs not yet stored
        self._folder = None
        self._procs: List[subprocess.Popen] = []
        self.thread = threading.Thread(target=self._run, name="flux_numba_prebuild", daemon=True)

    # -- what is ready
    def pending(self, op: str, backend: str) -> Optional[str]:
        """``registry.pending``: why ``backend`` of ``op`` cannot run yet, or None."""
        if backend != "numba" or self.done.is_set() or op not in self._covered:
            return None
        left = self._left
        if left is None:
            return "its kernels are being planned for the background build"
        if left.get(op, 0) > 0:
            return "its kernels are being built in the background"
        return None

    def covers(self, op: str) -> bool:
        """True when ``op``'s numba kernels are this build's to make."""
        return op in self._covered

    def holds(self, launcher) -> bool:
        """True when ``launcher``'s kernel is (or may be) one the build will store."""
        if self.done.is_set():
            return False
        w = self._waiting
        return w is None or w.get(id(launcher), 0) > 0

    def progress(self):
        """(kernels finished, kernels to build)."""
        return self.built + self.failed, self.total

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
        from .registry import registry
        try:
            self._build()
        except Exception as e:
            self.state = "failed"
            self.errors.append(f"{type(e).__name__}: {e}")
            log.warning("[flux_numba] background kernel build failed (%s: %s); kernels compile where "
                        "they are first used", type(e).__name__, e)
        finally:
            self._cleanup()
            self.done.set()
            if registry.pending == self.pending:
                registry.pending = None

    def _build(self):
        import torch
        from numba import cuda
        torch.cuda.set_device(torch.device(self.device))
        jobs = self.jobs = plan(self.device, ops=self.ops)
        self.plan_s = time.perf_counter() - self.t0
        waiting: Dict[int, int] = {}
        left: Dict[str, int] = {}
        for j in jobs:
            waiting[id(j.launcher)] = waiting.get(id(j.launcher), 0) + 1
            for op in j.ops:
                left[op] = left.get(op, 0) + 1
        self._waiting, self._left = waiting, left
        if not jobs:
            self.state = "nothing"
            return
        cc = cuda.get_current_device().compute_capability  # what numba itself compiles for
        self.total = len(jobs)
        n = self.max_workers or min(MAX_WORKERS, max(1, (os.cpu_count() or 2) // 2))
        n = self.workers = max(1, min(n, len(jobs)))
        self.state = "building"
        self._folder = tempfile.mkdtemp(prefix="flux_numba_build_")
        with open(os.path.join(self._folder, "plan.json"), "w") as f:
            json.dump({"package": _package_of(jobs[0].recipe[0]), "root": os.path.dirname(HERE), "cc": list(cc),
                       "jobs": [j.spec() for j in jobs]}, f)
        log.info("[flux_numba] building %d kernels for sm_%d%d in %d background processes (planned in %.1f s; "
                 "the first start after an install or update -- later starts load them from numba's cache); "
                 "until then the ops run ComfyUI's torch math", len(jobs), cc[0], cc[1], n, self.plan_s)
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
        for w in range(n):  # each worker starts at its own place in the list, then claims what is left
            self._procs.append(subprocess.Popen(
                [sys.executable, os.path.join(HERE, "prebuild_worker.py"), self._folder, str((w * len(jobs)) // n)],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        stored: Set[int] = set()
        while len(stored) < len(jobs):
            alive = any(p.poll() is None for p in self._procs)
            if alive and time.perf_counter() - self.t0 > BUILD_LIMIT_S:
                self.errors.append(f"workers stopped after {BUILD_LIMIT_S:.0f} s")
                for p in self._procs:
                    p.kill()
                alive = False
            for i, job in enumerate(jobs):  # (workers gone before this scan: all they wrote is here)
                if i not in stored and self._collect(i, job):
                    stored.add(i)
            if not alive and len(stored) < len(jobs):
                for i, job in enumerate(jobs):
                    if i not in stored:
                        self._finish(job, ok=False, err="its worker exited without building it")
                break
            time.sleep(0.05)
        for p in self._procs:
            try:
                err = p.communicate(timeout=5)[1]
            except Exception:
                err = ""
            if p.returncode not in (0, None) and err:
                self.errors.append(f"worker exit {p.returncode}: {err.strip()[-300:]}")
        self.state = "done"
        log.info("[flux_numba] background kernel build: %d of %d kernels built in %.1f s by %d processes%s",
                 self.built, self.total, time.perf_counter() - self.t0, n,
                 f"; {self.failed} left to compile on use ({self.errors[0]})" if self.failed else "")

    def _collect(self, i, job) -> bool:
        """Store job ``i`` if its worker finished it (True), else False."""
        base = os.path.join(self._folder, str(i))
        if os.path.exists(base + ".bin"):
            try:
                with open(base + ".bin", "rb") as f:
                    data = f.read()
                _install(job.launcher.dispatcher(), job.sig, data)
                self._finish(job, ok=True)
            except Exception as e:
                self._finish(job, ok=False, err=f"storing {job.label()}: {type(e).__name__}: {e}")
            return True
        if os.path.exists(base + ".err"):
            try:
                with open(base + ".err") as f:
                    err = f.read()
            except OSError:
                err = "?"
            self._finish(job, ok=False, err=f"{job.label()}: {err}")
            return True
        return False

    def _finish(self, job, ok: bool, err: str = ""):
        """One job over: stored, or failed (that kernel is then compiled where it is used)."""
        if ok:
            self.built += 1
        else:
            self.failed += 1
            self.errors.append(err)
        self._waiting[id(job.launcher)] -= 1
        for op in job.ops:
            self._left[op] -= 1

    def _cleanup(self):
        for p in self._procs:
            if p.poll() is None:
                p.kill()
        if self._folder:
            shutil.rmtree(self._folder, ignore_errors=True)


def _install(disp, sig, data: bytes):
    """Store a worker's kernel (``data``: numba's own cache-file bytes for it) in numba's on-disk
    cache -- the dispatcher's index key, the next free data file, as ``IndexDataCacheFile.save``
    does, under numba's compiler lock so that a compile in another thread never writes the same
    index at the same time; the kernel is then loaded where it is first used, like any cached one.
    Where the cache cannot be written, the kernel goes into the dispatcher in memory instead."""
    from numba.cuda.core.compiler_lock import global_compiler_lock  # the lock numba-cuda's dispatcher takes
    with global_compiler_lock:
        cache = disp._cache
        try:
            if not getattr(cache, "_enabled", False):
                raise RuntimeError("numba's cache is off for this kernel")
            cf = cache._cache_file
            cache._impl.locator.ensure_cache_path()
            key = _index_key(disp, sig)
            overloads = cf._load_index()
            name = overloads.get(key)
            if name is None:
                used = set(overloads.values())
                i = 1
                while cf._data_name(i) in used:
                    i += 1
                name = overloads[key] = cf._data_name(i)
                cf._save_index(overloads)
            with cf._open_for_write(cf._data_path(name)) as f:
                f.write(data)
            return
        except Exception as e:  # a read-only install: the kernel still serves this process
            log.info("[flux_numba] prebuild: on-disk cache not written (%s: %s); kept in memory", type(e).__name__, e)
        import pickle
        kernel = cache._impl.rebuild(disp.targetctx, pickle.loads(data))
        if sig not in disp.overloads:
            disp.add_overload(kernel, sig)


_build: Optional[Build] = None


def _gate(launcher=None):
    """``launching.compile_gate``: a compile of one of the build's kernels in another thread waits
    for the build (then finds the kernel built); other compiles go ahead."""
    b = _build
    if b is None or b.done.is_set() or threading.current_thread() is b.thread:
        return
    if launcher is not None and not b.holds(launcher):
        return
    if not b.wait(WAIT_LIMIT_S):
        log.warning("[flux_numba] background kernel build still running after %.0f s; compiling here", WAIT_LIMIT_S)


def with_index(device, current_index: Callable[[], int]):
    """``device`` as a torch.device with its CUDA index (None or "cuda" -> the current one):
    ``torch.cuda.set_device`` refuses a CUDA device without an index."""
    import torch
    d = torch.device("cuda") if device is None else torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", current_index())
    return d


def start(device=None, workers=None, ops=None) -> Optional[Build]:
    """Start the background build for ``device`` (torch's current CUDA device) once per process;
    None where there is nothing to do (no CUDA GPU, numba unusable, the simulator, ``ENABLED``
    off)."""
    global _build
    if _build is not None:
        return _build
    if not ENABLED or runtime.SIMULATOR or runtime.numba_status() is not None or not NUMBA_OK:
        return None
    import torch
    if not torch.cuda.is_available():
        return None
    from .registry import registry
    _build = Build(with_index(device, torch.cuda.current_device), workers, ops)
    launching.compile_gate = _gate
    registry.pending = _build.pending
    _build.thread.start()
    return _build


def current() -> Optional[Build]:
    return _build
