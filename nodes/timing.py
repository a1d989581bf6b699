"""Step timing behind FluxNumbaStepTimer: per-step wall time, it/s and the backend of every registry op,
sent live to the browser.

How a step is measured
----------------------
The node (``timer.py``) clones the MODEL and adds two ComfyUI wrappers (``host.install_sampling_wrappers``) to the
clone, so nothing else in the model (``model_function_wrapper``, block patches, other wrappers) is touched:

* ``OUTER_SAMPLE`` -- one sampler call = one *run* (run id, label, patch description, step count);
* ``APPLY_MODEL`` -- one diffusion-model call = one *step* record ``{step, ms, backends, sigma, batch}``.
  APPLY_MODEL exists for every ComfyUI model type (the DIFFUSION_MODEL wrapper only for some), so the same
  node times FLUX and the tiny test UNet alike.

On CUDA the time is taken with CUDA events on the current stream; a step's record is resolved without
a device sync: at the start of the next step only the events that already completed are read
(``Event.query()``), the rest at the end of the run (one synchronize).  On CPU: ``time.perf_counter``.

``backends`` is the difference of ``registry.usage`` (the op registry's call counter) across the step:
``{op: {backend: calls}}``; a stock model calls no registry op, so it is ``{}``.  The counter is only
read, never reset, so ``registry.take_usage()`` users elsewhere are unaffected.

Data
----
* Python: ``get_runs()``, ``get_run(run_id)``, ``last_run(node_id=None, label=None)``, ``clear_runs()``
  (the store is ``runs``; re-exported here).
* Browser: ``send_sync("flux_numba.run", {...phase: "start"|"end"})`` and ``send_sync("flux_numba.step", {...})``
  keyed by the node's UNIQUE_ID, each step message carrying the running summary (mean/min/max/total
  ms, it/s), so the web extension only draws.  ``set_sender(fn)`` replaces PromptServer (tests).
"""
from __future__ import annotations

import json
import logging
import time
from typing import Any, Callable, Dict, List, Optional

from .runs import (MAX_RUNS, Run, SELECTION_HELP, SelectionError, _lock, _store, clear_runs,  # noqa: F401
                   get_run, get_runs, graphs_summary, last_run, merge_backends, model_state, select_runs, summarize)

log = logging.getLogger("flux_numba")

EVENT_STEP = "flux_numba.step"
EVENT_RUN = "flux_numba.run"
WRAPPER_KEY = "flux_numba_step_timer"

CATEGORIES = ("attention", "gemm", "fused", "other")

_sender: Optional[Callable[[str, dict], Any]] = None


# ---------------------------------------------------------------------------------------------- sending
def set_sender(fn: Optional[Callable[[str, dict], Any]]):
    """Route messages to ``fn(event, data)`` instead of ComfyUI's PromptServer; None restores the server.

    Returns the previous sender so tests can restore it."""
    global _sender
    prev, _sender = _sender, fn
    return prev


def _server_send(event: str, data: dict):
    from .host import ui
    ui.send_event(event, data)


def send(event: str, data: dict):
    fn = _sender or _server_send
    try:
        fn(event, data)
    except Exception as e:  # never let the UI channel break sampling
        log.debug("[flux_numba] timer: sending %s failed: %s", event, e)


def jsonable(obj, depth: int = 0):
    """A JSON-safe copy of ``obj`` (patch descriptions may hold tensors, enums, callables)."""
    if depth > 6:
        return str(obj)
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if obj == obj and abs(obj) != float("inf") else None
    if isinstance(obj, dict):
        return {str(k): jsonable(v, depth + 1) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set)):
        return [jsonable(v, depth + 1) for v in obj]
    if hasattr(obj, "shape") and hasattr(obj, "dtype"):
        return f"<tensor {tuple(obj.shape)} {obj.dtype}>"
    try:
        json.dumps(obj)
        return obj
    except Exception:
        return str(obj)


# ---------------------------------------------------------------------------------------------- profiling
def _fused_names():
    try:
        from ..cuda_kernels.registry import registry
        return tuple(n for n in registry.ops if n != "attention")
    except Exception:
        return ()


