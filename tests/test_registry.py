"""Registry dispatch: forcing, fallback with a logged reason, strict mode, usage counts."""
import logging

import pytest
import torch

from flux_numba_pack.cuda_kernels.registry import OpRegistry


def make():
    r = OpRegistry()
    r.register("double", lambda x: x * 2)
    r.register_backend("double", "fast", lambda x: x + x + 0 * x, check=lambda x: None if x.dtype == torch.float32 else "fp32 only")
    r.register_backend("double", "broken", lambda x: x, check=lambda x: "never available", priority=20)
    return r


def test_auto_picks_highest_priority_that_accepts():
    r = make()
    x = torch.ones(3)
    assert torch.equal(r.call("double", x), 2 * x)
    assert r.last["double"] == "fast"
    assert r.last["double"] == r.choose("double", x).name
    r.call("double", x.half())
    assert r.last["double"] == "torch"


def test_force_and_fallback_logged(caplog):
    r = make()
    with caplog.at_level(logging.INFO, logger="flux_numba"):
        with r.force("torch"):
            r.call("double", torch.ones(2))
            assert r.last["double"] == "torch"
        with r.force(double="fast"):
            r.call("double", torch.ones(2, dtype=torch.float64))
            assert r.last["double"] == "torch"
    assert any("fp32 only" in m for m in caplog.messages)
    assert r.fallbacks[("double", "fast", "fp32 only")] == 1


def test_strict_raises_and_nested_force():
    r = make()
    r.strict = True
    with r.force("fast"):
        with pytest.raises(RuntimeError, match="fp32 only"):
            r.call("double", torch.ones(2, dtype=torch.float64))
        with r.force(double="torch"):
            r.call("double", torch.ones(2))
            assert r.last["double"] == "torch"
        r.call("double", torch.ones(2))
        assert r.last["double"] == "fast"


def test_unknown_backend_and_usage():
    r = make()
    with r.force("nope"):
        r.call("double", torch.ones(1))
    assert r.last["double"] == "torch"
    r.call("double", torch.ones(1))
    assert r.take_usage() == {"double": {"torch": 1, "fast": 1}}
    assert r.take_usage() == {}
    with pytest.raises(KeyError):
        r.register_backend("missing", "x", lambda: 0)


def test_check_that_raises_is_a_reason_not_a_crash():
    r = OpRegistry()
    r.register("op", lambda x: x)
    r.register_backend("op", "bad", lambda x: x, check=lambda x: 1 / 0)
    r.call("op", 1)
    assert r.last["op"] == "torch"


def test_pack_registers_every_flux_op():
    from flux_numba_pack.cuda_kernels import registry
    for op in ("ln_modulate", "gated_residual", "gated_residual_ln_modulate", "qk_norm_rope", "gelu_tanh", "attention"):
        assert op in registry.ops and "torch" in registry.backends(op)


def test_opt_in_backend_runs_only_when_forced():
    r = OpRegistry()
    r.register("op", lambda x: ("ref", x))
    r.register_backend("op", "slow", lambda x: ("slow", x), priority=50, auto=False)
    assert r.call("op", 1)[0] == "ref"
    with r.force("slow"):
        assert r.call("op", 1)[0] == "slow"
    from flux_numba_pack.cuda_kernels import registry
    # the pack's attention kernels are opt-in; auto only times SDPA's two backend orders
    auto = {n for n, b in registry.ops["attention"].backends.items() if b.auto and n != "torch"}
    assert auto == {"cudnn"}


def test_autotune_trials_never_write_the_callers_out(monkeypatch):
    """``out=`` may alias an input (GELU in place over linear1's output in the single block):
    autotune's trial calls must write a private stand-in, or the input would be transformed
    once per trial before the real call.  (The timing itself needs CUDA: faked here.)"""
    class Ev:
        def __init__(self, **kw):
            pass

        def record(self):
            pass

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return 1.0
    monkeypatch.setattr(torch.cuda, "Event", Ev)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda n: None)
    r = OpRegistry()

    def inc(x, out=None):
        out = x.clone() if out is None else out
        out.copy_(x + 1)
        return out
    op = r.register("inc", inc)
    x = torch.zeros(4)
    assert r._time(op, op.backends["torch"], (x,), {"out": x}) == pytest.approx(0.1)
    assert torch.equal(x, torch.zeros(4))  # untouched by the 11 trial calls
    assert torch.equal(r.call("inc", x, out=x), torch.ones(4))


