"""Non-causal multi-head attention in FLUX's layout.

``attention(q, k, v, mask=None, out=None) -> [B, L, H*D]``
  q, k, v: [B, H, L, D] (RoPE already applied); mask: None, bool or additive float,
  [L, L] / [B, L, L] / [B, H, L, L] (ComfyUI's rules); scale 1/sqrt(D).
  out: optional [B, L, H*D] view to write into (the single block's linear2 input buffer).

Backends
--------
``numba`` (priority 10): bf16 flash-attention forward on tensor cores (mma.sync m16n8k16 via
inline PTX, helpers in ``mma.py``): FA2 scheme, bf16 in / fp32 accumulate / bf16 out.

Tiling: one block = BM=64 query rows of one (b, h), 4 warps x 16 rows; KV tiles of BN=64 tokens.
Shared memory: sK, sV = 64 x (D + 8) bf16 each (rows padded by 16 bytes: conflict-free ldmatrix),
34.8 KB at D=128 (fits the 48 KB static limit); Q is staged once through that K|V buffer and
kept in registers as mma A fragments (D=128: 252 registers/thread, no spills, per ptxas).  Global -> shared with 16-byte cp.async (zero-filled past L);
V of tile j loads while S = Q K^T of tile j runs, K of tile j+1 while P V of tile j runs.
Online softmax in fp32, base 2 (scale * log2 e folded into S), P rounded to bf16 for the
P V mma exactly like FlashAttention.  Ragged tails: query rows >= L are computed on zeros and
not stored; key columns >= L get -3e38 before the max.  Mask: converted once per call to an
additive float32 [Bm, Hm, L, L] view (bool -> 0 / -1e30, floats clamped to >= -1e30: the kernel
is built with fast-math, so no infinities), broadcast with stride 0; a row whose every key is
masked averages V uniformly instead of producing NaN (SDPA gives NaN there).
FLOPs: 4 * B * H * L^2 * D (QK^T + PV); [1,24,4608,128]: 261 GFLOP -> 0.35 ms at 750 TFLOP/s.
Variants (``FLUX_ATTN_TILE`` / ``set_variant``): ``4w`` = 64 query rows per block (default),
``8w`` = 128 rows, 8 warps sharing each K/V tile (same 35 KB of shared memory); Hopper only
(sm_90, else 4w): ``wg`` = one warpgroup / 64 rows on wgmma (S: m64n64k16, Q in registers, K via a
shared-memory descriptor; O: m64n{D}k16, P in registers, V MN-major via a descriptor; no-swizzle
core-matrix tiles, 32 KB), ``wgr`` = wg capped at 168 registers, ``wg2`` = two warpgroups / 128
rows sharing each K/V tile (half the L2 -> SM traffic).  Measured (H200, [1,24,4608,128], median
of 25): 4w 0.974 ms = 268 TFLOP/s (cuDNN SDPA 0.398 ms = 655); wg 1.707 ms, wgr 1.804, wg2 1.243
(all correct at D=128, errors = SDPA's; ~80% error at D=64, so on the GPU they run for D=128 only
and fall back to 4w otherwise -- see _wg_ok).  4w stays the default.
``w32`` family (``_make_kernel32``, FA2's tiling; every head dim): 32 query rows per warp (two
m16 tiles), so one ldmatrix.x4 (512 B) feeds 4 mma instead of 2: 128 B of shared-memory reads per
4096-FLOP mma instead of 256 (Hopper: ~128 B/clk/SM, i.e. 4w needs >= 2 clk of smem per mma).
Q stays in registers (2 x D/4), O 2 x D/2 fp32, so at D=128 the KV tile is 32 keys (S = 32
fp32; 224 array registers, ptxas: 255 regs + ~70 B spill, the 4 row sums) -- 64 keys at D <= 64;
K/V in a 2-stage cp.async ring (34.8 KB static, tile j+1 loads while tile j computes, one barrier
per tile); O is rescaled only for rows whose running max moved (exact).  ``w32`` = 4 warps / 128
rows (864 blocks at FLUX size, 2 per SM: 3.27 waves -> 4), ``w32x8`` = 8 warps / 256 rows (half
the L2 -> SM K/V traffic; Q staged in 2 passes), ``w32x2`` = 2 warps / 64 rows, ``w32e`` = w32
rescaling O every tile, ``w32n32`` = 32-key tiles at any D.  Predicted at FLUX size: ~0.6-0.75 ms
(350-430 TFLOP/s).  MEASURED (H200, session 2 run 4, device time of 10 launches in a CUDA graph):
4w 1.009 ms, w32 1.133, w32x8 1.035, w32n16 1.187 -- all correct (errors = SDPA's on every case)
and all slower than 4w: halving the shared-memory reads per mma bought nothing, so the smem
bandwidth model was wrong for these kernels (spills at 255 registers and the longer per-tile
softmax chain are the suspects; no Nsight Compute here to tell).  Opt-in only.
``wgp`` family (``_make_kernel_wgp``, Hopper, D=128 on the GPU like wg): wg's wgmma kernel with
32-key K|V tiles in a 3-stage cp.async ring (16 KB per stage = exactly 48 KB static; 2 tiles in
flight while one computes, one barrier per tile) instead of wg's single buffers, whose load latency
was exposed every tile; O rescaled only when the row max moved.  ptxas: wgp 194 regs (2 blocks/SM),
``wgpr`` capped at 168 (3 blocks/SM, 28 B spill), ``wgpx2`` 2 warpgroups / 128 rows (161 regs),
``wgp2`` 2-stage ring.  Prediction: the wgmma work per 32-key tile is ~256 clk/SM vs ~500+ with
mma.sync, so 0.45-0.6 ms if 2-3 co-resident blocks hide the softmax and the waits.
``wgpp`` (``_make_kernel_wgpp``): wgp plus FA3's intra-warpgroup overlap -- S(j+1) and P(j) V(j)
are issued together, the softmax of tile j+1 runs between wait_group 1 and 0 (SASS checked: 8
HGMMA 64x32 + 2 HGMMA 64x128 back to back, DEPBAR 1, softmax, DEPBAR 0; no branch may surround a
wgmma group or ptxas serializes them all (C7514), hence a phantom last S that is masked out).
186 regs (``wgppr``: 168, 8 B spill; ``wgppx2``: 2 warpgroups / 128 rows, 167 regs).
``wgpp64``: 64-key tiles (half the per-tile barriers / waits / shuffles per key; 255 regs, no
spill), 3 x 32 KB ring in dynamic shared memory (96 KB: _dyn_optin sets the kernel attribute
before the first launch; 2 blocks/SM = 192 KB).  Predicted the fastest: ~0.45-0.55 ms.
MEASURED (session 2 run 4): wgpp 1.900 ms, wgpp64 1.796, wgppr 1.811 -- correct (masks, ragged
L=333, x12 logits: errors = SDPA's; the >48 KB dynamic shared memory opt-in works) but 1.8x
slower than 4w.  Opt-in only; 4w stays the default (cuDNN SDPA: 0.40-0.44 ms = 590-650).

``numba-8bit`` (priority 5, never picked over ``numba`` automatically; the fast profile forces it):
K smoothed by a per-head vector (mean of 64 evenly spaced tokens; no correction needed, see the
section comment), Q int8 per 16 rows, K int8 per 64 tokens (absmax scales), S on int8 tensor
cores (m16n8k32, exact int32), P bf16 x the caller's bf16 V (m16n8k16, fp32 accumulate).
Pre-pass = ONE numba launch (``quantize_8bit_numba``, 85 MB = ~23 us of traffic at FLUX size; it
was 3 launches + a torch mean + a V->fp16 pass = 1.11 ms; the one-launch version measured 0.40 ms
(0.23 ms at [1,1,16384,64]: launch overhead + serialized load latency), since then the loads are
branch-free (unmeasured)); ``quantize_8bit`` is its torch reference (``FLUX_ATTN_8BIT_PREPASS=torch``
uses it).  Head dims 32, 64, 128.  Measured: 8-bit total 0.935 ms at FLUX (was 1.78), error 1.26%.
Fused prologue (no pre-pass): flux_core.blocks asks ``qk_norm_rope(..., quant8=True)`` when attention
is forced to numba-8bit; that pass also writes int8 Q/K with per-(token, head) scales (K minus a
per-head mean of 64 sampled tokens from a tiny pre-launch) and the block offers the pack to exactly
one attention call (``prequantized(pack)``; taken only for the same q/k objects).  The kernel then
runs with per-token scales (``_make_kernel8(per_tok=True)``: K scales staged in shared memory with
the K tile, the Q row scale folded into the exp2 argument).  Without a pack: the pre-pass as above.
MEASURED (session 2 run 4, device time): pre-pass 0.091 ms (the 0.40 ms above was host-bound
timing), old path pre-pass + kernel 0.903 ms; fused: qk_norm_rope with quantization 0.098 ms vs
0.052 plain, kernel 0.908 ms; prologue + attention 1.000 ms fused vs 0.951 old -- the per-token
scales cost the kernel ~0.1 ms, so the fusion is 5% slower, but more accurate: 1.01-1.11% vs
1.32-1.47% (fp32 reference; SDPA bf16 0.23%).  Bar (<= 0.33 ms) not met by either.
``FLUX_ATTN_8BIT_KERNEL=wg|wgr`` / ``set_variant8``: Hopper kernel, S on wgmma m64n64k32 s8
(correct at D=128, 1.49 ms: slower than the mma.sync kernel; D=128 only on the GPU).
Since session 3 the Hopper default at D=128 is the wgb family (``_make_kernel8_wgb``: the bf16
default's bulk-copy structure with S on int8 wgmma); session 4: ``wgbp`` (ping-pong warpgroups,
4-stage ring) 0.487 ms kernel, and with qk_norm_rope's pack it uses the pack's Q8 + per-token Q
scales and quantizes K itself (QTOK; per-token K scales would need a scale per S column: measured
0.80 ms).  The 0.33 ms bar: K / V bulk traffic (1.5 GB per call at 128-row blocks) bounds the
kernel at ~0.49 ms and its compute alone at ~0.40 (no-load ablation); FP8 P V, the way past both,
costs 2.9-3.9% error on the bar's inputs (bench/attn8_fp8_error.py) against the 2% bar.
"""
import torch
import torch.nn.functional as F

