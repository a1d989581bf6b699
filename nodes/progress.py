"""Progress for first-use kernel compilation, so ComfyUI shows a bar instead of a silent stall.

Usage (in the patch node, while warming kernels)::

    from .progress import compile_progress
    with compile_progress(unique_id, total=len(kernels)) as prog:
        for name, warm in kernels:
            t0 = time.perf_counter()
            cached = warm()               # True when numba loaded it from the on-disk cache
            prog.step(name, cached=cached)
        # or: prog.warm(name, lambda: launch_once(...), dispatchers=[my_kernel])

Inside ComfyUI this drives ComfyUI's progress bar on the node (``host.ui.progress_bar``) and the
text under the node (``host.ui.send_progress_text``: "compiling ln_modulate (3/7) ..." and at the
end "7 kernels ready in 41.2 s: 5 compiled, 2 from the on-disk cache").  Outside ComfyUI it only logs.
``set_text_sink(fn)`` lets tests capture the text.
"""
from __future__ import annotations

import contextlib
import logging
import time
from typing import Callable, List, Optional

log = logging.getLogger("flux_numba")

_text_sink: Optional[Callable[[str, Optional[str]], None]] = None


def set_text_sink(fn):
    """Send progress text to ``fn(text, node_id)`` instead of ComfyUI; returns the previous sink."""
    global _text_sink
    prev, _text_sink = _text_sink, fn
    return prev


def _send_text(text: str, node_id):
    if _text_sink is not None:
        _text_sink(text, node_id)
        return
    from .host import ui
    ui.send_progress_text(text, node_id)


def cache_hits(*dispatchers) -> int:
    """Total on-disk cache hits of numba(-cuda) dispatchers (0 when they have no stats)."""
    n = 0
    for d in dispatchers:
        try:
            n += sum(d.stats.cache_hits.values())
        except Exception:
            pass
    return n


class CompileProgress:
    def __init__(self, node_id, total: int, title: str = "FluxNumba kernels"):
        self.node_id = None if node_id is None else str(node_id)
        self.total = max(int(total), 1)
        self.title = title
        self.done = 0
        self.cached: List[str] = []
        self.compiled: List[str] = []
        self.t0 = time.perf_counter()
        from .host import ui
        self._bar = ui.progress_bar(self.total, self.node_id)

    def text(self, msg: str):
        log.info("[flux_numba] %s", msg)
        try:
            _send_text(msg, self.node_id)
        except Exception:
            pass

    def begin(self, name: str):
        """Announce the kernel about to compile (shows before the possibly long stall)."""
        self.text(f"{self.title}: compiling {name} ({self.done + 1}/{self.total}) ...")

    def step(self, name: str = "", cached: bool = False):
        """One kernel ready; ``cached`` when it came from numba's on-disk cache."""
        self.done += 1
        (self.cached if cached else self.compiled).append(name)
        if self._bar is not None:
            self._bar.update_absolute(min(self.done, self.total), self.total)
        how = "loaded from on-disk cache" if cached else "compiled"
        self.text(f"{self.title}: {name} {how} ({self.done}/{self.total}, {time.perf_counter() - self.t0:.1f} s)")

    def warm(self, name: str, fn: Callable, dispatchers=()):
        """Run ``fn()`` (compile/launch one kernel) between ``begin`` and ``step``.

        Cache use is read from numba-cuda's dispatcher stats (``d.stats.cache_hits``, kernels declared
        with ``cache=True``) of ``dispatchers``; without dispatchers, a ``True`` return of ``fn`` means
        "cached".  Returns ``fn``'s result."""
        self.begin(name)
        before = cache_hits(*dispatchers)
        out = fn()
        cached = (cache_hits(*dispatchers) > before) if dispatchers else (out is True)
        self.step(name, cached=cached)
        return out

    def summary(self) -> str:
        dt = time.perf_counter() - self.t0
        if self.done and not self.compiled:
            how = "all from the on-disk cache"
        elif self.cached:
            how = f"{len(self.compiled)} compiled, {len(self.cached)} from the on-disk cache"
        else:
            how = f"{len(self.compiled)} compiled (no on-disk cache yet; next start is faster)"
        return f"{self.title}: {self.done} kernels ready in {dt:.1f} s: {how}"


@contextlib.contextmanager
def compile_progress(node_id, total: int, title: str = "FluxNumba kernels"):
    """Context manager yielding a :class:`CompileProgress`; prints a summary (or the failure) at the end."""
    prog = CompileProgress(node_id, total, title)
    prog.text(f"{title}: preparing {prog.total} kernels (first use compiles them; this can take a while) ...")
    try:
        yield prog
    except BaseException as e:
        prog.text(f"{title}: failed after {prog.done}/{prog.total}: {type(e).__name__}: {e}")
        raise
    else:
        prog.text(prog.summary())
