"""What error would an 8-bit P.V add to the 8-bit attention?  A CPU emulation (torch) of the
kernel's arithmetic on the kinds of inputs the GPU checks use (fresh N(0, 1) bf16 q / k / v, and
the same with a few channels 30x), against fp32 attention:

    python bench/probes/attn8_pv_error.py [L] [H]

Q / K: int8 as the kernels quantize them (``scores8_reference``: K smoothed by its mean, Q per 16
rows, K per 64 keys).
Then the online softmax over 128-key tiles as the wgmma kernel runs it: P = exp2-style
exp(S - running max), the accumulator rescaled when the max moves, the row sum taken from the
same (quantized) P that meets V -- the kernel's ones column.  P.V ways:

  P           "bf16"           what the kernels do today
              "e4m3"           P x 448 -> e4m3 (SageAttention2 / FA3 FP8: a static scale)
              "u8"             P x 255 -> u8 (a static scale)
              "u8 tile" / "e4m3 tile"   P / (its row's max in this tile) -> u8 x 255 / e4m3 x 448:
                               the tile's int32 / fp32 P.V is scaled per row before it joins the
                               fp32 accumulator (two-level accumulation)
  V           "bf16", "e4m3 ch" (per-channel scale over the sequence, x 448), "i8 ch" (per channel
              over the sequence, x 127), "i8 tile" (per channel and 128-key tile, x 127)

Prints the relative Frobenius error of each against fp32 attention; the 8-bit bar is 2% on the
random inputs, no NaN / Inf on the outlier ones.
"""
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))   # the repo root: _pack
import _pack  # noqa: E402

_pack.load()
from flux_numba_pack.cuda_kernels.attention.int8_format import scores8_reference  # noqa: E402

F8 = torch.float8_e4m3fn
BN = 128
WAYS = (("bf16", "bf16"), ("bf16", "e4m3 ch"), ("e4m3", "bf16"), ("e4m3", "e4m3 ch"),
        ("e4m3 tile", "e4m3 ch"), ("bf16", "i8 ch"), ("u8", "bf16"), ("u8", "i8 ch"),
        ("u8 tile", "bf16"), ("u8 tile", "i8 ch"), ("u8 tile", "i8 tile"))


def quant_v(v, how):
    if how == "bf16":
        return v
    if how == "e4m3 ch":
        sc = v.abs().amax(2, keepdim=True) / 448
        return (v / sc).to(F8).float() * sc
    if how == "i8 ch":
        sc = v.abs().amax(2, keepdim=True) / 127
        return torch.round(v / sc).clamp(-127, 127) * sc
    if how == "i8 tile":
        B, H, L, D = v.shape
        vt = v.view(B, H, L // BN, BN, D)
        sc = vt.abs().amax(3, keepdim=True) / 127
        return (torch.round(vt / sc).clamp(-127, 127) * sc).view(B, H, L, D)
    raise ValueError(how)


def quant_p(p, how):
    """p: [.., rows, BN] in [0, 1] (relative to the running max)."""
    if how == "bf16":
        return p.bfloat16().float()
    if how == "e4m3":
        return (p * 448).to(F8).float() / 448
    if how == "u8":
        return torch.round(p * 255) / 255
    tm = p.amax(-1, keepdim=True).clamp_min(1e-30)
    if how == "u8 tile":
        return torch.round(p / tm * 255) * (tm / 255)
    if how == "e4m3 tile":
        return (p / tm * 448).to(F8).float() * (tm / 448)
    raise ValueError(how)


def attention_8bit(q, k, v, p_how, v_how):
    B, H, L, D = q.shape
    s = scores8_reference(q, k)         # int8 Q / K exactly as the kernels' pre-pass makes them
    vq = quant_v(v, v_how)
    m = torch.full((B, H, L, 1), -math.inf)
    acc = torch.zeros(B, H, L, D)
    den = torch.zeros(B, H, L, 1)
    for j in range(0, L, BN):
        sj = s[..., j:j + BN]
        mn = torch.maximum(m, sj.amax(-1, keepdim=True))
        alpha = torch.exp(m - mn)
        pq = quant_p(torch.exp(sj - mn), p_how)
        acc = acc * alpha + pq @ vq[:, :, j:j + BN]
        den = den * alpha + pq.sum(-1, keepdim=True)
        m = mn
    return acc / den


def main():
    L = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
    H = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    B, D = 1, 128
    assert L % BN == 0
    for case in ("random", "outliers"):
        rows = {}
        for seed in range(2):
            g = torch.Generator().manual_seed(seed)
            q, k, v = [torch.randn(B, H, L, D, generator=g) for _ in range(3)]
            if case == "outliers":      # a few channels 30x, as the fp8 GEMM test does
                ch = torch.randperm(D, generator=g)[:4]
                for x in (q, k, v):
                    x[..., ch] *= 30
            q, k, v = [x.bfloat16().float() for x in (q, k, v)]
            ref = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D), -1) @ v
            for way in WAYS:
                out = attention_8bit(q, k, v, *way)
                bad = int((~torch.isfinite(out)).sum())
                err = ((out - ref).norm() / ref.norm()).item()
                rows.setdefault(way, []).append(f"{err:.3%}" + (f" ({bad} non-finite)" if bad else ""))
        print(f"[{B},{H},{L},{D}] {case} inputs, int8 Q/K, 2 seeds: relative error vs fp32 attention (bar 2%)")
        print(f"  {'P':10s} {'V':8s} errors")
        for (ph, vh), errs in rows.items():
            print(f"  {ph:10s} {vh:8s} " + "  ".join(errs))


if __name__ == "__main__":
    main()
