"""FLUX blocks as functions over block modules, dispatched through the op registry.

The same functions run on ComfyUI's own ``DoubleStreamBlock`` / ``SingleStreamBlock`` modules
and on this pack's standalone modules (``flux_core.model``): both use the FLUX.1 reference
submodule names (``img_mod.lin``, ``img_attn.qkv``, ``img_attn.norm.query_norm``, ``img_mlp[0]``...).
*How* a weight is obtained is not read off attributes here: Linear layers are called as modules
(so the host's weight casting, LoRA patches and offloading stay in charge), and where a kernel
needs a weight tensor itself (the q/k RMSNorm scales, the GEMM-epilogue up-projection) it asks
``BlockContext.host`` -- ``context.Weights`` for plain modules, ``nodes/host/flux.py`` inside ComfyUI
(casts through ComfyUI's ops, honouring DynamicVRAM staging, offload and weight patches).

Two paths with one math:
  * ``stock``: ComfyUI's order of operations op by op (every op through the registry, so forcing
    the ``torch`` backend reproduces stock ComfyUI),
  * ``fused``: the fused ops (LN+modulate, q/k norm+RoPE into the attention layout, gated
    residual + next LN+modulate, GELU written into linear2's input buffer).
Which backend runs inside each op is the registry's business (auto / forced).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..cuda_kernels import ops
from . import fast
from .context import (BlockContext, Weights, block_linears, check_block_inputs, modulation,  # noqa: F401 (re-exported)
                      plain_weights, qk_parts, views_of)


def double_block(blk, img, txt, vec, pe, mask=None, ctx: Optional[BlockContext] = None):
    """One FLUX double-stream block. Returns (img, txt); updates img/txt in place like stock."""
    ctx = ctx or BlockContext()
    check_block_inputs(img, "img")
    check_block_inputs(txt, "txt")
    if ctx.fp8_block("double", blk, img):
        return fast.double_block(blk, img, txt, vec, pe, mask, ctx)
    H = blk.num_heads
    sv = ctx.silu(vec)
    i_sh1, i_sc1, i_g1, i_sh2, i_sc2, i_g2 = modulation(blk.img_mod, sv)
    t_sh1, t_sc1, t_g1, t_sh2, t_sc2, t_g2 = modulation(blk.txt_mod, sv)
    eps = ctx.eps
    Lt = txt.shape[1]

    img_qkv = blk.img_attn.qkv(ops.ln_modulate(img, i_sh1, i_sc1, eps))
    txt_qkv = blk.txt_attn.qkv(ops.ln_modulate(txt, t_sh1, t_sc1, eps))
    parts, qk_eps = qk_parts([(txt_qkv, blk.txt_attn), (img_qkv, blk.img_attn)], ctx)
    q, k, v, q8 = ctx.qk_norm_rope(parts, pe, H, qk_eps)
    ctx.host.release()  # the norm scales' last use is queued (a staging host frees them now, as its ops do)
    del img_qkv, txt_qkv, parts
    attn = ctx.attn(q, k, v, mask, pack=q8)
    del q, k, v, q8
    txt_attn, img_attn = attn[:, :Lt], attn[:, Lt:]

    if ctx.fused:
        h = ops.gated_residual_ln_modulate(img, i_g1, blk.img_attn.proj(img_attn), i_sh2, i_sc2, eps)
        ops.gated_residual(img, i_g2, _mlp(blk.img_mlp, h, ctx))
        h = ops.gated_residual_ln_modulate(txt, t_g1, blk.txt_attn.proj(txt_attn), t_sh2, t_sc2, eps)
        ops.gated_residual(txt, t_g2, _mlp(blk.txt_mlp, h, ctx))
    else:
        ops.gated_residual(img, i_g1, blk.img_attn.proj(img_attn))
        ops.gated_residual(img, i_g2, _mlp(blk.img_mlp, ops.ln_modulate(img, i_sh2, i_sc2, eps)))
        ops.gated_residual(txt, t_g1, blk.txt_attn.proj(txt_attn))
        ops.gated_residual(txt, t_g2, _mlp(blk.txt_mlp, ops.ln_modulate(txt, t_sh2, t_sc2, eps)))
    if txt.dtype == torch.float16:
        txt = torch.nan_to_num(txt, nan=0.0, posinf=65504, neginf=-65504)
    return img, txt


def _mlp(mlp, x, ctx: Optional[BlockContext] = None):
    """Linear -> GELU(tanh) -> Linear, the GELU through the registry (or in the GEMM epilogue)."""
    pw = ctx.host.linear(mlp[0], x) if ctx is not None and ctx.gemm_epilogue else None
    if pw is not None:
        h = ops.linear_gelu(x, pw[0], pw[1])
        ctx.host.release()
        return mlp[2](h)
    return mlp[2](ops.gelu_tanh(mlp[0](x)))


def _linear_rows(lin, x, ctx):
    """``lin(x)`` for x [B, L, K] whose rows are strided (a column slice of a wider buffer).
    torch's linear runs a non-contiguous 3-D input as matmul + a separate bias-add kernel; addmm on
    the 2-D row view keeps the bias in the GEMM epilogue (less GPU time per step).  But eagerly the
    addmm path costs more host time per call and made the eager step host-bound, so it is used only
    while a CUDA graph is being captured (host cost then vanishes).  Numbers: BENCHMARKS.md, FLUX step."""
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


def single_block(blk, x, vec, pe, mask=None, ctx: Optional[BlockContext] = None):
    """One FLUX single-stream block. Returns x (updated in place like stock)."""
    ctx = ctx or BlockContext()
    check_block_inputs(x, "x")
    if ctx.fp8_block("single", blk, x):
        return fast.single_block(blk, x, vec, pe, mask, ctx)
    H = blk.num_heads
    C = blk.hidden_size
    M = blk.mlp_hidden_dim
    sv = ctx.silu(vec)
    sh, sc, g = modulation(blk.modulation, sv)
    eps = ctx.eps
    h = ops.ln_modulate(x, sh, sc, eps)
    lin1 = blk.linear1(h)
    del h
    qkv, mlp = lin1[..., :3 * C], lin1[..., 3 * C:]
    parts, qk_eps = qk_parts([(qkv, blk)], ctx)
    q, k, v, q8 = ctx.qk_norm_rope(parts, pe, H, qk_eps)
    ctx.host.release()
    del parts
    if ctx.fused and not views_of(lin1, q, k, v):
        # linear2's input [attn | gelu(mlp)] is built inside linear1's output: the attention
        # output over lin1's v columns (dead once qk_norm_rope has written v to its own buffer),
        # GELU in place over the mlp half, then linear2 reads lin1[..., 2C:] (row stride 3C+M).
        # No [B, L, C+M] buffer (141.6 MB at 1024^2): the step's peak stays below stock's.
        buf = lin1[..., 2 * C:]
        ctx.attn(q, k, v, mask, out=buf[..., :C], pack=q8)
        del q, k, v, q8
        ops.gelu_tanh(mlp, out=mlp)
        del qkv, mlp
        out = _linear_rows(blk.linear2, buf, ctx)
        del buf, lin1
    elif ctx.fused:  # q/k/v still view linear1's output (torch qk_norm_rope): a separate buffer
        B, L, _ = x.shape
        buf = torch.empty((B, L, C + M), dtype=lin1.dtype, device=lin1.device)
        ctx.attn(q, k, v, mask, out=buf[..., :C], pack=q8)
        del q, k, v, q8
        ops.gelu_tanh(mlp, out=buf[..., C:])
        del lin1, qkv, mlp
        out = blk.linear2(buf)
    else:
        attn = ctx.attn(q, k, v, mask, pack=q8)
        del q, k, v, q8
        out = blk.linear2(torch.cat((attn, ops.gelu_tanh(mlp)), 2))
    ops.gated_residual(x, g, out)
    if x.dtype == torch.float16:
        x = torch.nan_to_num(x, nan=0.0, posinf=65504, neginf=-65504)
    return x

