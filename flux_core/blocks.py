"""FLUX blocks as functions over block modules, dispatched through the op registry.

The same functions run on ComfyUI's own ``DoubleStreamBlock`` / ``SingleStreamBlock`` modules
and on this pack's standalone modules (``flux_core.model``): both have the same attribute
paths (``img_mod.lin``, ``img_attn.qkv``, ``img_attn.norm.query_norm.scale``, ``img_mlp[0]``...).
Linear layers are *called as modules*, so ComfyUI's weight casting, LoRA patches and low-VRAM
offloading stay in charge of the weights.

Two paths with one math:
  * ``stock``: ComfyUI's order of operations op by op (every op through the registry, so forcing
    the ``torch`` backend reproduces stock ComfyUI),
  * ``fused``: the fused ops (LN+modulate, q/k norm+RoPE into the attention layout, gated
    residual + next LN+modulate, GELU written into linear2's input buffer).
Which backend runs inside each op is the registry's business (auto / forced).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from ..cuda_kernels import registry
from ..cuda_kernels import attention as _attention_op


@dataclass
class BlockContext:
    """Per-forward settings shared by all blocks.

    gemm_epilogue: compute Linear+GELU as one op (``linear_gelu``; cuBLASLt bias+GELU epilogue)
        when the layer's weights are plain tensors of the input's dtype and device.
    fused: use the fused op sequence (else stock ComfyUI order).
    attention: optional callable ``(q, k, v, mask, out) -> [B, L, H*D]`` replacing the
        registry's attention op (the ComfyUI patch passes ComfyUI's own optimized_attention
        when attention is not routed through the pack).
    eps: norm epsilon (FLUX: 1e-6).
    quant8: the attention is the registry op forced to numba-8bit (the caller's option): qk_norm_rope
        then also emits the int8 pack, passed to the attention op as ``q8``.
    """
    fused: bool = True
    attention: Optional[Callable] = None
    eps: float = 1e-6
    gemm_epilogue: bool = False  # fold GELU into the up-projection GEMM (op linear_gelu) where weights allow
    silu_cache: dict = field(default_factory=dict)
    quant8: bool = False

    def wants_q8(self) -> bool:
        """From the options alone: the 8-bit registry op runs (``quant8``, no replacement callable),
        so qk_norm_rope also emits int8 Q/K and the 8-bit kernel skips its pre-pass.  The exact /
        bf16 paths never ask (no extra bytes, no extra launches)."""
        return self.quant8 and self.attention is None

    def qk_norm_rope(self, parts, pe, H):
        """(q, k, v, pack): pack is qk_norm_rope's Quant8 when wants_q8() and its backend made one
        (Q only when the 8-bit kernel that runs quantizes K itself)."""
        if self.wants_q8():
            qkv = parts[0][0]
            q8 = "qk" if _attention_op.int8_wants_k(qkv.device, qkv.shape[-1] // (3 * H)) else "q"
            return registry.call("qk_norm_rope", parts, pe, H, self.eps, quant8=q8)
        q, k, v = registry.call("qk_norm_rope", parts, pe, H, self.eps)
        return q, k, v, None

    def attn(self, q, k, v, mask, out=None, pack=None):
        if pack is not None:  # the 8-bit op's int8 hand-off (any other backend ignores it)
            return registry.call("attention", q, k, v, mask, out=out, q8=pack)
        if self.attention is not None:
            o = self.attention(q, k, v, mask)
            if out is not None:
                out.copy_(o)
                return out
            return o
        return registry.call("attention", q, k, v, mask, out=out)

    def silu(self, vec):
        """SiLU(vec) computed once per forward (the same vec object feeds every block of a step).

        Keyed on the object itself, held by the cache so its id cannot be reused; not on
        data_ptr/_version (inference-mode tensors, as in ComfyUI, have no version counter)."""
        hit = self.silu_cache.get("vec")
        if hit is None or hit[0] is not vec:
            hit = self.silu_cache["vec"] = (vec, F.silu(vec if vec.ndim == 3 else vec[:, None, :]))
        return hit[1]


def plain_weights(lin, x):
    """(weight, bias) of a Linear module usable directly on x, or None when the module must be
    called instead (ComfyUI casts or patches its weights per call: low-VRAM offload, on-the-fly
    LoRA functions, fp8/quantized storage, a per-tensor weight scale)."""
    if getattr(lin, "comfy_cast_weights", False) or getattr(lin, "weight_function", None) \
            or getattr(lin, "bias_function", None) or getattr(lin, "scale_weight", None) is not None:
        return None
    w, b = getattr(lin, "weight", None), getattr(lin, "bias", None)
    for t in (w, b):
        if t is not None and (type(t.data) is not torch.Tensor or t.dtype != x.dtype or t.device != x.device):
            return None
    return (w, b) if w is not None else None


def modulation(mod, silu_vec):
    """``Modulation.forward`` with SiLU(vec) precomputed: chunks of lin(silu(vec))."""
    return mod.lin(silu_vec).chunk(mod.multiplier, dim=-1)


def _norm_scales(m):
    """q/k RMSNorm scales of an attention module (double block) or a single block: both have
    ``.norm.query_norm`` / ``.norm.key_norm``."""
    return m.norm.query_norm.scale, m.norm.key_norm.scale


def _check_block_inputs(x, name):
    if x.ndim != 3:
        raise ValueError(f"{name} must be [B, L, C], got shape {tuple(x.shape)}")


def double_block(blk, img, txt, vec, pe, mask=None, ctx: Optional[BlockContext] = None):
    """One FLUX double-stream block. Returns (img, txt); updates img/txt in place like stock."""
    ctx = ctx or BlockContext()
    _check_block_inputs(img, "img")
    _check_block_inputs(txt, "txt")
    H = blk.num_heads
    sv = ctx.silu(vec)
    i_sh1, i_sc1, i_g1, i_sh2, i_sc2, i_g2 = modulation(blk.img_mod, sv)
    t_sh1, t_sc1, t_g1, t_sh2, t_sc2, t_g2 = modulation(blk.txt_mod, sv)
    eps = ctx.eps
    Lt = txt.shape[1]

    img_qkv = blk.img_attn.qkv(registry.call("ln_modulate", img, i_sh1, i_sc1, eps))
    txt_qkv = blk.txt_attn.qkv(registry.call("ln_modulate", txt, t_sh1, t_sc1, eps))
    q, k, v, q8 = ctx.qk_norm_rope([(txt_qkv, *_norm_scales(blk.txt_attn)),
                                    (img_qkv, *_norm_scales(blk.img_attn))], pe, H)
    del img_qkv, txt_qkv
    attn = ctx.attn(q, k, v, mask, pack=q8)
    del q, k, v, q8
    txt_attn, img_attn = attn[:, :Lt], attn[:, Lt:]

    if ctx.fused:
        h = registry.call("gated_residual_ln_modulate", img, i_g1, blk.img_attn.proj(img_attn), i_sh2, i_sc2, eps)
        registry.call("gated_residual", img, i_g2, _mlp(blk.img_mlp, h, ctx))
        h = registry.call("gated_residual_ln_modulate", txt, t_g1, blk.txt_attn.proj(txt_attn), t_sh2, t_sc2, eps)
        registry.call("gated_residual", txt, t_g2, _mlp(blk.txt_mlp, h, ctx))
    else:
        registry.call("gated_residual", img, i_g1, blk.img_attn.proj(img_attn))
        registry.call("gated_residual", img, i_g2, _mlp(blk.img_mlp, registry.call("ln_modulate", img, i_sh2, i_sc2, eps)))
        registry.call("gated_residual", txt, t_g1, blk.txt_attn.proj(txt_attn))
        registry.call("gated_residual", txt, t_g2, _mlp(blk.txt_mlp, registry.call("ln_modulate", txt, t_sh2, t_sc2, eps)))
    if txt.dtype == torch.float16:
        txt = torch.nan_to_num(txt, nan=0.0, posinf=65504, neginf=-65504)
    return img, txt


def _mlp(mlp, x, ctx: Optional[BlockContext] = None):
    """Linear -> GELU(tanh) -> Linear, the GELU through the registry (or in the GEMM epilogue)."""
    pw = plain_weights(mlp[0], x) if ctx is not None and ctx.gemm_epilogue else None
    if pw is not None:
        return mlp[2](registry.call("linear_gelu", x, pw[0], pw[1]))
    return mlp[2](registry.call("gelu_tanh", mlp[0](x)))


def _linear_rows(lin, x):
    """``lin(x)`` for x [B, L, K] whose rows are strided (a column slice of a wider buffer).
    torch's linear runs a non-contiguous 3-D input as matmul + a separate bias-add kernel (1.5 ms
    of GPU time per FLUX step on the H200, session 2 run 7); addmm on the 2-D row view keeps the
    bias in the GEMM epilogue (run 9: kernel time 117.6 -> 114.6 ms/step).  But eagerly the addmm
    path costs more host time per call and the eager step became host-bound (126 -> 137 ms,
    runs 9-10), so it is used only while a CUDA graph is being captured (host cost then vanishes)."""
    if not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
        return lin(x)
    pw = plain_weights(lin, x)
    if pw is None or pw[1] is None:
        return lin(x)
    B, L, K = x.shape
    try:
        x2 = x.view(B * L, K)
    except RuntimeError:
        return lin(x)
    return torch.addmm(pw[1], x2, pw[0].t()).view(B, L, -1)


def _views_of(base, *ts) -> bool:
    """True when any of ts shares base's storage."""
    p = base.untyped_storage().data_ptr()
    return any(t.untyped_storage().data_ptr() == p for t in ts)


