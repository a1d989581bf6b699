"""Launching: ``Launcher`` holds one lazily-compiled kernel and launches it on torch's current stream
(GPU: a prepared ``cuLaunchKernel`` per argument pattern; the simulator: numba's own launch);
``cached_launcher`` keeps one per compile-time constant set.  Planning mode (``collecting`` /
``planning``: prebuild records the kernels instead of launching them), ``compile_gate`` (prebuild's
wait), numba ``signature`` of a launch, the word views the row kernels take (``words``,
``nhwc_words``, ``aligned16``), ``grid3`` and the backends' shared ``common_check``.

Module state that benchmarks, tests and prebuild set here (``launching.X = ...``, never through
a module that re-exports it): ``PREPARED``, ``_FAST_OK``, ``compile_gate``.
"""
from __future__ import annotations

import contextlib
import functools
import threading as _threading
import time as _time

import numpy as _np
import torch

from . import runtime
from .jit import NUMBA_OK, SIMULATOR, cuda  # noqa: F401


def aligned16(*ws) -> bool:
    """Every int64 word view has a 16-byte aligned base, even row strides and an even last dim
    (so word pairs (2j, 2j+1) of every row can move as one 16-byte access)."""
    for w in ws:
        if w.data_ptr() % 16 or w.shape[-1] % 2:
            return False
        if any(st % 2 for st, n in zip(w.stride()[:-1], w.shape[:-1]) if n > 1):
            return False
    return True


def nhwc_words(t: torch.Tensor):
    """Flat int64 view of a channels_last-contiguous [N, C, H, W] tensor's NHWC memory (no copy)."""
    return t.permute(0, 2, 3, 1).view(-1).view(torch.int64)


def words(t: torch.Tensor):
    """int64 view of a bf16 tensor (4 elements per word) or None when not 8-byte aligned.

    torch's dtype view enforces exactly what the kernels need: unit stride and a size divisible
    by 4 on the last dim, storage offset and every other stride divisible by 4 elements."""
    if t.element_size() != 2:
        return None
    try:
        return t.view(torch.int64)
    except RuntimeError:
        return None


