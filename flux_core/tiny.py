"""The embedded default model: a FLUX-architecture checkpoint generated from a seed.

No download and no committed weights: ``tiny_state_dict(seed)`` makes the same tensors on every
machine (torch's CPU generator).  ``comfy_min_state_dict`` makes the smallest checkpoint ComfyUI
itself detects as FLUX (hidden 3072, 1 double + 1 single block, ~531 M parameters).
(A random FLUX VAE in ComfyUI's layout: ``nodes/host/vae.random_vae_state_dict``.)
"""
from __future__ import annotations

from typing import Dict

import torch

from .checkpoint import FluxConfig, expected_shapes

TINY = FluxConfig(in_channels=16, out_channels=16, vec_in_dim=32, context_in_dim=64, hidden_size=128,
                  mlp_ratio=4.0, num_heads=4, depth=2, depth_single_blocks=2, axes_dim=[4, 14, 14],
                  qkv_bias=True, guidance_embed=True)

COMFY_MIN = FluxConfig(in_channels=16, out_channels=16, vec_in_dim=32, context_in_dim=64, hidden_size=3072,
                       mlp_ratio=4.0, num_heads=24, depth=1, depth_single_blocks=1, axes_dim=[16, 56, 56],
                       qkv_bias=True, guidance_embed=True)


def random_state_dict(cfg: FluxConfig, seed: int = 0, dtype=torch.float32, std: float = None) -> Dict[str, torch.Tensor]:
    """Deterministic weights: N(0, std) matrices (std ~ 1/sqrt(fan_in) so activations stay O(1)),
    small biases, norm scales near 1."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for k, shp in sorted(expected_shapes(cfg).items()):
        if k.endswith(".scale"):
            t = 1.0 + 0.1 * torch.randn(shp, generator=g)
        elif len(shp) == 1:
            t = 0.02 * torch.randn(shp, generator=g)
        else:
            s = std if std is not None else shp[1] ** -0.5
            t = s * torch.randn(shp, generator=g)
        sd[k] = t.to(dtype)
    return sd


def tiny_state_dict(seed: int = 0, dtype=torch.float32):
    return random_state_dict(TINY, seed, dtype)


def comfy_min_state_dict(seed: int = 0, dtype=torch.bfloat16):
    return random_state_dict(COMFY_MIN, seed, dtype)
