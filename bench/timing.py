"""GPU timing for the bench drivers: one copy of each way they time a call.

* ``event_times`` -- ms of each call between two CUDA events after ``warm`` calls; options: a GPU
  sleep queued before each pair (``sleep_cycles``: the host's launch cost is hidden, device time
  only) and a synchronize around each call (``sync_each``: nothing else in flight);
* ``median_ms`` / ``median`` -- the median of those (``statistics.median``);
* ``graph_ms`` -- device time of one call: ``n`` calls captured in one CUDA graph, the median
  replay / ``n``;
* ``queued_ms`` -- ``reps`` back-to-back calls queued behind a GPU sleep long enough to cover
  their host launch time: (device ms per call, host us per call, whether the queue held);
* ``host_us`` -- host time per call (Python + launch) with the GPU kept busy;
* ``back_to_back_ms`` -- ms per call with ``n`` calls queued back to back between one pair of
  events (no sync in between, as a sampler runs its steps);
* ``wall_ms`` -- wall-clock ms of one synchronized call, median.

bench.py (repo root) and the drivers under bench/e2e, bench/ops and bench/probes import this module;
each puts bench/ on sys.path first (this file's folder, the parent of its own).
"""
import statistics
import time

import torch


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def event_times(fn, reps=25, warm=3, sleep_cycles=0, sync_each=False):
    """ms of each of ``reps`` calls, one call between two CUDA events, after ``warm`` calls."""
    for _ in range(warm):
        fn()
    if not sync_each:
        torch.cuda.synchronize()
    ev = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if sync_each:
            torch.cuda.synchronize()
        if sleep_cycles:
            torch.cuda._sleep(sleep_cycles)
        s.record()
        fn()
        e.record()
        if sync_each:
            e.synchronize()
        ev.append((s, e))
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in ev]


def median_ms(fn, reps=25, warm=3, sleep_cycles=0, sync_each=False):
    """Median of ``event_times``."""
    return median(event_times(fn, reps, warm, sleep_cycles, sync_each))


def graph_ms(fn, n=10, reps=20):
    """Device time of one call: ``n`` calls captured in one CUDA graph (after one eager call), the
    median of ``reps`` replays / n."""
    fn()
    torch.cuda.synchronize()
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        for _ in range(n):
            fn()
    t = median_ms(gr.replay, reps=reps) / n
    del gr
    return t


def queued_ms(fn, reps=10, trials=3):
    """(device ms per call, host us per call, queued ok): ``reps`` back-to-back calls queued behind
    a GPU sleep long enough to cover their host launch time, so the events bracket device work
    only; median over ``trials``.  Host us/call = wall time of issuing the calls (no sync)."""
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    host = time.perf_counter() - t
    torch.cuda.synchronize()
    cycles = int(max(4_000_000, 3.0 * host * 2.0e9))  # ~2 GHz: 3x the host time of the loop
    devs, hosts = [], []
    for _ in range(trials):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(cycles)
        s.record()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        hosts.append(time.perf_counter() - t)
        e.record()
        e.synchronize()
        devs.append(s.elapsed_time(e) / reps)
    dev = sorted(devs)[len(devs) // 2]
    h = sorted(hosts)[len(hosts) // 2]
    return dev, h / reps * 1e6, h * 1e3 < 0.8 * cycles / 2.0e6


def host_us(fn, n=50, sleep_cycles=20_000_000):
    """Host us per call over ``n`` calls, the GPU kept busy (a sleep queued first): the enqueue
    cost, not waiting."""
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(sleep_cycles)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def back_to_back_ms(fn, n):
    """ms per call with ``n`` calls queued back to back (one pair of events, no sync in between)."""
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(n):
        fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / n


def wall_ms(fn, n, dev=None):
    """Median wall-clock ms of one call, synchronized before and after each."""
    ts = []
    for _ in range(n):
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize(dev)
    return median(ts)
