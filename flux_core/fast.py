"""The fast profile: FLUX blocks with their GEMMs in fp8 e4m3.

Block GEMMs -- qkv, proj, MLP up / down, single-block linear1 / linear2 -- run as
``torch._scaled_mm`` (cuBLASLt) on fp8 e4m3 operands with row-wise scales: per-token activation
scales, per-output-channel weight scales, bias and bf16 output in the GEMM's epilogue.  The
modulation GEMVs, embedders and the final layer stay bf16 (they are not in the blocks' GEMM path).

Every activation quantisation happens in the Numba kernel that writes that GEMM's input (format:
``cuda_kernels/fp8_format.py``):
  qkv / mlp-up / linear1 input   ``ln_modulate_fp8``                 (LN + modulate -> fp8 + row scales)
  double mlp-up input            ``gated_residual_ln_modulate_fp8``  (residual update + next LN + modulate)
  double mlp-down input          ``gelu_tanh_fp8``                   (GELU of the up-projection)
  single linear2 input           ``attn_gelu_fp8``                   ([attention | GELU(mlp)], one row scale)
  double proj input              ``quantize_fp8``                    (the attention output; cuDNN writes bf16)
Attention itself stays on the attention op (cuDNN-first SDPA by default; bf16 q/k/v).

Weights: a Linear whose stored weight is fp8 e4m3 already -- ComfyUI's fp8_e4m3fn weight dtype, or a
scaled fp8 checkpoint (one fp32 scale per tensor) -- is the GEMM's operand as it is
(``BlockContext.host.linear_fp8``; per-channel scales 1 or that scale), no copy.
Otherwise the weight as the host hands it to the block (after LoRA and other weight patches:
``BlockContext.host.linear``) is quantised to e4m3 with per-output-channel scales by
``Fp8Weights``, in one of two ways:
  * ``keep=False`` (profile ``fast``): on every call, by the ``quantize_fp8`` rows kernel (one row
    per output channel), into a transient buffer -- no second copy of the weights on the GPU (peak
    as stock's), at the cost of reading the bf16 weights once more per step (23.8 GB read + 11.9 GB
    written for FLUX.1-dev: ~10 ms at the copy bandwidth);
  * ``keep=True`` (profile ``fast-cached``): once per weight version -- (host epoch, storage pointer,
    version counter, shape) -- and cached; a new version (LoRA change, reload) re-quantises only
    that weight.  The cache holds an fp8 copy of bf16 block weights (11.9 GB for FLUX.1-dev) next
    to the host's.
A block whose Linears the host hands out neither way (other quantized formats such as nvfp4, weight
functions on quantized weights, custom ops) runs the exact path (``BlockContext.fp8_block``).

GEMMs use cuBLASLt's fp8 fast accumulation (``FAST_ACCUM``; FLUX_NUMBA_FP8_FAST_ACCUM=0 turns it
off): 4.6 ms/step less with the 28-step trajectory unchanged (44.4 dB either way, BENCHMARKS).

Hardware (``support``, a probe GEMM once per device): row-wise scales in cuBLASLt's epilogue where
torch's ``_scaled_mm`` takes them (sm_90).  A GPU with tensor-wise scales only (sm_89), one below
sm_89 and a torch without fp8 run the exact profile with a log line.  (A tensor-wise path -- unit
scales, then the row / channel scales and bias applied to the output in three more passes -- was
built and measured: 154 ms/step forced on the H200 against row-wise 88 and exact 124; retired, tag
``fp8-tensorwise-v1``.  An sm_89 path would need those scales fused into the output's consumers.)
"""
from __future__ import annotations

import os
import weakref
from typing import Optional

import torch

from ..cuda_kernels import ops
from ..cuda_kernels import fp8_format
from ..cuda_kernels.runtime import tensor_version
from .context import block_linears, modulation, qk_parts, views_of  # noqa: F401 (block_linears: re-exported)

FP8 = fp8_format.FP8


_SUPPORT = {}  # device -> None (row-wise fp8 GEMMs run) | reason string (probed once)


