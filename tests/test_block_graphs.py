"""Per-block graphs (flux_core/block_graphs.py): the state machine and the static buffers, on the CPU
with a recording stand-in for CUDA graphs (``Recorder``: a capture records the function, a replay
runs it again over the same static buffers -- what a CUDA graph does with fixed addresses).

A toy block updates ``img`` / ``txt`` in place from ``vec`` / ``pe`` like a FLUX block; every result
is compared with the same block run eagerly on fresh random inputs."""
import pytest
import torch

from flux_numba_pack.flux_core.block_graphs import BlockGraphs, allowed, is_allowed


class Graph:
    def __init__(self, fn):
        self.fn, self.replays = fn, 0

    def replay(self):
        self.replays += 1
        self.fn()


class Recorder:
    def __init__(self, fail=None):
        self.graphs, self.fail = [], fail

    def __call__(self, fn):
        if self.fail is not None:
            raise self.fail
        g = Graph(fn)
        self.graphs.append(g)
        return g


def toy(img, txt=None, vec=None, pe=None, mask=None, scale=1.0):
    img.mul_(0.5).add_(vec[:, None, :] * scale + pe.mean())
    if txt is not None:
        txt.add_(vec[:, None, :] * 2 * scale)
        return {"img": img, "txt": txt}
    return {"img": img}


def inputs(seed, L=6, C=8):
    g = torch.Generator().manual_seed(seed)
    return {"img": torch.randn(2, L, C, generator=g), "txt": torch.randn(2, 3, C, generator=g),
            "vec": torch.randn(2, C, generator=g), "pe": torch.randn(1, 1, L + 3, 2, 2, 2, generator=g), "mask": None}


def run(bg, key, weights, inp, scale=1.0):
    """One block call; returns (outputs, what a fresh eager run gives)."""
    want = toy(**{k: (v.clone() if v is not None else None) for k, v in inp.items()}, scale=scale)
    got = bg.call(key, "double", weights, inp, lambda **t: toy(**t, scale=scale),
                  lambda: toy(**inp, scale=scale), outputs=("img", "txt"))
    return got, want


def same(got, want):
    return all(torch.allclose(got[k], want[k], atol=1e-6) for k in want)


def test_capture_on_second_resident_call_then_replay_with_new_inputs():
    rec = Recorder()
    bg = BlockGraphs(rec)
    got, want = run(bg, "b0", "W", inputs(1))
    assert same(got, want) and bg.counts["eager"] == 1 and not rec.graphs      # first call: eager
    got, want = run(bg, "b0", "W", inputs(2))
    assert same(got, want) and bg.counts["capture"] == 1 and rec.graphs[0].replays == 1
    for seed in (3, 4, 5):                                                      # replays follow new inputs
        inp = inputs(seed)
        got, want = run(bg, "b0", "W", inp)
        assert same(got, want)
        assert got["img"] is not inp["img"]        # the stage's static buffer, the caller's tensor copied in
    assert bg.counts["replay"] == 3 and rec.graphs[0].replays == 4


def test_blocks_chain_on_the_stage_buffers_without_copies():
    rec = Recorder()
    bg = BlockGraphs(rec)
    for _ in range(2):  # warm both blocks up (eager, then capture)
        inp = inputs(7)
        o = run(bg, "b0", "W", inp)[0]
        run(bg, "b1", "W", dict(inp, img=o["img"], txt=o["txt"]))
    inp = inputs(8)
    ref = toy(**{k: (v.clone() if v is not None else None) for k, v in inp.items()})
    ref = toy(**dict({k: (v.clone() if v is not None else None) for k, v in inp.items()}, img=ref["img"], txt=ref["txt"]))
    o0 = bg.call("b0", "double", "W", inp, toy, lambda: None, outputs=("img", "txt"))
    bufs = next(iter(bg.buffers.values()))
    assert o0["img"] is bufs.t["img"]
    o1 = bg.call("b1", "double", "W", dict(inp, img=o0["img"], txt=o0["txt"]), toy, lambda: None,
                 outputs=("img", "txt"))
    assert o1["img"] is bufs.t["img"] and same(o1, ref)
    assert len(bg.buffers) == 1 and bg.counts["replay"] == 2


def test_miss_runs_eager_and_recaptures_once_resident_again():
    rec = Recorder()
    bg = BlockGraphs(rec)
    run(bg, "b0", "W1", inputs(1))
    run(bg, "b0", "W1", inputs(2))                       # captured under W1
    got, want = run(bg, "b0", None, inputs(3))           # not resident now: eager, graph kept
    assert same(got, want) and bg.counts["eager_not_resident"] == 1 and len(bg.entries) == 1
    got, want = run(bg, "b0", "W1", inputs(4))           # resident again, same weights: replay
    assert same(got, want) and bg.counts["replay"] == 1
    got, want = run(bg, "b0", "W2", inputs(5))           # weights moved: stale graph dropped, eager
    assert same(got, want) and not bg.entries and bg.counts["eager"] == 2
    got, want = run(bg, "b0", "W2", inputs(6))           # stable under W2: re-captured
    assert same(got, want) and bg.counts["capture"] == 2 and len(rec.graphs) == 2