from ..registry import registry
from .launch import normalize_mask

OP = "attention"


def reference(q, k, v, mask=None, out=None):
    B, H, L, D = q.shape
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=normalize_mask(mask), dropout_p=0.0, is_causal=False)
    o = o.transpose(1, 2).reshape(B, L, H * D)
    if out is None:
        return o
    out.copy_(o)
    return out


registry.register(OP, reference, doc=__doc__)


# ====================================================================== numba backend (bf16 flash attention)
# (design notes: module docstring)
import math as _math
import os

from .. import runtime as _rt
from .launch import (_BM, _BN, _NW, _LOG2E, SMEM_ALIGN, SMEM_ALIGN_WG, _words, _f32_1d, _dummy_mask,  # noqa: F401
                     _cp_ok, _prep_mask, _dyn_optin, _dwords, _launch, _go, _arr, _c_arr, _words_ok)
from .bf16_mma import _make_kernel  # noqa: F401
from .bf16_wgmma import _make_kernel_wgpp  # noqa: F401
from .int8_mma import _make_kernel8  # noqa: F401
from .int8_wgmma import _make_kernel8_wgb  # noqa: F401
from .softmax import _make_softmax  # noqa: F401
from .tile_kv import _make_issue, tile_kv_reference, tile_kv, _tile_kernel, _stand_in  # noqa: F401
from .int8_format import (_KMEAN_SAMPLES, _kmean_index, quantize_8bit, _QNT, _make_prepass, _qkernel,  # noqa: F401
                          _scratch8, _scratch8_tiled, _prepass, quantize_8bit_numba)

