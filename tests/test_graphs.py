"""Whole-forward CUDA graphs (flux_core/graphs.py) under both of torch's CUDA allocators.

ComfyUI runs on cudaMallocAsync by default; there an invalidated capture terminates the process,
so the capture must refuse a forward that syncs the host *before* the stream is invalidated.  Each
allocator runs in its own process (the backend is fixed at process start): a clean forward with a
Numba kernel replays equal to eager for new inputs; a forward that calls ``.item()`` raises a
Python error from the capture and the process goes on (eager still works); a forward that frees a
tensor allocated before the capture is captured (torch defers that free); the sync debug mode is
restored after each.  GPU only (FLUX_NUMBA_REAL_GPU=1).
"""
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU = os.environ.get("FLUX_NUMBA_REAL_GPU") == "1" and torch.cuda.is_available()

SCRIPT = r'''
import sys, torch
sys.path.insert(0, sys.argv[1])
import _pack
_pack.load()
from flux_numba_pack.flux_core.graphs import GraphedForward
from flux_numba_pack.cuda_kernels import registry
print("backend", torch.cuda.get_allocator_backend())
dev = "cuda"
w = torch.randn(256, 256, device=dev, dtype=torch.bfloat16) * 0.05

def clean(x):
    h = registry.call("gelu_tanh", x @ w)  # a Numba kernel between two GEMMs
    return h @ w + 1

x0 = torch.randn(64, 256, device=dev, dtype=torch.bfloat16)
gf = GraphedForward(clean)  # warmup=2: two eager calls, then capture + replay
for i in range(5):
    x = torch.randn(64, 256, device=dev, dtype=torch.bfloat16)
    got, want = gf(x), clean(x)
    err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
    assert err < 1e-2, err
    assert gf.captures == (1 if i >= 2 else 0), (i, gf.captures)
assert gf.captures == 1 and gf.replays == 3, (gf.captures, gf.replays)
print("clean ok", err)

def syncs(x):
    y = x @ w
    if y.abs().max().item() > 1e9:  # a host sync every call
        y = y * 0
    return y

gs = GraphedForward(syncs)
gs(x0)  # the first warm-up call is unchecked (JIT and autotune may sync)
try:
    gs(x0)
    raise SystemExit("a syncing forward passed the checked warm-up")
except RuntimeError as e:
    print("sync refused:", str(e).splitlines()[0][:100])
assert gs.captures == 0
assert not torch.cuda.is_current_stream_capturing()
y = syncs(x0)  # eager still fine
torch.cuda.synchronize()
print("eager after refusal ok")

held = [torch.randn(64, 256, device=dev, dtype=torch.bfloat16)]

def frees_old(x):
    old = held.pop() if held else None  # a tensor from before the capture, released inside it
    out = x @ w
    if old is not None:
        out = out + 0 * old
    held.append(out.detach())
    return out

gd = GraphedForward(frees_old)
x = torch.randn(64, 256, device=dev, dtype=torch.bfloat16)
for _ in range(3):
    got = gd(x)
assert gd.captures == 1
torch.cuda.synchronize()
want = x @ w
assert ((got.float() - want.float()).abs().max() / want.float().abs().max()).item() < 1e-2
print("deferred free ok")
assert torch.cuda.get_sync_debug_mode() == 0
print("ALL OK")
'''


@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU (FLUX_NUMBA_REAL_GPU=1)")
@pytest.mark.parametrize("backend", ["native", "cudaMallocAsync"])
def test_capture_under_allocator(backend):
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=f"backend:{backend}")
    r = subprocess.run([sys.executable, "-c", SCRIPT, ROOT], capture_output=True, text=True, timeout=300, env=env)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert f"backend {backend}" in out and "ALL OK" in out, out[-3000:]