class Launcher:
    """A lazily compiled kernel launched on torch's current stream with few Python steps.

    ``launcher(grid, block, *args)``; args are torch tensors (16-bit floats are passed as int16
    bit views), Python ints (typed int64) and ``numpy.float32`` scalars.

    GPU fast path: on the first call for a given (dtype, ndim) argument pattern the kernel is
    compiled explicitly for layout-'A' arrays (``dispatcher.compile``: the on-disk cache is
    used), and every launch then builds the kernel parameters straight from the tensors'
    data_ptr/shape/strides -- no ``as_cuda_array``, no argument typing -- packs them into the
    signature's preallocated buffer and calls ``cuLaunchKernel`` (``_Prepared``; cuda.core's launch,
    the one numba uses, where that is unavailable or from another thread) on torch's current stream
    (CUDA-graph capturable).
    Any failure there disables the fast path (logged) and the ordinary numba launch
    (``kernel[grid, block, stream](*arrays)``, also what the simulator uses) takes over
    (benchmarks compare the two by setting ``_FAST_OK``).
    """

    __slots__ = ("factory", "args", "kernel", "_cfg", "_fast")

    def __init__(self, factory, *args):
        self.factory = factory  # factory(*args) -> numba dispatcher; called on first launch only
        self.args = args
        self.kernel = None
        self._cfg = {}
        self._fast = {} if _FAST_OK else None

    def dispatcher(self):
        """The numba dispatcher (``factory(*args)``, made once)."""
        k = self.kernel
        if k is None:
            k = self.kernel = self.factory(*self.args)
        return k

    def recipe(self):
        """(module, qualname, args) that rebuild this launcher's kernel in another process -- the
        factory must be a module-level function and its args plain values -- or None."""
        f = self.factory
        mod, qn = getattr(f, "__module__", None), getattr(f, "__qualname__", "")
        if not mod or "<" in qn or not all(isinstance(a, (int, str, bool)) for a in self.args):
            return None
        return mod, qn, self.args

    def __call__(self, grid, block, *args):
        col = getattr(_COLLECT, "jobs", None)
        if col is not None:  # planning the kernels to build (prebuild.plan): record, launch nothing
            col.append((self, signature(args)))
            return
        k = self.kernel
        if k is None:
            k = self.dispatcher()
        fast = self._fast
        if fast is not None:
            key = tuple((a.dtype, a.dim()) if isinstance(a, torch.Tensor) else type(a) for a in args)
            handle = fast.get(key)
            if handle is None:
                handle = fast[key] = self._compile_fast(args)
            if handle is not False:
                if type(handle) is _Prepared and handle.owner == _get_ident():
                    handle.launch(grid, block, args)
                    return
                cfg = self._cfg.get((grid, block))
                if cfg is None:
                    cfg = self._cfg[(grid, block)] = _launch_config(grid, block)
                if type(handle) is _Prepared:
                    handle = handle.kernel
                _cuda_launch(runtime.stream(), cfg, handle, *_param_values(args, _c_float))
                return
        st = runtime.stream()
        key = (grid, block, st)
        cfg = None if SIMULATOR else self._cfg.get(key)
        if cfg is None:
            if len(self._cfg) > 256:
                self._cfg.clear()
            # (the simulator's kernel[...] configures and returns the kernel object itself: a cached
            # configuration would launch with the grid of the latest one, so it is never reused there)
            if not SIMULATOR:
                compile_gate(self)
            cfg = k[grid, block, st]
            if not SIMULATOR:
                self._cfg[key] = cfg
        cfg(*[_arg(a) for a in args])

    def occupancy(self, nt, *args):
        """Blocks of ``nt`` threads per SM that the kernel compiled for these launch arguments
        keeps resident (CUDA occupancy API: registers, shared memory, launch bounds), or None in
        the simulator or when numba cannot say.  For grids sized to fill the GPU exactly once."""
        if SIMULATOR or not NUMBA_OK:
            return None
        col = getattr(_COLLECT, "jobs", None)
        if col is not None:  # planning: the kernel is recorded, no answer yet
            col.append((self, signature(args)))
            return None
        try:
            fn = self.compile(signature(args))._codelibrary.get_cufunc()
            n = cuda.current_context().get_active_blocks_per_multiprocessor(fn, nt, 0)
            return int(n[-1] if isinstance(n, tuple) else n)
        except Exception:  # pragma: no cover - GPU only
            return None

    def label(self) -> str:
        """The kernel's name in logs: its factory and arguments."""
        rec = self.recipe()
        return f"{rec[1]}{tuple(rec[2])}" if rec else getattr(self.factory, "__name__", "?")

    def compile(self, sig):
        """``dispatcher.compile(sig)``, after ``compile_gate`` (a kernel the background build holds is
        not compiled twice); a kernel that had to be compiled here (not in memory, not in numba's
        on-disk cache, not built in the background) is logged with its time."""
        disp = self.dispatcher()
        if sig in getattr(disp, "overloads", {}):
            return disp.compile(sig)
        compile_gate(self)
        misses = getattr(disp, "_cache_misses", None)
        before = misses.get(sig, 0) if misses is not None else 0
        t0 = _time.perf_counter()
        kern = disp.compile(sig)
        if misses is not None and misses.get(sig, 0) > before:
            import logging
            logging.getLogger("flux_numba").info("[flux_numba] kernel %s compiled on first use in %.2f s",
                                                 self.label(), _time.perf_counter() - t0)
        return kern

    def _compile_fast(self, args):
        global _FAST_OK
        try:
            kern = self.compile(signature(args))
            if getattr(kern, "cooperative", False):
                raise TypeError("cooperative kernel")
            cufunc = kern._codelibrary.get_cufunc()
            if PREPARED and _DRV is not None:
                try:
                    return _Prepared(cufunc, args)
                except Exception as e:  # pragma: no cover - GPU only
                    import logging
                    logging.getLogger("flux_numba").info("[flux_numba] prepared launch unavailable (%s: %s); "
                                                         "cuda.core's launch is used", type(e).__name__, e)
            return cufunc.kernel
        except Exception as e:  # pragma: no cover - GPU only
            import logging
            logging.getLogger("flux_numba").warning("[flux_numba] fast launch disabled (%s: %s); "
                                                    "using numba's launcher", type(e).__name__, e)
            _FAST_OK = False
            self._fast = None
            return False


def cached_launcher(cache: dict, key, factory, *args):
    """``cache[key]``, made on first use as ``Launcher(factory, *args)`` -- each op keeps one
    Launcher per compile-time constant set (its module's ``_launchers``, which tests inspect).
    ``factory`` a module-level function and ``args`` plain values, so that a worker process can
    build the same kernel (``prebuild``)."""
    la = cache.get(key)
    if la is None:
        la = cache[key] = Launcher(factory, *args)
    return la