_kernels = {}


# Tiling variants of the bf16 kernel: "4w" = mma.sync, 64 query rows (4 warps) x 64-key tiles
# (default off Hopper / at head dims != 128), "8w" = 128 rows (8 warps); "wgpp128x2s3b" = the wgmma
# kernel, 2 warpgroups x 128-key tiles, 3-stage bulk-copy ring (default on Hopper at D=128).
# Retired at tag attention-variants-pre-retire (BENCHMARKS.md, [1,24,4608,128], H200):
#   w32 family (32 rows / warp): 1.133 ms (w32x8 1.035, w32n16 1.187) vs 4w 1.009
#   wg / wgr / wg2 (single-buffered wgmma): 1.71 / 1.80 / 1.24 ms
#   wgp / wgpp / wgpp64 / wgppr (cp.async ring): 1.90 / 1.80 / 1.81 ms; 128x2s3 cp.async 1.074
#   wgpp..f (unchecked full-tile loads): 1.001 vs 1.058 (cp.async ring, still 1.8x the bulk kernel)
#   wgpp..w (producer warp): 32x1s4w 0.656, 32x2s6w 0.781 vs 128x2s3b 0.561
#   wgpp..e (mbarrier stage release): 128x2s3e 0.594; ..p (+ ping-pong): 0.595 vs 0.561
VARIANTS = {"4w": 4, "8w": 8, "wgpp128x2s3b": "wgpp128x2s3b", "auto": "auto"}
_AUTO_WG = "wgpp128x2s3b"
_variant = os.environ.get("FLUX_ATTN_TILE", "auto")
if _variant not in VARIANTS:
    _variant = "auto"