def test_flux_graph_wrapper_interrupt_keeps_graphs(monkeypatch):
    """ComfyUI's cancel (InterruptProcessingException, raised inside any op) during a warm-up or
    capture propagates and leaves the CUDA graph on for the model's next steps; any other capture
    error turns it off for that model and the step runs eagerly.  (No GPU: the capture is faked.)"""
    import types
    import flux_numba_pack.flux_core.graphs as FG
    import flux_numba_pack.nodes.cuda_graph as CG
    import flux_numba_pack.nodes.host as H

    class InterruptProcessingException(Exception):
        pass

    raised = []

    class Fake:
        def __init__(self, fn, **kw):
            self.fn = fn

        def __call__(self, *xs, weights_key=None, can_capture=None):
            raise raised.pop(0)

    monkeypatch.setattr(CG, "capture_problem", lambda ex, topts: None)
    monkeypatch.setattr(H, "graph_state", lambda dm, dev: ([], ()))
    monkeypatch.setattr(FG, "GraphedForward", Fake)
    eager = []
    ex = types.SimpleNamespace(class_obj=object())
    ex_call = lambda *a, **k: eager.append(1) or "eager"   # noqa: E731
    executor = type("Ex", (), {"__call__": lambda self, *a, **k: ex_call(*a, **k), "class_obj": ex.class_obj})()
    x = types.SimpleNamespace(is_cuda=True, device="cuda:0")
    w = CG.GraphWrapper()
    raised.append(InterruptProcessingException("cancelled"))
    with pytest.raises(InterruptProcessingException):
        w(executor, x, None, None)
    assert w.failed is None and w.gf is not None and eager == []
    raised.append(RuntimeError("capture broke"))
    assert w(executor, x, None, None) == "eager"
    assert w.failed.startswith("capture failed (RuntimeError") and w.gf is None and eager == [1]


def test_graphed_forward_stays_eager_while_kernels_are_built(monkeypatch):
    """While the background build runs, every call is eager (no warm-up counted, no capture tried:
    a capture would freeze the torch stand-ins of the kernels); afterwards the warm-ups start."""
    from flux_numba_pack.cuda_kernels import registry
    from flux_numba_pack.flux_core.graphs import GraphedForward
    monkeypatch.setattr(registry, "pending", lambda op, b: "building")
    calls = []
    gf = GraphedForward(lambda x: calls.append(1) or x * 2, warmup=2)
    for _ in range(5):  # on this CPU a capture attempt would raise: none is made
        assert torch.equal(gf(torch.ones(3)), torch.full((3,), 2.0))
    assert len(calls) == 5 and not gf.graphs and not gf._seen and gf.captures == 0
    monkeypatch.setattr(registry, "pending", None)
    gf(torch.ones(3))
    assert sum(n for n, _ in gf._seen.values()) == 1  # the first warm-up with the kernels in place


def test_graphed_forward_puts_a_capture_off_while_there_is_no_room(monkeypatch):
    """``can_capture`` answering why not: the call after the warm-ups runs eagerly (its result used,
    nothing turned off, no capture attempted -- on this CPU one would raise); once it answers None
    the next call captures."""
    import contextlib
    import flux_numba_pack.flux_core.graphs as FG
    from flux_numba_pack.flux_core.graphs import GraphedForward
    monkeypatch.setattr(FG, "no_host_syncs", contextlib.nullcontext)   # (sync debug mode needs CUDA)
    gf = GraphedForward(lambda x: x * 2, warmup=2)
    room = ["no room (stand-in)"]
    for _ in range(4):
        assert torch.equal(gf(torch.ones(3), weights_key=("w",), can_capture=lambda: room[0]), torch.full((3,), 2.0))
    assert gf.captures == 0 and not gf.graphs and gf.deferred == "no room (stand-in)"
    captured = []
    monkeypatch.setattr(gf, "_capture", lambda xs, wk: captured.append(wk) or (_ for _ in ()).throw(RuntimeError("x")))
    room[0] = None
    with pytest.raises(RuntimeError):
        gf(torch.ones(3), weights_key=("w",), can_capture=lambda: room[0])
    assert captured == [("w",)]


def test_graphed_forward_captures_only_on_weights_that_stay_put(monkeypatch):
    """Weights found somewhere else on every call (DynamicVRAM re-staging a decoder per decode under
    memory pressure): the warm-ups start again at each move, so no capture is paid for a graph that
    would never be replayed; once the weights stay put for ``warmup`` calls the next one captures."""
    import contextlib
    import flux_numba_pack.flux_core.graphs as FG
    from flux_numba_pack.flux_core.graphs import GraphedForward
    monkeypatch.setattr(FG, "no_host_syncs", contextlib.nullcontext)   # (sync debug mode needs CUDA)
    gf = GraphedForward(lambda x: x * 2, warmup=2)
    captured = []
    monkeypatch.setattr(gf, "_capture", lambda xs, wk: captured.append(wk) or (_ for _ in ()).throw(RuntimeError("x")))
    for i in range(6):  # a new placement every call
        assert torch.equal(gf(torch.ones(3), weights_key=(i,)), torch.full((3,), 2.0))
    assert captured == [] and gf.captures == 0
    gf(torch.ones(3), weights_key=(5,))  # the 2nd call on one placement: its last warm-up
    assert captured == []
    with pytest.raises(RuntimeError):
        gf(torch.ones(3), weights_key=(5,))
    assert captured == [(5,)]
