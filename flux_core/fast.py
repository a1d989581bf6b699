"""The fast profile: FLUX blocks with their GEMMs in fp8 e4m3.

Block GEMMs -- qkv, proj, MLP up / down, single-block linear1 / linear2 -- run as
``torch._scaled_mm`` (cuBLASLt) on fp8 e4m3 operands with row-wise scales: per-token activation
scales, per-output-channel weight scales, bias and bf16 output in the GEMM's epilogue.  The
modulation GEMVs, embedders and the final layer stay bf16 (they are not in the blocks' GEMM path);
with ``keep=True``, modulation Linears the host would stream every step (``BlockContext.keep_plain``:
on a card too small for the model, beyond the DynamicVRAM budget) are kept as plain bf16 copies too.

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
  * ``keep=True`` (profile ``fast-cached``): once per weight version -- (host epoch, the module's
    own weight: storage pointer, version counter, shape) -- and cached; a new version (LoRA change,
    reload) re-quantises only that weight.  The cache holds an fp8 copy of bf16 block weights
    (11.9 GB for FLUX.1-dev); while it is current the host is not asked for those weights at all
    (a DynamicVRAM host streams none of them: on a card too small for the bf16 model the block
    GEMMs read only the copy).
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
    call (``keep=False``) or once per weight version and cached (``keep=True``).

    The kept copy is keyed on the weight's *source*, read without casting anything: the host's
    weight-patch identity (``epoch``: ComfyUI's ``current_weight_patches_uuid``, which changes with
    every LoRA / strength change) and the module's own weight tensor (storage, version counter,
    shape, dtype, device).  A hit hands out the copy and its bias without asking the host for the
    weight at all, so a host that stages weights per call (DynamicVRAM streaming a bf16 model on a
    small card) never moves the block GEMMs' bf16 weights again once they are cached.  Each entry
    has a serial number: a graph captured over the copy records the serials it read (``serials``)."""

    def __init__(self, keep: bool = True):
        self.keep = keep
        self._cache = {}   # id(lin) -> (weakref(lin), source key, q, scales, bias copy, serial)
        self._plain = {}   # id(lin) -> (weakref(lin), source key, weight copy, bias copy, serial): ``keep_plain``
        self._ones = {}
        self._serial = 0
        self.quantised = 0  # weights (re)quantised into the cache so far: a LoRA change touches only its weights

    def clear(self) -> int:
        """Free the kept copies (made again on their next use); returns how many were freed."""
        n = len(self._cache) + len(self._plain)
        self._cache.clear()
        self._plain.clear()
        return n

    def nbytes(self) -> int:
        """Device bytes the kept copies hold (fp8 weights, scales, biases, plain copies)."""
        return sum(t.numel() * t.element_size() for d, sl in ((self._cache, slice(2, 5)), (self._plain, slice(2, 4)))
                   for e in d.values() for t in e[sl] if t is not None)

    def _current(self, table, lin, epoch):
        hit = table.get(id(lin))
        if hit is None or hit[0]() is not lin:
            return None
        key = self.source_key(lin, epoch)
        return hit if key is not None and hit[1] == key else None

    def kept_plain(self, lin, epoch):
        """(weight, bias) of a current plain copy of ``lin`` (``keep_plain``), else None."""
        hit = self._current(self._plain, lin, epoch) if self.keep else None
        return None if hit is None else (hit[2], hit[3])

    def keep_plain(self, lin, w, b, epoch):
        """Keep a copy of the weight / bias the host handed out for ``lin`` as they are (no quantisation):
        the fast-cached profile's modulation Linears whose weights the host would stream every step
        (``BlockContext.keep_plain``).  Returns (weight, bias) of the copy."""
        key = self.source_key(lin, epoch)
        ent = (w.detach().clone(), None if b is None else b.detach().clone())
        if key is not None:
            self._serial += 1
            self._plain[id(lin)] = (weakref.ref(lin), key) + ent + (self._serial,)
        return ent

    @staticmethod
    def source_key(lin, epoch):
        """The identity of what the host would hand out for ``lin`` (class docstring), or None when
        the module has no weight tensor to key on."""
        w = getattr(lin, "weight", None)
        if not isinstance(w, torch.Tensor):
            return None
        return (epoch, w.data_ptr(), tensor_version(w), tuple(w.shape), w.dtype, w.device)

    def cached(self, lin, epoch):
        """(q, scales [1, N], bias) of a kept copy that is still current for ``lin`` at ``epoch``,
        else None.  Nothing is cast or staged."""
        hit = self._current(self._cache, lin, epoch) if self.keep else None
        return None if hit is None else (hit[2], hit[3], hit[4])

    def serials(self, lins, epoch):
        """The serial numbers of the current copies (fp8 or plain) of ``lins`` (0: none) -- part of a
        graph's key."""
        out = []
        for lin in lins:
            hit = self._current(self._cache, lin, epoch) or self._current(self._plain, lin, epoch)
            out.append(hit[-1] if hit is not None else 0)
        return tuple(out)

    def block_state(self, kind, blk, epoch, streamed=None):
        """For one block call of the kept profile: (ids of the Linears whose current copies serve it --
        the host need not stage or fault them --, the serials of the block's copies for a graph's
        key, ids of modulation Linears to keep plain copies of: those ``streamed(lin)`` says the host
        would stream every step)."""
        lins = block_linears(kind, blk) + modulation_linears(kind, blk)
        serials = self.serials(lins, epoch)
        served = frozenset(id(lin) for lin, n in zip(lins, serials) if n)
        plain = frozenset(id(m) for m in modulation_linears(kind, blk)
                          if id(m) not in served and streamed is not None and streamed(m))
        return served, serials, plain

    def get(self, lin, w, b, epoch=None):
        """(q, scales [1, N], bias) for the weight ``w`` / bias ``b`` the host handed out for ``lin``."""
        if not self.keep:  # transient: the quantising rows kernel, one row per output channel
            q, s = ops.quantize_fp8(w.detach())
            return q, s.view(1, -1), b
        hit = self.cached(lin, epoch)
        if hit is not None:
            return hit
        key = self.source_key(lin, epoch)
        q, s = fp8_format.quantize_rows_reference(w.detach())  # rows of W = output channels
        bias = None if b is None else b.detach().clone()  # the host's bias may live in a staging buffer
        self._serial += 1
        ent = (q, s.reshape(1, -1).contiguous(), bias)
        if key is not None:
            self._cache[id(lin)] = (weakref.ref(lin), key) + ent + (self._serial,)
        self.quantised += 1
        return ent

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


