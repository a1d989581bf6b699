"""Per-block CUDA graphs: each fused FLUX block captured once and replayed while its weights stay put.

Where the whole-forward graph (``graphs.GraphedForward``) cannot run -- weights staged per call by
ComfyUI's DynamicVRAM, a wrapper the host cannot move outside the capture, ControlNet
residuals, reference latents, masks, partial offload -- a block whose weights are resident is still
a fixed piece of GPU work: it is captured once per (block, input signature) and replayed, so its
~40 kernel launches and ComfyUI's per-op weight casts cost one graph launch.  Blocks whose weights
are not resident run eagerly, and are captured once they are resident again.

The state machine (``BlockGraphs.call``), per key = (block, input signature):
  * ``weights`` is the host's residency key for the block this call (``None``: not graphable now --
    streamed / offloaded weights, weight functions): eager;
  * a graph whose recorded ``weights`` equals this call's: replay;
  * else the call runs eagerly and the key is remembered; the next call with the same ``weights``
    (the weights stayed where the last eager call left them) captures and replays; a different
    ``weights`` (weights moved, LoRA changed) drops the stale graph first.
  * ``prepare()`` (the host stages the block's weights) yields False when a weight is not resident
    at capture time: its copy / patch work (DynamicVRAM faults, a LoRA bake) would be captured and
    re-run on every replay, so the call runs eagerly and a later one tries again;
  * a failed capture (a host sync inside the block, a capture error) -> eager for that key for good,
    the reason logged once; after an allocator assert no block captures any more in this process
    (``capture.captures_off``); ComfyUI's interrupt propagates.

Inputs and outputs: a graph reads fixed addresses, so each stage (double / single) and signature has
one set of static buffers (``StageBuffers``) shared by all its blocks: ``img`` / ``txt`` are updated
in place and returned, so block i+1 gets block i's buffer and nothing is copied between blocks; a
caller's fresh tensor (the first block of a stage) is copied in.  ``vec`` / ``pe`` / ``mask`` are
copied when the caller passes a different object (once per forward).  Each capture gets a fresh
per-call state from ``core`` (no tensor computed inside one graph is read by another).  All graphs of
one ``BlockGraphs`` share one memory pool while any of them lives (``capture.GraphPool``: a handle
is never reused once its graphs are gone): their temporaries are dead at each graph's end, and
replays are serial on one stream.

Capture goes through ``capture_fn(fn) -> graph`` (``graph.replay()``; ``capture_fn.release(graph)``
drops one); the default is ``capture.capturing`` on a side stream (host syncs raise, thread-local
capture mode, the garbage collector paused, one young-generation collection per round of captures
instead of ``torch.cuda.graph``'s full one per capture: 57 captures per FLUX forward).  Tests pass a recording
stand-in that re-runs ``fn`` on replay, which exercises the same buffer and state logic on the CPU.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from collections import Counter, OrderedDict
from typing import Callable, Dict, Optional

import torch

from ..cuda_kernels import registry
from .capture import CapturesOff, GraphPool, capturing, captures_off, drop_graph
from .graphs import is_interrupt

log = logging.getLogger("flux_numba")

STREAMS = ("img", "txt")          # updated in place by the block, returned
PER_FORWARD = ("vec", "pe", "mask")  # read only, the same object for every block of one forward

_allowed = threading.local()


class allowed:
    """Context: block calls inside may use per-block graphs (the whole-forward graph is not running
    this call).  Re-entrant, per thread."""

    def __enter__(self):
        _allowed.depth = getattr(_allowed, "depth", 0) + 1
        return self

    def __exit__(self, *exc):
        _allowed.depth -= 1
        return False


def is_allowed() -> bool:
    return getattr(_allowed, "depth", 0) > 0


def signature(inputs: Dict[str, Optional[torch.Tensor]]) -> tuple:
    """Shapes, strides, dtypes and devices of the inputs, and whether inference mode is on (buffers made
    under it cannot be updated outside it)."""
    return (torch.is_inference_mode_enabled(),) + tuple(
        (n, None if t is None else (tuple(t.shape), t.dtype, t.device, tuple(t.stride()))) for n, t in inputs.items())


class StageBuffers:
    """Static input / output tensors of one stage and signature (module docstring)."""

    def __init__(self, inputs):
        self.t = {n: (None if v is None else torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device))
                  for n, v in inputs.items()}
        self.src = {}  # per-forward input name -> the caller's tensor last copied in (held: its id stays unique)

    def load(self, inputs):
        for n, v in inputs.items():
            b = self.t[n]
            if v is None or v is b:
                continue
            if n in STREAMS:
                b.copy_(v)
            elif self.src.get(n) is not v:
                b.copy_(v)
                self.src[n] = v

    def outputs(self, names):
        return {n: self.t[n] for n in names}


class _Entry:
    __slots__ = ("graph", "weights", "bufs", "usage")

    def __init__(self, graph, weights, bufs, usage):
        self.graph, self.weights, self.bufs, self.usage = graph, weights, bufs, usage


class CudaCapture:
    """The default ``capture_fn``: ``fn()`` captured into a CUDA graph through ``capture.capturing``
    (module docstring); ``release(graph)`` is how BlockGraphs drops one (the pool then knows when a
    handle's last graph is gone)."""

    def __init__(self):
        self.pool = GraphPool()
        self.streams = {}

    def __call__(self, fn):
        dev = torch.cuda.current_device()
        s = self.streams.get(dev)
        if s is None:
            s = self.streams[dev] = torch.cuda.Stream()
        with capturing(self.pool, s) as g:
            fn()
        return g

    def release(self, graph):
        self.pool.release(graph)


class BlockGraphs:
    """Per-block graphs of one patched model (module docstring)."""

    def __init__(self, capture_fn: Optional[Callable] = None, max_signatures: int = 4):
        self.capture_fn = capture_fn if capture_fn is not None else CudaCapture()  # one pool per model
        self.max_signatures = max(1, max_signatures)
        self.entries: Dict[tuple, _Entry] = {}
        self.seen: Dict[tuple, object] = {}   # key -> weights of its last eager call
        self.failed: Dict[tuple, str] = {}
        self.buffers: "OrderedDict[tuple, StageBuffers]" = OrderedDict()
        self.counts = Counter()  # replay / capture / eager / eager_not_resident / failed
        self._last_bufs = None   # the stage buffers of the last replay
        self._logged = set()

    # ------------------------------------------------------------------ state
    def _release(self, graph):
        """Drop one graph: through the capture function (which owns its pool), else reset."""
        rel = getattr(self.capture_fn, "release", None)
        if rel is not None:
            rel(graph)
        elif graph is not None and hasattr(graph, "reset"):
            drop_graph(graph)

    def drop(self, why: str = ""):
        """Free every graph and buffer (ComfyUI unloaded the model, or weights changed identity)."""
        for e in self.entries.values():
            self._release(e.graph)
        self.entries.clear()
        self.seen.clear()
        self.buffers.clear()
        self._last_bufs = None
        if why:
            log.info("[flux_numba] per-block CUDA graphs dropped: %s", why)

    def _buffers(self, stage, inputs):
        """The stage's static buffers for this signature.  Up to ``max_signatures`` signatures per
        stage (the double and single stages each have their own: one prompt shape is one signature
        of each); beyond that the stage's least recently replayed signature and its graphs go."""
        sig = (stage, signature(inputs))
        b = self.buffers.get(sig)
        if b is None:
            mine = [k for k in self.buffers if k[0] == stage]
            if len(mine) >= self.max_signatures:
                old = self.buffers.pop(mine[0])  # least recently used (replays move theirs to the end)
                if old is self._last_bufs:
                    self._last_bufs = None
                for k in [k for k, e in self.entries.items() if e.bufs is old]:
                    self._release(self.entries.pop(k).graph)
            b = self.buffers[sig] = StageBuffers(inputs)
        return b

    def note(self, key, msg, *a):
        if key not in self._logged:
            self._logged.add(key)
            log.info("[flux_numba] " + msg, *a)

    # ------------------------------------------------------------------ call
    def call(self, key, stage: str, weights, inputs: Dict[str, Optional[torch.Tensor]],
             core: Callable, eager: Callable, outputs=("img",), prepare: Optional[Callable] = None,
             can_capture: Optional[Callable] = None):
        """One block call.  ``key``: (block identity, call signature) -- the stage's signature is
        added here; ``weights``: the host's residency key (None: not graphable now); ``inputs``:
        name -> tensor (``STREAMS`` updated in place, ``PER_FORWARD`` read); ``core(**tensors)``: the
        block on the given tensors, returning {name: tensor} for ``outputs``; ``eager()``: the same
        block on the caller's tensors (its result is returned as it is); ``prepare()``: a context
        manager held around a capture (the host stages the block's weights there); ``can_capture()``:
        None, or why capturing now is unsafe (the call then runs eagerly and a later one tries again)."""
        key = (key, signature(inputs))
        if weights is None:
            self.counts["eager_not_resident"] += 1
            return eager()
        e = self.entries.get(key)
        if e is not None:
            if e.weights == weights:
                if e.bufs is not self._last_bufs:  # (once per stage and forward: the LRU order of shapes)
                    self._last_bufs = e.bufs
                    self.buffers.move_to_end((stage, key[1]))
                e.bufs.load(inputs)
                e.graph.replay()
                registry.replayed(e.usage)
                self.counts["replay"] += 1
                return e.bufs.outputs(outputs)
            del self.entries[key]  # weights moved / changed: stale
            self._release(e.graph)
        if not registry.settled():  # kernels still building: no capture of their stand-ins
            self.seen.pop(key, None)
            self.counts["eager_kernels_building"] += 1
            return eager()
        if key in self.failed or self.seen.get(key) != weights:
            self.seen[key] = weights
            self.counts["eager"] += 1
            return eager()
        off = captures_off()
        if off:
            self.counts["eager_captures_off"] += 1
            return eager()
        why = can_capture() if can_capture is not None else None
        if why:
            self.counts["eager_no_headroom"] += 1
            self.note(("headroom", why), "per-block CUDA graph not captured now: %s; the block runs eagerly", why)
            return eager()
        return self._capture(key, stage, weights, inputs, core, eager, outputs, prepare)

    def _capture(self, key, stage, weights, inputs, core, eager, outputs, prepare):
        bufs = self._buffers(stage, inputs)
        bufs.load(inputs)

        def body():
            out = core(**bufs.t)
            for n in outputs:
                t = out[n]
                if t is not bufs.t[n]:
                    bufs.t[n].copy_(t)
        graph = None
        try:  # (the calls made while capturing are counted on each replay, not here)
            with registry.recorded() as usage, (prepare() if prepare is not None else contextlib.nullcontext()) as ready:
                if ready is False:  # staging found weights that are not resident: their copy / patch work
                    self.seen.pop(key, None)  # would be captured (re-run on every replay): not now
                    self.counts["eager_not_resident"] += 1
                else:
                    graph = self.capture_fn(body)
        except CapturesOff:
            self.counts["eager_captures_off"] += 1
            return eager()
        except Exception as e:
            if is_interrupt(e):
                raise
            why = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            self.failed[key] = why
            self.counts["failed"] += 1
            self.note(("failed", why), "per-block CUDA graph capture failed (%s); that block runs eagerly", why)
            return eager()
        if graph is None:
            return eager()
        e = self.entries[key] = _Entry(graph, weights, bufs, usage)
        self.counts["capture"] += 1
        self.note(("captured", stage), "per-block CUDA graphs: captured a %s block (weights resident); replayed "
                  "from now on while they stay resident", stage)
        graph.replay()
        registry.replayed(e.usage)
        return bufs.outputs(outputs)