def single_block(blk, x, vec, pe, mask=None, ctx: Optional[BlockContext] = None):
    """One FLUX single-stream block. Returns x (updated in place like stock)."""
    ctx = ctx or BlockContext()
    _check_block_inputs(x, "x")
    H = blk.num_heads
    C = blk.hidden_size
    M = blk.mlp_hidden_dim
    sv = ctx.silu(vec)
    sh, sc, g = modulation(blk.modulation, sv)
    eps = ctx.eps
    h = registry.call("ln_modulate", x, sh, sc, eps)
    lin1 = blk.linear1(h)
    del h
    qkv, mlp = lin1[..., :3 * C], lin1[..., 3 * C:]
    q, k, v, q8 = ctx.qk_norm_rope([(qkv, *_norm_scales(blk))], pe, H)
    if ctx.fused and not _views_of(lin1, q, k, v):
        # linear2's input [attn | gelu(mlp)] is built inside linear1's output: the attention
        # output over lin1's v columns (dead once qk_norm_rope has written v to its own buffer),
        # GELU in place over the mlp half, then linear2 reads lin1[..., 2C:] (row stride 3C+M).
        # No [B, L, C+M] buffer (141.6 MB at 1024^2): the step's peak stays below stock's.
        buf = lin1[..., 2 * C:]
        ctx.attn(q, k, v, mask, out=buf[..., :C], pack=q8)
        del q, k, v, q8
        registry.call("gelu_tanh", mlp, out=mlp)
        del qkv, mlp
        out = _linear_rows(blk.linear2, buf)
        del buf, lin1
    elif ctx.fused:  # q/k/v still view linear1's output (torch qk_norm_rope): a separate buffer
        B, L, _ = x.shape
        buf = torch.empty((B, L, C + M), dtype=lin1.dtype, device=lin1.device)
        ctx.attn(q, k, v, mask, out=buf[..., :C], pack=q8)
        del q, k, v, q8
        registry.call("gelu_tanh", mlp, out=buf[..., C:])
        del lin1, qkv, mlp
        out = blk.linear2(buf)
    else:
        attn = ctx.attn(q, k, v, mask, pack=q8)
        del q, k, v, q8
        out = blk.linear2(torch.cat((attn, registry.call("gelu_tanh", mlp)), 2))
    registry.call("gated_residual", x, g, out)
    if x.dtype == torch.float16:
        x = torch.nan_to_num(x, nan=0.0, posinf=65504, neginf=-65504)
    return x

