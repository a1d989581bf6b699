"""Compatibility names: this module's former contents live in three modules now --

  * ``jit``: ``NUMBA_OK``, ``jit_kernel``, the sources hash (``tree_hash``, ``source_hash``,
    ``keyed_on_sources``);
  * ``device``: the device helpers (``bf2f``, ``pack4``, ``block_sum``, ... and their simulator
    fallbacks under the same names), ``RED_SMEM``;
  * ``launching``: ``Launcher``, ``cached_launcher``, planning (``collecting``, ``planning``),
    ``signature``, ``arr``, ``words`` / ``nhwc_words`` / ``aligned16``, ``grid3``, ``common_check``.

The pack imports those modules; the public names are re-exported here for code that still says
``intrinsics``.  Module state (``PREPARED``, ``_FAST_OK``, ``compile_gate``) is
``launching``'s: read here it is launching's current value; set it on ``launching`` -- an assignment
through this module raises AttributeError (it would change nothing).
"""
import sys as _sys
import types as _types

from . import launching
from .jit import NUMBA_OK, SIMULATOR, cuda, jit_kernel, keyed_on_sources, source_hash, tree_hash
from .device import (RED_SMEM, float32, int16, int32, int64, bf2f, word_get, f2bf, wrap_i16, wrap_i32,
                     wrap_i64, lo_f32, hi_f32, unpack4, pack4, pack1, round_bf16, unpack_f32x2, unpack_w, rsqrt,
                     tanh, gelu_tanh, gelu_fast, block_sum, block_max, group_sum, group_max, fdiv_rn, ld2, st2)
from .launching import (Launcher, aligned16, arr, cached_launcher, collecting, common_check, grid3,
                        nhwc_words, planning, signature, words)

__all__ = ["NUMBA_OK", "SIMULATOR", "cuda", "jit_kernel", "keyed_on_sources", "source_hash", "tree_hash",
           "RED_SMEM", "float32", "int16", "int32", "int64", "bf2f", "word_get", "f2bf", "wrap_i16", "wrap_i32",
           "wrap_i64", "lo_f32", "hi_f32", "unpack4", "pack4", "pack1", "round_bf16", "unpack_f32x2", "unpack_w",
           "rsqrt", "tanh", "gelu_tanh", "gelu_fast", "block_sum", "block_max", "group_sum", "group_max", "fdiv_rn",
           "ld2", "st2", "Launcher", "aligned16", "arr", "cached_launcher", "collecting", "common_check", "grid3",
           "nhwc_words", "planning", "signature", "words"]

_STATE = ("PREPARED", "_FAST_OK", "compile_gate")


def __getattr__(name):
    if name in _STATE:
        return getattr(launching, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _Compat(_types.ModuleType):
    def __setattr__(self, name, value):
        if name in _STATE:
            raise AttributeError(f"{name} is cuda_kernels.launching's state now: set launching.{name}")
        super().__setattr__(name, value)


_sys.modules[__name__].__class__ = _Compat
