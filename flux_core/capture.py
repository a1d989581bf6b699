"""The one way the pack captures a CUDA graph, made so that no capture can break the process.

torch keeps process-wide capture state in its allocators, and two mistakes leave it broken for the
rest of the process (every later capture anywhere -- the pack's, ComfyUI's own -- then fails, and
under cudaMallocAsync every free is deferred forever):

  * **a pool handle reused after its last graph is gone.**  ``CUDAGraph.capture_begin`` first tells
    the device allocator a capture is under way (cudaMallocAsync: one process-wide flag), then asks
    the pinned-host allocator (and the native device allocator) to share the pool, which asserts
    ``use_count > 0`` when the handle's pool is still registered but no graph uses it any more.  The
    throw comes after the flag was set and nothing clears it: frees pile into
    ``capture_free_streams`` and every later ``capture_begin`` asserts ``capture_free_streams.empty()``.
    ``GraphPool`` therefore counts the live graphs of each handle and hands out a fresh handle once a
    handle's last graph is released (all releases go through it) or a capture on it failed;
  * **a capture that throws between begin and end** (an invalidated capture makes
    ``cudaStreamEndCapture`` fail before torch ends the allocator's recording).  ``capturing``
    ends the recording itself after any failure (``torch._C._cuda_endAllocateToPool``; a no-op
    error when it had ended) and retires the handle.

Around each capture: the cyclic garbage collector is paused (a cycle holding a pre-capture tensor
cannot be freed inside the capture: every pre-capture temporary is held until the capture ends),
one collection of the young generations per round of captures before it (``torch.cuda.graph`` runs a
full ``gc.collect()`` before each capture; the per-block graphs capture up to 57 blocks in one
forward, and a full collection of a ComfyUI server's heap takes a third of a second: with the
collector paused inside the capture, the collection only frees recent garbage early, which the young
generations hold), host syncs raise
(``no_host_syncs``) and ``capture_error_mode="thread_local"`` keeps other threads' CUDA calls out.

If torch reports an allocator assert anyway, the recording is ended as above and the pack stops
capturing in this process (``captures_off()``; one log line): its existing graphs keep replaying,
everything else runs eagerly, and the rest of ComfyUI keeps a working allocator.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time
import warnings
from typing import Dict, Optional

import torch

log = logging.getLogger("flux_numba")

GC_ROUND_S = 5.0  # captures closer together than this share one collection

_state = {"off": None, "last_gc": 0.0, "gc_s": 0.0}
_probe = threading.local()


class CapturesOff(RuntimeError):
    """The pack captures no more graphs in this process (``captures_off()`` says why)."""


def captures_off() -> Optional[str]:
    """Why the pack captures no CUDA graphs any more in this process (an allocator assert was seen),
    or None."""
    return _state["off"]


def reset_for_tests():
    _state["off"] = None
    _state["last_gc"] = 0.0


def turn_captures_off(why: str):
    if _state["off"] is None:
        _state["off"] = why
        log.warning("[flux_numba] CUDA graph capture stopped for this process: %s; the pack's captured graphs keep "
                    "replaying, everything else runs eagerly", why)


def in_probe() -> bool:
    """True inside this thread's sync-checked warm-up or capture (``no_host_syncs``): an error
    raised there belongs to the graph wrapper (it runs the step eagerly), not to a block fallback."""
    return getattr(_probe, "depth", 0) > 0


@contextlib.contextmanager
def no_host_syncs():
    """torch raises on an operation that synchronizes the host with the device (sync debug mode
    "error") while inside; the previous mode is restored on exit."""
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    _probe.depth = getattr(_probe, "depth", 0) + 1
    try:
        yield
    finally:
        _probe.depth -= 1
        torch.cuda.set_sync_debug_mode(prev)


@contextlib.contextmanager
def allocator_notes_silenced():
    """The allocator's benign deferred-free notes ("freeAsync() was called on an uncaptured
    allocation during graph capture": a pre-capture tensor released inside the capture, whose free
    torch defers to the capture's end) are not printed inside."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def drop_graph(graph):
    """Free a captured graph's memory now, quietly."""
    with allocator_notes_silenced():
        graph.reset()