def test_tensor_version_without_raising():
    """runtime.tensor_version: the counter of a normal tensor, None for an inference-mode tensor --
    found by asking is_inference() first (asking ``_version`` there raises, ~40 us per block call)."""
    import torch
    from flux_numba_pack.cuda_kernels import runtime
    t = torch.zeros(3)
    v = runtime.tensor_version(t)
    t.add_(1)
    assert runtime.tensor_version(t) == v + 1
    with torch.inference_mode():
        u = torch.zeros(3)
    assert runtime.tensor_version(u) is None


def test_shape_key_is_hashable_and_tells_layouts_apart():
    import torch
    from flux_numba_pack.cuda_kernels.registry import OpRegistry
    x = torch.zeros(2, 4, 6)
    a = OpRegistry.shape_key((x, [x, 1e-6]), {"out": None})
    assert a == OpRegistry.shape_key((torch.ones(2, 4, 6), [x, 1e-6]), {"out": None}) and hash(a) == hash(a)
    assert a != OpRegistry.shape_key((x.transpose(1, 2).contiguous().transpose(1, 2), [x, 1e-6]), {"out": None})
    assert a != OpRegistry.shape_key((x.double(), [x, 1e-6]), {"out": None})


def _mark(out):  # a module-level kernel body: the simulator swaps this module's global ``cuda`` per thread
    if cuda.threadIdx.x == 0:
        out[cuda.blockIdx.x] = cuda.blockIdx.x + 1


def test_launcher_grids_do_not_leak_between_launches():
    """One Launcher launched with grids 3, 1, 3: each launch runs its own grid (in the simulator
    ``kernel[grid, block]`` returns the kernel object itself, so a reused cached configuration
    would run the latest grid)."""
    from flux_numba_pack.cuda_kernels import launching
    if not launching.NUMBA_OK or not launching.SIMULATOR:
        pytest.skip("simulator launcher behaviour")
    global cuda
    from numba import cuda
    la = launching.Launcher(lambda: cuda.jit(_mark))
    for n in (3, 1, 3):
        out = torch.zeros(4, dtype=torch.int64)
        la((n,), (32,), out)
        assert out.tolist() == [i + 1 for i in range(n)] + [0] * (4 - n), (n, out.tolist())


def test_decisions_remembered_per_signature():
    """A repeated signature skips the checks; a new shape, dtype or layout, a new backend, a new
    policy and an argument the key cannot describe are decided afresh; a forced fallback is
    counted on every call."""
    r = OpRegistry()
    r.register("double", lambda x, *rest, **kw: x * 2)
    calls = []

    def check(x, *rest, **kw):
        calls.append(tuple(x.shape))
        return None if x.dtype == torch.float32 else "fp32 only"
    r.register_backend("double", "fast", lambda x, *rest, **kw: x + x, check=check)
    x = torch.ones(3)
    for _ in range(3):
        assert torch.equal(r.call("double", x, 1e-6, out=None), 2 * x)
    assert calls == [(3,)] and r.last["double"] == "fast" and r.usage[("double", "fast")] == 3
    r.call("double", torch.ones(4))
    r.call("double", torch.ones(4, 2).t())  # same numel, other layout
    r.call("double", torch.ones(4).double())
    assert calls == [(3,), (4,), (2, 4), (4,)] and r.last["double"] == "torch"
    r.call("double", x, object())  # opaque argument: never remembered
    r.call("double", x, object())
    assert len(calls) == 6
    r.register_backend("double", "other", lambda x, *rest, **kw: x * 2, check=lambda x, *a, **k: "no", priority=-5)
    r.call("double", x)
    assert len(calls) == 7
    r.set_policy({"double": "fast"})
    r.call("double", x)
    assert len(calls) == 8
    r.set_policy({})
    from flux_numba_pack.cuda_kernels.registry import Backend
    old = r.ops["double"].backends["fast"]
    r.ops["double"].backends["fast"] = Backend("fast", lambda x, *a, **k: x * 3, check=check)  # as monkeypatch.setitem
    assert torch.equal(r.call("double", x), 3 * x) and len(calls) == 9
    r.ops["double"].backends["fast"] = old
    r.set_policy({"double": "fast"})
    y = torch.ones(3, dtype=torch.float64)
    for _ in range(3):  # forced and unavailable: checked and counted every time
        r.call("double", y)
    assert r.fallbacks[("double", "fast", "fp32 only")] == 3 and len(calls) == 12