# planning mode (prebuild.plan): this thread's Launchers record (launcher, signature) instead of
# launching; ``jobs`` is the list they append to
_COLLECT = _threading.local()


@contextlib.contextmanager
def collecting():
    """Within: this thread's Launcher calls record ``(launcher, numba signature)`` into the
    yielded list and launch nothing (outputs stay unwritten)."""
    prev = getattr(_COLLECT, "jobs", None)
    jobs = _COLLECT.jobs = []
    try:
        yield jobs
    finally:
        _COLLECT.jobs = prev


def planning() -> bool:
    """True inside ``collecting()`` on this thread (answers such as occupancy are not final)."""
    return getattr(_COLLECT, "jobs", None) is not None


def _no_gate(launcher=None):
    return None


compile_gate = _no_gate  # prebuild installs its wait here: a kernel being built elsewhere is not compiled twice


def signature(args):
    """numba argument types of a launch: layout-'A' arrays for tensors (16-bit floats as int16 bit
    views), int64 for ints, float32 for numpy.float32."""
    from numba import types as nt
    dts = {torch.int16: nt.int16, torch.bfloat16: nt.int16, torch.float16: nt.int16, torch.int64: nt.int64,
           torch.float32: nt.float32, torch.int32: nt.int32, torch.uint8: nt.uint8}
    sig = []
    for a in args:
        if isinstance(a, torch.Tensor):
            sig.append(nt.Array(dts[a.dtype], a.dim(), "A"))
        elif type(a) is int:
            sig.append(nt.int64)
        elif isinstance(a, _np.float32):
            sig.append(nt.float32)
        else:
            raise TypeError(f"kernel argument of type {type(a).__name__}")
    return tuple(sig)


def _arg(a):
    if isinstance(a, torch.Tensor):
        a = runtime.arr(a)
    if SIMULATOR and isinstance(a, _np.ndarray):
        # wrap without the simulator's copy-in/copy-out (which refuses strided views):
        # kernels then write straight into the torch tensor's memory
        a = _FakeCUDAArray(a)
    return a


def arr(t):
    """``runtime.arr`` plus the simulator wrapping (for arrays cached by the launchers)."""
    return _arg(t)


if SIMULATOR and NUMBA_OK:
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray as _FakeCUDAArray

    def _patch_sim_shared():
        """numba-cuda 0.30.4's simulator creates ``cuda.shared.array`` lazily per block WITHOUT a
        lock: two threads entering together can each get a private array, so a reduction then
        sums stale memory (seen as rare wrong rows in the first block, timing dependent).  Same
        lookup (caller file + line) under a lock; also avoids a full traceback per call."""
        import sys
        import threading

        from numba.core import types as _types
        from numba.np import numpy_support as _nps
        from numba.cuda.simulator import kernelapi as _ka
        if getattr(_ka.FakeCUDAShared.array, "_flux_locked", False):
            return
        orig = _ka.FakeCUDAShared.array
        lock = threading.Lock()

        def array(self, shape, dtype, alignment=None):
            if alignment is not None or shape == 0:
                return orig(self, shape, dtype, alignment)
            if isinstance(dtype, _types.Type):
                dtype = _nps.as_dtype(dtype)
            f = sys._getframe(1)
            caller = (f.f_code.co_filename, f.f_lineno)
            with lock:
                res = self._allocations.get(caller)
                if res is None:
                    res = self._allocations[caller] = _np.empty(shape, dtype)
            return res
        array._flux_locked = True
        _ka.FakeCUDAShared.array = array

    try:
        _patch_sim_shared()
    except Exception:  # pragma: no cover - simulator internals moved: keep the original
        pass

# Prepared launches (GPU): each (kernel, argument pattern) packs its parameters into one preallocated
# buffer with a precompiled ``struct`` layout and calls ``cuLaunchKernel`` (cuda.bindings) with a fixed
# ``void**`` array -- no per-launch argument objects.  Benchmarks compare it with cuda.core's launch by
# setting ``PREPARED`` (bench/ops/gpu_launch_cost.py).
PREPARED = True
_DRV = None
_get_ident = _threading.get_ident


def _param_values(args, as_float):
    """A launch's kernel parameters in numba's ABI: per tensor (meminfo 0, parent 0, nitems, itemsize,
    data pointer, shape..., byte strides...), ints as int64 (intptr-sized, as numba passes shapes),
    anything else as a float32 through ``as_float``."""
    vals = []
    for a in args:
        if isinstance(a, torch.Tensor):
            es = a.element_size()
            vals += (0, 0, a.numel(), es, a.data_ptr())
            vals += a.shape
            vals += [st * es for st in a.stride()]
        elif type(a) is int:
            vals.append(a)
        else:
            vals.append(as_float(a))
    return vals


