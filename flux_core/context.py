"""What the block functions share: how a block gets its weights (``Weights``), the per-forward
settings (``BlockContext``) and the small helpers both paths use -- the exact / stock-order blocks
(``blocks``) and the fp8 blocks (``fast``) import this module, not each other.

Nothing here knows ComfyUI: a host (ComfyUI's adapter, ``nodes/host/flux.py``) subclasses ``Weights`` to
obtain weights the way its ops do; this pack's standalone modules (``flux_core.model``) use the
plain ``Weights``.
"""
from __future__ import annotations

import contextlib

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from ..cuda_kernels import ops
from ..cuda_kernels import attention as _attention_op


def block_linears(kind, blk):
    """The Linear modules of a FLUX block's GEMM path (what the fast profile runs in fp8)."""
    if kind == "double":
        return [blk.img_attn.qkv, blk.txt_attn.qkv, blk.img_attn.proj, blk.txt_attn.proj,
                blk.img_mlp[0], blk.img_mlp[2], blk.txt_mlp[0], blk.txt_mlp[2]]
    return [blk.linear1, blk.linear2]


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

    @contextlib.contextmanager
    def module(self, m, like):
        """(weight, bias) of a module with weights (a convolution, a GroupNorm) for input ``like``,
        valid inside the context: its own tensors here; a host that casts per call hands out its cast
        and takes it back on exit."""
        yield m.weight, m.bias

    def every_op(self):
        """Called once per op that host-agnostic code runs (a host's per-op hook: its interrupt check)."""


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
        (``Weights.linear_ok``), else the exact path; ``fp8_epoch`` the host's weight-patch identity;
        ``keep_plain`` the modulation Linears (ids) whose weights the cache keeps as plain copies
        (the host would otherwise stream them every step).
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
    keep_plain: frozenset = frozenset()  # ids of modulation Linears the fp8 cache keeps plain copies of

    def fp8_block(self, kind, blk, like) -> bool:
        """This block call takes the fp8 path (fast profile, fused order, every Linear handed out as
        plain weights -- asked without casting anything)."""
        if self.fp8 is None or not self.fused:
            return False
        return all(self.host.linear_ok(lin, like) for lin in block_linears(kind, blk))

    def wants_q8(self) -> bool:
        """From the options alone: the 8-bit registry op runs (``quant8``, no replacement callable),
        so qk_norm_rope also emits int8 Q/K and the 8-bit kernel skips its pre-pass.  The exact /
        bf16 paths never ask (no extra bytes, no extra launches)."""
        return self.quant8 and self.attention is None

    def qk_norm_rope(self, parts, pe, H, eps=None):
        """(q, k, v, pack): pack is qk_norm_rope's Quant8 when wants_q8() and its backend made one
        (Q + V's tile image when the 8-bit kernel that runs quantizes K itself: int8_pack_kind)."""
        eps = self.eps if eps is None else eps
        if self.wants_q8():
            qkv = parts[0][0]
            q8 = _attention_op.int8_pack_kind(qkv.device, qkv.shape[-1] // (3 * H))
            return ops.qk_norm_rope(parts, pe, H, eps, quant8=q8)
        q, k, v = ops.qk_norm_rope(parts, pe, H, eps)
        return q, k, v, None

    def attn(self, q, k, v, mask, out=None, pack=None):
        if pack is not None:  # the 8-bit op's int8 hand-off (any other backend ignores it)
            return ops.attention(q, k, v, mask, out=out, q8=pack)
        if self.attention is not None:
            o = self.attention(q, k, v, mask)
            if out is not None:
                out.copy_(o)
                return out
            return o
        return ops.attention(q, k, v, mask, out=out)

    def silu(self, vec):
        """SiLU(vec) computed once per forward (the same vec object feeds every block of a step).

        Keyed on the object itself, held by the cache so its id cannot be reused; not on
        data_ptr/_version (inference-mode tensors, as in ComfyUI, have no version counter)."""
        hit = self.silu_cache.get("vec")
        if hit is None or hit[0] is not vec:
            hit = self.silu_cache["vec"] = (vec, F.silu(vec if vec.ndim == 3 else vec[:, None, :]))
        return hit[1]


def plain_weights(lin, x):
    """(weight, bias) of a plain ``torch.nn.Linear`` usable directly on x, or None when the module
    must be called instead: a module whose class has its own forward (a host's op that casts,
    patches or dequantizes its weights per call -- only the host's ``Weights`` knows its math), or
    weights of another dtype / device / tensor type.  A module that knows when its forward is
    ``F.linear`` on its own tensors says so itself (``lin.plain_weights(x)``: this pack's
    ``flux_core.model.Linear``)."""
    own = getattr(type(lin), "plain_weights", None)
    if callable(own):
        return own(lin, x)
    if type(lin).forward is not torch.nn.Linear.forward:
        return None
    return own_tensors(lin, x)


def own_tensors(lin, x):
    """The module's own (weight, bias) when they are plain tensors of x's dtype on x's device, else None."""
    w, b = getattr(lin, "weight", None), getattr(lin, "bias", None)
    for t in (w, b):
        if t is not None and (type(t.data) is not torch.Tensor or t.dtype != x.dtype or t.device != x.device):
            return None
    return (w, b) if w is not None else None


def modulation(mod, silu_vec):
    """``Modulation.forward`` with SiLU(vec) precomputed: chunks of lin(silu(vec))."""
    return mod.lin(silu_vec).chunk(mod.multiplier, dim=-1)


def qk_parts(qkv_of, ctx):
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


def check_block_inputs(x, name):
    if x.ndim != 3:
        raise ValueError(f"{name} must be [B, L, C], got shape {tuple(x.shape)}")


def views_of(base, *ts) -> bool:
    """True when any of ts shares base's storage."""
    p = base.untyped_storage().data_ptr()
    return any(t.untyped_storage().data_ptr() == p for t in ts)
