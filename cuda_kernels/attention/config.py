"""Kernel settings: one typed, frozen config per kernel, one ``select`` per dtype, one ``build``.

A config names the kernel (``kind``) and the settings its factory takes; ``select_bf16`` /
``select_int8`` map (device capability, head dim) to the config the op runs, with the measured
reason beside each branch ([1,24,4608,128] on an H200, device time; the full tables are in
BENCHMARKS.md).  ``build(cfg, D, has_mask, per_token)`` returns the cached ``launch.Kernel``.
Benchmarks and tests pass a config explicitly to ``numba_attention`` / ``numba_attention_8bit``;
nothing is read from the environment.

Kernel families retired at tag ``attention-variants-pre-retire`` (correct, measured slower, the
default on no GPU): one comment line each inside ``select_bf16`` / ``select_int8``.  The ablation
flags (loads / softmax / P V / barrier / fence switched off) went with them; their numbers stay
in BENCHMARKS.md (the attention section's history) and the tag reproduces them.
"""
from dataclasses import dataclass

from . import bf16_mma, bf16_wgmma, int8_mma, int8_wgmma, int8_wgmma_u8s8


@dataclass(frozen=True)
class Bf16Config:
    """kind "mma": mma.sync m16n8k16, rows / 16 warps, K / V tiles of ``keys`` through cp.async
    (double-buffered in 35 KB of static shared memory).  kind "wgmma": ``warpgroups`` x 64 query
    rows on wgmma, ``keys``-key tiles in a ``stages``-deep ring moved by bulk copies (``bulk``:
    K / V re-laid out by tile_kv; the only kept wgmma load path)."""
    kind: str
    rows: int
    keys: int
    warpgroups: int = 0
    stages: int = 0
    bulk: bool = False

    def __post_init__(self):
        if self.kind == "mma":
            assert self.rows % 16 == 0 and self.rows <= 2 * self.keys and not self.bulk, self
        elif self.kind == "wgmma":
            assert self.rows == 64 * self.warpgroups and self.stages >= 3 and self.bulk, self
        else:
            raise ValueError(f"unknown bf16 attention kernel kind {self.kind!r}")


