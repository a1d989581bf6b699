"""Kernel compilation: whether numba imports (``NUMBA_OK``; ``SIMULATOR`` from ``runtime``) and
``jit_kernel`` -- ``cuda.jit`` with fastmath and numba's on-disk cache, the cache key made to cover
every cuda_kernels source (``tree_hash`` / ``source_hash``, ``keyed_on_sources``).

The layer below ``device`` (device helpers) and ``launching`` (``Launcher``).  Nothing here compiles
at import; importing works without numba (``NUMBA_OK`` is then False).
"""
from __future__ import annotations

import functools
import os

from . import runtime

try:
    from numba import cuda
    NUMBA_OK = True
except Exception:  # pragma: no cover - numba missing: backends decline via check
    cuda = None
    NUMBA_OK = False

SIMULATOR = runtime.SIMULATOR


def tree_hash(root) -> str:
    """sha256 over every *.py below ``root``, subfolders included (path relative to root + bytes,
    in sorted order; __pycache__ skipped)."""
    import hashlib
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(filenames):
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                h.update(os.path.relpath(path, root).replace(os.sep, "/").encode())
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=1)
def source_hash() -> str:
    """``tree_hash`` of cuda_kernels/ (the attention/ package included): part of each cached
    kernel's key, so an edit of any file a kernel is built from misses the cache."""
    return tree_hash(os.path.dirname(os.path.abspath(__file__)))


def keyed_on_sources(disp):
    """Make numba's on-disk cache key of dispatcher ``disp`` include ``source_hash()``.

    numba keys a cached kernel on its own bytecode, closure values and the *defining* file's
    mtime/size: an edit of a device function in another file (device.py) would load a stale
    kernel, and two kernels that differ only in jit options (launch_bounds) would share an entry.
    With the hash and the options in the index key a changed tree simply misses (and
    recompiles once).

    numba hashes the closure values by pickling them, and a device function (a dispatcher) in a
    kernel's closure pickles differently in every process: such a kernel (the LayerNorm row kernels
    capture their ``load_row``) never hit the cache after a restart.  The key is computed from a
    stand-in of the function whose closure holds plain values as they are and each device function
    as its module, name and (recursively) closure -- its code is covered by the source hash."""
    c = getattr(disp, "_cache", None)
    ik = getattr(c, "_index_key", None)
    if ik is None or getattr(ik, "_flux_keyed", False):
        return disp
    if getattr(c, "_py_func", None) is not None:
        c._py_func = _StableKeyFunc(c._py_func)
    # numba's key also omits the jit options (fastmath, launch_bounds): add them too
    opts = repr(sorted((k, repr(v)) for k, v in getattr(disp, "targetoptions", {}).items()))
    tag = ("flux_numba_sources", source_hash(), opts)

    def _index_key(sig, codegen):
        return ik(sig, codegen) + (tag,)
    _index_key._flux_keyed = True
    c._index_key = _index_key
    return disp


class _Cell:
    __slots__ = ("cell_contents",)

    def __init__(self, v):
        self.cell_contents = v


def _stable(v):
    """A process-independent stand-in for a closure value (device functions by name)."""
    f = getattr(v, "py_func", None)
    if f is not None and callable(f):
        cl = getattr(f, "__closure__", None) or ()
        mod = getattr(f, "__module__", "") or ""
        i = mod.find("cuda_kernels")  # the pack's own name for it: ComfyUI names the pack by its path
        return ("device function", mod[i:] if i >= 0 else mod, getattr(f, "__qualname__", ""),
                tuple(_stable(x.cell_contents) for x in cl))
    return v


class _StableKeyFunc:
    """What numba's cache key reads of a kernel's Python function (``__code__``, ``__closure__``),
    with the closure made process-independent (``_stable``)."""

    def __init__(self, f):
        self._f = f
        self.__code__ = f.__code__
        cl = f.__closure__
        self.__closure__ = None if cl is None else tuple(_Cell(_stable(x.cell_contents)) for x in cl)

    def __getattr__(self, name):
        return getattr(self._f, name)


def jit_kernel(fn=None, **kw):
    """``cuda.jit`` for kernels: fastmath + on-disk cache on the GPU (keyed on the hash of all
    cuda_kernels sources, see ``keyed_on_sources``), lazy compilation."""
    def deco(f):
        if not NUMBA_OK:
            return f
        if SIMULATOR:
            return cuda.jit(f)
        return keyed_on_sources(cuda.jit(f, fastmath=True, cache=True, **kw))
    return deco(fn) if fn is not None else deco
