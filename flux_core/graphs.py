"""Whole-forward CUDA graphs: capture once per input signature, replay every step.

Numba launches cost 16-35 us of Python each and a FLUX step has ~600 small kernels; replaying a
captured graph removes that host work and the launch gaps between kernels.  Every Numba launch
goes to torch's current stream (``runtime.stream()``), so it is captured with the torch ops.

Safe only when nothing in the forward changes address or needs the host between steps:
``graph_blockers(module)`` lists the reasons not to capture (weights off the GPU, already
capturing; ComfyUI's host adapter has its own one-pass check, ``nodes.host.graph_state``, with the
per-call weight work ComfyUI's ops do); callers fall back to eager execution and log why.
Weights patched *in place* (ComfyUI applies LoRA that way) keep their addresses, so replays see
them; a change of weight storage (``data_ptr``) invalidates the graph and it is re-captured.

Capture never invalidates the stream (which matters most under the cudaMallocAsync allocator,
ComfyUI's default: there the frees that follow an invalidated capture raise inside a destructor
and terminate the process):
  * the last warm-up runs with torch's sync debug mode set to "error", so a forward that syncs the
    host (``.item()``, a device-to-host copy, ``nonzero``) raises an ordinary exception before any
    capture begins -- the caller then runs eagerly.  (The mode is process-wide: for those two
    forwards another thread's syncing op would raise as well; ComfyUI runs models on its one
    prompt-worker thread);
  * the capture runs with the same mode (a sync raises before it reaches the driver: the capture
    stays valid and is ended and dropped) and ``capture_error_mode="thread_local"`` (another
    thread's CUDA calls, e.g. a server thread's, neither invalidate it nor fail);
  * the capture itself goes through ``capture.capturing`` (pool handles never reused after their
    last graph, the allocator's recording ended after any failure, the garbage collector paused,
    capturing stopped for the process on an allocator assert): no capture can leave torch's
    allocators broken for the rest of the process.
"""
from __future__ import annotations

import contextlib
import logging
import time
from typing import Callable, Dict, List, Optional

import torch

from ..cuda_kernels import registry
from .capture import GraphPool, allocator_notes_silenced, capturing, captures_off, last_gc_seconds, no_host_syncs

log = logging.getLogger("flux_numba")


def graph_blockers(module: torch.nn.Module, device: torch.device) -> List[str]:
    why = []
    if device.type != "cuda":
        return ["not a CUDA device"]
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    off = [n for n, p in module.named_parameters() if p.device != device]
    if off:
        why.append(f"{len(off)} weights not on {device} (offloaded), e.g. {off[0]}")
    if torch.cuda.is_current_stream_capturing():
        why.append("already inside a capture")
    return why


def is_interrupt(e: BaseException) -> bool:
    """ComfyUI's cancel (``InterruptProcessingException``, raised inside any op): graph wrappers let
    it propagate instead of treating it as a failed warm-up or capture."""
    return type(e).__name__ == "InterruptProcessingException"


def _sig(x):
    if isinstance(x, torch.Tensor):
        return ("T", tuple(x.shape), x.dtype, x.device)
    if isinstance(x, (list, tuple)):
        return tuple(_sig(v) for v in x)
    if isinstance(x, dict):
        return tuple((k, _sig(v)) for k, v in sorted(x.items()))
    return ("V", x)


class _Entry:
    def __init__(self, graph, static_in, static_out, weights_key, usage):
        self.graph, self.static_in, self.static_out, self.weights_key = graph, static_in, static_out, weights_key
        self.usage = usage  # registry calls made by one forward, re-counted on every replay


