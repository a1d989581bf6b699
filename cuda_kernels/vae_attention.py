"""Single-head attention of the VAE decoder's mid block (head dim = C = 512, 128^2 = 16384 tokens).

``vae_attention(q, k, v)``
  q, k, v: [B, C, H, W] bf16 in channels_last memory (each the output of a 1x1 conv: [B, HW, C]
  contiguous rows); returns softmax(q k^T / sqrt(C)) v as [B, C, H, W] channels_last bf16 -- what
  ComfyUI's ``pytorch_attention`` computes (``F.scaled_dot_product_attention`` over [B, 1, HW, C]).
  Why not SDPA: at head dim 512 neither cuDNN's nor the flash kernel applies, and the
  mem-efficient kernel torch falls back to (``fmha_cutlassF_bf16_aligned_32x128_gmem_sm80``) takes
  ~150 TFLOP/s at 1024^2 (BENCHMARKS.md, NHWC decoder) -- the largest single kernel of the
  NHWC decoder after the convolutions.

Backend "numba": the scores in query chunks, as GEMMs at tensor-core rate plus one Numba pass:
  S = q_c k^T       cuBLAS bf16 GEMM with fp32 output (``torch.mm(..., out_dtype=float32)``)
  P = softmax(S / sqrt(C)) -> bf16   ``attn_softmax``: one block per row (grid-strided), three
                    sweeps over the row -- max, sum of exp, normalise + RNE to bf16 (4 values per
                    int64 store); the 64 KB row stays in L2 after the first sweep, so HBM sees S read
                    once and P written once
  O_c = P v         cuBLAS bf16 GEMM (fp32 accumulation), written into the output rows
  P in bf16 is what flash attention feeds its P v MMA too; S and the softmax are fp32.  Chunk rows:
  S + P of a chunk <= 384 MB, chunks balanced (4096 rows at 16384 tokens: 4 chunks, 12 launches);
  <= 48 MB while a CUDA graph is being captured (a graph keeps its memory between replays; the
  launches are free there: 512 rows, 32 chunks at 16384 tokens).
Floor (1024^2, B = 1): 2 x 275 GFLOP at 765 TFLOP/s = 0.72 ms; bytes S (1 GB fp32 written + read)
+ P (0.5 GB written + read) ~ 3 GB -> 0.81 ms; so ~1.5 ms if nothing overlaps.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from . import launching
from .jit import NUMBA_OK, jit_kernel
from .device import RED_SMEM
from . import runtime
from .registry import registry
from .config import VAE_ATTENTION, VaeAttentionConfig  # noqa: F401
from .device import cuda, float32, pack4, unpack_f32x2, ld2, block_sum, block_max  # noqa: F401

OP = "vae_attention"
SIMULATOR = runtime.SIMULATOR
RED = RED_SMEM


def reference(q, k, v):
    """ComfyUI's ``pytorch_attention``: SDPA over [B, 1, HW, C], back to [B, C, H, W] (channels_last view)."""
    B, C, H, W = q.shape
    q, k, v = (t.reshape(B, 1, C, H * W).transpose(2, 3).contiguous() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v)
    return out.reshape(B, H, W, C).permute(0, 3, 1, 2)


registry.register(OP, reference, doc=__doc__)


def make_softmax_kernel():
    def attn_softmax(sw, pw, R, L4, scale):
        """rows r of S (fp32, L = 4 L4 values, as int64 words: 2 fp32 each) -> P (bf16, 4 per word)."""
        red = cuda.shared.array(RED, float32)
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        r = cuda.blockIdx.x
        while r < R:
            base = r * L4
            m = float32(-3.0e38)
            i = tid
            while i < L4:
                t = ld2(sw, 2 * (base + i))
                a = unpack_f32x2(t[0])
                b = unpack_f32x2(t[1])
                m = max(m, max(max(a[0], a[1]), max(b[0], b[1])))
                i += nt
            m = block_max(m, red)
            s = float32(0)
            i = tid
            while i < L4:
                t = ld2(sw, 2 * (base + i))
                a = unpack_f32x2(t[0])
                b = unpack_f32x2(t[1])
                s += (math.exp((a[0] - m) * scale) + math.exp((a[1] - m) * scale)) + \
                     (math.exp((b[0] - m) * scale) + math.exp((b[1] - m) * scale))
                i += nt
            s = block_sum(s, red)
            inv = float32(1) / s
            i = tid
            while i < L4:
                t = ld2(sw, 2 * (base + i))
                a = unpack_f32x2(t[0])
                b = unpack_f32x2(t[1])
                pw[base + i] = pack4(math.exp((a[0] - m) * scale) * inv, math.exp((a[1] - m) * scale) * inv,
                                     math.exp((b[0] - m) * scale) * inv, math.exp((b[1] - m) * scale) * inv)
                i += nt
            r += cuda.gridDim.x

    return jit_kernel(attn_softmax)


