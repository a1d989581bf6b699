"""sha256 of the PTX of each kept attention kernel, compiled for sm_90 without a GPU.

    python bench/probes/ptx_hash_attention.py [--root TREE]

TREE (default: this checkout) is a copy of the pack, e.g. ``git archive attention-variants-pre-retire``
unpacked elsewhere: the hashes of two trees show whether a refactor changed the generated code.
Kernels (head dim 128, their default settings on Hopper / elsewhere), each unmasked and masked:
bf16 mma (4 warps, 64-key tiles), bf16 wgmma (128x128 tiles, 2 warpgroups, 3 stages, bulk copies),
int8 mma (per-block scales / per-token scales), int8 wgmma (ping-pong, 4 stages; per-block /
per-token Q scales).  Works with both the configs API (``attention.config``) and the older
factory signatures of the tagged tree.

Three hashes per kernel: ``raw`` over the PTX as numba writes it, ``code`` over the PTX with the
kernel's mangled entry symbol replaced by one fixed name.  That symbol spells the defining module
and factory (``flux_numba_pack.cuda_kernels.attention._make_kernel_wgpp.<locals>.kern``) and a
counter of the functions numba compiled before it, so a move of a factory into another module
changes ``raw`` and nothing else; ``code`` is the comparison that matters (every instruction,
register and shared-memory declaration); ``ops`` over the sorted multiset of instructions (equal
when two kernels differ only in register numbering and instruction order).  ``--ptxas``: registers
and spills per kernel from ptxas -v (sm_90a).
"""
import argparse
import hashlib
import os
import re
import sys
import types

os.environ["NUMBA_ENABLE_CUDASIM"] = "0"

NEEDS = ("these scripts compile PTX without a GPU and need numba-cuda's NVVM and NVRTC: run install.py on a "
         "CUDA torch, or pip install 'cuda-toolkit[nvrtc,nvvm]==13.*' (CUDA 13) / 'cuda-toolkit[nvcc,nvrtc]==12.*' "
         "(CUDA 12), or point CUDA_HOME at a CUDA toolkit")


def die(message):
    """One line on stderr, exit status 2 (what is missing, or a bad option)."""
    print(message, file=sys.stderr)
    sys.exit(2)


def ptx_toolchain_missing():
    """None when numba-cuda compiles a kernel to PTX for sm_90 here (no GPU needed), else one line
    naming what is missing (NVVM / NVRTC not found, numba-cuda not importable)."""
    try:
        from numba import cuda, types as nt
    except Exception as e:
        return f"numba-cuda is not importable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"

    def probe(x):
        x[0] = 1

    try:
        cuda.compile_ptx(probe, (nt.int32[:],), cc=(9, 0))
    except Exception as e:
        text = f"{type(e).__name__}: {e}"
        chain, x = [], e
        while x is not None and len(chain) < 8:  # the libraries named anywhere in the exception chain
            chain.append(str(x))
            x = x.__cause__ or x.__context__
        libs = sorted(set(re.findall(r"lib(nvvm|nvrtc)", " ".join(chain).lower())), reverse=True)
        what = (" and ".join(f"{n.upper()} (lib{n})" for n in libs) + " not found") if libs \
            else "numba-cuda cannot compile PTX"
        first = text.splitlines()[0]
        return f"{what} ({first[:160]}{'...' if len(first) > 160 else ''}); {NEEDS}"
    return None


def need_tool(name, path=None):
    """The path of executable ``name`` (or ``path``), or exit 2 with one line saying it is missing."""
    import shutil
    exe = shutil.which(path or name)
    if exe is None:
        die(f"{os.path.basename(sys.argv[0])}: error: {path or name} not found on PATH "
                 f"({name} comes with a CUDA toolkit, or the nvidia-cuda-nvcc / nvidia-cuda-nvdisasm wheels)")
    return exe


def kernels(A):
    """[(name, kernel dispatcher, kind)] -- kind 'bf16' / 'int8' selects the signature."""
    out = []
    for m in (False, True):
        tag = "mask" if m else "nomask"
        if hasattr(A, "config"):       # configs API
            C = A.config
            out.append((f"bf16_mma/{tag}", C.build(C.BF16_MMA, 128, m).kern, "bf16"))
            out.append((f"bf16_wgmma/{tag}", C.build(C.BF16_WGMMA, 128, m).kern, "bf16"))
            for pt in (False, True):
                out.append((f"int8_mma/{tag}/{'tok' if pt else 'blk'}",
                            C.build(C.INT8_MMA, 128, m, per_token=pt).kern, "int8"))
                out.append((f"int8_wgmma/{tag}/{'tok' if pt else 'blk'}",
                            C.build(C.INT8_WGMMA, 128, m, per_token=pt).kern, "int8"))
        else:                          # the tagged tree's factories
            out.append((f"bf16_mma/{tag}", A._make_kernel(128, m, 4), "bf16"))
            try:                       # the tag: every flag positional
                k = A._make_kernel_wgpp(128, m, None, 2, 128, 0, 3, False, True, False, False, False)
            except TypeError:          # after the retirement: (D, has_mask, NWG, BN, STAGES)
                k = A._make_kernel_wgpp(128, m, 2, 128, 3)
            out.append((f"bf16_wgmma/{tag}", k, "bf16"))
            for pt in (False, True):
                out.append((f"int8_mma/{tag}/{'tok' if pt else 'blk'}", A._make_kernel8(128, m, pt), "int8"))
                try:
                    k = A._make_kernel8_wgb(128, m, STAGES=4, PP=True, QTOK=pt)
                except TypeError:
                    k = A._make_kernel8_wgb(128, m, STAGES=4, QTOK=pt)
                out.append((f"int8_wgmma/{tag}/{'tok' if pt else 'blk'}", k, "int8"))
    return out


