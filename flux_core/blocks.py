"""FLUX blocks as functions over block modules, dispatched through the op registry.

The same functions run on ComfyUI's own ``DoubleStreamBlock`` / ``SingleStreamBlock`` modules
and on this pack's standalone modules (``flux_core.model``): both use the FLUX.1 reference
submodule names (``img_mod.lin``, ``img_attn.qkv``, ``img_attn.norm.query_norm``, ``img_mlp[0]``...).
*How* a weight is obtained is not read off attributes here: Linear layers are called as modules
(so the host's weight casting, LoRA patches and offloading stay in charge), and where a kernel
needs a weight tensor itself (the q/k RMSNorm scales, the GEMM-epilogue up-projection) it asks
``BlockContext.host`` -- ``Weights`` below for plain modules, ``nodes/host.py`` inside ComfyUI
(casts through ComfyUI's ops, honouring DynamicVRAM staging, offload and weight patches).

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


class Weights:
    """How a block gets the weight tensors its kernels read, for modules whose parameters are plain
    tensors (this pack's ``flux_core.model``); ComfyUI's host adapter subclasses it.

    ``norm(m, like)`` -> an RMSNorm module's scale on ``like``'s device and dtype: the module's one
    own parameter, whatever it is called (``.scale`` in FLUX's reference and ComfyUI v0.8.0,
    ``.weight`` in ``torch.nn.RMSNorm`` / ComfyUI v0.33's ops).  ``norm_eps(m, like)`` -> its epsilon.
    ``linear(lin, x)`` -> (weight, bias) usable directly on x, or None when the module must be
    called.  ``release()`` ends the use of what was handed out so far (a host that stages weights per
    call frees them there): blocks call it right after the kernel that read them is queued, as
    ComfyUI's own ops do, and whoever made the BlockContext calls it once more at the end."""

    FLUX_EPS = 1e-6  # FLUX.1's q/k RMSNorm epsilon where the module does not say

    def norm(self, m, like):
        ps = list(m.parameters(recurse=False))
        if len(ps) != 1:
            raise ValueError(f"{type(m).__name__} has {len(ps)} own parameters, expected one RMSNorm scale")
        w = ps[0]
        return w if (w.device == like.device and w.dtype == like.dtype) else w.to(device=like.device, dtype=like.dtype)

    def norm_eps(self, m, like):
        if hasattr(m, "eps"):  # torch.nn.RMSNorm semantics: None = the input dtype's machine epsilon
            return float(m.eps) if m.eps is not None else float(torch.finfo(like.dtype).eps)
        return self.FLUX_EPS

    def linear(self, lin, x):
        return plain_weights(lin, x)

    def linear_ok(self, lin, x) -> bool:
        """Would ``linear(lin, x)`` hand out weights?  Answered without casting or staging anything."""
        return plain_weights(lin, x) is not None

    def linear_fp8(self, lin, x):
        """(weight e4m3 [N, K], bias in x's dtype, per-tensor weight scale or None) when the module
        stores its weight in fp8 e4m3 -- unscaled, or with one fp32 scale for the whole tensor
        (the fast profile then uses it as it is), else None."""
        return None

    def release(self):
        pass


@dataclass
class BlockContext:
    """Per-forward settings shared by all blocks.

    gemm_epilogue: compute Linear+GELU as one op (``linear_gelu``; cuBLASLt bias+GELU epilogue)
        when the layer's weights are plain tensors of the input's dtype and device.
    fused: use the fused op sequence (else stock ComfyUI order).
    attention: optional callable ``(q, k, v, mask, out) -> [B, L, H*D]`` replacing the
        registry's attention op (the ComfyUI patch passes ComfyUI's own optimized_attention
        when attention is not routed through the pack).
    eps: LayerNorm epsilon (FLUX: 1e-6); the q/k RMSNorm epsilon comes from the norm modules.
    host: a ``Weights`` (how kernels get weight tensors; ComfyUI's adapter inside ComfyUI).
    quant8: the attention is the registry op forced to numba-8bit (the caller's option): qk_norm_rope
        then also emits the int8 pack, passed to the attention op as ``q8``.
    fp8: the fast profile's weight cache (``flux_core.fast.Fp8Weights``): the fused blocks run their
        GEMMs in fp8 (``flux_core.fast``) where every block Linear's weights are plain tensors
        (``Weights.linear_ok``), else the exact path; ``fp8_epoch`` the host's weight-patch identity.
    """
    fused: bool = True
    attention: Optional[Callable] = None
    eps: float = 1e-6
    gemm_epilogue: bool = False  # fold GELU into the up-projection GEMM (op linear_gelu) where weights allow
    silu_cache: dict = field(default_factory=dict)
    host: Weights = field(default_factory=Weights)
    quant8: bool = False
    fp8: Optional[object] = None
    fp8_epoch: object = None

    def fp8_block(self, kind, blk, like) -> bool:
        """This block call takes the fp8 path (fast profile, fused order, every Linear handed out as
        plain weights -- asked without casting anything)."""
        if self.fp8 is None or not self.fused:
            return False
        from . import fast
        return all(self.host.linear_ok(lin, like) for lin in fast.block_linears(kind, blk))

    def wants_q8(self) -> bool:
        """From the options alone: the 8-bit registry op runs (``quant8``, no replacement callable),
        so qk_norm_rope also emits int8 Q/K and the 8-bit kernel skips its pre-pass.  The exact /
        bf16 paths never ask (no extra bytes, no extra launches)."""
        return self.quant8 and self.attention is None

    def qk_norm_rope(self, parts, pe, H, eps=None):
        """(q, k, v, pack): pack is qk_norm_rope's Quant8 when wants_q8() and its backend made one
        (Q only when the 8-bit kernel that runs quantizes K itself)."""
        eps = self.eps if eps is None else eps
        if self.wants_q8():
            qkv = parts[0][0]
            q8 = "qk" if _attention_op.int8_wants_k(qkv.device, qkv.shape[-1] // (3 * H)) else "q"
            return registry.call("qk_norm_rope", parts, pe, H, eps, quant8=q8)
        q, k, v = registry.call("qk_norm_rope", parts, pe, H, eps)
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


def _qk_parts(qkv_of, ctx):
    """[(qkv, q_scale, k_scale)] for qk_norm_rope and the shared RMSNorm epsilon; ``qkv_of`` pairs
    each qkv activation with the module holding ``.norm.query_norm`` / ``.norm.key_norm`` (an
    attention module of a double block, or a single block)."""
    parts, eps = [], set()
    for qkv, m in qkv_of:
        qn, kn = m.norm.query_norm, m.norm.key_norm
        parts.append((qkv, ctx.host.norm(qn, qkv), ctx.host.norm(kn, qkv)))
        eps.update((ctx.host.norm_eps(qn, qkv), ctx.host.norm_eps(kn, qkv)))
    if len(eps) != 1:
        raise ValueError(f"q/k RMSNorms with different epsilons {sorted(eps)}")
    return parts, eps.pop()


def _check_block_inputs(x, name):
    if x.ndim != 3:
        raise ValueError(f"{name} must be [B, L, C], got shape {tuple(x.shape)}")


def double_block(blk, img, txt, vec, pe, mask=None, ctx: Optional[BlockContext] = None):
    """One FLUX double-stream block. Returns (img, txt); updates img/txt in place like stock."""
    ctx = ctx or BlockContext()
    _check_block_inputs(img, "img")
    _check_block_inputs(txt, "txt")
    if ctx.fp8_block("double", blk, img):
        from . import fast
        return fast.double_block(blk, img, txt, vec, pe, mask, ctx)
    H = blk.num_heads
    sv = ctx.silu(vec)
    i_sh1, i_sc1, i_g1, i_sh2, i_sc2, i_g2 = modulation(blk.img_mod, sv)
    t_sh1, t_sc1, t_g1, t_sh2, t_sc2, t_g2 = modulation(blk.txt_mod, sv)
    eps = ctx.eps
    Lt = txt.shape[1]

    img_qkv = blk.img_attn.qkv(registry.call("ln_modulate", img, i_sh1, i_sc1, eps))
    txt_qkv = blk.txt_attn.qkv(registry.call("ln_modulate", txt, t_sh1, t_sc1, eps))
    parts, qk_eps = _qk_parts([(txt_qkv, blk.txt_attn), (img_qkv, blk.img_attn)], ctx)
    q, k, v, q8 = ctx.qk_norm_rope(parts, pe, H, qk_eps)
    ctx.host.release()  # the norm scales' last use is queued (a staging host frees them now, as its ops do)
    del img_qkv, txt_qkv, parts
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
    pw = ctx.host.linear(mlp[0], x) if ctx is not None and ctx.gemm_epilogue else None
    if pw is not None:
        h = registry.call("linear_gelu", x, pw[0], pw[1])
        ctx.host.release()
        return mlp[2](h)
    return mlp[2](registry.call("gelu_tanh", mlp[0](x)))


def _linear_rows(lin, x, ctx):
    """``lin(x)`` for x [B, L, K] whose rows are strided (a column slice of a wider buffer).
    torch's linear runs a non-contiguous 3-D input as matmul + a separate bias-add kernel (1.5 ms
    of GPU time per FLUX step on the H200, session 2 run 7); addmm on the 2-D row view keeps the
    bias in the GEMM epilogue (run 9: kernel time 117.6 -> 114.6 ms/step).  But eagerly the addmm
    path costs more host time per call and the eager step became host-bound (126 -> 137 ms,
    runs 9-10), so it is used only while a CUDA graph is being captured (host cost then vanishes)."""
    if not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
        return lin(x)
    pw = ctx.host.linear(lin, x)
    if pw is None or pw[1] is None:
        return lin(x)
    B, L, K = x.shape
    try:
        x2 = x.view(B * L, K)
    except RuntimeError:
        return lin(x)
    out = torch.addmm(pw[1], x2, pw[0].t()).view(B, L, -1)
    ctx.host.release()
    return out


def _views_of(base, *ts) -> bool:
    """True when any of ts shares base's storage."""
    p = base.untyped_storage().data_ptr()
    return any(t.untyped_storage().data_ptr() == p for t in ts)


def single_block(blk, x, vec, pe, mask=None, ctx: Optional[BlockContext] = None):
    """One FLUX single-stream block. Returns x (updated in place like stock)."""
    ctx = ctx or BlockContext()
    _check_block_inputs(x, "x")
    if ctx.fp8_block("single", blk, x):
        from . import fast
        return fast.single_block(blk, x, vec, pe, mask, ctx)
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
    parts, qk_eps = _qk_parts([(qkv, blk)], ctx)
    q, k, v, q8 = ctx.qk_norm_rope(parts, pe, H, qk_eps)
    ctx.host.release()
    del parts
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
        out = _linear_rows(blk.linear2, buf, ctx)
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