def test_per_forward_inputs_copied_once_per_new_object():
    rec = Recorder()
    bg = BlockGraphs(rec)
    run(bg, "b0", "W", inputs(1))
    run(bg, "b0", "W", inputs(2))
    inp = inputs(3)
    run(bg, "b0", "W", inp)
    bufs = next(iter(bg.buffers.values()))
    assert bufs.src["vec"] is inp["vec"] and bufs.src["pe"] is inp["pe"]
    inp["vec"].add_(1.0)  # the same object again is not copied (a forward's vec is made once) ...
    run(bg, "b0", "W", dict(inp, img=torch.randn(2, 6, 8), txt=torch.randn(2, 3, 8)))
    new = inputs(4)
    got, want = run(bg, "b0", "W", new)  # ... a new object is
    assert same(got, want)


def test_failed_capture_runs_eager_for_good_and_interrupt_propagates():
    bg = BlockGraphs(Recorder(fail=RuntimeError("operation would make the legacy stream depend on a capturing blocking stream")))
    run(bg, "b0", "W", inputs(1))
    got, want = run(bg, "b0", "W", inputs(2))
    assert same(got, want) and bg.counts["failed"] == 1
    got, want = run(bg, "b0", "W", inputs(3))
    assert same(got, want) and bg.counts["failed"] == 1 and bg.counts["eager"] == 2

    class InterruptProcessingException(Exception):
        pass
    bg = BlockGraphs(Recorder(fail=InterruptProcessingException()))
    run(bg, "b0", "W", inputs(1))
    with pytest.raises(InterruptProcessingException):
        run(bg, "b0", "W", inputs(2))
    assert not bg.failed


def test_signatures_are_bounded_and_drop_frees_everything():
    rec = Recorder()
    bg = BlockGraphs(rec, max_signatures=2)
    for L in (6, 10, 14):
        for s in range(2):
            run(bg, "b0", "W", inputs(s, L=L))
    assert len(bg.entries) == 2 and len({k[1] for k in bg.buffers}) == 2
    got, want = run(bg, "b0", "W", inputs(9, L=14))
    assert same(got, want)
    bg.drop("test")
    assert not bg.entries and not bg.buffers and not bg.seen


def run_single(bg, key, weights, inp):
    inp = {k: v for k, v in inp.items() if k != "txt"}
    want = toy(**{k: (v.clone() if v is not None else None) for k, v in inp.items()})
    got = bg.call(key, "single", weights, inp, lambda **t: toy(**t), lambda: toy(**inp), outputs=("img",))
    return got, want


def test_signatures_are_bounded_per_stage_least_recently_replayed_first():
    """A prompt shape is one signature of each stage (double and single blocks): with room for 2 per
    stage, a workflow alternating two shapes (Redux's longer context, another resolution) keeps both
    shapes' graphs of both stages -- no re-capture per switch -- and a third shape evicts the least
    recently replayed one, not the first one made."""
    rec = Recorder()
    bg = BlockGraphs(rec, max_signatures=2)

    def forward(L, seed):
        for b in ("d0", "d1"):
            got, want = run(bg, b, "W", inputs(seed, L=L))
            assert same(got, want)
        for b in ("s0", "s1"):
            got, want = run_single(bg, b, "W", inputs(seed, L=L))
            assert same(got, want)
    for r in range(3):           # two shapes, alternating prompt by prompt
        forward(6, r)
        forward(10, r)
    assert bg.counts["capture"] == 8 and len(bg.entries) == 8
    forward(6, 7)                # shape 6 is now the most recently replayed
    n = bg.counts["capture"]
    for s in range(2):
        forward(14, 10 + s)      # a third shape: evicts shape 10 (least recent), not shape 6
    assert bg.counts["capture"] == n + 4 and len(bg.entries) == 8   # (first call eager, second captures)
    before = bg.counts["capture"]
    forward(6, 20)
    assert bg.counts["capture"] == before and bg.counts["replay"] > 0   # shape 6 still replays
    assert {k[0] for k in bg.buffers} == {"double", "single"} and len(bg.buffers) == 4


def test_allowed_is_scoped_per_thread():
    import threading
    assert not is_allowed()
    seen = []
    with allowed():
        with allowed():
            assert is_allowed()
        assert is_allowed()
        t = threading.Thread(target=lambda: seen.append(is_allowed()))
        t.start()
        t.join()
    assert not is_allowed() and seen == [False]


def test_no_capture_while_kernels_are_being_built(monkeypatch):
    """While the background build runs (registry not settled) blocks run eagerly and nothing is
    captured -- a capture would freeze the torch stand-ins; once settled: one eager call, then capture."""
    from flux_numba_pack.cuda_kernels import registry
    monkeypatch.setattr(registry, "pending", lambda op, b: "building")
    rec = Recorder()
    bg = BlockGraphs(rec)
    for seed in (1, 2, 3):
        got, want = run(bg, "b0", "W", inputs(seed))
        assert same(got, want)
    assert not rec.graphs and bg.counts["eager_kernels_building"] == 3
    monkeypatch.setattr(registry, "pending", None)
    got, want = run(bg, "b0", "W", inputs(4))
    assert same(got, want) and not rec.graphs and bg.counts["eager"] == 1
    got, want = run(bg, "b0", "W", inputs(5))
    assert same(got, want) and bg.counts["capture"] == 1