def opcodes(ptx):
    """The multiset of PTX instructions (opcode with its type suffixes, guards dropped), sorted:
    equal when two kernels differ only in register numbering and instruction order."""
    import collections
    c = collections.Counter()
    for ln in ptx.splitlines():
        ln = re.sub(r"^@!?%p\d+\s+", "", ln.strip())
        if ln and not ln.startswith(("//", ".", "{", "}", ")", "(")) and not ln.endswith(":"):
            c[ln.split()[0]] += 1
    return "\n".join(f"{k} {v}" for k, v in sorted(c.items()))


def ptxas_info(ptx):
    """' | regs R, spill S/L bytes' from ptxas -v (PTX version lowered to what ptxas reads, sm_90a
    for wgmma)."""
    import subprocess
    import tempfile
    src = re.sub(r"^\.version \d+\.\d+", ".version 8.0", ptx, count=1, flags=re.M)
    src = re.sub(r"^\.target sm_90$", ".target sm_90a", src, count=1, flags=re.M)
    d = tempfile.mkdtemp()
    with open(os.path.join(d, "k.ptx"), "w") as f:
        f.write(src)
    r = subprocess.run(["ptxas", "-arch=sm_90a", "-v", "k.ptx", "-o", "k.cubin"], cwd=d, capture_output=True, text=True)
    regs = re.search(r"Used (\d+) registers", r.stderr)
    sp = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", r.stderr)
    if not regs:
        return " | ptxas failed: " + r.stderr.strip().splitlines()[-1][:80]
    return f" | regs {regs.group(1)}, spill {sp.group(1)}/{sp.group(2)} B"


def main():
    ap = argparse.ArgumentParser()
    ap.error = lambda msg: ap.exit(2, f"ptx_hash_attention.py: error: {msg}\n")
    ap.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    ap.add_argument("--only", default="", help="regex of kernel names")
    ap.add_argument("--dump", default="", help="folder to write each kernel's PTX to")
    ap.add_argument("--ptxas", action="store_true",
                    help="also assemble each PTX with ptxas -arch=sm_90a (on PATH): registers, spills")
    a = ap.parse_args()
    if not os.path.isfile(os.path.join(a.root, "_pack.py")):
        ap.error(f"--root {a.root}: not a copy of the pack (no _pack.py)")
    if a.ptxas:
        need_tool("ptxas")
    sys.path.insert(0, a.root)
    try:
        import _pack
        _pack.load()
    except ModuleNotFoundError as e:
        die(f"ptx_hash_attention.py: error: {e.name or e} is not installed ({e}): run `python3 install.py --standalone` first")
    import numba.cuda.dispatcher as _d
    _d.get_current_device = lambda: types.SimpleNamespace(compute_capability=(9, 0))
    why = ptx_toolchain_missing()
    if why:
        die(f"ptx_hash_attention.py: error: {why}")
    from numba import cuda, types as nt
    from flux_numba_pack.cuda_kernels import attention as A
    I32, F32, i64 = nt.Array(nt.int32, 1, "A"), nt.Array(nt.float32, 1, "A"), nt.int64
    sigs = {"bf16": (I32, I32, I32, I32, F32) + (i64,) * 16 + (nt.float64,),
            "int8": (I32, I32, I32, F32, F32, I32, F32) + (i64,) * 11 + (nt.float64,)}
    for name, kern, kind in kernels(A):
        if a.only and not re.search(a.only, name):
            continue
        ptx, _ = cuda.compile_ptx(kern.py_func, sigs[kind], cc=(9, 0), fastmath=True)
        if a.dump:
            os.makedirs(a.dump, exist_ok=True)
            with open(os.path.join(a.dump, name.replace("/", "_") + ".ptx"), "w") as f:
                f.write(ptx)
        sym = re.search(r"\.entry (\S+)\(", ptx).group(1)
        code = ptx.replace(sym[3:] if sym.startswith("_ZN") else sym, "KERNEL")   # also in the NumbaEnv symbol
        h = lambda x: hashlib.sha256(x.encode()).hexdigest()[:16]  # noqa: E731
        extra = ptxas_info(ptx) if a.ptxas else ""
        print(f"{name:28s} code {h(code)}  raw {h(ptx)}  ops {h(opcodes(ptx))}  ({len(code)} chars){extra}", flush=True)


if __name__ == "__main__":
    main()