@dataclass(frozen=True)
class Int8Config:
    """kind "mma": int8 mma.sync m16n8k32 for S, bf16 m16n8k16 for P V, 64 x 64 tiles (the
    pre-pass's scale granularity).  kind "wgmma": 2 warpgroups on wgmma taking turns (``ping_pong``),
    ``keys``-key tiles in a ``stages``-deep bulk-copy ring (``bulk``), and its switches (int8_wgmma's
    header; the defaults are the kept kernel): ``ones`` (row sums from a ones column of V), ``tau``
    (rescale threshold, log2 units; 0: the max moves on every increase), ``biasacc`` (S accumulated
    onto the bits of 1.5 * 2^23), ``exp_poly`` (every exp_poly-th 8-key n-tile's exp2 on the FMA
    pipe; 0: none), ``pv`` (P V on "bf16" wgmma, or "u8s8": u8 P per row and 64-key group x s8 V per
    channel on integer wgmma, int32 per group -- int8_wgmma_u8s8, the arithmetic of int8_pv_ref;
    row sums in registers, so ``ones`` off).  The mma kernel has no such switches: they keep their
    defaults there."""
    kind: str
    rows: int
    keys: int
    warpgroups: int = 0
    stages: int = 0
    bulk: bool = False
    ping_pong: bool = False
    ones: bool = True
    tau: float = 8.0
    biasacc: bool = True
    exp_poly: int = 4
    pv: str = "bf16"

    def __post_init__(self):
        if self.kind == "mma":
            assert self.rows == 64 and self.keys == 64 and not (self.bulk or self.ping_pong), self
            assert (self.ones, self.tau, self.biasacc, self.exp_poly, self.pv) == (True, 8.0, True, 4, "bf16"), self
        elif self.kind == "wgmma":
            assert self.rows == 128 and self.warpgroups == 2 and self.keys % 64 == 0, self
            assert self.stages >= 3 and self.bulk and self.ping_pong, self
            assert self.tau >= 0 and self.exp_poly >= 0 and (self.keys // 8) % max(self.exp_poly, 1) == 0, self
            assert self.pv in ("bf16", "u8s8") and not (self.pv == "u8s8" and (self.ones or self.keys != 128)), self
        else:
            raise ValueError(f"unknown int8 attention kernel kind {self.kind!r}")


BF16_MMA = Bf16Config("mma", rows=64, keys=64)
BF16_WGMMA = Bf16Config("wgmma", rows=128, keys=128, warpgroups=2, stages=3, bulk=True)
INT8_MMA = Int8Config("mma", rows=64, keys=64)
INT8_WGMMA = Int8Config("wgmma", rows=128, keys=128, warpgroups=2, stages=4, bulk=True, ping_pong=True)
# the integer-P V variant (issue #38): opt-in (the registry's "numba-8bit-u8s8", benchmarks), selected nowhere
INT8_WGMMA_U8S8 = Int8Config("wgmma", rows=128, keys=128, warpgroups=2, stages=4, bulk=True, ping_pong=True,
                             ones=False, pv="u8s8")


def wgmma_ok(cc, D, simulator=False):
    """wgmma runs on sm_90 only; on the GPU at head dim 128 only: on the H200 it gave ~80% error at
    D=64 (L=16384), cause not found (the simulator's emulation passes D=32 / 64)."""
    return simulator or (cc[0] == 9 and D == 128)


def select_bf16(cc, D):
    """The bf16 kernel for compute capability ``cc`` (major, minor) and head dim D."""
    # retired (tag attention-variants-pre-retire; H200, [1,24,4608,128], vs the kept kernels' numbers below):
    #   w32 / w32x8 / w32n16 (32 query rows per warp, FA2 tiling): 1.133 / 1.035 / 1.187 ms vs mma 1.009
    #   wg / wgr / wg2 (wgmma, single-buffered cp.async K / V): 1.71 / 1.80 / 1.24 ms
    #   wgp / wgpp / wgpp64 / wgppr (wgmma, cp.async ring): 1.90 / 1.80 / 1.81 ms; 128x2s3 ring 1.074
    #   unchecked full-tile cp.async loads (FL): 1.001 ms vs 1.058 checked -- both 1.8x the bulk kernel
    #   producer warp (WS: 32x1s4w / 32x2s6w): 0.656 / 0.781 ms vs 128x2s3 bulk 0.561
    #   mbarrier stage release (REL, 128x2s3e): 0.594 ms; + ping-pong warpgroups (PP): 0.595
    if wgmma_ok(cc, D):
        # kernel 0.561 ms + tile_kv 0.050 = op 0.620 ms (421 TFLOP/s) vs mma 1.000; errors = SDPA's
        return BF16_WGMMA
    # sm_80 / sm_89, and Hopper at D != 128: mma.sync, 64 x 64 tiles -- 1.009 ms on the H200
    return BF16_MMA


def select_int8(cc, D):
    """The 8-bit kernel for compute capability ``cc`` and head dim D."""
    # retired (tag attention-variants-pre-retire; H200, [1,24,4608,128]):
    #   wg / wgr (one warpgroup, cp.async): op 1.49 ms vs the mma kernel's 0.90
    #   wgb (block barrier per tile, 3 stages): kernel 0.520-0.530 ms vs ping-pong 0.487
    #   wgbpf (int32-direct softmax, FS): 0.492-0.498 ms vs 0.487 (more registers: 254 vs 226)
    #   per-token K scales in the wgmma kernel: op 0.855 ms (spills) vs per-64-key scales 0.617
    #   torch pre-pass (the former environment knob): 1.11 ms vs the one-launch Numba pre-pass 0.091
    # (tag attention-pv8-e4m3 = 722d0cf; H200, same process as the kept kernel):
    #   e4m3 P V on wgmma (P x 448, tile_v8t's e4m3 V^T, per-channel V scales): kernel 0.487-0.502 ms vs
    #   0.486-0.494, error 3.9% vs 1.26% (e4m3's 3-bit mantissa on P and V: 3.6% on random inputs in fp32
    #   emulation -- the 2% bar cannot hold with fp8 P V); S's int32 -> fp32 by the magic bias instead of
    #   I2F: 0.494 vs 0.486 (more instructions: the loop is not I2F-throughput-bound)
    # not selected (not measured yet): INT8_WGMMA_U8S8, u8 P x s8 V^T on wgmma (int8_wgmma_u8s8; torch reference
    #   int8_pv_ref.py), P scaled per row and 64-key group, each group's int32 P V scaled into the fp32 O --
    #   under 2% error in emulation; one int32 accumulator (group 1's product waits for group 0's conversion);
    #   the producer / consumer split (setmaxnreg) would hold a second one
    if wgmma_ok(cc, D):
        # the kept kernel (32-bit ring counters, ones column, rescale threshold, biased S, a quarter of the
        # exp2 on the FMA pipe: int8_wgmma's header); fed by qk_norm_rope's "qv" pack (Q8 + V's tile image)
        # it is still a little slower than cuDNN on the same tensors (BENCHMARKS.md, Attention); mma ~2x slower
        return INT8_WGMMA
    # elsewhere: int8 mma.sync -- op 0.903 ms (pre-pass 0.091 + kernel), error 1.26%
    return INT8_MMA


_built = {}


def build(cfg, D, has_mask, per_token=False):
    """The ``launch.Kernel`` of ``cfg`` at head dim D (per_token: int8 kernels fed per-token
    scales by qk_norm_rope's pack), built once per process."""
    key = (cfg, D, bool(has_mask), bool(per_token))
    k = _built.get(key)
    if k is None:
        if isinstance(cfg, Bf16Config):
            k = (bf16_mma if cfg.kind == "mma" else bf16_wgmma).make(cfg, D, bool(has_mask))
        else:
            mod = int8_mma if cfg.kind == "mma" else int8_wgmma_u8s8 if cfg.pv == "u8s8" else int8_wgmma
            k = mod.make(cfg, D, bool(has_mask), bool(per_token))
        _built[key] = k
    return k