_softmax = launching.Launcher(make_softmax_kernel) if NUMBA_OK else None
_F32_OUT = {}


def _mm_f32_ok(device) -> bool:
    """cuBLAS bf16 x bf16 -> fp32 through ``torch.mm(..., out_dtype=)`` (torch >= 2.8 on CUDA), once per device."""
    key = str(device)
    ok = _F32_OUT.get(key)
    if ok is None:
        try:
            a = torch.ones(16, 16, device=device, dtype=torch.bfloat16)
            ok = torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
        except Exception:
            ok = False
        _F32_OUT[key] = ok
    return ok


def _scores(qc, kt):
    if qc.device.type == "cpu":                      # the simulator: CPU tensors
        return qc.float() @ kt.float()
    return torch.mm(qc, kt, out_dtype=torch.float32)


def _rows_view(t):
    B, C, H, W = t.shape
    return t.permute(0, 2, 3, 1).reshape(B, H * W, C)


def check(q, k, v, config=None):
    why = launching.common_check(q, k, v)
    if why:
        return why
    for t in (q, k, v):
        if t.dtype != torch.bfloat16 or t.dim() != 4 or not t.is_contiguous(memory_format=torch.channels_last):
            return "q, k, v must be channels_last bf16 [B, C, H, W]"
        if t.shape != q.shape:
            return "q, k, v shapes differ"
        if t.data_ptr() % 16:
            return "16-byte alignment"
    L = q.shape[2] * q.shape[3]
    if L % 4:
        return f"{L} tokens: a multiple of 4"
    if q.device.type == "cuda" and not _mm_f32_ok(q.device):
        return "torch.mm(out_dtype=float32) not available (torch < 2.8)"
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return "no autograd"
    return None


def vae_attention_numba(q, k, v, config=None):
    """``config``: a VaeAttentionConfig (benchmarks / tests), else ``config.VAE_ATTENTION``."""
    cfg = config or VAE_ATTENTION
    B, C, H, W = q.shape
    L = H * W
    qr, kr, vr = _rows_view(q), _rows_view(k), _rows_view(v)
    out = torch.empty((B, H, W, C), device=q.device, dtype=q.dtype)
    orows = out.view(B, L, C)
    budget = cfg.graph_chunk_bytes if q.is_cuda and torch.cuda.is_current_stream_capturing() else cfg.chunk_bytes
    rows = max(128, min(L, (budget // (6 * L)) // 128 * 128))
    chunks = -(-L // rows)
    rows = min(L, -(-(-(-L // chunks)) // 128) * 128)          # balanced chunks, multiples of 128 rows
    if SIMULATOR:
        rows = max(1, L // 2)
    scale = np.float32(1.0 / math.sqrt(C))
    P = torch.empty((rows, L), device=q.device, dtype=torch.bfloat16)
    for b in range(B):
        kt = kr[b].t()
        for r0 in range(0, L, rows):
            r1 = min(L, r0 + rows)
            S = _scores(qr[b, r0:r1], kt)
            Pc = P[:r1 - r0]
            grid = 2 if SIMULATOR else min(r1 - r0, 8 * runtime.sm_count())
            _softmax(grid, cfg.tpb, S.view(-1).view(torch.int64), Pc.view(-1).view(torch.int64), r1 - r0, L // 4, scale)
            torch.mm(Pc, vr[b], out=orows[b, r0:r1])
    return out.permute(0, 3, 1, 2)


registry.register_backend(OP, "numba", vae_attention_numba, check=check, priority=10)
