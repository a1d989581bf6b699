"""The ops as typed functions: one function per registry op, same parameters as its torch reference.

Call sites use these (``ops.ln_modulate(x, shift, scale, eps)``) instead of naming ops by string, so
a misspelt op is an AttributeError at the call and an argument list that does not fit is visible in
the signature; each function forwards to ``registry.call`` with the arguments exactly as given (the
registry's dispatch -- forced backend, autotune, fallback with a logged reason -- is unchanged).
``tests/test_registry.py`` checks that every registered op has its function here with its
reference's parameters.
"""
from __future__ import annotations

from .registry import registry



def _call(name, *args, **kwargs):
    return registry.call(name, *args, **kwargs)  # looked up per call (tests wrap registry.call)


# FLUX blocks
def ln_modulate(x, shift, scale, eps: float = 1e-6):
    return _call("ln_modulate", x, shift, scale, eps)


def gated_residual(x, gate, y):
    return _call("gated_residual", x, gate, y)


def gated_residual_ln_modulate(x, gate, y, shift, scale, eps: float = 1e-6):
    return _call("gated_residual_ln_modulate", x, gate, y, shift, scale, eps)


def qk_norm_rope(parts, pe, num_heads: int, eps: float = 1e-6, quant8=False):
    if quant8:
        return _call("qk_norm_rope", parts, pe, num_heads, eps, quant8=quant8)
    return _call("qk_norm_rope", parts, pe, num_heads, eps)


def attention(q, k, v, mask=None, out=None, q8=None):
    if q8 is not None:
        return _call("attention", q, k, v, mask, out=out, q8=q8)
    return _call("attention", q, k, v, mask, out=out)


def gelu_tanh(x, out=None):
    if out is not None:
        return _call("gelu_tanh", x, out=out)
    return _call("gelu_tanh", x)


def linear_gelu(x, weight, bias, out=None):
    if out is not None:
        return _call("linear_gelu", x, weight, bias, out=out)
    return _call("linear_gelu", x, weight, bias)


# the fast profile's fp8 inputs
def ln_modulate_fp8(x, shift, scale, eps: float = 1e-6):
    return _call("ln_modulate_fp8", x, shift, scale, eps)


def gated_residual_ln_modulate_fp8(x, gate, y, shift, scale, eps: float = 1e-6):
    return _call("gated_residual_ln_modulate_fp8", x, gate, y, shift, scale, eps)


def quantize_fp8(x):
    return _call("quantize_fp8", x)


def gelu_tanh_fp8(x):
    return _call("gelu_tanh_fp8", x)


def attn_gelu_fp8(a, m):
    return _call("attn_gelu_fp8", a, m)


# the VAE decoder
def groupnorm_silu(x, num_groups, weight, bias, eps: float = 1e-6, silu: bool = True):
    return _call("groupnorm_silu", x, num_groups, weight, bias, eps, silu=silu)


def groupnorm_silu_nhwc(x, num_groups, weight, bias, eps: float = 1e-6, silu: bool = True, pre_bias=None):
    if pre_bias is not None:
        return _call("groupnorm_silu_nhwc", x, num_groups, weight, bias, eps, silu=silu, pre_bias=pre_bias)
    return _call("groupnorm_silu_nhwc", x, num_groups, weight, bias, eps, silu=silu)


def upsample_nearest2x(x):
    return _call("upsample_nearest2x", x)


def bias_residual_nhwc(y, bias, residual=None):
    return _call("bias_residual_nhwc", y, bias, residual)


def vae_attention(q, k, v):
    return _call("vae_attention", q, k, v)
