#!/usr/bin/env python3
"""Where the GPU waits, read off a chrome trace of torch.profiler (host + GPU activity), e.g. the
``trace_<case>.json.gz`` files of ``gpu_server.py --profile DIR --profile-kinds trace``.

For every idle gap of the GPU (no kernel, copy or memset running) at least ``--min-us`` long: its
length, when it starts (ms from the first GPU event), the GPU events on either side, and what the
host was doing meanwhile (the host-side events overlapping the gap, by time).  A gap with no host
activity is Python between torch calls; one that overlaps a long ``cudaMemcpyAsync`` / synchronize is
the host waiting for the GPU (a sync), after which the host's next work runs with the GPU idle.

    python bench/e2e/trace_gaps.py trace_patched.json.gz --min-us 1000
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json
import sys

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATS = ("cpu_op", "cuda_runtime", "cuda_driver", "user_annotation", "python_function")


def load(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        d = json.load(f)
    return d["traceEvents"] if isinstance(d, dict) else d


def gaps(events, min_us):
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATS and "dur" in e), key=lambda e: e["ts"])
    if not gpu:
        return [], None
    out, end, prev = [], gpu[0]["ts"] + gpu[0]["dur"], gpu[0]["name"]
    for e in gpu[1:]:
        if e["ts"] - end >= min_us:
            out.append((end, e["ts"], prev, e["name"]))
        if e["ts"] + e["dur"] > end:
            end, prev = e["ts"] + e["dur"], e["name"]
    return out, gpu[0]["ts"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", help="chrome trace (.json or .json.gz) from torch.profiler with CPU and CUDA activity")
    p.add_argument("--min-us", type=float, default=1000.0, help="smallest gap listed (microseconds)")
    p.add_argument("--top", type=int, default=8, help="host events listed per gap")
    a = p.parse_args(argv)
    try:
        events = load(a.trace)
    except (OSError, ValueError, KeyError) as e:
        print(f"trace_gaps.py: error: {a.trace}: {e}", file=sys.stderr)
        return 2
    host = [e for e in events if e.get("cat") in HOST_CATS and "dur" in e]
    found, t0 = gaps(events, a.min_us)
    if t0 is None:
        print("trace_gaps.py: error: no GPU events in the trace", file=sys.stderr)
        return 2
    for start, stop, before, after in found:
        over, count = collections.Counter(), collections.Counter()
        for e in host:
            s, f = e["ts"], e["ts"] + e["dur"]
            if f >= start and s <= stop:
                over[e["name"]] += min(f, stop) - max(s, start)
                count[e["name"]] += 1
        print(f"gap {(stop - start) / 1e3:.2f} ms at {(start - t0) / 1e3:.1f} ms  after {before[:50]}  before {after[:50]}")
        for name, us in over.most_common(a.top):
            print(f"    {us / 1e3:7.2f} ms x{count[name]:<4d} {name[:100]}")
    print(f"{len(found)} gaps of >= {a.min_us:.0f} us, {sum(b - s for s, b, *_ in found) / 1e3:.1f} ms in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