def set_variant(name):
    global _variant
    if name not in VARIANTS:
        raise ValueError(f"unknown attention tiling {name!r}; have {sorted(VARIANTS)}")
    _variant = name


def _warps(D, dev=None):
    nw = VARIANTS[_variant]
    if nw == "auto":
        nw = _AUTO_WG if _wg_ok(D, dev) and not _rt.SIMULATOR else 4
    if nw == _AUTO_WG:
        return nw if _wg_ok(D, dev) else 4
    return nw if (64 * (D // 8)) % (32 * nw) == 0 else 4  # 8 warps need D >= 32


_hop_cache = {}


def _wg_ok(D, dev):
    """wgmma kernels: Hopper only, and (on the GPU) head dim 128 only -- the H200 run of
    2026-11-29 passed every D=128 case and the D=32 unit tests but gave ~80% error at D=64
    (L=16384), cause not found yet (the simulator's emulation of the same layout passes D=64)."""
    return _hopper(dev) and (_rt.SIMULATOR or D == 128)


def _hopper(dev):
    if _rt.SIMULATOR:
        return True
    ok = _hop_cache.get(dev)
    if ok is None:
        ok = _hop_cache[dev] = torch.cuda.get_device_capability(dev)[0] == 9
    return ok


def _kernel(D, has_mask, nw=4):
    key = (D, bool(has_mask), nw)
    kern = _kernels.get(key)
    if kern is None:
        kern = _kernels[key] = (_make_kernel_wgpp(D, bool(has_mask), 2, 128, 3) if nw == _AUTO_WG
                                else _make_kernel(D, bool(has_mask), nw))
    return kern


_cc_cache = {}


def _cc_ok(dev):
    if _rt.SIMULATOR:
        return True
    ok = _cc_cache.get(dev)
    if ok is None:
        ok = _cc_cache[dev] = torch.cuda.get_device_capability(dev) >= (8, 0)
    return ok


def check(q, k, v, mask=None, out=None):
    why = _rt.device_ok(q, k, v, mask, out)
    if why:
        return why
    if not _cc_ok(q.device):
        return "needs compute capability >= 8.0 (mma.sync bf16, ldmatrix, cp.async)"
    if q.dtype != torch.bfloat16 or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"numba attention takes bf16 only (got {q.dtype})"
    if q.ndim != 4 or k.shape != q.shape or v.shape != q.shape:
        return "q, k, v must share one [B, H, L, D] shape (self-attention)"
    D = q.shape[-1]
    if D % 16 or D > 128 or D < 16:
        return f"head dim {D} unsupported (multiples of 16 up to 128)"
    if q.shape[2] < 1:
        return "empty sequence"
    if q.shape[0] * q.shape[1] > 65535:
        return "B*H > 65535 (grid y limit)"
    if mask is not None:
        if mask.ndim not in (2, 3, 4) or tuple(mask.shape[-2:]) != (q.shape[2], q.shape[2]):
            return f"mask shape {tuple(mask.shape)} unsupported (need [..., L, L])"
    if out is not None and (out.dtype != q.dtype or tuple(out.shape) != (q.shape[0], q.shape[2], q.shape[1] * D)):
        return "out must be bf16 [B, L, H*D]"
    return None


def numba_attention(q, k, v, mask=None, out=None):
    B, H, L, D = q.shape
    q, k, v = [x if _cp_ok(x) else x.contiguous() for x in (q, k, v)]
    dst = out
    if dst is None or dst.stride(-1) != 1 or dst.stride(1) % 2 or dst.stride(0) % 2 or dst.data_ptr() % 4:
        dst = torch.empty((B, L, H * D), dtype=q.dtype, device=q.device)
    if mask is not None:
        m, mst = _prep_mask(mask, B, H, L, q.device)
        marr = _f32_1d(m)
    else:
        m, mst = None, [0, 0, 0]
        marr = _dummy_mask.get(q.device)
        if marr is None:
            marr = _dummy_mask[q.device] = _f32_1d(torch.zeros(1, dtype=torch.float32, device=q.device))
    nw = _warps(D, q.device)
    kern = _kernel(D, mask is not None, nw)
    if nw == _AUTO_WG:
        nth, rows = kern.nth, kern.rows
    else:
        nth, rows = 32 * nw, 16 * nw
    if getattr(kern, "tile_kv", 0):
        k, v = tile_kv(k, v, kern.tile_kv)
    _launch(kern, q, k, v, dst, marr, mst, rows, nth)
    if out is not None and dst is not out:
        out.copy_(dst)
        return out
    return dst


# Opt-in (auto=False): on the H200 cuDNN's SDPA is 2.5x faster at FLUX shapes (BENCHMARKS.md), so
# `auto` would only pay ~4 s of JIT to time it and lose; FluxNumbaPatch's attention option forces it.
registry.register_backend(OP, "numba", numba_attention, check=check, priority=10, auto=False)


# ====================================================================== numba-8bit backend
# SageAttention-style: K smoothed by a per-(b, h) mean over tokens (softmax is invariant to a
# per-query constant shift: subtracting any vector c from every key changes row i of Q K^T by the
# constant q_i . c, so NO correction is needed -- c only has to be the same for all keys of a
# head; we use the mean of 64 evenly spaced tokens, which every K block recomputes identically),
# Q quantized to int8 per 16 query rows (one warp's rows), K per 64-token tile, absmax / 127
# scales; S = Q K^T on int8 tensor cores (mma m16n8k32 s8, exact int32), rescaled to fp32;
# online softmax in fp32; P (bf16) V (the caller's bf16 V, read in place: no conversion pass)
# on bf16 tensor cores (m16n8k16, fp32 accumulate), exactly like the bf16 kernel.
# Pre-pass: ONE numba launch (``quantize_8bit_numba``) reads Q and K once and writes int8 + scales
# into cached scratch buffers; ``quantize_8bit`` is its torch reference (tests).

_kernels8 = {}


# "auto" (default): _AUTO8 = wgbp on Hopper at head dim 128 (kernel 0.487 ms at the FLUX shape;
# op with the Numba pre-pass 0.66 ms, fed by qk_norm_rope's fused pack 0.62 ms vs the mma kernel's
# 0.90, same error), else "mma".  With qk_norm_rope's per-token pack wgbp takes the pack's Q8 + Q
# scales (QTOK) and quantizes K itself (K-only pre-pass, tile layout); the mma kernel takes the
# whole pack.  Retired at tag attention-variants-pre-retire (BENCHMARKS.md, H200, FLUX shape):
#   wg / wgr (single-warpgroup int8 wgmma, cp.async): 1.49 ms op vs mma 0.90
#   wgb (block barrier per tile, 3 stages): kernel 0.520-0.530 vs wgbp 0.487
#   wgbpf (wgbp + int32-direct softmax, FS): 0.492-0.498 vs 0.487
#   torch pre-pass (FLUX_ATTN_8BIT_PREPASS=torch): 1.11 ms vs the Numba pre-pass 0.091
_variant8 = os.environ.get("FLUX_ATTN_8BIT_KERNEL", "auto")
_AUTO8 = "wgbp"
_VARIANTS8 = ("auto", "mma", "wgbp")


def set_variant8(name):
    global _variant8
    if name not in _VARIANTS8:
        raise ValueError(f"unknown 8-bit attention kernel {name!r}; have {list(_VARIANTS8)}")
    _variant8 = name


def _kernel8(D, has_mask, wg=None, per_tok=False):
    key = (D, bool(has_mask), wg, bool(per_tok))
    kern = _kernels8.get(key)
    if kern is None:
        kern = _kernels8[key] = (_make_kernel8_wgb(D, bool(has_mask), QTOK=bool(per_tok)) if wg == "wgbp"
                                 else _make_kernel8(D, bool(has_mask), bool(per_tok)))
    return kern


# ---- handoff from qk_norm_rope(quant8=True): its Quant8 (int8 Q/K + per-token scales, made in the
# same pass as the bf16 q/k) replaces the pre-pass.  Scoped and validated: flux_core.blocks wraps
# exactly one attention call in ``prequantized(pack)``; numba-8bit takes the pack only when the call's
# q and k ARE the tensors the pack was made from (object identity) with matching shapes; any other
# backend (torch / SDPA, bf16 numba, ComfyUI's attention) never looks at it.  No op signature changes.
import contextlib as _contextlib
import threading as _threading

_q8_local = _threading.local()


@_contextlib.contextmanager
def prequantized(pack):
    """Offer ``pack`` (a qk_norm_rope Quant8, or None) to the numba-8bit attention calls inside."""
    prev = getattr(_q8_local, "pack", None)
    _q8_local.pack = pack
    try:
        yield
    finally:
        _q8_local.pack = prev


def _pending_pack(q, k):
    pk = getattr(_q8_local, "pack", None)
    if pk is None or pk.q is not q or pk.k is not k:
        return None
    B, H, L, D = q.shape
    if k.shape != q.shape or tuple(pk.q8.shape) != (B, H, pk.Lp, D) or pk.Lp < L or pk.Lp % _BN \
            or pk.q8.device != q.device or pk.qs.numel() != B * H * pk.Lp:
        return None
    return pk


def check_8bit(q, k, v, mask=None, out=None):
    why = check(q, k, v, mask, out)
    if why:
        return why
    if q.shape[-1] not in (32, 64, 128):
        return f"8-bit attention needs head dim 32, 64 or 128 (got {q.shape[-1]})"
    return None


def numba_attention_8bit(q, k, v, mask=None, out=None):
    B, H, L, D = q.shape
    pk = _pending_pack(q, k)
    if not all(_words_ok(x) for x in (q, k)):
        q, k = q.contiguous(), k.contiguous()
    if not _cp_ok(v):
        v = v.contiguous()
    v8 = ("mma" if _rt.SIMULATOR else _AUTO8) if _variant8 == "auto" else _variant8
    wg = v8 if (v8 != "mma" and _wg_ok(D, q.device)) else None
    kern = _kernel8(D, mask is not None, wg, pk is not None)
    BNt = kern.tile_kv if wg else 0     # wgbp: K8 and V as tile images for the bulk copies
    if pk is not None:  # fused: qk_norm_rope already wrote int8 Q/K + per-token scales
        Lp = pk.Lp
        arrs = pk.views.get("attn8")
        if arrs is None:  # numba views cached with the (scratch) buffers
            arrs = pk.views["attn8"] = (_arr(pk.q8), _arr(pk.k8), _c_arr(pk.qs), _c_arr(pk.ks))
        q8a, k8a, qsa, ksa = arrs
        if BNt:         # Q8 + per-token Q scales from the pack; K8 tiled + per-64-key scales here
            ent, Lk = _prepass(q, k, tiled=BNt, konly=True)
            assert Lk == Lp, (Lk, Lp)
            k8a, ksa = ent[7], ent[9]
    else:
        ent, Lp = _prepass(q, k, tiled=BNt)     # K8 straight in the tile layout when BNt
        q8a, k8a, qsa, ksa = ent[6], ent[7], ent[8], ent[9]
    dst = out
    if dst is None or dst.stride(-1) != 1 or dst.stride(1) % 2 or dst.stride(0) % 2 or dst.data_ptr() % 4:
        dst = torch.empty((B, L, H * D), dtype=q.dtype, device=q.device)
    if mask is not None:
        m, mst = _prep_mask(mask, B, H, L, q.device)
        marr = _f32_1d(m)
    else:
        mst = [0, 0, 0]
        marr = _dummy_mask.get(q.device)
        if marr is None:
            marr = _dummy_mask[q.device] = _f32_1d(torch.zeros(1, dtype=torch.float32, device=q.device))
    rows, nth = _BM, _NW * 32
    if BNt:
        v = tile_kv(v, None, BNt)[0]
        rows, nth = kern.rows, kern.nth
    args = (q8a, k8a, _words(v), qsa, ksa, _words(dst), marr,
            v.stride(0) // 2, v.stride(1) // 2, v.stride(2) // 2,
            dst.stride(0) // 2, dst.stride(1) // 2, mst[0], mst[1], mst[2], L, Lp, H, _LOG2E / _math.sqrt(D))
    _go(kern, ((L + rows - 1) // rows, B * H), nth, args, q.device)
    if out is not None and dst is not out:
        out.copy_(dst)
        return out
    return dst


registry.register_backend(OP, "numba-8bit", numba_attention_8bit, check=check_8bit, priority=5, auto=False)
