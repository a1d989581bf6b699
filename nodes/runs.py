"""The timed runs of FluxNumbaStepTimer kept in memory (the newest ``MAX_RUNS``), their summaries, and
the report's selection of them (``select_runs``: 'last', 'all', a label, 'run:<id>', 'node:<id>').
``timing`` records into them; the report nodes read them."""
from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict
from typing import Dict, List, Optional

MAX_RUNS = 64  # runs kept in memory (oldest dropped)

_lock = threading.RLock()
_runs: "OrderedDict[int, Run]" = OrderedDict()
_ids = itertools.count(1)


def summarize(ms: List[float]) -> Dict[str, Optional[float]]:
    """mean/min/max/total ms and it/s (1000 / mean) of a list of step times."""
    if not ms:
        return {"steps": 0, "mean_ms": None, "min_ms": None, "max_ms": None, "total_ms": 0.0, "its": None}
    tot = float(sum(ms))
    mean = tot / len(ms)
    return {"steps": len(ms), "mean_ms": mean, "min_ms": float(min(ms)), "max_ms": float(max(ms)),
            "total_ms": tot, "its": (1000.0 / mean) if mean > 0 else None}


def merge_backends(records) -> Dict[str, Dict[str, int]]:
    out: Dict[str, Dict[str, int]] = {}
    for r in records:
        for op, per in (r.get("backends") or {}).items():
            d = out.setdefault(op, {})
            for b, n in per.items():
                d[b] = d.get(b, 0) + int(n)
    return out


class Run:
    def __init__(self, node_id, label, patch=None, device="cpu", total_steps=None):
        self.id = next(_ids)
        self.node_id = None if node_id is None else str(node_id)
        self.label = label
        self.patch = patch
        self.device = device
        self.total_steps = total_steps
        self.started = time.time()
        self.ended: Optional[float] = None
        self.steps: List[dict] = []
        self.profile: Optional[dict] = None
        self.error: Optional[str] = None  # the sampler raised (the run ended without its steps)
        self.fallbacks = 0  # blocks that ran ComfyUI's original block during this run (the pack's counters)

    @property
    def done(self):
        return self.ended is not None

    def timed_ms(self) -> List[float]:
        """Step times used for the summary: profiled steps are left out when others exist."""
        plain = [r["ms"] for r in self.steps if not r.get("profiled")]
        return plain if plain else [r["ms"] for r in self.steps]

    def summary(self):
        s = summarize(self.timed_ms())
        s["recorded_steps"] = len(self.steps)
        return s

    def to_dict(self) -> dict:
        backends = merge_backends(self.steps)
        # which ops ran is known only from finished steps: a run that failed (or is still) before its
        # first step is not "partly patched: no op of the pack ran"
        known = backends if self.steps else None
        return {"run": self.id, "node": self.node_id, "label": self.label, "patch": self.patch,
                "device": self.device, "total_steps": self.total_steps, "started": self.started,
                "ended": self.ended, "done": self.done, "steps": [dict(r) for r in self.steps],
                "summary": self.summary(), "backends": backends, "profile": self.profile, "error": self.error,
                "model": model_state(self.patch, known, self.fallbacks), "graphs": graphs_summary(self.steps)}


def model_state(patch, backends=None, fallbacks=0) -> dict:
    """What ran the run's steps: ``state`` "stock" (no FluxNumbaPatch before the timer), "not patched"
    (the patch passed the model through: ``why``), "patched", or "partly patched" (some block calls ran
    ComfyUI's original block, or no pack op ran at all).  Only "patched" runs get a speed-up line."""
    if not isinstance(patch, dict):
        return {"state": "stock", "why": "no FluxNumbaPatch before this timer"}
    if not patch.get("active"):
        return {"state": "not patched", "why": patch.get("reason") or "FluxNumbaPatch passed the model through"}
    if fallbacks:
        return {"state": "partly patched", "why": f"{fallbacks} block calls ran ComfyUI's original block (see the log)"}
    if backends is not None and not backends:  # (None: not known yet, at the start of a run)
        return {"state": "partly patched", "why": "no op of the pack ran during this run"}
    return {"state": "patched", "why": None}


def graphs_summary(steps) -> dict:
    """How many steps replayed CUDA graphs for all / some / none of their blocks."""
    out = {"all": 0, "some": 0, "none": 0, "host_bound": 0}
    for r in steps:
        g = r.get("graphs")
        if g:
            out[g["state"]] = out.get(g["state"], 0) + 1
        if r.get("host_bound"):
            out["host_bound"] += 1
    return out


def _store(run: Run):
    with _lock:
        _runs[run.id] = run
        while len(_runs) > MAX_RUNS:
            _runs.popitem(last=False)


def get_runs() -> List[dict]:
    """All kept runs, oldest first, as plain dicts."""
    with _lock:
        return [r.to_dict() for r in _runs.values()]


def get_run(run_id: int) -> Optional[dict]:
    with _lock:
        r = _runs.get(int(run_id))
        return r.to_dict() if r else None


def last_run(node_id=None, label: Optional[str] = None) -> Optional[dict]:
    """The newest run, optionally of one timer node (its UNIQUE_ID) and/or one label."""
    with _lock:
        for r in reversed(_runs.values()):
            if node_id is not None and r.node_id != str(node_id):
                continue
            if label is not None and r.label != label:
                continue
            return r.to_dict()
    return None


def clear_runs():
    with _lock:
        _runs.clear()


class SelectionError(ValueError):
    """A report selection string that cannot be read (e.g. ``run:abc``)."""


SELECTION_HELP = "'last', 'all', a label, 'run:<id>' or 'node:<id>', several comma-separated"


def select_runs(selection: str = "last") -> List[dict]:
    """Runs chosen by a report selection string.

    ``last``: the newest run of every label (so a stock-vs-patched workflow shows both);
    ``all``: every kept run; ``run:<id>``; ``node:<id>``: newest run of that timer node (``node:``
    without an id: ``last``); anything else: the newest run with that label.  Several selections may
    be comma-separated.  Raises SelectionError for a string that cannot be read (``run:`` without a
    number...)."""
    if selection is not None and not isinstance(selection, str):
        raise SelectionError(f"must be text ({SELECTION_HELP}), got {type(selection).__name__} {selection!r}")
    sel = (selection or "last").strip()
    out: List[dict] = []
    seen = set()

    def add(r):
        if r and r["run"] not in seen:
            seen.add(r["run"])
            out.append(r)

    for part in [p.strip() for p in sel.split(",") if p.strip()] or ["last"]:
        low = part.lower()
        if low.startswith("node:") and not part[5:].strip():
            low = "last"  # 'node:' without an id: the default selection
        if low == "last":
            with _lock:
                newest: "OrderedDict[str, Run]" = OrderedDict()
                for r in _runs.values():
                    newest.pop(r.label, None)
                    newest[r.label] = r
                items = [r.to_dict() for r in newest.values()]
            for d in items:
                add(d)
        elif low == "all":
            for d in get_runs():
                add(d)
        elif low.startswith("run:"):
            rid = part[4:].strip()
            if not rid.isdigit():
                raise SelectionError(f"{part!r}: run:<id> takes a run number (the 'run' column of the table), "
                                     f"e.g. run:3, got {rid!r}")
            add(get_run(int(rid)))
        elif low.startswith("node:"):
            add(last_run(node_id=part[5:].strip()))
        else:
            add(last_run(label=part))
    out.sort(key=lambda d: d["run"])
    return out
