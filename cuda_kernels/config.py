"""Launch and tiling settings of the element-wise / row kernels: one typed, frozen config per op
family, one module-level default instance each (the attention kernels have theirs in
``attention/config.py``).

An op's launcher reads its default here; its ``numba`` backend takes ``config=`` (an instance of
the same class) so that benchmarks and tests run another setting explicitly -- nothing sets a
module global.  A launcher made for a config other than the default is cached under its key plus
the config (``launcher_key``), so the default's launchers are never replaced.  Physical limits
(threads per block, shared-memory sizes fixed by the algorithm) stay in the op modules.
"""
from dataclasses import dataclass

from .runtime import SIMULATOR

# the word layouts of the row kernels: (VEC, VW) = int64 words of 4 bf16 moved as 16-byte pairs,
# as single 8-byte words, or int16 scalars (the unaligned fallback)
WORD_LAYOUTS = ((4, 2), (4, 1), (1, 1))


@dataclass(frozen=True)
class _Words:
    """Words per thread for each word layout (a thread's NW / VW slots of VEC * VW elements)."""
    nw16: int = 8    # (4, 2): 8 words = 32 bf16, four 16-byte loads per tensor
    nw8: int = 4     # (4, 1)
    nw2: int = 16    # (1, 1)

    def nw(self, VEC, VW):
        return self.nw16 if VW == 2 else self.nw8 if VEC == 4 else self.nw2

    def nw_for(self):
        """{(VEC, VW): NW} over every word layout."""
        return {k: self.nw(*k) for k in WORD_LAYOUTS}


@dataclass(frozen=True)
class RowsConfig(_Words):
    """ln_modulate, gated_residual_ln_modulate (+ their fp8 outputs) and gated_residual.
    ``nw16``: measured on the H200 at C=3072, 8 words per thread faster than 4 for ln_modulate,
    gated_residual_ln_modulate and gated_residual (BENCHMARKS.md, row kernels).
    ``pipe_blocks`` / ``pipe_blocks_gated``: 16-byte rows go through the pipelined kernel with that
    many blocks per SM (what fits by registers: 76 registers x 96 threads -> 8); 0 = the one-row
    kernel.  Measured on the H200 (img rows): LN a little faster pipelined (8/SM) than one-row; the
    gated variant pipelined (95 registers, 4-12 blocks/SM) slower than one-row: off.
    ``late`` / ``late_gated``: the one-row kernel loads shift/scale in the last pass instead of
    with x (88 -> 64 registers at 16-byte words: 10 rows in flight per SM instead of 7); measured
    faster for LN, slower for the gated LN -> late for LN only."""
    pipe_blocks: int = 8
    pipe_blocks_gated: int = 0
    late: bool = True
    late_gated: bool = False

    def pipe(self, GATED):
        return self.pipe_blocks_gated if GATED else self.pipe_blocks

    def late_vec(self, GATED):
        return self.late_gated if GATED else self.late


@dataclass(frozen=True)
class GeluConfig(_Words):
    """gelu_tanh: words per thread per layout, at most ``threads`` threads per row chunk."""
    threads: int = 256


@dataclass(frozen=True)
class Fp8RowsConfig(_Words):
    """fp8_rows (quantize / GELU / concat to fp8 rows): rows up to ``max_k`` elements; launch bounds
    (max threads at K <= max_k, min blocks per SM) per word layout."""
    max_k: int = 16384
    lb16: tuple = (512, 2)
    lb8: tuple = (1024, 1)
    lb2: tuple = (1024, 1)

    def lb(self, VEC, VW):
        return self.lb16 if VW == 2 else self.lb8 if VEC == 4 else self.lb2


@dataclass(frozen=True)
class QkConfig:
    """qk_norm_rope: at most ``max_threads`` threads per block (one group of lanes per head, head
    chunks on grid z); the kernel's launch bounds (``max_threads``, ``min_blocks``), none when
    ``min_blocks`` is 0."""
    max_threads: int = 128
    min_blocks: int = 8

    def launch_bounds(self):
        return (self.max_threads, self.min_blocks) if self.min_blocks else None


@dataclass(frozen=True)
class NhwcConfig:
    """The VAE's NHWC kernels (bias_residual_nhwc, upsample_nearest2x, groupnorm_silu_nhwc):
    ``tpb`` threads per block (a multiple of 32; the simulator runs 32), ``max_s``:
    groupnorm_silu_nhwc's most pixel chunks per sample (the last block merges G x S partials)."""
    tpb: int = 32 if SIMULATOR else 256
    max_s: int = 2 if SIMULATOR else 256


@dataclass(frozen=True)
class GroupNormConfig:
    """groupnorm_silu (NCHW): ``tpb`` threads per block (GPU: a multiple of 32; simulator: a power
    of 2), ``u`` slots per thread per iteration (a slot = 16 B, 8 B or one element)."""
    tpb: int = 8 if SIMULATOR else 256
    u: int = 4


@dataclass(frozen=True)
class VaeAttentionConfig:
    """vae_attention: query chunks whose S (fp32) + P (bf16) take at most ``chunk_bytes``
    (``graph_chunk_bytes`` while a CUDA graph is being captured: a graph keeps its memory between
    replays); ``tpb`` threads per block of the softmax kernel."""
    tpb: int = 32 if SIMULATOR else 256
    chunk_bytes: int = 384 << 20
    graph_chunk_bytes: int = 48 << 20


ROWS = RowsConfig()
GELU = GeluConfig()
FP8_ROWS = Fp8RowsConfig()
QK_NORM_ROPE = QkConfig()
NHWC = NhwcConfig()
GROUPNORM = GroupNormConfig()
VAE_ATTENTION = VaeAttentionConfig()


def launcher_key(key, cfg, default):
    """A launcher's cache key: ``key`` for the default config, ``key + (cfg,)`` for any other."""
    return key if cfg is default else key + (cfg,)
