"""Non-causal multi-head attention in FLUX's layout.

``attention(q, k, v, mask=None, out=None, q8=None) -> [B, L, H*D]``
  q, k, v: [B, H, L, D] (RoPE already applied); mask: None, bool or additive float,
  [L, L] / [B, L, L] / [B, H, L, L] (ComfyUI's rules); scale 1/sqrt(D).
  out: optional [B, L, H*D] view to write into (the single block's linear2 input buffer).
  q8: optional ``int8_format.Quant8`` of these very q / k (qk_norm_rope(quant8=True)): the 8-bit
      backend uses it instead of its pre-pass; every other backend ignores it.
FLOPs: 4 * B * H * L^2 * D; [1,24,4608,128]: 261 GFLOP -> 0.35 ms at 750 TFLOP/s.

Backends: ``cudnn`` (torch SDPA with cuDNN's kernel tried first; auto times it against the
reference, whose torch order tries FLASH first) and the pack's two kernels, both opt-in
(``auto=False``: cuDNN's SDPA is faster at FLUX shapes; forced by the node's attention option or
the fast profile)
  ``numba``       bf16 flash-attention forward: bf16 in, fp32 accumulate / softmax, bf16 out.
  ``numba-8bit``  SageAttention-style: S = Q8 K8^T on int8 tensor cores (exact int32), P (bf16) V
                  (the caller's bf16 V) on bf16 tensor cores.
  ``numba-8bit-u8s8``  the same with P V on integers too (u8 P x s8 V, int8_wgmma_u8s8; Hopper d128
                  only; an experiment of issue #38, forced only).
``reference`` (torch SDPA) is the op's reference; ``check`` / ``check_8bit`` say why a backend
declines a call.  Measurements and the history of every variant tried: BENCHMARKS.md.

Kernels (one file each; ``config.select_bf16`` / ``select_int8`` pick one per device and head dim)
  bf16_mma     mma.sync m16n8k16, 4 warps x 16 query rows, 64-key K / V tiles double-buffered
               through cp.async (35 KB static shared memory; Q kept in registers); every sm_80+ GPU.
  bf16_wgmma   Hopper wgmma, 2 warpgroups x 64 rows, 128-key tiles in a 3-stage ring moved by
               bulk copies (K / V re-laid out once by ``tile_kv``), S(j+1) issued with P(j) V(j).
  int8_mma     the bf16_mma structure with S on mma.sync m16n8k32 s8.
  int8_wgmma   the bf16_wgmma structure with S on wgmma s8, the two warpgroups ping-ponging
               (named-barrier turns, stages released on mbarriers), a 4-stage ring; V chunk-major
               with a ones column (row sums from P V), a quarter of P's exp2 by a cubic on the FMA pipe.
  int8_wgmma_u8s8  int8_wgmma with P V on wgmma u8 x s8 (Int8Config pv="u8s8"): u8 P per row and
               64-key group, V as vt8's s8 V^T tiles with channel scales, int32 per group.
The wgmma kernels run on sm_90 at head dim 128 only (``config.wgmma_ok``).

Shared pieces, imported one way (``launch`` <- ``fragments``, ``softmax``, ``tile_kv``,
``int8_format`` <- the kernel files <- ``config`` <- this module; qk_norm_rope imports
``int8_format``, nothing here imports qk_norm_rope):
  launch       ``Kernel`` (a kernel + its launch geometry), numba views, mask, output buffer, launch.
  fragments    register-fragment pieces all kernels share (ids, Q fragments, S / P V on mma.sync,
               the wgmma issue groups, O rescale and store, padded-row loads).
  softmax      the online softmax over one S tile (mask + ragged tail, running max / sum, S -> P).
  tile_kv      K / V as the byte image of the wgmma kernels' shared-memory tiles + the bulk copy.
  int8_format  the int8 Q / K format (K smoothed by a per-head mean of 64 evenly spaced tokens --
               softmax is invariant to it, no correction needed; absmax / 127 scales per 16 query
               rows and per 64 keys, or per token from qk_norm_rope's pack) and the one-launch
               pre-pass that writes it.

Numerics common to all kernels: online softmax in fp32, base 2 (scale * log2 e folded into one
FFMA), P rounded to bf16 for P V as in FlashAttention; query rows >= L computed on zeros and not
stored; key columns >= L get -3e38 before the max.  The mask becomes one additive fp32
[Bm, Hm, L, L] view (bool -> 0 / -1e30, floats clamped to >= -1e30: fast-math, no infinities),
broadcast with stride 0; a fully masked row averages V uniformly (SDPA gives NaN).

8-bit hand-off, an explicit value: flux_core.blocks decides from its options (``BlockContext.quant8``)
to ask ``qk_norm_rope(..., quant8=...)`` for int8 Q / K with per-token scales (a ``Quant8``) and
passes it to this op as ``q8``.  The mma kernel takes the whole pack; the wgmma kernel takes its
Q8 + per-token Q scales and V's tile image (``pack.vt``, written by the same pass: no tile_kv
launch) and quantizes K itself (per-64-key scales, in the tile layout), so the block asks for what
``int8_pack_kind(device, head dim)`` says ("qk", or "qv" for the wgmma kernel).
"""
import math

