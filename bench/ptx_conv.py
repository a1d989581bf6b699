"""PTX + ptxas registers / spills of the NHWC conv kernels (conv3x3.py), compiled for sm_90 without a GPU.

    python bench/ptx_conv.py [--configs 8x16-128-32-w2x4-s3,...] [--variants all|plain,...]

Needs numba-cuda's NVVM / NVRTC libraries (pip ``nvidia-cuda-nvrtc`` or a CUDA toolkit on
LD_LIBRARY_PATH) and ``ptxas`` on PATH.  Per (config, variant): PTX size, registers, spills,
the threads and the shared memory a block takes, and the blocks per SM those allow on an H200
(65536 registers, 227 KB shared per SM).  Variants: plain, res (residual epilogue), gn / gn_silu
(GroupNorm(+SiLU) prologue), up (nearest 2x), odd (odd Cout: 16-bit stores), 1x1, 1x1_gn.
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
import types

os.environ["NUMBA_ENABLE_CUDASIM"] = "0"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

VARIANTS = {  # name: (KSZ, PRO, SILU, UP, RES, ODD)
    "plain": (3, 0, 0, 0, 0, 0), "res": (3, 0, 0, 0, 1, 0), "gn": (3, 1, 0, 0, 0, 0),
    "gn_silu": (3, 1, 1, 0, 0, 0), "gn_silu_res": (3, 1, 1, 0, 1, 0), "up": (3, 0, 0, 1, 0, 0),
    "odd_gn_silu": (3, 1, 1, 0, 0, 1), "1x1": (1, 0, 0, 0, 0, 0), "1x1_gn": (1, 1, 0, 0, 0, 0),
    "1x1_res": (1, 0, 0, 0, 1, 0),
}


def ptxas(ptx):
    d = tempfile.mkdtemp()
    with open(os.path.join(d, "k.ptx"), "w") as f:
        f.write(re.sub(r"^\.version \d+\.\d+", ".version 8.0", ptx, count=1, flags=re.M))
    r = subprocess.run(["ptxas", "-arch=sm_90", "-v", "k.ptx", "-o", "k.cubin"], cwd=d, capture_output=True,
                       text=True)
    regs = re.search(r"Used (\d+) registers", r.stderr)
    sp = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", r.stderr)
    if not regs:
        return None, r.stderr.strip().splitlines()[-1][:120] if r.stderr.strip() else "ptxas failed"
    return int(regs.group(1)), f"{sp.group(1)}/{sp.group(2)}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="8x16-128-32-w2x4-s3,8x16-16-32-w8x1-s3")
    ap.add_argument("--variants", default="all")
    ap.add_argument("--dump", default="", help="folder to write each kernel's PTX to")
    a = ap.parse_args()
    import _pack
    _pack.load()
    import numba.cuda.dispatcher as _d
    _d.get_current_device = lambda: types.SimpleNamespace(compute_capability=(9, 0))
    from numba import cuda, types as nt
    from flux_numba_pack.cuda_kernels import conv3x3 as C
    A = lambda t: nt.Array(t, 1, "A")  # noqa: E731
    sig = (A(nt.int32), A(nt.int32), A(nt.float32), A(nt.int32), A(nt.int32), A(nt.int16),
           A(nt.float32), A(nt.float32), A(nt.float32)) + (nt.int64,) * 11
    names = list(VARIANTS) if a.variants == "all" else a.variants.split(",")
    rows = []
    for cs in a.configs.split(","):
        cfg = C.Config.parse(cs)
        for v in names:
            flags = VARIANTS[v]
            t = time.time()
            try:
                k, nth, dyn = C.make_kernel(cfg, *flags)
                lb = (nth, cfg.min_blocks) if cfg.min_blocks else None
                ptx, _ = cuda.compile_ptx(k.py_func, sig, cc=(9, 0), fastmath=True, launch_bounds=lb)
            except Exception as e:
                rows.append((cfg.name, v, "ERROR", f"{type(e).__name__}: {str(e).splitlines()[0][:80]}", "", "", ""))
                print(rows[-1], flush=True)
                continue
            if a.dump:
                os.makedirs(a.dump, exist_ok=True)
                with open(os.path.join(a.dump, f"{cfg.name}_{v}.ptx"), "w") as f:
                    f.write(ptx)
            regs, spill = ptxas(ptx)
            smem = cfg.smem_bytes(flags[0], flags[1])
            per_sm = "?" if regs is None else str(min(65536 // (regs * nth), (227 * 1024) // smem, 2048 // nth))
            rows.append((cfg.name, v, str(regs), spill, str(nth), f"{smem / 1024:.1f}", per_sm))
            print(f"{cfg.name} {v}: regs {regs} spill {spill} ({len(ptx)} chars, {time.time() - t:.1f} s)", flush=True)
    hdr = ("config", "variant", "regs", "spill st/ld B", "threads", "smem KB", "blocks/SM")
    w = [max(len(r[i]) for r in rows + [hdr]) for i in range(len(hdr))]
    print()
    for r in [hdr] + rows:
        print("  ".join(s.ljust(w[i]) for i, s in enumerate(r)))


if __name__ == "__main__":
    main()
