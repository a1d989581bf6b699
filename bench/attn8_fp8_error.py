"""How much error would FP8 (e4m3) P.V add to the 8-bit attention?  A CPU emulation (torch), run
on the same kind of inputs as the GPU checks (fresh N(0, 1) bf16 q / k / v, fp32 reference):

    python bench/attn8_fp8_error.py [L] [H]

Q / K: int8 as the kernels quantize them (K smoothed by its mean, Q per 16 rows, K per 64 keys);
P = exp(S - rowmax) in [0, 1]; then P V four ways: P and V in bf16 (what the kernels do), V in
e4m3 with per-channel scales, P in e4m3 (scaled so max P = 448), both (SageAttention2's FP8 P V).
Prints the relative Frobenius error of each against fp32 attention; the issue's 8-bit bar is 2%.
"""
import math
import sys

import torch


def main():
    L = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
    H = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    B, D = 1, 128
    f8 = torch.float8_e4m3fn
    rows = {}
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        q, k, v = [torch.randn(B, H, L, D, generator=g).bfloat16().float() for _ in range(3)]
        ref = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D), -1) @ v

        def qint8(x, blk):
            xs = x.view(B, H, L // blk, blk, D)
            sc = xs.abs().amax((3, 4), keepdim=True) / 127
            return (torch.round(xs / sc).clamp(-127, 127) * sc).view(B, H, L, D)

        s = qint8(q, 16) @ qint8(k - k.mean(2, keepdim=True), 64).transpose(-1, -2) / math.sqrt(D)
        p = torch.exp(s - s.amax(-1, keepdim=True))
        den = p.sum(-1, keepdim=True)
        vs = v.abs().amax(2, keepdim=True) / 448
        v8 = (v / vs).to(f8).float() * vs
        p8 = (p * 448).to(f8).float() / 448
        pb = p.bfloat16().float()
        for name, out in (("bf16 P, bf16 V (the kernels)", pb @ v), ("bf16 P, e4m3 V", pb @ v8),
                          ("e4m3 P, bf16 V", p8 @ v), ("e4m3 P, e4m3 V (FP8 P.V)", p8 @ v8)):
            rows.setdefault(name, []).append(((out / den - ref).norm() / ref.norm()).item())
    print(f"[{B},{H},{L},{D}] int8 Q/K, 3 seeds: relative error vs fp32 attention (bar 2%)")
    for name, errs in rows.items():
        print(f"  {name:32s} " + "  ".join(f"{e:.3%}" for e in errs))


if __name__ == "__main__":
    main()
