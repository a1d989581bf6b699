"""GPU check of the thread-block-cluster launch path (attention._launch_cluster) and the 8-bit
cluster kernel (wgbpc) on small shapes; run under compute-sanitizer to locate faults:

    FLUX_NUMBA_REAL_GPU=1 python bench/gpu_cluster_check.py
"""
import os
import sys

os.environ.setdefault("FLUX_NUMBA_REAL_GPU", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import torch  # noqa: E402
import _pack  # noqa: E402

_pack.load()
from llvmlite import ir  # noqa: E402
from numba import cuda, types  # noqa: E402
from numba.core.extending import intrinsic  # noqa: E402
from flux_numba_pack.cuda_kernels import attention as A, mma  # noqa: E402


@intrinsic
def _nctarank(typingctx):
    def cg(context, builder, s, args):
        return builder.call(ir.InlineAsm(ir.FunctionType(ir.IntType(32), []), "mov.u32 $0, %cluster_nctarank;", "=r"), [])
    return types.int32(), cg


@cuda.jit
def probe(out):
    i = cuda.blockIdx.x
    if cuda.threadIdx.x == 0:
        out[2 * i] = mma.cluster_rank()
        out[2 * i + 1] = _nctarank()


def main():
    out = torch.full((16,), -1, dtype=torch.int32, device="cuda")
    A._launch_cluster(probe, (8, 1), 32, (cuda.as_cuda_array(out),), 0, 2)
    torch.cuda.synchronize()
    print("cluster probe (rank, size) per block:", out.view(8, 2).tolist(), flush=True)
    for L in (256, 333):   # the plain wgbp kernel (no cluster code) through the cluster launch
        g = torch.Generator(device="cuda").manual_seed(L)
        q, k, v = [torch.randn(1, 2, L, 128, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3)]
        A.set_variant8("wgbp")
        kern = A._kernel8(128, False, "wgbp", False)
        for ncl in (1, 2):
            kern.cluster = ncl
            o = A.numba_attention_8bit(q, k, v)
            torch.cuda.synchronize()
            r = A.reference(q, k, v).float()
            print(f"wgbp via cluster launch {ncl} L={L}: rel err {((o.float() - r).norm() / r.norm()).item():.4%}", flush=True)
        kern.cluster = 1
    for L in (256, 333):
        g = torch.Generator(device="cuda").manual_seed(L)
        q, k, v = [torch.randn(1, 2, L, 128, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3)]
        A.set_variant8("wgbpc")
        o = A.numba_attention_8bit(q, k, v)
        torch.cuda.synchronize()
        r = A.reference(q, k, v).float()
        print(f"wgbpc L={L}: rel err {((o.float() - r).norm() / r.norm()).item():.4%}", flush=True)


if __name__ == "__main__":
    main()
