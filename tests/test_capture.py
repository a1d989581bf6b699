"""flux_core/capture.py on the CPU: torch's graph / allocator bookkeeping emulated as the C++ code
does it (``FakeTorch``: a pool handle shared only while ``use_count > 0``, the cudaMallocAsync
process-wide "capture under way" flag set by ``capture_begin`` before the host allocator's assert
and cleared only by a successful end), so the failure the servers showed -- one reused pool handle,
then every capture in the process failing -- is reproduced here and its absence checked.

Also the per-block graph state machine (``BlockGraphs`` with the real ``CudaCapture`` over the
emulator): a LoRA change drops every block's graph and the re-capture uses a fresh handle; an
allocator assert turns capturing off for the process with one log line while captured graphs keep
replaying and the allocator stays usable for others; ``prepare`` reporting non-resident weights
puts a capture off."""
import gc
import logging

import pytest
import torch

from flux_numba_pack.flux_core import capture as cap
from flux_numba_pack.flux_core.block_graphs import BlockGraphs, CudaCapture


class FakeTorch:
    """torch.cuda's graph API as its allocators behave (CUDAGraph.cpp, CUDAMallocAsyncAllocator.cpp,
    CachingHostAllocator.h)."""

    def __init__(self, monkeypatch, fail_begin_at=None):
        self.underway = False      # cudaMallocAsync's process-wide capture flag
        self.pools = {}            # handle -> use_count (host allocator / native pools)
        self.next = 0
        self.begins = 0
        self.fail_begin_at = fail_begin_at
        self.fail_end = False
        self.gc_enabled_inside = []
        fake = self

        class Graph:
            def __init__(self):
                self.pool, self.ended, self.replays = None, False, 0

            def capture_begin(self, pool=None, capture_error_mode=None):
                fake.begins += 1
                if fake.underway:  # beginAllocateToPool: TORCH_INTERNAL_ASSERT(capture_free_streams.empty())
                    raise RuntimeError("capture_free_streams.empty() INTERNAL ASSERT FAILED at "
                                       "c10/cuda/CUDAMallocAsyncAllocator.cpp:804")
                fake.underway = True
                if fake.fail_begin_at == fake.begins:
                    raise RuntimeError("it->second->use_count > 0 INTERNAL ASSERT FAILED at "
                                       "ATen/core/CachingHostAllocator.h:773 (injected)")
                if pool in fake.pools:
                    if fake.pools[pool] <= 0:  # create_or_incref_pool: a live pool only
                        raise RuntimeError("it->second->use_count > 0 INTERNAL ASSERT FAILED at "
                                           "ATen/core/CachingHostAllocator.h:773")
                    fake.pools[pool] += 1
                else:
                    fake.pools[pool] = 1
                self.pool = pool
                fake.gc_enabled_inside.append(gc.isenabled())

            def capture_end(self):
                if fake.fail_end:  # cudaStreamEndCapture failed: torch never ends the allocators' recording
                    raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
                fake.underway = False
                self.ended = True

            def replay(self):
                self.replays += 1

            def reset(self):
                if self.ended:
                    fake.pools[self.pool] -= 1   # releasePool; the entry stays registered at 0
                    self.ended = False

        class Stream:
            def wait_stream(self, other):
                pass

        def end_allocate_to_pool(device, handle):
            if not fake.underway:
                raise RuntimeError("CudaMallocAsync::notifyCaptureAboutToEnd called, but capture_underway is false")
            fake.underway = False

        def handle():
            fake.next += 1
            return (0, fake.next)

        monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
        monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: Stream())
        monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: Stream())
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "stream", lambda s: _null())
        monkeypatch.setattr(torch.cuda, "graph_pool_handle", handle)
        monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
        monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda m: None)
        monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", end_allocate_to_pool, raising=False)
        self.Graph = Graph

    def comfy_capture_works(self):
        """Another user of torch's graphs (ComfyUI's own block graphs: a private pool) can capture."""
        g = self.Graph()
        g.capture_begin(pool=("comfy", self.next))
        g.capture_end()
        g.reset()
        return True


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


@pytest.fixture(autouse=True)
def _fresh_state():
    cap.reset_for_tests()
    yield
    cap.reset_for_tests()


def _capture(pool, fn=lambda: None):
    with cap.capturing(pool, torch.cuda.Stream()) as g:
        fn()
    return g


def test_reusing_a_dead_handle_is_what_breaks_the_process(monkeypatch):
    """The emulator reproduces the servers' failure: one capture on a handle whose graphs are all gone,
    then every later capture in the process fails (the pack's old handle-per-model behaviour)."""
    ft = FakeTorch(monkeypatch)
    handle = torch.cuda.graph_pool_handle()
    g = torch.cuda.CUDAGraph()
    g.capture_begin(pool=handle)
    g.capture_end()
    g.reset()                       # the last graph on the handle is dropped (a LoRA change) ...
    with pytest.raises(RuntimeError, match="use_count > 0"):
        torch.cuda.CUDAGraph().capture_begin(pool=handle)    # ... and the handle reused
    with pytest.raises(RuntimeError, match="capture_free_streams"):
        ft.comfy_capture_works()    # poisoned: nobody in the process can capture any more