def is_numba_kernel(name: str) -> bool:
    from ..flux_core.harness import is_pack_kernel
    return is_pack_kernel(name)


def classify(name: str, fused_names=()) -> str:
    """attention / gemm / fused (the pack's kernels) / other (``flux_core.harness.kernel_category``)."""
    from ..flux_core.harness import kernel_category
    return kernel_category(name, fused_names)


def split_from_profiler(prof, on_cuda: bool, wall_ms: float) -> dict:
    """Per-category self time (ms) of one profiled step: device kernels on CUDA, aten ops on CPU."""
    fused = _fused_names()
    cats = {c: 0.0 for c in CATEGORIES}
    numba_ms = 0.0
    top: Dict[str, float] = {}
    for ev in prof.key_averages():
        dev = str(getattr(ev, "device_type", "")).upper()
        if on_cuda:
            if "CUDA" not in dev:
                continue
            us = getattr(ev, "self_device_time_total", None)
            if us is None:
                us = getattr(ev, "self_cuda_time_total", 0.0)
        else:
            if "CPU" not in dev:
                continue
            us = getattr(ev, "self_cpu_time_total", 0.0)
        ms = float(us or 0.0) / 1000.0
        if ms <= 0:
            continue
        cats[classify(ev.key, fused)] += ms
        if is_numba_kernel(ev.key):
            numba_ms += ms
        top[ev.key] = top.get(ev.key, 0.0) + ms
    tracked = sum(cats.values())
    busy = (100.0 * tracked / wall_ms) if on_cuda and wall_ms > 0 else None
    return {"source": "cuda kernels" if on_cuda else "cpu ops (self time)", "wall_ms": wall_ms,
            "gpu_busy_pct": busy,
            "ms": cats, "numba_ms": numba_ms, "untracked_ms": max(0.0, wall_ms - tracked) if not on_cuda else None,
            "top": sorted(([k[:80], v] for k, v in top.items()), key=lambda kv: -kv[1])[:8]}


# ---------------------------------------------------------------------------------------------- timing
_GRAPH_KEYS = ("replay", "capture", "eager", "eager_not_resident", "eager_no_headroom", "failed")


def _pack_stats(patch):
    """The pack's live counters of this model's FluxNumbaPatch (nodes.patch.stats), or None."""
    if not isinstance(patch, dict) or not patch.get("active") or patch.get("id") is None:
        return None
    try:
        from .runner import stats
        return stats(patch["id"])
    except Exception:
        return None


def _graph_snapshot(st):
    if not st:
        return None
    bg = st.get("block_graphs") or {}
    return {"whole_replays": st.get("whole_replays", 0), "whole_eager": st.get("whole_eager", 0),
            "fallbacks": st.get("fallbacks", 0), "misses": dict(st.get("block_graph_misses") or {}),
            **{k: bg.get(k, 0) for k in _GRAPH_KEYS}}


def graph_step(before, after, st) -> Optional[dict]:
    """This step's CUDA-graph state from the pack's counters before / after it: ``state`` all (the
    whole step, or every block, replayed) / some / none, ``blocks`` replayed of called, ``why`` for
    the blocks that did not replay."""
    if before is None or after is None:
        return None
    d = {k: after[k] - before[k] for k in after if k != "misses"}
    if d["whole_replays"] > 0:
        return {"state": "all", "mode": "whole step", "why": None}
    replayed = d["replay"] + d["capture"]
    eager = d["eager"] + d["eager_not_resident"] + d["eager_no_headroom"] + d["failed"]
    why = None
    if d["eager_not_resident"]:
        new = {k: v - before["misses"].get(k, 0) for k, v in after["misses"].items()}
        why = max(new, key=new.get) if new and max(new.values()) > 0 else "weights not resident"
    elif d["eager_no_headroom"]:
        why = "no capture under memory pressure (the log says why)"
    elif d["failed"]:
        why = "a capture failed (the log says why)"
    elif d["eager"]:
        why = "warming up (first call of a block, or its weights changed)"
    if replayed + eager == 0:
        why = st.get("whole_why") or "CUDA graphs off (cuda_graph off)"
        return {"state": "none", "mode": "eager", "blocks": [0, 0], "why": why}
    state = "all" if eager == 0 else "some" if replayed else "none"
    return {"state": state, "mode": "blocks", "blocks": [replayed, replayed + eager], "why": why}


