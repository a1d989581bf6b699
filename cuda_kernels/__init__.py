"""Numba-CUDA kernels for FLUX, one op per module, each with its torch reference.

Importing this package registers every op in ``registry``.  No ComfyUI imports here.
"""
from . import _numpy_compat  # noqa: F401  (first: before anything imports numba-cuda)
from .registry import registry, REFERENCE  # noqa: F401
from . import runtime  # noqa: F401
from . import ln_modulate, gated_residual, qk_norm_rope, gelu_tanh, attention  # noqa: F401
from . import groupnorm_silu, groupnorm_silu_nhwc, upsample_nearest2x, bias_residual_nhwc, vae_attention  # noqa: F401  (VAE decoder)
from . import linear_gelu  # noqa: F401
from . import fp8_rows  # noqa: F401  (fp8_format: the fast profile's fp8 GEMM inputs)

from . import ops  # noqa: F401,E402  (one typed function per op)