def test_pool_handle_is_shared_while_graphs_live_and_fresh_after_the_last_release(monkeypatch):
    ft = FakeTorch(monkeypatch)
    pool = cap.GraphPool()
    a, b = _capture(pool), _capture(pool)
    assert a.pool == b.pool and pool.count() == 2       # shared while alive
    pool.release(a)
    c = _capture(pool)
    assert c.pool == a.pool                               # b still lives on it
    pool.release(b)
    pool.release(c)
    assert pool.count() == 0 and pool.current is None
    d = _capture(pool)                                    # the old handle is dead: a new one
    assert d.pool != a.pool and not ft.underway and ft.comfy_capture_works()


def test_failed_end_is_repaired_and_the_handle_retired(monkeypatch):
    """cudaStreamEndCapture failing (an invalidated capture) leaves torch's recording on: ended here,
    the handle retired, the garbage collector back on; the next capture and ComfyUI's work."""
    ft = FakeTorch(monkeypatch)
    pool = cap.GraphPool()
    keep = _capture(pool)
    ft.fail_end = True
    with pytest.raises(RuntimeError, match="previous error during capture"):
        _capture(pool)
    ft.fail_end = False
    assert not ft.underway and gc.isenabled() and cap.captures_off() is None
    nxt = _capture(pool)
    assert ft.gc_enabled_inside and not any(ft.gc_enabled_inside)   # no cyclic collection inside a capture
    assert nxt.pool != keep.pool and ft.comfy_capture_works()


def test_one_young_generation_collection_per_round_of_captures(monkeypatch):
    """Before a capture: one collection of generations 0-1 per round (a full one costs a ComfyUI
    server's prompt a third of a second: BENCHMARKS.md), none for the captures within the round;
    a round later, one again.  last_gc_seconds() says what the last capture paid."""
    FakeTorch(monkeypatch)
    calls = []
    monkeypatch.setattr(cap.gc, "collect", lambda *a: calls.append(a) or 0)
    pool = cap.GraphPool()
    _capture(pool)
    _capture(pool)
    assert calls == [(1,)] and cap.last_gc_seconds() == 0.0
    cap._state["last_gc"] -= cap.GC_ROUND_S + 1   # the round is over
    _capture(pool)
    assert calls == [(1,), (1,)]


def test_allocator_assert_turns_capturing_off_once_and_keeps_the_allocator_usable(monkeypatch, caplog):
    ft = FakeTorch(monkeypatch, fail_begin_at=2)
    pool = cap.GraphPool()
    _capture(pool)
    with caplog.at_level(logging.WARNING, logger="flux_numba"):
        with pytest.raises(RuntimeError, match="INTERNAL ASSERT"):
            _capture(pool)
        with pytest.raises(cap.CapturesOff):
            _capture(pool)
    assert "capture stopped for this process" in caplog.text and caplog.text.count("capture stopped") == 1
    assert not ft.underway and ft.comfy_capture_works()


def _toy_core(img, txt=None, vec=None, pe=None, mask=None):
    img.add_(vec[:, None, :])
    return {"img": img}


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    return {"img": torch.randn(1, 4, 8, generator=g), "vec": torch.randn(1, 8, generator=g),
            "pe": None, "mask": None}


def _forward(bg, n_blocks, weights, seed, prepare=None):
    x = _inputs(seed)
    for i in range(n_blocks):
        out = bg.call(("blk", i), "single", weights, x, _toy_core, lambda: _toy_core(**x), outputs=("img",),
                      prepare=prepare)
        x = dict(x, img=out["img"])
    return x["img"]


def test_lora_changes_recapture_every_block_on_a_fresh_handle(monkeypatch):
    """The LoRA-after-the-patch series: 57 blocks captured, the LoRA changes (a new residency key for
    every block: each stale graph is dropped at its next call), re-captured, changed back: no capture
    fails, the allocator never stays in capture mode."""
    ft = FakeTorch(monkeypatch)
    bg = BlockGraphs(CudaCapture())
    for weights in ("base", "base", "base", "lora", "lora", "lora", "base", "base"):
        _forward(bg, 57, weights, 1)
    assert bg.counts["failed"] == 0 and bg.counts["capture"] == 3 * 57, bg.counts
    assert not ft.underway and ft.comfy_capture_works() and cap.captures_off() is None


def test_block_graphs_after_an_allocator_assert(monkeypatch, caplog):
    """An allocator assert mid-forward: capturing stops for the process (one log line), captured blocks
    keep replaying, the others run eagerly; results stay right."""
    ft = FakeTorch(monkeypatch, fail_begin_at=5)
    bg = BlockGraphs(CudaCapture())
    with caplog.at_level(logging.WARNING, logger="flux_numba"):
        for _ in range(4):
            _forward(bg, 8, "W", 1)
    assert bg.counts["capture"] == 4 and bg.counts["failed"] == 1
    assert bg.counts["replay"] == 2 * 4 and bg.counts["eager_captures_off"] > 0
    assert caplog.text.count("capture stopped for this process") == 1
    assert not ft.underway and ft.comfy_capture_works()


def test_capture_put_off_while_staging_finds_weights_not_resident(monkeypatch):
    ft = FakeTorch(monkeypatch)
    bg = BlockGraphs(CudaCapture())
    state = {"ready": False}

    class Prepare:
        def __enter__(self):
            return state["ready"]

        def __exit__(self, *a):
            return False
    for _ in range(3):
        _forward(bg, 2, "W", 1, prepare=Prepare)
    assert bg.counts["capture"] == 0 and bg.counts["eager_not_resident"] == 2 and bg.counts["failed"] == 0
    state["ready"] = True
    for _ in range(3):
        _forward(bg, 2, "W", 1, prepare=Prepare)
    assert bg.counts["capture"] == 2 and bg.counts["replay"] == 4 and ft.begins == 2