class _Prepared:
    """A compiled kernel's prepared launch for one argument pattern (tensors by dtype / ndim, ints,
    float32 scalars), used by the thread that made it (another thread takes cuda.core's launch: the
    buffer is never shared between threads)."""

    __slots__ = ("kernel", "fn", "st", "buf", "ptrs", "addr", "owner", "dims")

    def __init__(self, cufunc, args):
        import ctypes
        import struct
        self.kernel = cufunc.kernel  # cuda.core's launch handle (other threads)
        h = cufunc.handle
        if isinstance(h, _DRV.CUkernel):  # context-independent kernel: this context's function
            err, h = _DRV.cuKernelGetFunction(h)
            if err != _DRV.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"cuKernelGetFunction: {err}")
        self.fn = h
        fmt = []
        for a in args:
            if isinstance(a, torch.Tensor):
                fmt.append("q" * (5 + 2 * a.dim()))  # numba's array ABI: meminfo, parent, nitems, itemsize, data, shape, strides
            elif type(a) is int:
                fmt.append("q")
            else:
                fmt.append("f4x")  # float32, in its own 8-byte slot
        self.st = struct.Struct("<" + "".join(fmt))
        n = self.st.size // 8
        self.buf = ctypes.create_string_buffer(self.st.size)
        base = ctypes.addressof(self.buf)
        self.ptrs = (ctypes.c_void_p * n)(*[base + 8 * i for i in range(n)])
        self.addr = ctypes.addressof(self.ptrs)
        self.owner = _get_ident()
        self.dims = {}

    def launch(self, grid, block, args):
        d = self.dims.get((grid, block))
        if d is None:
            g = tuple(grid) + (1, 1) if isinstance(grid, tuple) else (grid, 1, 1)
            b = tuple(block) + (1, 1) if isinstance(block, tuple) else (block, 1, 1)
            if len(self.dims) > 256:
                self.dims.clear()
            d = self.dims[(grid, block)] = g[:3] + b[:3]
        self.st.pack_into(self.buf, 0, *_param_values(args, float))
        err, = _DRV.cuLaunchKernel(self.fn, d[0], d[1], d[2], d[3], d[4], d[5], 0,
                                   _DRV.CUstream(runtime._raw_stream()), self.addr, 0)
        if err != _DRV.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuLaunchKernel: {err}")


_FAST_OK = False
if NUMBA_OK and not SIMULATOR:
    try:  # cuda.bindings' driver module, as numba-cuda itself imports it (no dependency of our own)
        from numba.cuda.cudadrv.driver import binding as _DRV
    except Exception:  # pragma: no cover - numba-cuda moved it: cuda.core's launch
        _DRV = None
    try:
        from ctypes import c_float as _c_float

        from numba.cuda.dispatcher import launch as _cuda_launch, LaunchConfig as _LaunchConfig
        from numba.cuda._compat import CUDA_CORE_GE_1_0 as _GE10

        def _launch_config(grid, block):
            if _GE10:
                return _LaunchConfig(grid=grid, block=block, shmem_size=0, is_cooperative=False)
            return _LaunchConfig(grid=grid, block=block, shmem_size=0, cooperative_launch=False)

        _FAST_OK = True
    except Exception:  # pragma: no cover - numba-cuda internals moved: ordinary launches
        _FAST_OK = False


@functools.lru_cache(maxsize=1024)
def grid3(nx: int, ny: int, nz: int):
    """3-D grid for kernels that grid-stride in x, y and z (y, z capped at 65535; 2x2x2 in the
    simulator so tests stay fast but still exercise the strides)."""
    if SIMULATOR:
        return (min(nx, 2), min(ny, 2), min(nz, 2))
    return (max(1, min(nx, 2 ** 31 - 1)), max(1, min(ny, 65535)), max(1, min(nz, 65535)))


def common_check(*tensors, bf16_only=True):
    """device / dtype reason shared by every backend's check (None when fine)."""
    why = runtime.device_ok(*tensors)
    if why:
        return why
    if not NUMBA_OK:
        return "numba not importable"
    if bf16_only:
        for t in tensors:
            if t is not None and t.dtype != torch.bfloat16:
                return f"numba kernels take bf16 tensors (got {t.dtype})"
    return None