def _probe_row(device) -> bool:
    """A tiny row-wise scaled fp8 GEMM runs on ``device`` (torch's ``_scaled_mm`` with [M, 1] / [1, N]
    fp32 scales: sm_90 in CUDA builds, and torch's CPU path)."""
    a = torch.ones(16, 32, device=device).to(FP8)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1, device=device),
                         scale_b=torch.ones(1, 16, device=device), out_dtype=torch.bfloat16)
        return True
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def support(device) -> Optional[str]:
    """None when the fast profile's row-wise fp8 GEMMs run on ``device`` (a tiny probe GEMM, once per
    device), else the reason (the caller runs the exact profile with a log line)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device in _SUPPORT:
        return _SUPPORT[device]
    if FP8 is None or not hasattr(torch, "_scaled_mm"):
        why = f"torch {torch.__version__} has no float8_e4m3fn / _scaled_mm"
    elif device.type not in ("cuda", "cpu"):
        why = f"device {device.type} has no fp8 GEMM path here"
    elif device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        cc = torch.cuda.get_device_capability(device)
        why = f"sm_{cc[0]}{cc[1]} has no fp8 tensor cores (sm_89 or newer)"
    elif _probe_row(device):
        why = None
    else:  # sm_89: tensor-wise scales only (a tensor-wise path lost on the H200: BENCHMARKS, tag fp8-tensorwise-v1)
        why = (f"torch's _scaled_mm takes no row-wise scales on {device} (tensor-wise only, e.g. sm_89); "
               "the fast profile needs them")
    _SUPPORT[device] = why
    return why


class Fp8Weights:
    """fp8 e4m3 Linear weights with per-output-channel scales (module docstring): made on every
    call (``keep=False``) or once per weight version and cached (``keep=True``; redone when the
    weight the host hands out changes -- ``epoch``: the host's weight-patch identity, e.g.
    ComfyUI's ``current_weight_patches_uuid``)."""

    def __init__(self, keep: bool = True):
        self.keep = keep
        self._cache = {}
        self._ones = {}
        self.quantised = 0  # weights (re)quantised into the cache so far: a LoRA change touches only its weights

    def clear(self) -> int:
        """Free the kept fp8 copies (made again on their next use); returns how many were freed."""
        n = len(self._cache)
        self._cache.clear()
        return n

    def nbytes(self) -> int:
        """Device bytes the kept fp8 copies hold (weights and their scales)."""
        return sum(e[2].numel() * e[2].element_size() + e[3].numel() * e[3].element_size() for e in self._cache.values())

    def get(self, lin, w, b, epoch=None):
        if not self.keep:  # transient: the quantising rows kernel, one row per output channel
            q, s = ops.quantize_fp8(w.detach())
            return q, s.view(1, -1), b
        key = (epoch, w.data_ptr(), tensor_version(w), tuple(w.shape), w.dtype, w.device)
        hit = self._cache.get(id(lin))
        if hit is not None and hit[0]() is lin and hit[1] == key:
            return hit[2], hit[3], b
        q, s = fp8_format.quantize_rows_reference(w.detach())  # rows of W = output channels
        ent = (q, s.reshape(1, -1).contiguous())
        self._cache[id(lin)] = (weakref.ref(lin), key) + ent
        self.quantised += 1
        return ent[0], ent[1], b

    def ones(self, N, device):
        """``scale_b`` [1, N] of ones: the per-channel scales of weights stored in fp8 as they are."""
        key = (N, device)
        t = self._ones.get(key)
        if t is None:
            t = self._ones[key] = torch.ones(1, N, device=device, dtype=torch.float32)
        return t

    def stored_scales(self, N, device, scale=None):
        """``scale_b`` [1, N] of fp8-stored weights: ones, or their one per-tensor scale repeated
        (a scaled fp8 checkpoint; read at call time, so a re-quantised LoRA patch is seen)."""
        ones = self.ones(N, device)
        return ones if scale is None else ones * scale.to(device=device, dtype=torch.float32).reshape(1, 1)


# cuBLASLt's fp8 "fast accumulation": FLUX step 93.6 -> 89.0 ms with graph replay, trajectory 44.4 dB
# both ways (BENCHMARKS, H200 2026-12-01 fp8 runs); FLUX_NUMBA_FP8_FAST_ACCUM=0 turns it off
FAST_ACCUM = os.environ.get("FLUX_NUMBA_FP8_FAST_ACCUM", "1") != "0"

_BIAS_IN_EPILOGUE = {}  # device type -> whether _scaled_mm takes a bf16 bias with row-wise scales here


def scaled_mm(xq, xs, wq, ws, bias, out_dtype=torch.bfloat16):
    """``(xq * xs) @ (wq * ws)^T + bias`` -> [rows, N] in out_dtype, one cuBLASLt call (bias in the
    epilogue where this torch allows it with row-wise scales, else one add)."""
    dt = xq.device.type
    if bias is not None and _BIAS_IN_EPILOGUE.get(dt, True):
        try:
            return torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws, bias=bias, out_dtype=out_dtype,
                                    use_fast_accum=FAST_ACCUM)
        except RuntimeError:
            _BIAS_IN_EPILOGUE[dt] = False
    out = torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws, out_dtype=out_dtype, use_fast_accum=FAST_ACCUM)
    if bias is not None:
        out += bias
    return out