class GraphedForward:
    """``gf(*tensors)`` runs ``fn(*tensors)`` through a CUDA graph captured for that signature.

    The first ``warmup`` calls of a signature run ``fn`` eagerly (their results are returned: in a
    sampler they are ordinary steps, no forward is wasted); the next one captures and replays.  The
    warm-ups count only while the weights stay where they are: where every call finds them elsewhere
    (a decoder re-staged by DynamicVRAM on each decode under memory pressure) nothing is captured,
    rather than paying a capture per call for a graph that is never replayed.
    ``fn`` must take only tensors (positional) and return one tensor.  The returned tensor is a
    fresh copy (the static output buffer is reused by the next replay).
    """

    def __init__(self, fn: Callable, module: Optional[torch.nn.Module] = None, warmup: int = 2, max_graphs: int = 4):
        self.fn, self.module, self.warmup, self.max_graphs = fn, module, max(1, warmup), max_graphs
        self.graphs: Dict[tuple, _Entry] = {}
        self._seen: Dict[tuple, tuple] = {}  # signature -> (eager warm-up calls in a row, their weights key)
        self.pool = GraphPool()  # every graph of this wrapper is dropped through it (capture.py)
        self._streams = {}
        self.captures = 0
        self.replays = 0
        self.deferred = None  # why the last capture was put off (``can_capture``), if it was

    def _weights_key(self):
        if self.module is None:
            return None
        return tuple(p.data_ptr() for p in self.module.parameters())

    def __call__(self, *xs: torch.Tensor, weights_key: Optional[tuple] = None,
                 can_capture: Optional[Callable] = None) -> torch.Tensor:
        """``weights_key``: the identity of the weights the graph reads, when the caller has it
        already (default: the ``data_ptr`` of every parameter of ``module``); a change re-captures.
        ``can_capture()``: None when a capture may run now, else why not -- the call then runs ``fn``
        eagerly (not counted as a warm-up, nothing turned off) and a later call captures."""
        key = _sig(xs)
        wk = self._weights_key() if weights_key is None else weights_key
        e = self.graphs.get(key)
        if e is not None and e.weights_key != wk:
            log.info("[flux_numba] weights moved since capture: re-capturing the CUDA graph")
            self._release(self.graphs.pop(key))
            self._seen.pop(key, None)
            e = None
        if e is None:
            if not registry.settled():  # kernels still building: eager, and warm up again afterwards
                self._seen.pop(key, None)
                return self.fn(*xs)
            n, seen_wk = self._seen.get(key, (0, wk))
            if seen_wk != wk:
                # the weights moved between warm-ups (a memory manager re-placing them on every call
                # under memory pressure): a graph would be re-captured before it paid off -- the
                # warm-ups start again, so a capture needs ``warmup`` calls in a row on one placement
                n = 0
            if n < self.warmup:  # warm-up calls are ordinary eager steps: their results are used
                self._seen[key] = (n + 1, wk)
                # (JIT, autotune and allocator warm-up happen here; the last one proves the forward
                # never syncs the host, or raises before any capture is attempted)
                with no_host_syncs() if n + 1 == self.warmup else contextlib.nullcontext():
                    return self.fn(*xs)
            why = captures_off() or (can_capture() if can_capture is not None else None)
            if why:
                self.deferred = why
                return self.fn(*xs)
            if len(self.graphs) >= self.max_graphs:
                self._release(self.graphs.pop(next(iter(self.graphs))))
            e = self.graphs[key] = self._capture(xs, wk)
        for s, x in zip(e.static_in, xs):
            s.copy_(x)
        e.graph.replay()
        registry.replayed(e.usage)
        self.replays += 1
        return e.static_out.clone()

    def _release(self, e: _Entry):
        """Drop one graph and its static tensors (through the pool: a handle is not reused once its graphs
        are gone); the allocator's notes on freeing captured memory outside a capture are not printed."""
        with allocator_notes_silenced():
            self.pool.release(e.graph)
            e.static_in = e.static_out = e.graph = None

    def drop_all(self):
        """Free every graph."""
        for e in self.graphs.values():
            self._release(e)
        self.graphs.clear()

    def _capture(self, xs, wk) -> _Entry:
        static_in = [x.clone() for x in xs]
        dev = torch.cuda.current_device()
        s = self._streams.get(dev)
        if s is None:
            s = self._streams[dev] = torch.cuda.Stream()
        t0 = time.perf_counter()
        with registry.recorded(keep=True) as usage:
            with capturing(self.pool, s) as g:
                static_out = self.fn(*static_in)
        self.captures += 1
        log.info("[flux_numba] captured a CUDA graph for input shapes %s in %.0f ms (gc %.0f ms)",
                 [tuple(x.shape) for x in xs], 1e3 * (time.perf_counter() - t0), 1e3 * last_gc_seconds())
        return _Entry(g, static_in, static_out, wk, usage)


