#!/usr/bin/env python3
"""Host cost of one Numba kernel launch from Python, by route (GPU; prints a table last).

A tiny kernel with the argument pattern of the pack's row kernels (five 2-D tensors, an int, a
float32) is launched N times back to back; the GPU work is a few microseconds, so the loop's wall
time per launch is the host cost.  Routes:
  numba       ``kernel[grid, block, stream](*arrays)`` (numba's dispatcher, arguments typed per call)
  launcher    the pack's ``launching.Launcher`` (parameters from the tensors; its prepared launch)
  launcher/core  the same with ``PREPARED`` off (cuda.core's launch, the route before)
  params      the launcher's parameter building alone (no launch)
  cuda.core   cuda.core's ``launch`` on parameters built once (the launch alone)
  prepared    parameters packed into one preallocated buffer (``struct.pack_into``) and
              ``cuLaunchKernel`` through cuda.bindings with a fixed ``void**`` array
  torch       ``torch.add(x, y, out=z)`` on the same small tensors (a torch op's host cost, for scale)
Each route's result is checked against the torch reference first.

    python bench/ops/gpu_launch_cost.py [--n 20000]
"""
from __future__ import annotations

import argparse
import ctypes
import os
import struct
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root


def make_kernel():
    from flux_numba_pack.cuda_kernels.jit import jit_kernel
    from numba import cuda

    def k(a, b, c, d, out, n, f):
        i = cuda.grid(1)
        if i < n:
            r = i // a.shape[1]
            col = i - r * a.shape[1]
            out[r, col] = (a[r, col] + b[r, col] + c[r, col] + d[r, col]) * f
    return jit_kernel(k)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=20000)
    a = p.parse_args()
    sys.path.insert(0, ROOT)
    import _pack
    _pack.load()
    import torch
    import numpy as np
    from flux_numba_pack.cuda_kernels import launching, runtime
    from numba import cuda
    from cuda.bindings import driver as drv

    dev = torch.device("cuda")
    R, C = 4, 64
    ts = [torch.randn(R, C, device=dev) for _ in range(4)]
    out = torch.empty(R, C, device=dev)
    n, f = R * C, np.float32(0.5)
    ref = (ts[0] + ts[1] + ts[2] + ts[3]) * 0.5
    grid, block = (1, 1, 1), (256, 1, 1)
    la = launching.Launcher(make_kernel)
    args = (*ts, out, n, f)
    la(grid, block, *args)
    torch.cuda.synchronize()
    assert torch.allclose(out, ref), "launcher result"

    assert type(next(h for h in la._fast.values() if h)).__name__ == "_Prepared", "the launcher's default: prepared"
    launching.PREPARED = False  # the same launcher through cuda.core's launch (the route before prepared launches)
    la_core = launching.Launcher(make_kernel)
    out.zero_()
    la_core(grid, block, *args)
    torch.cuda.synchronize()
    launching.PREPARED = True
    assert torch.allclose(out, ref), "launcher (cuda.core) result"

    # the compiled handle, parameters as the cuda.core route builds them
    handle = next(h for h in la_core._fast.values() if h)
    kern = la.dispatcher().compile(launching.signature(args))
    cufunc = kern._codelibrary.get_cufunc()

    def params_of(args):
        return launching._param_values(args, ctypes.c_float)
    cfg = launching._launch_config(grid, block)
    fixed = params_of(args)

    # prepared: one buffer, one void** array
    fmt = "".join("f4x" if isinstance(v, ctypes.c_float) else "q" for v in fixed)
    st = struct.Struct("<" + fmt)
    buf = ctypes.create_string_buffer(st.size)
    offs, o = [], 0
    for v in fixed:
        offs.append(o)
        o += 8
    ptrs = (ctypes.c_void_p * len(fixed))(*[ctypes.addressof(buf) + x for x in offs])
    h = getattr(cufunc, "handle", None)
    fn = h
    if isinstance(h, drv.CUkernel):
        err, fn = drv.cuKernelGetFunction(h)
        assert err == drv.CUresult.CUDA_SUCCESS, err
    ptrs_addr = ctypes.addressof(ptrs)

    def prepared(*args):
        st.pack_into(buf, 0, *launching._param_values(args, float))
        err, = drv.cuLaunchKernel(fn, 1, 1, 1, 256, 1, 1, 0, drv.CUstream(runtime._raw_stream()), ptrs_addr, 0)
        if err != drv.CUresult.CUDA_SUCCESS:
            raise RuntimeError(err)

    out.zero_()
    prepared(*args)
    torch.cuda.synchronize()
    assert torch.allclose(out, ref), "prepared result"

    numba_args = [cuda.as_cuda_array(x) for x in ts + [out]]
    nk = la.dispatcher()

    def numba_launch(*_):
        nk[grid, block, runtime.stream()](*numba_args, n, f)
    out.zero_()
    numba_launch()
    torch.cuda.synchronize()
    assert torch.allclose(out, ref), "numba result"

    routes = {
        "numba": lambda: numba_launch(),
        "launcher": lambda: la(grid, block, *args),
        "launcher/core": lambda: la_core(grid, block, *args),
        "params": lambda: params_of(args),
        "cuda.core": lambda: launching._cuda_launch(runtime.stream(), cfg, handle, *fixed),
        "prepared": lambda: prepared(*args),
        "torch": lambda: torch.add(ts[0], ts[1], out=out),
    }
    rows = []
    for name, fnc in routes.items():
        for _ in range(200):
            fnc()
        torch.cuda.synchronize()
        best = []
        for rep in range(3):
            t0 = time.perf_counter()
            for _ in range(a.n):
                fnc()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            best.append((t1 - t0) / a.n * 1e6)
        rows.append((name, min(best), sorted(best)[1]))
    print(f"\nhost us per launch ({a.n} back to back, best / median of 3), {torch.cuda.get_device_name()}")
    for name, b, m in rows:
        print(f"{name:14} {b:7.2f} {m:7.2f}")


if __name__ == "__main__":
    main()
