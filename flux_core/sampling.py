"""FLUX's flow-matching Euler sampler (the schedule of the reference pipeline).

t runs from 1 (noise) to 0 (image), shifted towards noise for larger images:
t' = e^mu / (e^mu + (1/t - 1)), mu linear in the image token count (0.5 at 256 tokens, 1.15 at
4096).  One Euler step: x <- x + (t_next - t) * v(x, t).
"""
from __future__ import annotations

import math
from typing import Callable, List, Optional

import torch


def flux_schedule(steps: int, image_tokens: int, base_shift: float = 0.5, max_shift: float = 1.15) -> List[float]:
    if steps < 1:
        raise ValueError("steps must be >= 1")
    m = (max_shift - base_shift) / (4096 - 256)
    mu = base_shift + m * (image_tokens - 256)
    ts = torch.linspace(1, 0, steps + 1, dtype=torch.float64).tolist()

    def shift(t):
        if t <= 0:
            return 0.0
        if t >= 1:
            return 1.0
        return math.exp(mu) / (math.exp(mu) + (1 / t - 1))
    return [shift(t) for t in ts]


def euler_sample(model_fn: Callable, noise: torch.Tensor, timesteps: List[float],
                 step_callback: Optional[Callable] = None) -> torch.Tensor:
    """model_fn(x, t_tensor) -> velocity.  step_callback(i, x) after each step."""
    x = noise
    B = x.shape[0]
    for i, (t, tn) in enumerate(zip(timesteps[:-1], timesteps[1:])):
        tt = torch.full((B,), t, device=x.device, dtype=torch.float32)
        v = model_fn(x, tt)
        x = (x.float() + (tn - t) * v.float()).to(noise.dtype)
        if step_callback is not None:
            step_callback(i, x)
    return x
