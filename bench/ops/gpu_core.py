"""GPU check: linear_gelu (cuBLASLt bias+GELU epilogue) vs Linear then GELU, at FLUX shapes.

    python bench/ops/gpu_core.py
Checks the epilogue is the tanh GELU, that writing into a row-strided slice of linear2's input
buffer is correct, and times both (CUDA events, median of 30) with the bytes the GELU pass saves.
"""
import os
import sys

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # bench/: timing.py
ROOT = os.path.dirname(BENCH)  # the repo root
sys.path[:0] = [ROOT, BENCH]
import _pack  # noqa: E402

_pack.load()
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from flux_numba_pack.cuda_kernels import linear_gelu  # noqa: E402
import timing  # noqa: E402  (bench/timing.py)


def main():
    dev = "cuda"
    rows = []
    print("epilogue probe:", linear_gelu._epilogue_is_tanh(0, torch.bfloat16))
    for name, L, K, N, C in (("double mlp.0 img", 4096, 3072, 12288, None), ("double mlp.0 txt", 512, 3072, 12288, None),
                             ("single linear1 mlp->buf", 4608, 3072, 12288, 3072)):
        x = torch.randn(1, L, K, device=dev, dtype=torch.bfloat16)
        w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02
        b = torch.randn(N, device=dev, dtype=torch.bfloat16) * 0.02
        ref = F.gelu(F.linear(x.float(), w.float(), b.float()), approximate="tanh")
        stock = lambda: F.gelu(F.linear(x, w, b), approximate="tanh")
        if C is None:
            ours = lambda: linear_gelu.cublaslt(x, w, b)
            got = ours()
        else:
            buf = torch.full((1, L, C + N), float("nan"), device=dev, dtype=torch.bfloat16)
            ours = lambda: linear_gelu.cublaslt(x, w, b, out=buf[..., C:])
            ours()
            got = buf[..., C:]
            assert torch.isnan(buf[..., :C]).all(), "wrote outside its slice"
        e_st = ((stock().float() - ref).norm() / ref.norm()).item()
        e_our = ((got.float() - ref).norm() / ref.norm()).item()
        ts, to = (timing.median_ms(f, reps=30, warm=3, sync_each=True) for f in (stock, ours))
        saved = 2 * L * N * 2 / 1e9
        rows.append((name, e_st, e_our, ts, to, saved))
    print(f"\n{'shape':<26} {'err stock':>10} {'err ours':>10} {'stock ms':>9} {'ours ms':>9} {'GB saved':>9}")
    for r in rows:
        print(f"{r[0]:<26} {r[1]:>10.2e} {r[2]:>10.2e} {r[3]:>9.3f} {r[4]:>9.3f} {r[5]:>9.3f}")


if __name__ == "__main__":
    main()