# cuBLASLt's fp8 "fast accumulation": faster at the same trajectory agreement (BENCHMARKS.md, fp8 /
# fast profile section); FLUX_NUMBA_FP8_FAST_ACCUM=0 turns it off
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
    kept = ctx.fp8.cached(lin, ctx.fp8_epoch)
    p8 = None if kept is not None else ctx.host.linear_fp8(lin, like)
    if kept is not None:  # the kept copy is current: the host's weight is not asked for (nothing staged)
        wq, ws, b = kept
    elif p8 is not None:  # fp8-stored weights (unscaled or per-tensor scaled): the GEMM's operand as they are
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


def modulation_linears(kind, blk):
    """The modulation Linears of a FLUX block (bf16 GEMVs in every profile)."""
    return [blk.img_mod.lin, blk.txt_mod.lin] if kind == "double" else [blk.modulation.lin]


def _modulation(mod, sv, ctx):
    """``modulation(mod, sv)``, from the kept plain copy of its Linear where there is one (or where
    ``ctx.keep_plain`` asks for one: made here from the weights the host hands out)."""
    lin = mod.lin
    kept = ctx.fp8.kept_plain(lin, ctx.fp8_epoch)
    if kept is None and id(lin) in ctx.keep_plain:
        pw = ctx.host.linear(lin, sv)
        if pw is not None:
            kept = ctx.fp8.keep_plain(lin, pw[0], pw[1], ctx.fp8_epoch)
        ctx.host.release()
    if kept is None:
        return modulation(mod, sv)
    return torch.nn.functional.linear(sv, kept[0], kept[1]).chunk(mod.multiplier, dim=-1)


def double_block(blk, img, txt, vec, pe, mask, ctx):
    """The double block of ``blocks.double_block`` (fused order) with fp8 GEMMs."""
    H = blk.num_heads
    sv = ctx.silu(vec)
    i_sh1, i_sc1, i_g1, i_sh2, i_sc2, i_g2 = _modulation(blk.img_mod, sv, ctx)
    t_sh1, t_sc1, t_g1, t_sh2, t_sc2, t_g2 = _modulation(blk.txt_mod, sv, ctx)
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
    sh, sc, g = _modulation(blk.modulation, sv, ctx)
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
