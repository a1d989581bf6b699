"""Compile (or load from numba's on-disk cache) every Numba backend before the first step.

``warm_all(device, on_step=None)`` runs each registered Numba backend once on small FLUX-shaped
tensors (bf16, head dim 128), so the JIT happens at a moment the UI can show progress for, not
silently inside the first sampling step.  Whether numba wrote new cache entries (compiled) or
only read existing ones (on-disk cache) is read from the cache directories' ``.nbc`` files.
"""
from __future__ import annotations

import glob
import os
import time
from typing import Callable, Dict, List, Tuple

import torch

from .registry import registry

HERE = os.path.dirname(os.path.abspath(__file__))


def _cache_files() -> set:
    dirs = [os.path.join(HERE, "__pycache__")]
    if os.environ.get("NUMBA_CACHE_DIR"):
        dirs.append(os.environ["NUMBA_CACHE_DIR"])
    out = set()
    for d in dirs:
        out.update(glob.glob(os.path.join(d, "**", "*.nbc"), recursive=True))
    return out


FP8_OPS = ("ln_modulate_fp8", "gated_residual_ln_modulate_fp8", "quantize_fp8", "gelu_tanh_fp8", "attn_gelu_fp8")
VAE_OPS = ("groupnorm_silu_nhwc", "upsample_nearest2x", "bias_residual_nhwc", "vae_attention", "groupnorm_silu")
# the FLUX VAE decoder's channel counts (ch 128, mult 1,2,4,4) and where each NHWC op meets them
VAE_CHANNELS = (128, 256, 512)
VAE_UPSAMPLE_CHANNELS = (256, 512)


# the (op, backend) of each entry of ``warm_calls``, in its order, without building its test tensors
# (~20-50 ms of CPU randn and copies: a caller that only needs to know what is left to warm reads these)
WARM_NAMES = (
    ("ln_modulate", "numba"), ("gated_residual", "numba"), ("gated_residual_ln_modulate", "numba"),
    ("qk_norm_rope", "numba"), ("gelu_tanh", "numba"), ("attention", "numba"), ("attention", "numba-8bit"),
    ("groupnorm_silu", "numba"), ("groupnorm_silu_nhwc", "numba"), ("upsample_nearest2x", "numba"),
    ("bias_residual_nhwc", "numba"), ("vae_attention", "numba"), ("ln_modulate_fp8", "numba"),
    ("gated_residual_ln_modulate_fp8", "numba"), ("quantize_fp8", "numba"), ("gelu_tanh_fp8", "numba"),
    ("attn_gelu_fp8", "numba"),
)


def warm_name(op: str, backend: str) -> str:
    """The name ``warm_all`` reports an (op, backend) under."""
    return op if backend == "numba" else f"{op}/{backend}"