def test_every_op_has_its_typed_function():
    """cuda_kernels/ops.py has one function per registered op with its reference's parameters, and the
    FLUX / VAE code calls the ops through it (no op named by a string there)."""
    import inspect
    import os
    import re
    from flux_numba_pack.cuda_kernels import ops
    from flux_numba_pack.cuda_kernels.registry import registry as reg
    for name, op in reg.ops.items():
        if name.startswith("_"):
            continue  # throw-away ops of other tests
        fn = getattr(ops, name, None)
        assert callable(fn), f"cuda_kernels/ops.py has no function for op {name!r}"
        want = list(inspect.signature(op.reference).parameters)
        got = list(inspect.signature(fn).parameters)
        assert got == want, (name, got, want)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for sub in ("flux_core", "nodes"):
        for f in os.listdir(os.path.join(root, sub)):
            if f.endswith(".py"):
                src = open(os.path.join(root, sub, f)).read()
                assert not re.search(r'registry\.call\(\s*["\']', src), f"{sub}/{f} names an op by a string"


def test_pending_backend_runs_the_reference_until_built():
    """A backend whose kernels are still being built in the background is passed over (auto and
    forced), the decision is not remembered, nothing counts as a fallback; afterwards it is chosen."""
    r = make()
    r.autotune = False
    building = {"fast"}
    r.pending = lambda op, b: "being built" if b in building else None
    x = torch.ones(3)
    assert not r.settled()
    for _ in range(2):
        assert torch.equal(r.call("double", x), 2 * x) and r.last["double"] == "torch"
    with r.force(double="fast"):
        r.call("double", x)
        assert r.last["double"] == "torch"
    assert r.deferred[("double", "fast")] == 3 and not r.fallbacks
    building.clear()  # built: the next call takes it (no remembered choice in the way)
    r.call("double", x)
    assert r.last["double"] == "fast"
    r.pending = None
    assert r.settled()
    r.call("double", x)
    assert r.last["double"] == "fast"


def test_usage_of_calls_made_elsewhere():
    """The registry's API for calls it did not dispatch: ``count`` (a host's attention function),
    ``recorded`` (the calls inside a block, taken back out unless kept: a graph capture, also when it
    raises) and ``replayed`` (a recorded set counted again on each replay)."""
    from flux_numba_pack.cuda_kernels.registry import OpRegistry
    r = OpRegistry()
    r.register("op", lambda x: x + 1)
    r.count("attention", "comfy")
    assert r.usage[("attention", "comfy")] == 1 and r.last["attention"] == "comfy"
    with r.recorded() as rec:
        r.call("op", 1)
        r.call("op", 2)
    assert rec == {("op", "torch"): 2} and ("op", "torch") not in r.usage
    with pytest.raises(RuntimeError):
        with r.recorded() as rec2:
            r.call("op", 1)
            raise RuntimeError("capture failed")
    assert rec2 == {("op", "torch"): 1} and ("op", "torch") not in r.usage
    with r.recorded(keep=True) as kept:
        r.call("op", 1)
    assert kept == {("op", "torch"): 1} and r.usage[("op", "torch")] == 1
    r.replayed(rec)
    r.replayed(None)
    assert r.usage[("op", "torch")] == 3
