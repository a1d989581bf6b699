"""A ComfyUI-free FLUX.1 model with ComfyUI's module names and exactly ComfyUI's math.

Modules mirror ``comfy.ldm.flux`` attribute paths, so ``flux_core.blocks`` runs on these and on
ComfyUI's own blocks alike.  Weights may be stored in a lower precision (fp8) than the compute
dtype: ``Linear`` casts them per call, like ComfyUI's manual-cast ops.
"""
from __future__ import annotations

import math
from typing import Dict, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..cuda_kernels import ops
from .blocks import BlockContext, double_block, single_block
from .context import own_tensors
from .checkpoint import FluxConfig, NotFluxError, expected_shapes, infer_config


class Linear(nn.Module):
    def __init__(self, i, o, bias=True):
        super().__init__()
        self.in_features, self.out_features = i, o
        self.weight = nn.Parameter(torch.empty(o, i), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(o), requires_grad=False) if bias else None
        self.scale_weight = None  # fp8 per-tensor scale (ComfyUI "scaled fp8" files)

    def forward(self, x):
        w, b = self.weight, self.bias
        if w.dtype != x.dtype or w.device != x.device:
            w = w.to(device=x.device, dtype=x.dtype)
            if self.scale_weight is not None:
                w = w * self.scale_weight.to(device=x.device, dtype=x.dtype)
        if b is not None and (b.dtype != x.dtype or b.device != x.device):
            b = b.to(device=x.device, dtype=x.dtype)
        return F.linear(x, w, b)

    def plain_weights(self, x):
        """(weight, bias) when forward is ``F.linear`` on them for x (no per-tensor fp8 scale, x's dtype
        and device), else None (``context.plain_weights``)."""
        return None if self.scale_weight is not None else own_tensors(self, x)


class GELUTanh(nn.Module):
    def forward(self, x):
        return F.gelu(x, approximate="tanh")


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim), requires_grad=False)


class QKNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.query_norm, self.key_norm = RMSNorm(dim), RMSNorm(dim)


class SelfAttention(nn.Module):
    def __init__(self, dim, heads, qkv_bias):
        super().__init__()
        self.num_heads = heads
        self.qkv = Linear(dim, 3 * dim, qkv_bias)
        self.norm = QKNorm(dim // heads)
        self.proj = Linear(dim, dim)


class Modulation(nn.Module):
    def __init__(self, dim, double):
        super().__init__()
        self.is_double = double
        self.multiplier = 6 if double else 3
        self.lin = Linear(dim, self.multiplier * dim)


class MLPEmbedder(nn.Module):
    def __init__(self, i, h):
        super().__init__()
        self.in_layer, self.out_layer = Linear(i, h), Linear(h, h)

    def forward(self, x):
        return self.out_layer(F.silu(self.in_layer(x)))


class DoubleStreamBlock(nn.Module):
    def __init__(self, c: FluxConfig):
        super().__init__()
        C, M = c.hidden_size, c.mlp_hidden_dim
        self.num_heads, self.hidden_size = c.num_heads, C
        for s in ("img", "txt"):
            setattr(self, f"{s}_mod", Modulation(C, True))
            setattr(self, f"{s}_attn", SelfAttention(C, c.num_heads, c.qkv_bias))
            setattr(self, f"{s}_mlp", nn.Sequential(Linear(C, M), GELUTanh(), Linear(M, C)))


class SingleStreamBlock(nn.Module):
    def __init__(self, c: FluxConfig):
        super().__init__()
        C, M = c.hidden_size, c.mlp_hidden_dim
        self.num_heads, self.hidden_size, self.hidden_dim, self.mlp_hidden_dim = c.num_heads, C, C, M
        self.linear1 = Linear(C, 3 * C + M)
        self.linear2 = Linear(C + M, C)
        self.norm = QKNorm(C // c.num_heads)
        self.modulation = Modulation(C, False)


class LastLayer(nn.Module):
    def __init__(self, C, out):
        super().__init__()
        self.linear = Linear(C, out)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), Linear(C, 2 * C))


def timestep_embedding(t, dim, max_period=10000, time_factor: float = 1000.0):
    """ComfyUI's sinusoidal timestep embedding (cos first)."""
    t = time_factor * t
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(0, half, dtype=torch.float32, device=t.device) / half)
    args = t[:, None].float() * freqs[None]
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    if torch.is_floating_point(t):
        emb = emb.to(t)
    return emb