def _linear(lin, q, like, ctx):
    """lin applied to the fp8 activation ``q`` = (values [rows, K], scales [rows, 1]) -> bf16
    [B, L, N] shaped like ``like`` [B, L, *]."""
    p8 = ctx.host.linear_fp8(lin, like)
    if p8 is not None:  # fp8-stored weights (unscaled or per-tensor scaled): the GEMM's operand as they are
        wq, b, scale = p8
        ws = ctx.fp8.stored_scales(wq.shape[0], wq.device, scale)
    else:
        pw = ctx.host.linear(lin, like)
        if pw is None:
            raise RuntimeError(f"{type(lin).__name__}: the host hands out no plain weight (checked per block first)")
        wq, ws, b = ctx.fp8.get(lin, pw[0], pw[1], ctx.fp8_epoch)
    out = scaled_mm(q[0], q[1], wq, ws, b, like.dtype)
    ctx.host.release()
    B, L = like.shape[0], like.shape[1]
    return out.view(B, L, -1)


def double_block(blk, img, txt, vec, pe, mask, ctx):
    """The double block of ``blocks.double_block`` (fused order) with fp8 GEMMs."""
    H = blk.num_heads
    sv = ctx.silu(vec)
    i_sh1, i_sc1, i_g1, i_sh2, i_sc2, i_g2 = modulation(blk.img_mod, sv)
    t_sh1, t_sc1, t_g1, t_sh2, t_sc2, t_g2 = modulation(blk.txt_mod, sv)
    eps = ctx.eps
    Lt = txt.shape[1]
    img_qkv = _linear(blk.img_attn.qkv, ops.ln_modulate_fp8(img, i_sh1, i_sc1, eps), img, ctx)
    txt_qkv = _linear(blk.txt_attn.qkv, ops.ln_modulate_fp8(txt, t_sh1, t_sc1, eps), txt, ctx)
    parts, qk_eps = qk_parts([(txt_qkv, blk.txt_attn), (img_qkv, blk.img_attn)], ctx)
    q, k, v, q8 = ctx.qk_norm_rope(parts, pe, H, qk_eps)
    ctx.host.release()
    del img_qkv, txt_qkv, parts
    attn = ctx.attn(q, k, v, mask, pack=q8)
    del q, k, v, q8
    for x, a, m, g1, sh2, sc2, g2 in ((img, attn[:, Lt:], blk.img_attn, i_g1, i_sh2, i_sc2, i_g2),
                                      (txt, attn[:, :Lt], blk.txt_attn, t_g1, t_sh2, t_sc2, t_g2)):
        mlp = blk.img_mlp if m is blk.img_attn else blk.txt_mlp
        proj = _linear(m.proj, ops.quantize_fp8(a), x, ctx)
        h = ops.gated_residual_ln_modulate_fp8(x, g1, proj, sh2, sc2, eps)
        del proj
        up = _linear(mlp[0], h, x, ctx)
        del h
        down = _linear(mlp[2], ops.gelu_tanh_fp8(up), x, ctx)
        del up
        ops.gated_residual(x, g2, down)
    return img, txt


def single_block(blk, x, vec, pe, mask, ctx):
    """The single block of ``blocks.single_block`` (fused order) with fp8 GEMMs."""
    H, C = blk.num_heads, blk.hidden_size
    sv = ctx.silu(vec)
    sh, sc, g = modulation(blk.modulation, sv)
    lin1 = _linear(blk.linear1, ops.ln_modulate_fp8(x, sh, sc, ctx.eps), x, ctx)
    qkv, mlp = lin1[..., :3 * C], lin1[..., 3 * C:]
    parts, qk_eps = qk_parts([(qkv, blk)], ctx)
    q, k, v, q8 = ctx.qk_norm_rope(parts, pe, H, qk_eps)
    ctx.host.release()
    del parts
    if views_of(lin1, q, k, v):  # torch qk_norm_rope: q/k/v view linear1's output
        a = ctx.attn(q, k, v, mask, pack=q8)
    else:  # the attention output over lin1's dead v columns, as the exact path does
        a = ctx.attn(q, k, v, mask, out=lin1[..., 2 * C:3 * C], pack=q8)
    del q, k, v, q8, qkv
    out = _linear(blk.linear2, ops.attn_gelu_fp8(a, mlp), x, ctx)
    del a, mlp, lin1
    ops.gated_residual(x, g, out)
    return x