def _usage_snapshot():
    try:
        from ..cuda_kernels.registry import registry
        return dict(registry.usage)
    except Exception:
        return {}


def _usage_diff(before: dict, after: dict) -> Dict[str, Dict[str, int]]:
    out: Dict[str, Dict[str, int]] = {}
    for (op, b), n in after.items():
        d = n - before.get((op, b), 0)
        if d < 0:  # someone reset the counter mid-step: count what we saw after the reset
            d = n
        if d > 0:
            out.setdefault(op, {})[b] = d
    return out


def _step_info(x, t, transformer_options):
    sigma = None
    try:
        sigma = float(t.flatten()[0])
    except Exception:
        pass
    step = None
    sig = (transformer_options or {}).get("sample_sigmas")
    if sig is not None and sigma is not None:
        try:
            import torch
            d = (sig.float().cpu() - sigma).abs()
            i = int(torch.argmin(d))
            if float(d[i]) <= 1e-4 * max(1.0, abs(sigma)):
                step = i
        except Exception:
            pass
    return sigma, step


class StepTimer:
    """The wrappers one timer node attaches to its model clone (one instance per node execution)."""

    def __init__(self, node_id, label: str, profile_split: bool = False, patch=None):
        self.node_id = None if node_id is None else str(node_id)
        self.label = label
        self.profile_split = bool(profile_split)
        self.patch = patch
        self.run: Optional[Run] = None
        self._pending: List[tuple] = []  # (record, start_event, end_event) awaiting the GPU
        self._profiled = False
        self._fallbacks0 = None

    # -- run lifetime ---------------------------------------------------------------------------
    def begin(self, total_steps=None, device="cpu", patch=None):
        if self.run is not None and not self.run.done:
            self.end()
        self.run = Run(self.node_id, self.label, jsonable(patch if patch is not None else self.patch), device,
                       total_steps)
        self._profiled = False
        st = _pack_stats(self.run.patch)
        self._fallbacks0 = st.get("fallbacks", 0) if st is not None else None
        _store(self.run)
        send(EVENT_RUN, {"phase": "start", "node": self.node_id, "run": self.run.id, "label": self.label,
                         "total_steps": total_steps, "device": device, "patch": self.run.patch,
                         "model": model_state(self.run.patch)})
        return self.run

    def end(self, error: Optional[str] = None):
        run = self.run
        if run is None or run.done:
            return
        try:
            self._flush(block=True)
        except Exception as e:  # a failed run may have left the device in an error state
            error = error or f"{type(e).__name__}: {e}"
            self._pending.clear()
        run.ended = time.time()
        run.error = error
        st = _pack_stats(run.patch)
        if st is not None and self._fallbacks0 is not None:
            run.fallbacks = max(0, st.get("fallbacks", 0) - self._fallbacks0)
        d = run.to_dict()
        send(EVENT_RUN, {"phase": "end", "node": self.node_id, "run": run.id, "label": self.label,
                         "summary": d["summary"], "backends": d["backends"], "profile": run.profile,
                         "patch": run.patch, "error": error, "model": d["model"], "graphs": d["graphs"]})

    # -- records --------------------------------------------------------------------------------
    def _emit(self, rec: dict):
        run = self.run
        with _lock:
            rec["index"] = len(run.steps)
            run.steps.append(rec)
        msg = {"node": self.node_id, "run": run.id, "label": self.label, "total_steps": run.total_steps,
               "device": run.device, "summary": run.summary()}
        msg.update(rec)
        send(EVENT_STEP, msg)

    def _flush(self, block=False):
        while self._pending:
            rec, ev0, ev1 = self._pending[0]
            if not block and not ev1.query():
                return
            ev1.synchronize()
            rec["ms"] = float(ev0.elapsed_time(ev1))
            # host-bound: the GPU's span of the step is no longer than the host's time to issue it, so
            # the GPU waited for the host (a GPU-bound step's span is longer: the host ran ahead)
            rec["host_bound"] = rec.get("host_ms") is not None and rec["host_ms"] >= 0.9 * rec["ms"]
            self._pending.pop(0)
            self._emit(rec)

    # -- wrappers -------------------------------------------------------------------------------
    def outer_sample_wrapper(self, executor, *args, **kwargs):
        from .host import guider_device, guider_transformer_options, sampler_sigmas
        sigmas = sampler_sigmas(args, kwargs)
        total = None
        try:
            total = int(sigmas.shape[-1]) - 1
        except Exception:
            pass
        self.begin(total, guider_device(executor), guider_transformer_options(executor).get("flux_numba"))
        try:
            out = executor(*args, **kwargs)
        except BaseException as e:
            self.end(error=f"{type(e).__name__}: {str(e)[:300]}")
            raise
        self.end()
        return out

    def apply_model_wrapper(self, executor, x, t, c_concat=None, c_crossattn=None, control=None,
                            transformer_options={}, **kwargs):
        to = transformer_options or {}
        on_cuda = bool(getattr(x, "is_cuda", False))
        if self.run is None or self.run.done:  # sampler that bypasses OUTER_SAMPLE: open a run lazily
            sig = to.get("sample_sigmas")
            self.begin(int(sig.shape[-1]) - 1 if sig is not None else None,
                       str(getattr(x, "device", "cpu")), to.get("flux_numba", self.patch))
        elif self.run.patch is None and to.get("flux_numba") is not None:
            self.run.patch = jsonable(to.get("flux_numba"))
        if on_cuda:
            self._flush(block=False)
        sigma, step = _step_info(x, t, to)
        idx = len(self.run.steps) + len(self._pending)
        rec = {"step": step if step is not None else idx, "ms": None, "sigma": sigma,
               "batch": int(x.shape[0]) if hasattr(x, "shape") else None,
               "cond_or_uncond": jsonable(to.get("cond_or_uncond"))}
        total = self.run.total_steps or 0
        profile_now = self.profile_split and not self._profiled and (idx == min(1, max(total - 1, 0)))
        call = lambda: executor(x, t, c_concat, c_crossattn, control, transformer_options, **kwargs)

        before = _usage_snapshot()
        st = _pack_stats(self.run.patch)
        g0 = _graph_snapshot(st)
        if profile_now:
            out = self._profiled_call(call, x, on_cuda, rec)
        elif on_cuda:
            import torch
            stream = torch.cuda.current_stream(x.device)
            ev0 = torch.cuda.Event(enable_timing=True)
            ev1 = torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            ev0.record(stream)
            out = call()
            ev1.record(stream)
            rec["host_ms"] = (time.perf_counter() - t0) * 1000.0
            rec["backends"] = _usage_diff(before, _usage_snapshot())
            rec["graphs"] = graph_step(g0, _graph_snapshot(st), st)
            self._pending.append((rec, ev0, ev1))
            return out
        else:
            t0 = time.perf_counter()
            out = call()
            rec["ms"] = (time.perf_counter() - t0) * 1000.0
        rec["backends"] = _usage_diff(before, _usage_snapshot())
        # CUDA graphs exist only on CUDA: a step on the CPU has no graph state (not "none")
        rec["graphs"] = graph_step(g0, _graph_snapshot(st), st) if on_cuda else None
        self._emit(rec)
        return out

    def _profiled_call(self, call, x, on_cuda, rec):
        import torch
        from torch.profiler import ProfilerActivity, profile
        self._flush(block=True)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
        with profile(activities=acts) as prof:
            if on_cuda:
                torch.cuda.synchronize(x.device)
            t0 = time.perf_counter()
            out = call()
            if on_cuda:
                torch.cuda.synchronize(x.device)
            wall = (time.perf_counter() - t0) * 1000.0
        self._profiled = True
        rec["ms"] = wall
        rec["profiled"] = True
        try:
            split = split_from_profiler(prof, on_cuda, wall)
        except Exception as e:
            split = {"error": f"{type(e).__name__}: {e}"}
        split["step"] = rec["step"]
        rec["profile"] = split
        self.run.profile = split
        return out


# ---------------------------------------------------------------------------------------------- node