class GraphPool:
    """Memory-pool handles for a family of graphs that may share memory (their replays are serial on
    one stream).  A handle is shared only while at least one graph captured into it is alive;
    ``release`` is the only way a graph of the family is dropped (module docstring)."""

    def __init__(self):
        self.current = None
        self.live: Dict[tuple, int] = {}   # handle -> graphs alive on it
        self._of: Dict[int, tuple] = {}    # id(graph) -> its handle (graphs are held by their owners)

    def handle(self):
        if self.current is None:
            self.current = torch.cuda.graph_pool_handle()
        return self.current

    def add(self, graph, handle):
        self._of[id(graph)] = handle
        self.live[handle] = self.live.get(handle, 0) + 1

    def retire(self):
        """The current handle takes no further capture (one failed on it); live graphs keep it."""
        self.current = None

    def release(self, graph):
        """Drop ``graph`` (reset: its memory goes back) and forget its handle with its last graph."""
        h = self._of.pop(id(graph), None)
        drop_graph(graph)
        if h is None:
            return
        n = self.live.get(h, 0) - 1
        if n > 0:
            self.live[h] = n
            return
        self.live.pop(h, None)
        if self.current == h:
            self.current = None

    def count(self) -> int:
        return sum(self.live.values())


def _end_recording(device, handle):
    """End the allocators' recording into ``handle`` if a failed capture left it on (torch's own
    end runs only when ``cudaStreamEndCapture`` succeeded); an error means there was nothing to end."""
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    if end is None:
        return
    try:
        end(device, handle)
    except Exception:
        pass


def is_allocator_assert(e: BaseException) -> bool:
    """torch's allocator bookkeeping failed (as opposed to an ordinary capture error: a host sync,
    an op that cannot be captured)."""
    msg = str(e)
    return "INTERNAL ASSERT FAILED" in msg and any(k in msg for k in (
        "Allocator", "allocator", "capture_free_streams", "use_count", "capture_underway", "ptr_info"))


def _collect_once_per_round():
    now = time.monotonic()
    _state["gc_s"] = 0.0
    if now - _state["last_gc"] > GC_ROUND_S:
        gc.collect(1)   # generations 0 and 1 (see the module docstring)
        _state["last_gc"] = time.monotonic()
        _state["gc_s"] = _state["last_gc"] - now


def last_gc_seconds() -> float:
    """Seconds the last ``capturing`` spent in its collection (0 when it shared an earlier one)."""
    return _state["gc_s"]


@contextlib.contextmanager
def capturing(pool: GraphPool, stream: "torch.cuda.Stream"):
    """``with capturing(pool, stream) as g:`` -- the body is captured into the fresh CUDAGraph ``g``
    on ``stream`` (which first waits for the current stream; the current stream waits for it after)
    with memory from ``pool``.  Raises ``CapturesOff`` when the pack captures no more; any failure
    is re-raised after the allocator's recording is ended and the handle retired (an allocator
    assert also turns capturing off for the process)."""
    why = captures_off()
    if why:
        raise CapturesOff(why)
    _collect_once_per_round()
    dev = torch.cuda.current_device()
    handle = pool.handle()
    g = torch.cuda.CUDAGraph()
    cur = torch.cuda.current_stream()
    stream.wait_stream(cur)
    gc_on = gc.isenabled()
    gc.disable()
    try:
        with allocator_notes_silenced(), no_host_syncs(), torch.cuda.stream(stream):
            g.capture_begin(pool=handle, capture_error_mode="thread_local")
            try:
                yield g
            finally:
                g.capture_end()
    except BaseException as e:
        if "Only one capture at a time" not in str(e):  # (another capture's recording is not ours to end)
            _end_recording(dev, handle)
        pool.retire()
        if is_allocator_assert(e):
            turn_captures_off(f"torch's allocator reported {type(e).__name__}: {str(e).splitlines()[0][:160]}")
        raise
    finally:
        if gc_on:
            gc.enable()
        cur.wait_stream(stream)
    pool.add(g, handle)