def warm_calls(device, call=None) -> List[Tuple[str, str, Callable]]:
    """(op, backend, fn) for every Numba backend, at small shapes with FLUX's widths (and the FLUX
    VAE decoder's channel counts, each variant the NHWC decoder calls).  ``fn()`` runs the op
    through ``call(op, *args, **kw)`` -- ``registry.call`` unless given (``prebuild.plan`` calls
    the backend itself)."""
    c = call or registry.call
    dev, bf = torch.device(device), torch.bfloat16
    H, D, C, M, L = 24, 128, 3072, 12288, 80
    g = torch.Generator(device="cpu").manual_seed(0)
    r = lambda *s, dt=bf: torch.randn(*s, generator=g).to(dev, dt)
    x, y = r(1, L, C), r(1, L, C)
    mod = r(1, 1, 6 * C)
    sh, sc, gt = mod[..., :C], mod[..., C:2 * C], mod[..., 2 * C:3 * C]
    qkv_t, qkv_i, s = r(1, 16, 3 * C), r(1, L - 16, 3 * C), torch.ones(D, device=dev, dtype=bf)
    pe = r(1, 1, L, D // 2, 2, 2, dt=torch.float32)
    lin1, buf = r(1, L, 3 * C + M), torch.empty(1, L, C + M, device=dev, dtype=bf)
    q = r(1, H, L, D)
    gn, w = r(1, 128, 16, 16), torch.ones(128, device=dev, dtype=bf)
    nhwc = lambda ch, hw=4: r(1, ch, hw, hw).contiguous(memory_format=torch.channels_last)
    calls = [
        ("ln_modulate", "numba", lambda: c("ln_modulate", x, sh, sc, 1e-6)),
        ("gated_residual", "numba", lambda: c("gated_residual", x.clone(), gt, y)),
        ("gated_residual_ln_modulate", "numba", lambda: c("gated_residual_ln_modulate", x.clone(), gt, y, sh, sc, 1e-6)),
        ("qk_norm_rope", "numba", lambda: c("qk_norm_rope", [(qkv_t, s, s), (qkv_i, s, s)], pe, H, 1e-6)),
        ("gelu_tanh", "numba", lambda: c("gelu_tanh", lin1[..., 3 * C:], out=buf[..., C:])),
        ("attention", "numba", lambda: c("attention", q, q, q, None)),
        ("attention", "numba-8bit", lambda: _warm_8bit(c, qkv_t, qkv_i, s, pe, H, q)),
        ("groupnorm_silu", "numba", lambda: c("groupnorm_silu", gn, 32, w, w, 1e-6, True)),
        # the NHWC VAE decoder's kernels (specialised per channel count): GroupNorm(+SiLU) alone and
        # with the previous conv's bias folded in, the attention block's norm without SiLU
        ("groupnorm_silu_nhwc", "numba", lambda: [
            c("groupnorm_silu_nhwc", t, 32, t.new_ones(ch), t.new_zeros(ch), 1e-6, silu, **kw)
            for ch in VAE_CHANNELS for silu, kw in ((True, {}), (True, {"pre_bias": r(ch)}))
            for t in [nhwc(ch)]] + [
            c("groupnorm_silu_nhwc", t, 32, t.new_ones(512), t.new_zeros(512), 1e-6, False) for t in [nhwc(512)]]),
        ("upsample_nearest2x", "numba", lambda: [c("upsample_nearest2x", nhwc(ch)) for ch in VAE_UPSAMPLE_CHANNELS]),
        ("bias_residual_nhwc", "numba", lambda: [
            c("bias_residual_nhwc", nhwc(ch), r(ch), *res) for ch in VAE_CHANNELS for res in ((), (nhwc(ch),))]),
        ("vae_attention", "numba", lambda: c("vae_attention", nhwc(512), nhwc(512), nhwc(512))),
        # the fast profile's quantising kernels (FP8_OPS: warmed only for that profile)
        ("ln_modulate_fp8", "numba", lambda: c("ln_modulate_fp8", x, sh, sc, 1e-6)),
        ("gated_residual_ln_modulate_fp8", "numba",
         lambda: c("gated_residual_ln_modulate_fp8", x.clone(), gt, y, sh, sc, 1e-6)),
        ("quantize_fp8", "numba", lambda: c("quantize_fp8", x)),
        ("gelu_tanh_fp8", "numba", lambda: c("gelu_tanh_fp8", lin1[..., 3 * C:])),
        ("attn_gelu_fp8", "numba", lambda: c("attn_gelu_fp8", lin1[..., 2 * C:3 * C], lin1[..., 3 * C:])),
    ]
    return [(op, b, fn) for op, b, fn in calls if op in registry.ops and b in registry.backends(op)]


def _warm_8bit(c, qkv_t, qkv_i, s, pe, H, q):
    """Both 8-bit paths: the pre-pass one (any caller's q/k) and the blocks' fused one
    (qk_norm_rope's int8 pack -- Q + V's tile image when the selected kernel quantizes K itself --
    and the per-token-scale attention kernel), as flux_core.blocks asks for them."""
    from . import attention
    c("attention", q, q, q, None)
    want = attention.int8_pack_kind(q.device, q.shape[-1])
    qq, kk, vv, pack = c("qk_norm_rope", [(qkv_t, s, s), (qkv_i, s, s)], pe, H, 1e-6, quant8=want)
    if pack is not None:
        c("attention", qq, kk, vv, None, q8=pack)


def warm_all(device="cuda", on_begin: Callable = None, on_step: Callable = None, backends=None) -> Dict[str, dict]:
    """Run each Numba backend once (only the (op, backend) pairs in ``backends`` when given).
    on_begin(name) / on_step(name, cached: bool, seconds, error)."""
    results = {}
    for op, backend, fn in warm_calls(device):
        if backends is not None and (op, backend) not in backends:
            continue
        name = warm_name(op, backend)
        if on_begin:
            on_begin(name)
        before = _cache_files()
        t0 = time.perf_counter()
        err = None
        try:
            with registry.force(**{op: backend}):
                strict, registry.strict = registry.strict, True
                try:
                    fn()
                finally:
                    registry.strict = strict
            if torch.device(device).type == "cuda":
                torch.cuda.synchronize()
        except Exception as e:  # reported, never raised: the op then runs on torch
            err = f"{type(e).__name__}: {e}"
        dt = time.perf_counter() - t0
        cached = err is None and not (_cache_files() - before)
        results[name] = {"seconds": dt, "cached": cached, "error": err}
        if on_step:
            on_step(name, cached, dt, err)
    return results