def rope(pos, dim, theta):
    scale = torch.linspace(0, (dim - 2) / dim, steps=dim // 2, dtype=torch.float64, device=pos.device)
    omega = 1.0 / (theta ** scale)
    out = torch.einsum("...n,d->...nd", pos.to(dtype=torch.float32), omega)
    out = torch.stack([torch.cos(out), -torch.sin(out), torch.sin(out), torch.cos(out)], dim=-1)
    return out.reshape(*out.shape[:-1], 2, 2).to(torch.float32)


def embed_nd(ids, axes_dim, theta):
    """ComfyUI's EmbedND: [B, 1, L, D/2, 2, 2] float32 rotations."""
    return torch.cat([rope(ids[..., i], axes_dim[i], theta) for i in range(ids.shape[-1])], dim=-3).unsqueeze(1)


class FluxModel(nn.Module):
    def __init__(self, cfg: FluxConfig):
        super().__init__()
        self.cfg = cfg
        C = cfg.hidden_size
        pin = cfg.in_channels * cfg.patch_size ** 2
        self.img_in = Linear(pin, C)
        self.time_in = MLPEmbedder(256, C)
        self.vector_in = MLPEmbedder(cfg.vec_in_dim, C)
        self.guidance_in = MLPEmbedder(256, C) if cfg.guidance_embed else None
        self.txt_in = Linear(cfg.context_in_dim, C)
        self.double_blocks = nn.ModuleList([DoubleStreamBlock(cfg) for _ in range(cfg.depth)])
        self.single_blocks = nn.ModuleList([SingleStreamBlock(cfg) for _ in range(cfg.depth_single_blocks)])
        self.final_layer = LastLayer(C, cfg.out_channels * cfg.patch_size ** 2)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_state_dict(cls, sd: Dict[str, torch.Tensor], device="cpu", dtype: Optional[torch.dtype] = None,
                        cfg: Optional[FluxConfig] = None) -> "FluxModel":
        """Build from a (prefix-stripped) state dict.  ``dtype`` None keeps the stored dtype."""
        shapes = {k: tuple(v.shape) for k, v in sd.items()}
        cfg = cfg or infer_config(shapes)
        with torch.device("meta"):
            m = cls(cfg)
        params = dict(m.named_parameters())
        for k, p in params.items():
            t = sd[k]
            if dtype is not None and t.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
                t = t.to(dtype)
            parent, name = m._owner(k)
            setattr(parent, name, nn.Parameter(t.to(device), requires_grad=False))
        for k, v in sd.items():
            if k.endswith(".scale_weight"):
                parent, _ = m._owner(k[: -len(".scale_weight")] + ".weight")
                parent.scale_weight = v.to(device=device, dtype=torch.float32)
        extra = [k for k in sd if k not in params and not k.endswith(".scale_weight") and not k.endswith("scaled_fp8")]
        if extra:
            raise NotFluxError(f"unexpected tensors for this FLUX config, e.g. {extra[0]}")
        return m

    def _owner(self, key):
        *path, name = key.split(".")
        mod = self
        for p in path:
            mod = mod[int(p)] if p.isdigit() else getattr(mod, p)
        return mod, name

    @property
    def compute_dtype(self):
        w = self.img_in.weight
        return torch.bfloat16 if w.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else w.dtype

    # ------------------------------------------------------------------ forward
    def forward(self, x, timestep, context, y=None, guidance=None, ctx: Optional[BlockContext] = None,
                attn_mask=None, dtype: Optional[torch.dtype] = None):
        """x [B, C_lat, H, W] latent (H, W even); timestep [B] in [0, 1]; context [B, L_txt, ctx_dim];
        y [B, vec_in_dim]; guidance [B].  Returns the velocity, shaped like x."""
        cfg = self.cfg
        ctx = ctx or BlockContext()
        dtype = dtype or self.compute_dtype
        if x.ndim != 4 or x.shape[1] != cfg.in_channels:
            raise ValueError(f"latent must be [B, {cfg.in_channels}, H, W], got {tuple(x.shape)}")
        B, _, h, w = x.shape
        p = cfg.patch_size
        if h % p or w % p:
            raise ValueError(f"latent height/width must be multiples of {p} (image multiples of 16), got {h}x{w}")
        if context.ndim != 3 or context.shape[0] != B or context.shape[2] != cfg.context_in_dim:
            raise ValueError(f"context must be [{B}, L, {cfg.context_in_dim}], got {tuple(context.shape)}")
        hl, wl = h // p, w // p
        img = x.reshape(B, cfg.in_channels, hl, p, wl, p).permute(0, 2, 4, 1, 3, 5).reshape(B, hl * wl, -1).to(dtype)
        img_ids = torch.zeros(hl, wl, 3, device=x.device, dtype=torch.float32)
        img_ids[..., 1] += torch.linspace(0, hl - 1, steps=hl, device=x.device).unsqueeze(1)
        img_ids[..., 2] += torch.linspace(0, wl - 1, steps=wl, device=x.device).unsqueeze(0)
        img_ids = img_ids.reshape(1, hl * wl, 3).expand(B, -1, -1)
        txt_ids = torch.zeros(B, context.shape[1], 3, device=x.device, dtype=torch.float32)

        img = self.img_in(img)
        vec = self.time_in(timestep_embedding(timestep, 256).to(img.dtype))
        if self.guidance_in is not None and guidance is not None:
            vec = vec + self.guidance_in(timestep_embedding(guidance, 256).to(img.dtype))
        if y is None:
            y = torch.zeros(B, cfg.vec_in_dim, device=x.device, dtype=img.dtype)
        vec = vec + self.vector_in(y[:, : cfg.vec_in_dim].to(img.dtype))
        txt = self.txt_in(context.to(dtype))
        pe = embed_nd(torch.cat((txt_ids, img_ids), dim=1), cfg.axes_dim, cfg.theta)

        for blk in self.double_blocks:
            img, txt = double_block(blk, img, txt, vec, pe, attn_mask, ctx)
        img = torch.cat((txt, img), 1)
        for blk in self.single_blocks:
            img = single_block(blk, img, vec, pe, attn_mask, ctx)
        img = img[:, txt.shape[1]:, ...]
        shift, scale = self.final_layer.adaLN_modulation(vec[:, None, :]).chunk(2, dim=-1)
        img = self.final_layer.linear(ops.ln_modulate(img, shift, scale, ctx.eps))
        out = img.reshape(B, hl, wl, cfg.out_channels, p, p).permute(0, 3, 1, 4, 2, 5).reshape(B, cfg.out_channels, h, w)
        return out
