"""Device time of the 8-bit attention kernels at the FLUX shape (pre-pass + kernel, 10 calls in one
CUDA graph, median replay / 10), cuDNN SDPA timed the same way; error vs fp32 for each.

    FLUX_NUMBA_REAL_GPU=1 python bench/gpu_attn8_graph.py [mma,wgb]
"""
import os
import sys

os.environ.setdefault("FLUX_NUMBA_REAL_GPU", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
import torch  # noqa: E402

import _pack  # noqa: E402

_pack.load()
from flux_numba_pack.cuda_kernels import attention as A  # noqa: E402
import _attn_common as AC  # noqa: E402

AC.init(False)
B, H, L, D = 1, 24, 4608, 128
FLOP = 4 * B * H * L * L * D
g = torch.Generator(device="cuda").manual_seed(0)
q, k, v = [torch.randn(B, H, L, D, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3)]
ref = AC.ref32(q, k, v)
rows = [("cuDNN SDPA", AC.graph_ms(lambda: A.reference(q, k, v)), AC.rel(A.reference(q, k, v), ref))]
for var in (sys.argv[1] if len(sys.argv) > 1 else "mma,wgb").split(","):
    A.set_variant8(var)
    out = A.numba_attention_8bit(q, k, v)
    rows.append((f"numba-8bit {var}", AC.graph_ms(lambda: A.numba_attention_8bit(q, k, v)), AC.rel(out, ref)))
A.set_variant8("auto")
print(f"\n{torch.cuda.get_device_name()}, [1,24,4608,128], device time (graph of 10, median of 20)")
for name, t, e in rows:
    print(f"{name:22s} {t:8.4f} ms {FLOP / t / 1e9:7.1f} TFLOP/s  rel err {e:.4%}")