import torch
import torch.nn.functional as F

from .. import runtime as _rt
from ..registry import registry
from .launch import (normalize_mask, Kernel, _cp_ok, _words_ok, _words, _f32_1d, _arr, _c_arr,  # noqa: F401
                     _launch, _go, _mask_args, _out_buffer, _LOG2E, _BN)
from .tile_kv import tile_kv, tile_kv_reference  # noqa: F401
from .int8_format import (Quant8, quant8_reference, kmean_index, usable_pack, operands,  # noqa: F401
                          quantize_8bit, quantize_8bit_numba, _prepass, pack_vt, VT_KEYS,
                          reference_pack, scores8_reference, attention8_reference)
from .vt8 import pack_vt8, pack_vt8_reference  # noqa: F401
from . import config as configs  # noqa: F401  (the module; ``config`` is the backends' keyword)
from .config import Bf16Config, Int8Config, build, select_bf16, select_int8, wgmma_ok  # noqa: F401

OP = "attention"


def reference(q, k, v, mask=None, out=None, q8=None):
    B, H, L, D = q.shape
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=normalize_mask(mask), dropout_p=0.0, is_causal=False)
    o = o.transpose(1, 2).reshape(B, L, H * D)
    if out is None:
        return o
    out.copy_(o)
    return out


registry.register(OP, reference, doc=__doc__)


