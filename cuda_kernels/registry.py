"""Op registry: one named op, a plain torch reference, and optional faster backends.

Modelled on comfy-kitchen's registry: every op has an eager torch ``reference`` that is
always correct and always available; other backends (``numba``) declare a ``check`` that
says *why* they cannot take a given call (device, dtype, shape, missing numba, ...).

Dispatch for a call, in order:
  1. a forced backend (``force(...)`` context / ``set_policy``) -- used by tests, A/B timing
     and the ComfyUI patch's "backend" option.  If it cannot run this call the registry logs
     the reason and falls back to the reference (or raises when ``strict``).
  2. ``auto``: the highest-priority backend whose check passes, unless a measurement for this
     shape says the reference is faster (``autotune``: each candidate is timed once per
     shape key with CUDA events; in-place args are cloned for the trial).
  3. the reference.

While a backend's kernels are still being built in the background (``pending``, set by
``prebuild``), the backend is passed over -- the call runs the next choice, usually the reference
-- and the decision is not remembered, so the first call after the build takes the backend.

Every decision is logged once per (op, backend, reason) at INFO, and counted in ``usage``
so the step timer can report what ran.  No ComfyUI imports here.

A decision is remembered per (op, requested backend, autotune on/off, shape key) -- shapes,
dtypes, devices, strides and plain values of every argument, which is all a check may look at --
so a call that repeats a signature (every block of every step) skips the checks and the key
building of the tuning table: dispatch is then a dict lookup.  Not remembered: a forced backend
that fell back (counted per call in ``fallbacks``), a choice made while a CUDA graph is captured
(no timing there), and calls with an argument the key cannot describe (any object but tensors,
numbers, strings, None and tuples/lists of them).  A policy change is a new requested backend, and
every change of an op's backends -- registering one, or a test replacing one -- a new
``_Backends.version``: both are in the key, so no decision outlives what it chose among.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Sequence

log = logging.getLogger("flux_numba")

REFERENCE = "torch"


@dataclass
class Backend:
    name: str
    fn: Callable
    check: Optional[Callable] = None  # (*args, **kw) -> None if OK, else reason string
    priority: int = 0
    auto: bool = True  # False: runs only when forced (auto neither compiles nor times it)


class _Backends(dict):
    """An op's backends by name; ``version`` changes with every change of the mapping, however it
    is made (``register_backend``, or a test's ``monkeypatch.setitem``), so remembered decisions
    keyed on it never outlive the backends they chose among."""
    version = 0

    def _bump(self):
        self.version += 1

    def __setitem__(self, k, v):
        super().__setitem__(k, v)
        self._bump()

    def __delitem__(self, k):
        super().__delitem__(k)
        self._bump()

    def pop(self, *a):
        r = super().pop(*a)
        self._bump()
        return r

    def popitem(self):
        r = super().popitem()
        self._bump()
        return r

    def update(self, *a, **kw):
        super().update(*a, **kw)
        self._bump()

    def setdefault(self, k, v=None):
        r = super().setdefault(k, v)
        self._bump()
        return r

    def clear(self):
        super().clear()
        self._bump()


@dataclass
class Op:
    name: str
    reference: Callable
    doc: str = ""
    mutates: Sequence[int] = ()  # positional args written in place (cloned when autotuning)
    backends: Dict[str, Backend] = field(default_factory=_Backends)

    def candidates(self):
        return sorted((b for b in self.backends.values() if b.name != REFERENCE and b.auto),
                      key=lambda b: -b.priority)


class OpRegistry:
    def __init__(self):
        self.ops: Dict[str, Op] = {}
        self._local = threading.local()
        self._policy: Dict[str, str] = {}  # op name or "*" -> backend name or "auto"
        self.strict = False
        self.autotune = True  # auto: measure candidates once per shape on CUDA (never slower than torch)
        self._tuned: Dict[tuple, str] = {}
        self._logged = set()
        self.usage: Counter = Counter()  # (op, backend) -> calls
        self.last: Dict[str, str] = {}  # op -> backend of the last call
        self.fallbacks: Counter = Counter()  # (op, backend, reason) -> times a forced/auto choice fell back
        self._choices: Dict[tuple, "Backend"] = {}  # remembered decisions (module docstring)
        # (op, backend) -> why that backend cannot run *yet* (its kernels are still being built in
        # the background), or None; set by cuda_kernels.prebuild while a build runs, else None
        self.pending: Optional[Callable[[str, str], Optional[str]]] = None
        self.deferred: Counter = Counter()  # (op, backend) -> calls that ran the reference meanwhile

    def settled(self) -> bool:
        """False while some backend's kernels are still being built (CUDA graphs then wait: a capture
        would freeze the stand-in reference into the graph)."""
        return self.pending is None

    def _not_yet(self, op_name: str, backend: str) -> Optional[str]:
        p = self.pending
        if p is None or backend == REFERENCE:
            return None
        try:
            return p(op_name, backend)
        except Exception:
            return None

    # ------------------------------------------------------------------ registration
    def register(self, name: str, reference: Callable, doc: str = "", mutates: Sequence[int] = ()) -> Op:
        if name in self.ops:
            op = self.ops[name]
            op.reference, op.doc, op.mutates = reference, doc or op.doc, tuple(mutates)
        else:
            op = self.ops[name] = Op(name, reference, doc, tuple(mutates))
        op.backends[REFERENCE] = Backend(REFERENCE, reference, None, -1000)
        return op

    def register_backend(self, op_name: str, backend: str, fn: Callable, check: Optional[Callable] = None,
                         priority: int = 10, auto: bool = True):
        """``auto=False``: an opt-in backend, used only when forced (e.g. one measured slower than the
        reference on every shape that matters, whose JIT would only cost first-use time)."""
        if op_name not in self.ops:
            raise KeyError(f"register the op {op_name!r} (with its torch reference) before a backend")
        self.ops[op_name].backends[backend] = Backend(backend, fn, check, priority, auto)

    def backends(self, op_name: str):
        return list(self.ops[op_name].backends)

    # ------------------------------------------------------------------ policy
    def _stack(self):
        s = getattr(self._local, "stack", None)
        if s is None:
            s = self._local.stack = []
        return s

    def set_policy(self, policy: Dict[str, str]):
        """Process-wide policy, e.g. {"*": "auto"} or {"attention": "torch"}."""
        self._policy = dict(policy)

    @contextlib.contextmanager
    def force(self, backend: str = None, ops: Optional[Sequence[str]] = None, **per_op: str):
        """Force ``backend`` for ``ops`` (all ops when None), or per op via keywords."""
        pol = {}
        if backend is not None:
            for o in (ops if ops is not None else ["*"]):
                pol[o] = backend
        pol.update(per_op)
        self._stack().append(pol)
        try:
            yield
        finally:
            self._stack().pop()

    def requested(self, op_name: str) -> str:
        for pol in reversed(self._stack()):
            if op_name in pol:
                return pol[op_name]
            if "*" in pol:
                return pol["*"]
        return self._policy.get(op_name, self._policy.get("*", "auto"))

    # ------------------------------------------------------------------ dispatch
    def _note(self, op, backend, why, level=logging.INFO):
        key = (op, backend, why)
        if key not in self._logged:
            self._logged.add(key)
            log.log(level, "[flux_numba] op %s -> %s (%s)", op, backend, why)

    @staticmethod
    def _check(b: Backend, args, kwargs) -> Optional[str]:
        if b.check is None:
            return None
        try:
            return b.check(*args, **kwargs)
        except Exception as e:  # a broken check must never crash the caller
            return f"check raised {type(e).__name__}: {e}"

    def choose(self, op_name: str, *args, **kwargs) -> Backend:
        want = self.requested(op_name)
        sk, opaque = self._describe(args, kwargs)
        key = None if opaque else (op_name, want, self.autotune, self.ops[op_name].backends.version, sk)
        if key is not None:
            b = self._choices.get(key)
            if b is not None:
                return b
        b, final = self._choose(op_name, want, args, kwargs, sk)
        if key is not None and final:
            if len(self._choices) > 8192:
                self._choices.clear()
            self._choices[key] = b
        return b

    def _choose(self, op_name, want, args, kwargs, sk):
        """(backend, final): final when the same signature would get the same backend again."""
        op = self.ops[op_name]
        if want not in ("auto", REFERENCE):
            b = op.backends.get(want)
            why = None if b is not None else f"backend {want!r} not registered for {op_name}"
            if b is not None:
                later = self._not_yet(op_name, want)
                if later is not None:  # runs the reference until the kernels are built (not remembered)
                    self.deferred[(op_name, want)] += 1
                    self._note(op_name, REFERENCE, f"{want} deferred: {later}")
                    return op.backends[REFERENCE], False
                why = self._check(b, args, kwargs)
            if why is None:
                self._note(op_name, want, "forced")
                return b, True
            if self.strict:
                raise RuntimeError(f"forced backend {want!r} cannot run {op_name}: {why}")
            self.fallbacks[(op_name, want, why)] += 1
            self._note(op_name, REFERENCE, f"forced {want} unavailable: {why}", logging.WARNING)
            return op.backends[REFERENCE], False
        if want == REFERENCE:
            self._note(op_name, REFERENCE, "forced")
            return op.backends[REFERENCE], True
        # auto
        ok, final = [], True
        for b in op.candidates():
            later = self._not_yet(op_name, b.name)
            if later is not None:  # not a candidate yet; the choice is made again once it is built
                self.deferred[(op_name, b.name)] += 1
                self._note(op_name, REFERENCE if not ok else ok[0].name, f"{b.name} deferred: {later}")
                final = False
                continue
            why = self._check(b, args, kwargs)
            if why is None:
                ok.append(b)
            else:
                self._note(op_name, REFERENCE if not ok else ok[0].name, f"{b.name} skipped: {why}")
        if not ok:
            return op.backends[REFERENCE], final
        if self.autotune:
            b, tuned_final = self._tuned_choice(op, ok + [op.backends[REFERENCE]], args, kwargs, sk)
            return b, tuned_final and final
        self._note(op_name, ok[0].name, "auto: highest priority backend that accepts these inputs")
        return ok[0], final

    def call(self, op_name: str, *args, **kwargs):
        b = self.choose(op_name, *args, **kwargs)
        self.usage[(op_name, b.name)] += 1
        self.last[op_name] = b.name
        return b.fn(*args, **kwargs)

    __call__ = call

    # ------------------------------------------------------------------ usage of calls made elsewhere
    def count(self, op_name: str, backend: str, n: int = 1):
        """Record ``n`` calls of ``op_name`` that ran ``backend`` outside ``call`` (a host's own
        attention function chosen for the op)."""
        self.usage[(op_name, backend)] += n
        self.last[op_name] = backend

    @contextlib.contextmanager
    def recorded(self, keep: bool = False):
        """The calls made inside, as a Counter {(op, backend): calls} filled on exit (also on an
        exception).  ``keep=False``: they are taken back out of ``usage`` (a CUDA graph capture whose
        replays count them, ``replayed``)."""
        before = self.usage.copy()
        rec = Counter()
        try:
            yield rec
        finally:
            diff = self.usage.copy()
            diff.subtract(before)
            rec.update(+diff)
            if not keep:
                self.usage.clear()
                self.usage.update(before)

    def replayed(self, usage):
        """Count a recorded set of calls again (a CUDA graph replay)."""
        if usage:
            self.usage.update(usage)

    # ------------------------------------------------------------------ autotune
    @staticmethod
    def shape_key(args, kwargs, strict=False):
        """Hashable description of a call's arguments: (shape, dtype, device, strides) per tensor,
        plain values as they are.  ``strict``: None when an argument is anything else (other
        objects are described by their type name only when not strict)."""
        key, opaque = OpRegistry._describe(args, kwargs)
        return None if (strict and opaque) else key

    @staticmethod
    def _describe(args, kwargs):
        """(``shape_key``, whether an argument is an object the key describes only by type/shape)."""
        import torch
        opaque = []

        def sig(a):  # hashable torch objects as they are: no string formatting on every call
            if isinstance(a, torch.Tensor):
                return (a.shape, a.dtype, a.device, a.stride())
            if isinstance(a, (int, float, str, bool, type(None))):
                return a
            if isinstance(a, (list, tuple)):
                return tuple(sig(x) for x in a)
            opaque.append(a)
            if hasattr(a, "shape") and hasattr(a, "dtype"):
                return (tuple(a.shape), str(a.dtype), str(getattr(a, "device", "")), tuple(a.stride()) if hasattr(a, "stride") else ())
            return type(a).__name__
        key = tuple(sig(a) for a in args) + tuple((k, sig(v)) for k, v in sorted(kwargs.items()))
        return key, bool(opaque)

    def _tuned_choice(self, op: Op, cands, args, kwargs, sk):
        """(backend, final) -- not final while a graph is captured (no timing there); ``sk``: the
        call's ``shape_key``."""
        key = (op.name, tuple(b.name for b in cands), sk)
        name = self._tuned.get(key)
        if name is None:
            import torch
            on_cuda = any(getattr(a, "is_cuda", False) for a in args)
            if not on_cuda:
                return cands[0], True
            if torch.cuda.is_current_stream_capturing():
                return cands[0], False
            times = {b.name: self._time(op, b, args, kwargs) for b in cands}
            name = min(times, key=times.get)
            self._tuned[key] = name
            self._note(op.name, name, "autotune: " + ", ".join(f"{k} {v*1e3:.1f}us" for k, v in times.items()))
        return op.backends[name], True

    @staticmethod
    def _time(op: Op, b: Backend, args, kwargs, reps: int = 10) -> float:
        """Device time per call (ms), host launch cost excluded.

        The calls are queued behind a ~2 ms GPU sleep, so the device runs them back to back while
        the host is still launching: the events then bracket device work only.  (Timing one call
        at a time between events counts the host's launch latency as device time -- a benchmark
        once picked torch over faster Numba kernels that way.)  With the forward replayed as
        a CUDA graph, host cost is gone, so device time is the right criterion."""
        import torch

        def fresh():
            return [a.clone() if i in op.mutates else a for i, a in enumerate(args)]
        # an ``out=`` tensor gets a private stand-in: the trials must not write the caller's
        # buffer, which may alias an input (GELU in place over linear1's output)
        out = kwargs.get("out")
        if isinstance(out, torch.Tensor):
            kwargs = dict(kwargs, out=torch.empty_like(out))
        try:
            b.fn(*fresh(), **kwargs)  # warm-up / JIT
            inputs = [fresh() for _ in range(reps)]
            torch.cuda.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(4_000_000)  # ~2 ms at 2 GHz: room to enqueue every rep
            s.record()
            for a in inputs:
                b.fn(*a, **kwargs)
            e.record()
            e.synchronize()
            return s.elapsed_time(e) / reps
        except Exception as ex:  # a failing candidate is simply not chosen
            log.warning("[flux_numba] autotune: %s/%s failed: %s", op.name, b.name, ex)
            return float("inf")

    # ------------------------------------------------------------------ reporting
    def take_usage(self) -> Dict[str, Dict[str, int]]:
        """Return and reset {op: {backend: calls}} since the last call."""
        out: Dict[str, Dict[str, int]] = {}
        for (o, b), n in self.usage.items():
            out.setdefault(o, {})[b] = n
        self.usage.clear()
        return out


registry = OpRegistry()
