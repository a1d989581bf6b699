"""Static instruction mix of an attention kernel's main loop (no GPU needed).

    python bench/probes/sass_attention.py [--nvdisasm PATH] [--config BF16_MMA|BF16_WGMMA|INT8_WGMMA|INT8_WGMMA_U8S8]
                                   [--per-token] [--dump FILE]
Compiles an attention kernel (default: the bf16 mma.sync one, ``attention.configs.BF16_MMA``; D=128,
no mask; INT8_WGMMA with per-block or, ``--per-token``, per-token Q scales) to PTX for sm_90 with
numba, assembles it with ``ptxas -arch=sm_90a`` (on PATH; the nvidia-cuda-nvcc wheel ships one),
disassembles with ``nvdisasm`` (the nvidia-cuda-nvdisasm wheel: nvidia/cu13/bin/nvdisasm) and counts
the SASS opcodes of the loop that holds the tensor-core instructions (the backward branch enclosing
the most HMMA / HGMMA / IGMMA / QGMMA); ``--dump`` writes that loop's SASS to a file.
"""
import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
import types

os.environ["NUMBA_ENABLE_CUDASIM"] = "0"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
sys.path.insert(0, ROOT)


def main():
    ap = argparse.ArgumentParser()
    ap.error = lambda msg: ap.exit(2, f"sass_attention.py: error: {msg}\n")
    ap.add_argument("--nvdisasm", default="nvdisasm")
    ap.add_argument("--config", default="BF16_MMA", choices=("BF16_MMA", "BF16_WGMMA", "INT8_WGMMA", "INT8_WGMMA_U8S8"))
    ap.add_argument("--dump", help="write the main loop's SASS to this file")
    ap.add_argument("--per-token", action="store_true", help="8-bit kernels: per-token Q scales (qk_norm_rope's pack)")
    a = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from ptx_hash_attention import die, need_tool, ptx_toolchain_missing
    ptxas = need_tool("ptxas")
    nvdisasm = need_tool("nvdisasm", a.nvdisasm)
    try:
        import _pack
        _pack.load()
    except ModuleNotFoundError as e:
        die(f"sass_attention.py: error: {e.name or e} is not installed ({e}): run `python3 install.py --standalone` first")
    import numba.cuda.dispatcher as _d
    _d.get_current_device = lambda: types.SimpleNamespace(compute_capability=(9, 0))
    why = ptx_toolchain_missing()
    if why:
        die(f"sass_attention.py: error: {why}")
    from numba import cuda, types as nt
    from flux_numba_pack.cuda_kernels import attention as A
    I32, F32, i64 = nt.Array(nt.int32, 1, "A"), nt.Array(nt.float32, 1, "A"), nt.int64
    cfg = getattr(A.configs, a.config)
    if a.config.startswith("INT8"):   # (q8, k8, v, qsc, ksc, o, mask, 11 ints, sl2)
        sig = (I32, I32, I32, F32, F32, I32, F32) + (i64,) * 11 + (nt.float64,)
        kern = A.build(cfg, 128, False, per_token=a.per_token).kern
    else:
        sig = (I32, I32, I32, I32, F32) + (i64,) * 16 + (nt.float64,)
        kern = A.build(cfg, 128, False).kern
    ptx, _ = cuda.compile_ptx(kern.py_func, sig, cc=(9, 0), fastmath=True)
    ptx = re.sub(r"^\.version \d+\.\d+", ".version 8.4", ptx, count=1, flags=re.M)
    ptx = re.sub(r"^\.target sm_90\b(?!a)", ".target sm_90a", ptx, count=1, flags=re.M)   # wgmma needs sm_90a
    d = tempfile.mkdtemp()
    open(os.path.join(d, "k.ptx"), "w").write(ptx)
    r = subprocess.run([ptxas, "-arch=sm_90a", "-v", "k.ptx", "-o", "k.cubin"], cwd=d, capture_output=True, text=True)
    if r.returncode:
        die(f"sass_attention.py: error: ptxas failed: {' | '.join((r.stderr.strip().splitlines() or ['exit %d' % r.returncode])[:3])[:400]}")
    print(" ".join(ln.strip() for ln in r.stderr.splitlines() if "Used" in ln or "spill" in ln))
    r = subprocess.run([nvdisasm, "-c", os.path.join(d, "k.cubin")], capture_output=True, text=True)
    if r.returncode:
        die(f"sass_attention.py: error: nvdisasm failed: {(r.stderr.strip().splitlines() or ['exit %d' % r.returncode])[-1][:200]}")
    sass = r.stdout.splitlines()
    labels = {ln[:-1]: i for i, ln in enumerate(sass) if ln.startswith(".L_x_") and ln.endswith(":")}
    best = None
    for i, ln in enumerate(sass):
        m = re.search(r"BRA `\((\.L_x_\d+)\)", ln)
        if m and labels.get(m.group(1), i) < i:
            st = labels[m.group(1)]
            h = sum(re.search(r"\b(HMMA|[HIQ]GMMA)", sass[j]) is not None for j in range(st, i))
            if best is None or h > best[2]:
                best = (st, i, h)
    if best is None:
        die("sass_attention.py: error: no loop with HMMA instructions in the SASS (is nvdisasm's output empty?)")
    st, en, h = best
    ops = collections.Counter()
    for ln in sass[st:en + 1]:
        m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", ln)
        if m:
            ops[m.group(1)] += 1
    if a.dump:
        open(a.dump, "w").write("\n".join(sass[st:en + 1]) + "\n")
    print(f"main loop: {sum(ops.values())} instructions, {h} HMMA / GMMA per KV tile")
    print(", ".join(f"{k} {v}" for k, v in ops.most_common(24)))


if __name__ == "__main__":
    main()