# ----------------------------------------------------------------------------- cuDNN-first SDPA
def _sdpa_priority():
    try:
        import inspect
        from torch.nn.attention import SDPBackend, sdpa_kernel
        if "set_priority" not in inspect.signature(sdpa_kernel).parameters:
            return None
        return sdpa_kernel, [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                             SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    except Exception:
        return None


_PRIORITY = _sdpa_priority()
_ORDER_SET = set()  # devices whose default SDPA backend order torch has settled


def settle_default_order(device):
    """Make torch settle its default SDPA backend order on ``device`` before the pack ever saves and
    restores it.  torch picks that default lazily, at its first attention dispatch (cuDNN first on
    Hopper / Blackwell with a recent cuDNN, else flash first); ``sdpa_kernel(set_priority=True)``
    saves the order on entry and sets it back on exit -- used before that first dispatch, it saves
    the generic flash-first list and, on exit, makes it the process's order for good: every later
    stock attention then ran torch's flash kernel (~0.8 ms instead of ~0.45 at FLUX's shape on an
    H200; ComfyUI v0.8.0 stock ~11% slower per image after a first patched prompt).  One tiny
    attention call per device settles it; the save / restore is then exact."""
    if device in _ORDER_SET:
        return
    q = torch.zeros(1, 1, 8, 64, device=device, dtype=torch.bfloat16)
    F.scaled_dot_product_attention(q, q, q)
    _ORDER_SET.add(device)


def cudnn_attention(q, k, v, mask=None, out=None, q8=None):
    """The reference with cuDNN's fused attention tried first (then flash / efficient / math, so a
    call cuDNN declines still runs).  torch's own order tries FLASH first where it does not prefer
    cuDNN (on an H200 pytorch's flash kernel takes ~0.85 ms at [1,24,4608,128], cuDNN ~0.45); auto
    times both per shape.  The process's order is left exactly as it was (``settle_default_order``)."""
    if not torch.backends.cuda.cudnn_sdp_enabled():  # disabled since the registry chose this backend
        return reference(q, k, v, mask, out)  # (its decision is remembered): torch's own order, as asked
    settle_default_order(q.device)
    ctx, order = _PRIORITY
    with ctx(order, set_priority=True):
        return reference(q, k, v, mask, out)


def check_cudnn(q, k, v, mask=None, out=None, q8=None):
    if not q.is_cuda:
        return "cuDNN attention needs CUDA tensors"
    if _PRIORITY is None:
        return "this torch cannot set an SDPA backend order (torch.nn.attention.sdpa_kernel(set_priority=))"
    if not torch.backends.cuda.cudnn_sdp_enabled():
        return "cuDNN SDPA is disabled in torch.backends.cuda"
    settle_default_order(q.device)  # (outside any capture: the registry checks before it runs an op)
    return None


registry.register_backend(OP, "cudnn", cudnn_attention, check=check_cudnn, priority=1)

_cc_cache = {}


def capability(dev):
    """(major, minor) of ``dev``; the simulator reports sm_80 -- it runs what a non-Hopper GPU runs
    (tests reach the wgmma kernels through an explicit config)."""
    if _rt.SIMULATOR:
        return (8, 0)
    if getattr(dev, "type", str(dev).split(":")[0]) != "cuda":
        return (0, 0)  # not a CUDA device (a CPU tensor on a CPU-only torch): no kernel runs there
    cc = _cc_cache.get(dev)
    if cc is None:
        cc = _cc_cache[dev] = torch.cuda.get_device_capability(dev)
    return cc


def _resolve(cfg, select, q):
    """The config of this call: ``cfg`` (checked against the device and head dim) or the selection."""
    cc, D = capability(q.device), q.shape[-1]
    if cfg is None:
        return select(cc, D)
    if cfg.kind == "wgmma" and not wgmma_ok(cc, D, _rt.SIMULATOR):
        raise ValueError(f"{cfg} needs sm_90 and head dim 128 (got sm_{cc[0]}{cc[1]}, D={D})")
    return cfg


def check(q, k, v, mask=None, out=None, q8=None):
    why = _rt.device_ok(q, k, v, mask, out)
    if why:
        return why
    if capability(q.device) < (8, 0):
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


def _finish(dst, out):
    if out is not None and dst is not out:
        out.copy_(dst)
        return out
    return dst


def numba_attention(q, k, v, mask=None, out=None, q8=None, config=None):
    """The ``numba`` backend (q8 ignored); ``config`` (a Bf16Config, benchmarks / tests) overrides
    the selection."""
    B, H, L, D = q.shape
    cfg = _resolve(config, select_bf16, q)
    kernel = build(cfg, D, mask is not None)
    q, k, v = [x if _cp_ok(x) else x.contiguous() for x in (q, k, v)]
    dst = _out_buffer(out, q)
    marr, mst = _mask_args(mask, B, H, L, q.device)
    if kernel.tile_kv:
        k, v = tile_kv(k, v, kernel.tile_kv)
    _launch(kernel, q, k, v, dst, marr, mst)
    return _finish(dst, out)


registry.register_backend(OP, "numba", numba_attention, check=check, priority=10, auto=False)


def check_8bit(q, k, v, mask=None, out=None, q8=None):
    why = check(q, k, v, mask, out)
    if why:
        return why
    if q.shape[-1] not in (32, 64, 128):
        return f"8-bit attention needs head dim 32, 64 or 128 (got {q.shape[-1]})"
    return None


def int8_wants_k(dev, D):
    """Whether the 8-bit kernel selected for ``dev`` at head dim D reads a pack's K8 (the mma
    kernel) or only its Q8 + Q scales (the wgmma kernel quantizes K itself, in its tile layout)."""
    return select_int8(capability(dev), D).kind == "mma"


def int8_pack_kind(dev, D):
    """What qk_norm_rope's ``quant8`` should make for the 8-bit kernel selected for ``dev`` at head
    dim D: "qk" (the mma kernel reads Q8 and K8) or "qv" (the wgmma kernel: Q8 + V's tile image,
    when the kernel reads V in that layout -- else "q")."""
    cfg = select_int8(capability(dev), D)
    if cfg.kind == "mma":
        return "qk"
    kern = build(cfg, D, False, per_token=True)
    return "qv" if kern.tile_kv == VT_KEYS and kern.v_chunk_major else "q"


def numba_attention_8bit(q, k, v, mask=None, out=None, q8=None, config=None):
    """The ``numba-8bit`` backend: ``q8`` (a Quant8 of these q / k) replaces the pre-pass;
    ``config`` (an Int8Config) overrides the selection."""
    B, H, L, D = q.shape
    cfg = _resolve(config, select_int8, q)
    pk = usable_pack(q8, q, k, needs_k=cfg.kind == "mma")
    kernel = build(cfg, D, mask is not None, per_token=pk is not None)
    vt = pack_vt(pk, v, kernel)         # V's tile image from qk_norm_rope's pass (no tile_kv here)
    if not all(_words_ok(x) for x in (q, k)):
        q, k = q.contiguous(), k.contiguous()
    if not _cp_ok(v):
        v = v.contiguous()
    (q8a, k8a, qsa, ksa), Lp = operands(q, k, pk, kernel.tile_kv)
    dst = _out_buffer(out, q)
    marr, mst = _mask_args(mask, B, H, L, q.device)
    if kernel.v_s8:                     # integer P V: s8 V^T tiles + channel scales (int32 words)
        vb = pack_vt8(v, kernel.tile_kv)
        vw, vst = _c_arr(vb.view(-1)), (vb.stride(0), vb.stride(1), 0)
    else:
        if vt is not None:
            v = vt
        elif kernel.tile_kv:            # wgmma: V as tile images for the bulk copies
            v = tile_kv(v, None, kernel.tile_kv, chunk_major=kernel.v_chunk_major)[0]
        vw, vst = _words(v), (v.stride(0) // 2, v.stride(1) // 2, v.stride(2) // 2)
    args = (q8a, k8a, vw, qsa, ksa, _words(dst), marr, *vst,
            dst.stride(0) // 2, dst.stride(1) // 2, mst[0], mst[1], mst[2], L, Lp, H, _LOG2E / math.sqrt(D))
    _go(kernel, L, B * H, args, q.device)
    return _finish(dst, out)


registry.register_backend(OP, "numba-8bit", numba_attention_8bit, check=check_8bit, priority=5, auto=False)


def check_8bit_u8s8(q, k, v, mask=None, out=None, q8=None):
    why = check_8bit(q, k, v, mask, out)
    if why:
        return why
    if not wgmma_ok(capability(q.device), q.shape[-1]):
        return "the integer-P V kernel is a wgmma kernel: sm_90 at head dim 128 only"
    return None


def numba_attention_8bit_u8s8(q, k, v, mask=None, out=None, q8=None, config=None):
    """The ``numba-8bit-u8s8`` backend (opt-in, never auto; issue #38): the 8-bit op with P V on
    integers (``configs.INT8_WGMMA_U8S8``, or ``config``)."""
    return numba_attention_8bit(q, k, v, mask, out, q8, config or configs.INT8_WGMMA_U8S8)


registry.register_backend(OP, "numba-8bit-u8s8", numba_attention_8bit_u8s8, check=check_8bit_u8s8, priority=4,
                          auto=False)
