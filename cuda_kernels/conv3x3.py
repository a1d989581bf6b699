"""3x3 convolution (stride 1, pad 1) of an NHWC bf16 activation on tensor cores, for the FLUX VAE decoder.

``conv3x3_nhwc(x, wp, bias=None, residual=None, norm=None, upsample2x=False)``
  x         [N, Hi, Wi, Cin] contiguous bf16 (NHWC).
  wp        ``pack_weight(w)`` of a [Cout, Cin, 3, 3] weight: [Cout, 9, Cin] bf16, K-contiguous
            (k = tap * Cin + c, tap = 3 r + s), packed once per weight.
  bias      [Cout] (any float dtype) or None; added in fp32 in the epilogue.
  residual  [N, H, W, Cout] bf16 or None; added in fp32 in the epilogue (ResnetBlock's x + h).
  norm      None or (st, gamma, beta, silu): GroupNorm(+SiLU) applied to x as it is loaded,
            st = ``groupnorm_stats_nhwc(x, G)`` ([2, N, G] fp32 mean / rstd), gamma / beta [Cin];
            the zero padding applies to the normalised activation (conv(silu(gn(x))), as stock).
  upsample2x  nearest 2x upsampling folded into the input indexing: output [N, 2Hi, 2Wi, Cout].
  Returns y [N, H, W, Cout] bf16 (H, W = Hi, Wi or 2Hi, 2Wi), one rounding of the fp32 result.
The same kernel with 1x1 weights is op ``conv1x1_nhwc`` (conv1x1.py).

Kernel (implicit GEMM, mma.sync m16n8k16 bf16, fp32 accumulators): M = output pixels, N = Cout,
K = 9 Cin.  A block owns a TH x TW patch of output pixels of ONE image (BM = TH TW GEMM rows) and
BN output channels.  K runs over Cin chunks of BK channels (outer) and the 9 taps (inner): per
chunk the block loads the (TH+2) x (TW+2) x BK input *halo* into shared memory once, and the 9
taps read shifted windows of it -- ldmatrix takes one row address per lane, so the A fragment of
tap (r, s) is gathered straight from halo pixel (py + r, px + s): each input element is loaded
(and, with ``norm``, normalised) ~1.4x per block instead of 9x.  B (BN x BK of the packed weight
per tap) streams through an S-stage cp.async ring; halo chunks are double-buffered (S-buffered for
1x1).  Without ``norm`` the halo moves by 16-byte cp.async (zero-filled outside the image / past
Cin) straight into its buffer; with ``norm`` the raw halo is cp.async'ed S steps ahead into a
staging buffer and, after the MMAs of the step before its first use, each thread transforms the
chunks it copied: silu(x a_c + b_c) (a_c = rstd gamma_c, b_c = beta_c - mean a_c, per thread once
per chunk), rounded to bf16, stored into the halo buffer -- padding chunks are stored as 0, not
transformed.  Nothing is held in registers across the MMAs (``layout`` gives every buffer's
lifetime).  Registers (ptxas sm_90, bench/ptx_conv.py): 8x16-128-32-w2x4-s3 plain 123, GN
prologue 163 -> with launch_bounds(256, 2) ("-lb2") 128 with 48 B of spills, 2 blocks / SM.
Shared rows are padded to
BK/2 + 4 words (conflict-free ldmatrix for any 8 consecutive rows).  Warps tile the block WM x WN,
each (BM/WM) x (BN/WN) in m16n8 fragments.  Epilogue: fp32 + bias (+ residual), one RNE rounding,
32-bit stores of channel pairs (16-bit stores when Cout is odd, e.g. conv_out's 3).  Grid: one
block per (pixel tile, Cout block), Cout blocks of a tile adjacent (the halo is re-read from L2).
Simulator: same code, tiny tiles (``Config``; the mma.py helpers emulate the warp ops).

Floor per FLUX-decoder conv (1024^2 image, batch 1; H200: 765 TFLOP/s bf16 dense as cuBLAS
measures it, 3.7 TB/s; FLOPs = 2 H W Cout 9 Cin; bytes = x + y + weights (+ residual), each once):
  conv (Cin->Cout @ H W)      count  GFLOP   MB     t_flop   t_byte   bound
  16->512    @128^2 conv_in    1      2.4    17.3   3 us     4.7 us   bytes
  512->512   @128^2           10     77.3    38     101 us   10 us    FLOPs
  512->512   @256^2 (up 2x)    1    309     88     404 us   24 us    FLOPs
  512->512   @256^2            6    309    139     404 us   38 us    FLOPs
  512->512   @512^2 (up 2x)    1   1237    338    1617 us   91 us    FLOPs
  512->256   @512^2            1    619    404     808 us  109 us    FLOPs
  256->256   @512^2            5    309    269     404 us   73 us    FLOPs  (+1 with residual)
  256->256   @1024^2 (up 2x)   1   1237    671    1617 us  181 us    FLOPs
  256->128   @1024^2           1    619    806     808 us  218 us    FLOPs
  128->128   @1024^2           5    309    537     404 us  145 us    FLOPs
  128->3     @1024^2 conv_out  1      7.2  275       9 us   74 us    bytes
  (1x1 shortcuts: 512->256 @512^2 69 GFLOP / 201 MB, 256->128 @1024^2 69 GFLOP / 403 MB: ~90 /
  109 us, both near balance.)  Sum of the 3x3 convs: 9.7 TFLOP -> 12.7 ms at 765 TFLOP/s; the
  decoder is FLOP-bound on its convs, and an mma.sync kernel reaches a fraction of the wgmma peak
  (Hopper runs mma.sync at roughly half wgmma's rate), so the win over cuDNN is in what it avoids:
  the NCHW<->NHWC conversions and the separate GroupNorm-apply / SiLU / residual passes.
  With ``norm``: 1-2 MUFU ops per loaded element (ex2 + rcp; ``tanh`` configs: 1) x ~1.4 loads
  per element per Cout block -- negligible next to the MMAs at BN >= 128.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from . import intrinsics as ik
from . import runtime
from .registry import registry
# module globals (not closure cells): the simulator swaps `cuda` per thread
from .intrinsics import cuda, float32, int32, pack1  # noqa: F401

OP = "conv3x3_nhwc"
SIMULATOR = runtime.SIMULATOR

try:
    from . import mma as _mma
except Exception:  # pragma: no cover - numba missing
    _mma = None


# ---------------------------------------------------------------------------------- reference
def pack_weight(w):
    """[Cout, Cin, k, k] conv weight -> [Cout, k*k, Cin] bf16 contiguous (K = tap * Cin + c)."""
    Co, Ci, kh, kw = w.shape
    return w.detach().to(torch.bfloat16).permute(0, 2, 3, 1).reshape(Co, kh * kw, Ci).contiguous()


def unpack_weight(wp):
    """``pack_weight``'s inverse as a view: [Cout, Cin, k, k] (channels_last strides, what cuDNN's
    NHWC convolution reads without a copy)."""
    Co, T, Ci = wp.shape
    k = int(round(T ** 0.5))
    return wp.view(Co, k, k, Ci).permute(0, 3, 1, 2)


def norm_reference(h, norm):
    """silu(gn(h)) of an NCHW(-shaped) tensor from precomputed stats, in fp32, rounded to h's dtype."""
    st, gamma, beta, silu = norm
    C = h.shape[1]
    G = st.shape[2]
    mean = st[0].repeat_interleave(C // G, 1)[:, :, None, None]
    rstd = st[1].repeat_interleave(C // G, 1)[:, :, None, None]
    a = rstd * gamma.float()[None, :, None, None]
    y = h.float() * a + (beta.float()[None, :, None, None] - mean * a)
    if silu:
        y = F.silu(y)
    return y.to(h.dtype)


def reference(x, wp, bias=None, residual=None, norm=None, upsample2x=False):
    """Stock math on NHWC memory: (GroupNorm+SiLU,) nearest 2x, ``F.conv2d`` (cuDNN on CUDA, NHWC
    through channels_last views), + residual, each step rounded to x's dtype as ComfyUI does."""
    h = x.permute(0, 3, 1, 2)
    if norm is not None:
        h = norm_reference(h, norm)
    if upsample2x:
        h = F.interpolate(h, scale_factor=2.0, mode="nearest")
    w = unpack_weight(wp).to(x.dtype)
    y = F.conv2d(h, w, None if bias is None else bias.to(x.dtype), padding=w.shape[-1] // 2)
    if residual is not None:
        y = y + residual.permute(0, 3, 1, 2)
    return y.permute(0, 2, 3, 1).contiguous()


registry.register(OP, reference, doc=__doc__)


# ---------------------------------------------------------------------------------- configs
@dataclass(frozen=True)
class Config:
    """Block = TH x TW output pixels x BN channels, K chunks of BK channels, WM x WN warps,
    ``stages`` B buffers; ``act``: "exp" (SiLU as y rcp(1 + ex2(-y log2 e)), 2 MUFU) or "tanh"
    (0.5 y (1 + tanh.approx(y / 2)), 1 MUFU, ~1e-3 relative).  Name: "8x16-128-32-w2x4-s3[-tanh]"."""
    th: int
    tw: int
    bn: int
    bk: int
    wm: int
    wn: int
    stages: int
    act: str = "exp"
    min_blocks: int = 0      # launch_bounds(threads, min_blocks) when > 0 (caps the registers)

    @property
    def name(self):
        return (f"{self.th}x{self.tw}-{self.bn}-{self.bk}-w{self.wm}x{self.wn}-s{self.stages}"
                + ("" if self.act == "exp" else "-" + self.act)
                + (f"-lb{self.min_blocks}" if self.min_blocks else ""))

    @staticmethod
    def parse(s):
        m = re.fullmatch(r"(\d+)x(\d+)-(\d+)-(\d+)-w(\d+)x(\d+)-s(\d+)(?:-(exp|tanh))?(?:-lb(\d+))?",
                         s.strip())
        if not m:
            raise ValueError(f"bad conv config {s!r} (want e.g. 8x16-128-32-w2x4-s3[-tanh][-lb2])")
        v = [int(g) for g in m.groups()[:7]]
        return Config(*v, act=m.group(8) or "exp", min_blocks=int(m.group(9) or 0))

    def why_invalid(self):
        BM = self.th * self.tw
        if self.bk % 16 or self.bk > 64:
            return "bk must be 16, 32, 48 or 64"
        if BM % (16 * self.wm) or self.bn % (16 * self.wn):
            return "warp tile must be a multiple of 16 x 16"
        if not 2 <= self.stages <= 8:
            return "stages 2..8"
        if self.wm * self.wn * 32 > (_mma.MAX_THREADS if SIMULATOR else 1024):
            return "too many warps"
        if self.act not in ("exp", "tanh"):
            return "act exp|tanh"
        return None

    @property
    def threads(self):
        return 32 * self.wm * self.wn

    def smem_bytes(self, ksz, pro=0):
        return 4 * layout(self, ksz, pro)["NWORDS"]


# The FLUX VAE decoder's convolutions at a 128^2 latent (1024^2 image), batch 1, as the NHWC path
# runs them (ch 128, ch_mult [1, 2, 4, 4], 2 res blocks + 1, z 16; ComfyUI's model.py Decoder):
# (name, Cin, Cout, input H = W, kernel, upsample2x, norm (None | silu flag), residual, count)
DECODER_SHAPES = [
    ("conv_in", 16, 512, 128, 3, 0, None, 0, 1),
    ("r512@128.conv1", 512, 512, 128, 3, 0, True, 0, 5),      # mid.block_1/2, up[3].block[0-2]
    ("r512@128.conv2", 512, 512, 128, 3, 0, True, 1, 5),
    ("attn.qkv", 512, 1536, 128, 1, 0, False, 0, 1),          # mid.attn_1 q, k, v as one GEMM
    ("attn.proj", 512, 512, 128, 1, 0, None, 1, 1),
    ("up3.conv", 512, 512, 128, 3, 1, None, 0, 1),            # -> 256^2
    ("r512@256.conv1", 512, 512, 256, 3, 0, True, 0, 3),
    ("r512@256.conv2", 512, 512, 256, 3, 0, True, 1, 3),
    ("up2.conv", 512, 512, 256, 3, 1, None, 0, 1),            # -> 512^2
    ("r256@512.conv1a", 512, 256, 512, 3, 0, True, 0, 1),     # up[1].block[0]: 512 -> 256
    ("r256@512.nin", 512, 256, 512, 1, 0, None, 0, 1),        # its 1x1 shortcut
    ("r256@512.conv1", 256, 256, 512, 3, 0, True, 0, 2),
    ("r256@512.conv2", 256, 256, 512, 3, 0, True, 1, 3),
    ("up1.conv", 256, 256, 512, 3, 1, None, 0, 1),            # -> 1024^2
    ("r128@1024.conv1a", 256, 128, 1024, 3, 0, True, 0, 1),
    ("r128@1024.nin", 256, 128, 1024, 1, 0, None, 0, 1),
    ("r128@1024.conv1", 128, 128, 1024, 3, 0, True, 0, 2),
    ("r128@1024.conv2", 128, 128, 1024, 3, 0, True, 1, 3),
    ("conv_out", 128, 3, 1024, 3, 0, True, 0, 1),
]


def flops(Cin, Cout, H, W, ksz, N=1):
    """Multiply-adds x 2 of one conv (H, W: output size)."""
    return 2 * N * H * W * Cout * ksz * ksz * Cin


# GPU defaults (bench/gpu_conv.py compares alternatives); the simulator runs one or two warps
GPU_DEFAULT = "8x16-128-32-w2x4-s3-lb2"
GPU_NARROW = "8x16-16-32-w8x1-s3"        # Cout <= 16 (conv_out's 3 channels)
SIM_DEFAULT = "4x4-16-16-w1x1-s2"
CONFIGS = {}                             # (Cin, Cout, H, W, ksz, up) -> config name (bench results)


def choose_config(Cin, Cout, H, W, ksz, up):
    name = CONFIGS.get((Cin, Cout, H, W, ksz, up))
    if name is None:
        if SIMULATOR:
            name = SIM_DEFAULT
        else:
            name = GPU_NARROW if Cout <= 16 else GPU_DEFAULT
    return Config.parse(name)


# ---------------------------------------------------------------------------------- device helpers
if not ik.NUMBA_OK:  # pragma: no cover
    _silu_exp = _silu_tanh = None
elif SIMULATOR:
    import math

    def _silu_exp(y):
        y = float(y)
        if y >= 0.0:
            return np.float32(y / (1.0 + math.exp(-y)))
        e = math.exp(y)
        return np.float32(y * e / (1.0 + e))

    def _silu_tanh(y):
        h = 0.5 * float(y)
        return np.float32(h + h * math.tanh(h))
else:
    from llvmlite import ir as _ir
    from numba import types as _nbt
    from numba.cuda.extending import intrinsic as _intrinsic
    from .intrinsics import _ex2, _rcp

    _F32T = _ir.FloatType()
    _TANH = _ir.InlineAsm(_ir.FunctionType(_F32T, [_F32T]), "tanh.approx.f32 $0, $1;", "=f,f")

    @_intrinsic
    def _tanh_approx(typingctx, x):
        if not isinstance(x, _nbt.Float):
            return None
        sig = _nbt.float32(x)

        def codegen(context, builder, sig, args):
            return builder.call(_TANH, [context.cast(builder, args[0], sig.args[0], _nbt.float32)])
        return sig, codegen

    @cuda.jit(device=True, forceinline=True)
    def _silu_exp(y):
        return y * _rcp(float32(1) + _ex2(y * float32(-1.4426950408889634)))

    @cuda.jit(device=True, forceinline=True)
    def _silu_tanh(y):
        h = y * float32(0.5)
        return h + h * _tanh_approx(h)


# ---------------------------------------------------------------------------------- kernel
def make_kernel(cfg: Config, KSZ, PRO, SILU, UP, RES, ODD):
    """The conv kernel for one configuration.  KSZ 3 or 1; PRO: GroupNorm prologue (SILU: with
    SiLU); UP: nearest 2x input; RES: residual add; ODD: odd Cout (16-bit stores).  -> (kernel,
    threads, dynamic shared bytes)."""
    why = cfg.why_invalid()
    if why:
        raise ValueError(f"conv config {cfg.name}: {why}")
    TH, TW, BN, BK, WM, WN, S = cfg.th, cfg.tw, cfg.bn, cfg.bk, cfg.wm, cfg.wn, cfg.stages
    L = layout(cfg, KSZ, PRO)
    BM = TH * TW
    NTH = 32 * WM * WN
    TM = BM // WM
    TN = BN // WN
    MT = TM // 16
    NT = TN // 8
    NP = NT // 2
    PAD = KSZ // 2
    TAPS = KSZ * KSZ
    HC = TW + KSZ - 1
    CPP = BK // 8                 # 16-byte chunks per pixel / weight row
    RW = L["RW"]                  # padded shared row (words)
    HWORDS = L["HWORDS"]
    BWORDS = L["BWORDS"]
    HB = L["HB"]                  # halo buffers
    RB = L["RB"]                  # raw (untransformed) halo buffers of the prologue path
    BOFF = L["BOFF"]              # B ring (words)
    ROFF = L["ROFF"]              # raw halo ring (words)
    NWORDS = L["NWORDS"]
    NHC = L["NHP"] * CPP
    NLD = -(-NHC // NTH)
    NBC = BN * CPP
    NBL = -(-NBC // NTH)
    KK = BK // 16
    NACC = MT * NT * 4
    NAF = MT * 4
    NBF = NP * 4
    DYN = NWORDS * 4 > 48 * 1024 and not SIMULATOR
    SMW = 0 if DYN else NWORDS
    ALIGN = None if (SIMULATOR or DYN) else 16
    SCRW = _mma.SCR_WORDS
    mma_bf16, ldsm_x4, cp_async16 = _mma.mma_bf16, _mma.ldsm_x4, _mma.cp_async16
    cp_commit, smem_base, pack_bf16 = _mma.cp_commit, _mma.smem_base, _mma.pack_bf16
    bf16_lo, bf16_hi = _mma.bf16_lo, _mma.bf16_hi
    cp_wait = _mma.cp_wait_n(S - 1)
    cp_wait0 = _mma.cp_wait0
    act = _silu_tanh if cfg.act == "tanh" else _silu_exp
    DEV = dict(device=True) if SIMULATOR else dict(device=True, inline=True)
    assert NTH % CPP == 0

    @cuda.jit(**DEV)
    def issue_b(sm, saddr, w32, tap, c0, o0, Cin, Cout, tid):
        """B tile of (tap, channel chunk c0): weight rows o0 .. o0 + BN -> stage at saddr (bytes)."""
        for i in range(NBL):
            c = i * NTH + tid
            if NBC % NTH == 0 or c < NBC:
                row = c // CPP
                cc = c - row * CPP
                o = o0 + row
                ch = c0 + cc * 8
                nb = 16
                gw = ((o * TAPS + tap) * Cin + ch) // 2
                if o >= Cout or ch >= Cin:
                    nb = 0
                    gw = 0
                cp_async16(sm, saddr + (row * RW + cc * 4) * 4, w32, gw, nb)

    @cuda.jit(**DEV)
    def halo_src(c, n, oy0, ox0, c0, H, W, Hi, Wi, Cin):
        """(halo pixel, chunk, element offset of the 8 channels in x or -1 when zero padding)."""
        hp = c // CPP
        cc = c - hp * CPP
        hy = hp // HC
        hx = hp - hy * HC
        iy = oy0 + hy - PAD
        ix = ox0 + hx - PAD
        ch = c0 + cc * 8
        e = -1
        if iy >= 0 and iy < H and ix >= 0 and ix < W and ch < Cin:
            if UP:
                iy = iy // 2
                ix = ix // 2
            e = ((n * Hi + iy) * Wi + ix) * Cin + ch
        return hp, cc, e

    @cuda.jit(**DEV)
    def issue_halo(sm, saddr, x32, n, oy0, ox0, c0, H, W, Hi, Wi, Cin, tid):
        """The halo of channel chunk c0 -> shared at saddr (bytes) by 16-byte cp.async (zero-filled
        outside the image / past Cin)."""
        for i in range(NLD):
            c = i * NTH + tid
            if NHC % NTH == 0 or c < NHC:
                hp, cc, e = halo_src(c, n, oy0, ox0, c0, H, W, Hi, Wi, Cin)
                nb = 16
                if e < 0:
                    nb = 0
                    e = 0
                cp_async16(sm, saddr + (hp * RW + cc * 4) * 4, x32, e // 2, nb)

    @cuda.jit(**DEV)
    def affine(sc, sh, st, gam, bet, n, G, NG, c0, Cin, tid):
        """a_c = rstd gamma_c, b_c = beta_c - mean a_c for this thread's 8 channels of chunk c0
        (a thread's 16-byte column is the same for all its halo chunks: NTH % CPP == 0)."""
        ch0 = c0 + (tid % CPP) * 8
        cpg = Cin // G
        for e in range(8):
            ch = ch0 + e
            if ch < Cin:
                gi = n * G + ch // cpg
                a = st[NG + gi] * gam[ch]
                sc[e] = a
                sh[e] = bet[ch] - st[gi] * a
            else:
                sc[e] = float32(0)
                sh[e] = float32(0)

    @cuda.jit(**DEV)
    def tpair(w, sc, sh, e0):
        """One word of 2 bf16 -> the word of act(x a + b) (RNE bf16)."""
        y0 = bf16_lo(w) * sc[e0] + sh[e0]
        y1 = bf16_hi(w) * sc[e0 + 1] + sh[e0 + 1]
        if SILU:
            y0 = act(y0)
            y1 = act(y1)
        return pack_bf16(y0, y1)

    @cuda.jit(**DEV)
    def transform_halo(sm, rw0, hw0, sc, sh, n, oy0, ox0, c0, H, W, Hi, Wi, Cin, tid):
        """Prologue: this thread's chunks of the raw halo at word rw0 (its own cp.async, complete)
        -> act(x a + b) at word hw0; padding chunks are stored as 0 (not transformed)."""
        for i in range(NLD):
            c = i * NTH + tid
            if NHC % NTH == 0 or c < NHC:
                hp, cc, e = halo_src(c, n, oy0, ox0, c0, H, W, Hi, Wi, Cin)
                o = hp * RW + cc * 4
                if e >= 0:
                    w0 = sm[rw0 + o]
                    w1 = sm[rw0 + o + 1]
                    w2 = sm[rw0 + o + 2]
                    w3 = sm[rw0 + o + 3]
                    sm[hw0 + o] = tpair(w0, sc, sh, 0)
                    sm[hw0 + o + 1] = tpair(w1, sc, sh, 2)
                    sm[hw0 + o + 2] = tpair(w2, sc, sh, 4)
                    sm[hw0 + o + 3] = tpair(w3, sc, sh, 6)
                else:
                    sm[hw0 + o] = 0
                    sm[hw0 + o + 1] = 0
                    sm[hw0 + o + 2] = 0
                    sm[hw0 + o + 3] = 0

    @cuda.jit(**DEV)
    def mma_step(acc, af, bfr, sm, abase, aoff, bbase, scr):
        """acc += A (halo window at abase) x B (stage at bbase) for one BK chunk of one tap."""
        for kk in range(KK):
            for mt in range(MT):
                a0, a1, a2, a3 = ldsm_x4(sm, abase + aoff[mt] + kk * 32, scr)
                af[mt * 4] = a0
                af[mt * 4 + 1] = a1
                af[mt * 4 + 2] = a2
                af[mt * 4 + 3] = a3
            for p in range(NP):
                b0, b1, b2, b3 = ldsm_x4(sm, bbase + (p * 16 * RW) * 4 + kk * 32, scr)
                bfr[p * 4] = b0
                bfr[p * 4 + 1] = b1
                bfr[p * 4 + 2] = b2
                bfr[p * 4 + 3] = b3
            for mt in range(MT):
                for nt in range(NT):
                    i = (mt * NT + nt) * 4
                    bi = (nt // 2) * 4 + (nt % 2) * 2
                    acc[i], acc[i + 1], acc[i + 2], acc[i + 3] = mma_bf16(
                        af[mt * 4], af[mt * 4 + 1], af[mt * 4 + 2], af[mt * 4 + 3], bfr[bi], bfr[bi + 1],
                        acc[i], acc[i + 1], acc[i + 2], acc[i + 3], scr)

    def conv(x32, w32, bias, r32, y32, y16, st, gam, bet,
             H, W, Hi, Wi, Cin, Cout, G, NG, tiles_w, tiles_hw, NB):
        sm = cuda.shared.array(SMW, int32, alignment=ALIGN)
        scr = cuda.shared.array(SCRW, int32)
        acc = cuda.local.array(NACC, float32)
        af = cuda.local.array(NAF, int32)
        bfr = cuda.local.array(NBF, int32)
        aoff = cuda.local.array(MT, int32)
        sc = cuda.local.array(8, float32)
        sh = cuda.local.array(8, float32)
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid - warp * 32
        wmi = warp // WN
        wni = warp - wmi * WN
        bid = cuda.blockIdx.x
        nb = bid % NB
        t = bid // NB
        n = t // tiles_hw
        t = t - n * tiles_hw
        ty = t // tiles_w
        oy0 = ty * TH
        ox0 = (t - ty * tiles_w) * TW
        o0 = nb * BN
        sb = smem_base(sm)
        for mt in range(MT):     # this lane's ldmatrix row in the halo, tap (0, 0)
            m = wmi * TM + mt * 16 + lane % 16
            py = m // TW
            aoff[mt] = ((py * HC + (m - py * TW)) * RW + 4 * (lane // 16)) * 4
        boff = ((wni * TN + lane % 8 + 8 * (lane // 16)) * RW + 4 * ((lane // 8) % 2)) * 4
        for i in range(NACC):
            acc[i] = float32(0)
        NCB = (Cin + BK - 1) // BK
        KS = NCB * TAPS
        # ---- prologue path: raw halos of the chunks that start in steps 0 .. S-1, the first
        # transformed now; later raws are issued S steps ahead, transformed one step ahead
        if PRO:
            for jr in range(S):
                if jr < KS and jr % TAPS == 0:
                    c = jr // TAPS
                    issue_halo(sm, sb + (ROFF + (c % RB) * HWORDS) * 4, x32, n, oy0, ox0, c * BK,
                               H, W, Hi, Wi, Cin, tid)
            cp_commit()
            cp_wait0()
            affine(sc, sh, st, gam, bet, n, G, NG, 0, Cin, tid)
            transform_halo(sm, ROFF, 0, sc, sh, n, oy0, ox0, 0, H, W, Hi, Wi, Cin, tid)
        # ---- the first S - 1 steps' B tiles (and halos without the prologue)
        for j in range(S - 1):
            if j < KS:
                cbj = j // TAPS
                tapj = j - cbj * TAPS
                issue_b(sm, sb + (BOFF + (j % S) * BWORDS) * 4, w32, tapj, cbj * BK, o0, Cin, Cout, tid)
                if not PRO and tapj == 0:
                    issue_halo(sm, sb + ((cbj % HB) * HWORDS) * 4, x32, n, oy0, ox0, cbj * BK,
                               H, W, Hi, Wi, Cin, tid)
            cp_commit()
        # ---- main loop: step ks = (chunk cb, tap); the loads of step ks + S - 1 in flight
        for ks in range(KS):
            cb = ks // TAPS
            tap = ks - cb * TAPS
            j = ks + S - 1
            if j < KS:
                cbj = j // TAPS
                tapj = j - cbj * TAPS
                issue_b(sm, sb + (BOFF + (j % S) * BWORDS) * 4, w32, tapj, cbj * BK, o0, Cin, Cout, tid)
                if not PRO and tapj == 0:
                    issue_halo(sm, sb + ((cbj % HB) * HWORDS) * 4, x32, n, oy0, ox0, cbj * BK,
                               H, W, Hi, Wi, Cin, tid)
            if PRO:
                jr = ks + S
                if jr < KS and jr % TAPS == 0:
                    c = jr // TAPS
                    issue_halo(sm, sb + (ROFF + (c % RB) * HWORDS) * 4, x32, n, oy0, ox0, c * BK,
                               H, W, Hi, Wi, Cin, tid)
            cp_commit()
            cp_wait()
            cuda.syncthreads()
            r = tap // KSZ
            s = tap - r * KSZ
            abase = sb + ((cb % HB) * HWORDS + (r * HC + s) * RW) * 4
            mma_step(acc, af, bfr, sm, abase, aoff, sb + (BOFF + (ks % S) * BWORDS) * 4 + boff, scr)
            if PRO:
                jt = ks + 1
                if jt < KS and jt % TAPS == 0:
                    c = jt // TAPS
                    affine(sc, sh, st, gam, bet, n, G, NG, c * BK, Cin, tid)
                    transform_halo(sm, ROFF + (c % RB) * HWORDS, (c % HB) * HWORDS, sc, sh, n, oy0, ox0,
                                   c * BK, H, W, Hi, Wi, Cin, tid)
            cuda.syncthreads()
        # ---- epilogue: + bias (+ residual), one rounding, channel-pair stores
        g = lane // 4
        t4 = lane % 4
        for mt in range(MT):
            for hf in range(2):
                m = wmi * TM + mt * 16 + g + 8 * hf
                py = m // TW
                oy = oy0 + py
                ox = ox0 + m - py * TW
                if oy < H and ox < W:
                    pix = ((n * H + oy) * W + ox) * Cout
                    for nt in range(NT):
                        o = o0 + wni * TN + nt * 8 + 2 * t4
                        i = (mt * NT + nt) * 4 + 2 * hf
                        if ODD:
                            if o < Cout:
                                y16[pix + o] = pack1(acc[i] + bias[o])
                            if o + 1 < Cout:
                                y16[pix + o + 1] = pack1(acc[i + 1] + bias[o + 1])
                        elif o < Cout:
                            v0 = acc[i] + bias[o]
                            v1 = acc[i + 1] + bias[o + 1]
                            if RES:
                                rw = r32[(pix + o) // 2]
                                v0 += bf16_lo(rw)
                                v1 += bf16_hi(rw)
                            y32[(pix + o) // 2] = pack_bf16(v0, v1)

    kern = ik.jit_kernel(conv, **({} if SIMULATOR or not cfg.min_blocks else
                                  {"launch_bounds": (NTH, cfg.min_blocks)}))
    return kern, NTH, (NWORDS * 4 if DYN else 0)


def layout(cfg, KSZ, PRO):
    """Shared-memory layout (32-bit words): HB halo buffers | S B stages | RB raw halos (prologue).
    Buffer lifetimes (steps ks = chunk * taps + tap): B(j) issued at step j-S+1, read at j; a
    halo without prologue issued with the B of its first step; with the prologue its raw copy is
    issued S steps ahead and transformed (by the threads that copied it) after the MMAs of the
    step before -- so HB = 2 (S for 1x1) and RB = 1 (S for 1x1) keep every buffer's reuse behind a
    barrier, given S <= 9."""
    S, taps = cfg.stages, KSZ * KSZ
    RW = cfg.bk // 2 + 4
    NHP = (cfg.th + KSZ - 1) * (cfg.tw + KSZ - 1)
    HWORDS = NHP * RW
    BWORDS = cfg.bn * RW
    HB = S if taps == 1 else 2
    RB = (S if taps == 1 else 1) if PRO else 0
    assert S - 1 <= (HB - 1) * taps and S <= 9
    BOFF = HB * HWORDS
    ROFF = BOFF + S * BWORDS
    return dict(RW=RW, NHP=NHP, HWORDS=HWORDS, BWORDS=BWORDS, HB=HB, RB=RB, BOFF=BOFF, ROFF=ROFF,
                NWORDS=ROFF + RB * HWORDS)


# ---------------------------------------------------------------------------------- host side
_launchers = {}
_dummies = {}


def _launcher(cfg, KSZ, PRO, SILU, UP, RES, ODD):
    key = (cfg, KSZ, PRO, SILU, UP, RES, ODD)
    la = _launchers.get(key)
    if la is None:
        why = cfg.why_invalid()
        if why:
            raise ValueError(f"conv config {cfg.name}: {why}")
        box = {}

        def factory():
            k, nth, dyn = make_kernel(*key)
            box["nth"] = nth
            return k
        nbytes = 4 * layout(cfg, KSZ, PRO)["NWORDS"]
        dyn = nbytes if (nbytes > 48 * 1024 and not SIMULATOR) else 0
        la = _launchers[key] = ik.Launcher(factory, shmem=dyn)
    return la


def _dummy(dev, dtype):
    d = _dummies.get((dev, dtype))
    if d is None:
        d = _dummies[(dev, dtype)] = torch.zeros(8, device=dev, dtype=dtype)
    return d


def check_common(x, wp, bias, residual, norm, taps, upsample2x):
    why = ik.common_check(x, wp, residual)
    if why:
        return why
    if bias is not None:
        why = runtime.device_ok(bias)
        if why:
            return why
        if not bias.is_floating_point() or bias.dim() != 1 or bias.numel() != wp.shape[0]:
            return "bias must be a float [Cout] tensor"
    if x.dim() != 4 or not x.is_contiguous() or x.numel() == 0:
        return "x must be a non-empty contiguous NHWC [N, H, W, C] tensor"
    N, Hi, Wi, Cin = x.shape
    if Cin % 8:
        return f"Cin={Cin} not a multiple of 8"
    if wp.dim() != 3 or not wp.is_contiguous() or wp.shape[1] != taps or wp.shape[2] != Cin:
        return f"weight must be pack_weight(w) of a [Cout, {Cin}, k, k] weight with k*k = {taps}"
    Cout = wp.shape[0]
    H, W = (2 * Hi, 2 * Wi) if upsample2x else (Hi, Wi)
    if x.data_ptr() % 16 or wp.data_ptr() % 16:
        return "x / weight not 16-byte aligned"
    if residual is not None:
        if tuple(residual.shape) != (N, H, W, Cout) or not residual.is_contiguous():
            return "residual must be a contiguous [N, H, W, Cout] tensor"
        if Cout % 2 or residual.data_ptr() % 4:
            return "residual needs an even Cout and 4-byte alignment"
    if norm is not None:
        if len(norm) != 4:
            return "norm must be (stats, gamma, beta, silu)"
        st, gam, bet, _ = norm
        if st.dtype != torch.float32 or st.dim() != 3 or st.shape[0] != 2 or st.shape[1] != N:
            return "norm stats must be fp32 [2, N, G] (groupnorm_stats_nhwc)"
        G = st.shape[2]
        if Cin % G:
            return "Cin not divisible by the groups"
        for t in (gam, bet):
            if t is None or t.dim() != 1 or t.numel() != Cin or not t.is_floating_point():
                return "norm gamma/beta must be float [Cin] tensors"
        why = runtime.device_ok(st, gam, bet)
        if why:
            return why
    if N * max(H * W, Hi * Wi) * max(Cin, Cout) >= 2 ** 31:
        return "tensor too large for 32-bit element offsets"
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, wp, bias, residual)):
        return "no autograd"
    return None


def check(x, wp, bias=None, residual=None, norm=None, upsample2x=False):
    return check_common(x, wp, bias, residual, norm, 9, upsample2x)


def conv_nhwc_numba(x, wp, bias=None, residual=None, norm=None, upsample2x=False, cfg=None):
    """Launch the kernel (any kernel size pack_weight produced; ``cfg`` a Config or its name)."""
    N, Hi, Wi, Cin = x.shape
    Cout, taps = wp.shape[0], wp.shape[1]
    KSZ = 3 if taps == 9 else 1
    UP = 1 if upsample2x else 0
    H, W = (2 * Hi, 2 * Wi) if UP else (Hi, Wi)
    if cfg is None:
        cfg = choose_config(Cin, Cout, H, W, KSZ, UP)
    elif isinstance(cfg, str):
        cfg = Config.parse(cfg)
    dev = x.device
    ODD = Cout % 2
    y = torch.empty((N, H, W, Cout), device=dev, dtype=torch.bfloat16)
    if bias is None:
        bias = torch.zeros(Cout, device=dev, dtype=torch.float32)
    elif bias.dtype != torch.float32:
        bias = bias.float()
    PRO = SILU = 0
    if norm is not None:
        st, gam, bet, silu = norm
        PRO, SILU = 1, 1 if silu else 0
        gam = gam if gam.dtype == torch.float32 else gam.float()
        bet = bet if bet.dtype == torch.float32 else bet.float()
        G = st.shape[2]
        st = st.reshape(-1)
    else:
        st = gam = bet = _dummy(dev, torch.float32)
        G = 1
    RES = 0 if residual is None else 1
    xf = x.view(-1)
    r32 = residual.view(-1).view(torch.int32) if RES else _dummy(dev, torch.int32)
    yf = y.view(-1)
    y32 = _dummy(dev, torch.int32) if ODD else yf.view(torch.int32)
    y16 = yf.view(torch.int16) if ODD else _dummy(dev, torch.int16)
    tiles_w = -(-W // cfg.tw)
    tiles_hw = tiles_w * -(-H // cfg.th)
    NB = -(-Cout // cfg.bn)
    la = _launcher(cfg, KSZ, PRO, SILU, UP, RES, ODD)
    la(N * tiles_hw * NB, cfg.threads, xf.view(torch.int32), wp.view(-1).view(torch.int32),
       bias, r32, y32, y16, st, gam, bet, H, W, Hi, Wi, Cin, Cout, G, N * G, tiles_w, tiles_hw, NB)
    return y


registry.register_backend(OP, "numba", conv_nhwc_numba, check=check, priority=10)