def is_oom(e: BaseException) -> bool:
    return isinstance(e, getattr(torch.cuda, "OutOfMemoryError", ())) or "out of memory" in str(e).lower()


class GraphGuard:
    """The one policy of the pack's CUDA graphs around host code (the FLUX forward's, the VAE decoder's
    low-resolution stage): where the caller finds a graph unsafe, ``eager(why, fn)`` runs ``fn`` and
    logs the reason once; else ``run`` replays through a ``GraphedForward`` (its warm-ups, capture,
    re-capture on moved weights).  A failed warm-up or capture turns the graph off for good (eager
    from then on, reason logged once) -- except the host's interrupt (the user cancelled: it
    propagates and the graph stays on), out-of-memory with ``on_oom="raise"`` (graphs dropped, then
    re-raised: the host has its own fallback, e.g. a tiled decode), and any error while the registry
    is strict (tests)."""

    def __init__(self, message: str, warmup: int = 2, max_graphs: int = 2, on_oom: str = "eager"):
        self.message, self.warmup, self.max_graphs, self.on_oom = message, warmup, max_graphs, on_oom
        self.gf: Optional[GraphedForward] = None
        self.failed: Optional[str] = None
        self.last_mode: Optional[str] = None  # "graph" | "warm-up" | "eager: <why>"
        self._logged = set()

    def eager(self, why: str, fn: Callable):
        if why not in self._logged:
            self._logged.add(why)
            log.info("[flux_numba] %s: %s", self.message, why)
        self.last_mode = "eager: " + why
        return fn()

    def drop(self):
        gf, self.gf = self.gf, None
        drop_all = getattr(gf, "drop_all", None)
        if drop_all is not None:
            drop_all()

    def run(self, fn: Callable, inputs, weights_key, eager_fn: Callable, can_capture: Optional[Callable] = None):
        """``fn(*inputs)`` through the graph (``fn`` is the closure of this call: a capture records it);
        ``can_capture``: see ``GraphedForward.__call__``."""
        if self.gf is None:
            self.gf = GraphedForward(fn, warmup=self.warmup, max_graphs=self.max_graphs)
        self.gf.fn = fn
        replays = getattr(self.gf, "replays", 0)
        try:
            out = self.gf(*inputs, weights_key=weights_key, can_capture=can_capture)
        except Exception as e:
            if is_interrupt(e):
                raise
            if self.on_oom == "raise" and is_oom(e):
                self.drop()
                raise
            if registry.strict:
                raise
            self.drop()
            self.failed = f"capture failed ({type(e).__name__}: {str(e)[:200]})"
            return self.eager(self.failed, eager_fn)
        self.last_mode = "graph" if getattr(self.gf, "replays", 0) > replays else "warm-up"
        return out


class Guarded:
    """For a wrapper that owns a ``GraphGuard`` as ``self.guard``: its state and ``drop()``."""

    guard: GraphGuard

    @property
    def gf(self):
        return self.guard.gf

    @property
    def failed(self):
        return self.guard.failed

    @property
    def last_mode(self):
        return self.guard.last_mode

    def drop(self):
        """Free the captured graphs; later calls re-capture."""
        self.guard.drop()
