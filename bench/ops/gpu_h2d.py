"""Host-to-device copy bandwidth on this machine (the ceiling of weight streaming under memory
pressure): pinned (cudaHostAlloc), pageable, and registered (cudaHostRegister) host memory, one
stream and two streams, CUDA events, median of repeats.  Prints a table.

    python bench/ops/gpu_h2d.py [--sizes-mb 0.25,1,19,57,128] [--reps 9]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: timing.py
import timing  # noqa: E402  (bench/timing.py, the shared timing helper)


def timed(fn, reps):
    """Median ms of one call between events, synchronized around each (timing.median_ms)."""
    return timing.median_ms(fn, reps, warm=0, sync_each=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes-mb", default="0.25,1,19,57,128")
    p.add_argument("--reps", type=int, default=9)
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("gpu_h2d.py: no CUDA GPU on this machine", file=sys.stderr)
        sys.exit(2)
    dev = torch.device("cuda")
    rows = []
    for mb in (float(s) for s in a.sizes_mb.split(",")):
        n = int(mb * (1 << 20))
        d = torch.empty(n, dtype=torch.uint8, device=dev)
        d2 = torch.empty(n, dtype=torch.uint8, device=dev)
        pinned = torch.empty(n, dtype=torch.uint8).pin_memory()
        pinned2 = torch.empty(n, dtype=torch.uint8).pin_memory()
        pageable = torch.ones(n, dtype=torch.uint8)
        reg = torch.ones(n, dtype=torch.uint8)
        cudart = torch.cuda.cudart()
        ok = cudart.cudaHostRegister(reg.data_ptr(), n, 0) == 0 if hasattr(cudart, "cudaHostRegister") else False
        s2 = torch.cuda.Stream()

        def two():
            d.copy_(pinned, non_blocking=True)
            s2.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s2):
                d2.copy_(pinned2, non_blocking=True)
            torch.cuda.current_stream().wait_stream(s2)
        r = {"MB": mb,
             "pinned": timed(lambda: d.copy_(pinned, non_blocking=True), a.reps),
             "pageable": timed(lambda: d.copy_(pageable, non_blocking=True), a.reps),
             "registered": timed(lambda: d.copy_(reg, non_blocking=True), a.reps) if ok else None,
             "pinned x2 streams": timed(two, a.reps) / 2}
        if ok:
            cudart.cudaHostUnregister(reg.data_ptr())
        rows.append(r)
    print(f"{'MB':>8} " + " ".join(f"{k:>20}" for k in ("pinned", "pageable", "registered", "pinned x2 streams")))
    for r in rows:
        cells = []
        for k in ("pinned", "pageable", "registered", "pinned x2 streams"):
            ms = r[k]
            cells.append(f"{'-':>20}" if ms is None else f"{r['MB'] / 1024 / (ms / 1e3):>9.1f} GB/s {ms:6.3f}ms")
        print(f"{r['MB']:>8} " + " ".join(cells))


if __name__ == "__main__":
    main()
