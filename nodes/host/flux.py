"""ComfyUI's FLUX modules and ops as the pack meets them (part of the host package).

Tested on every change: ComfyUI v0.8.0 and v0.33.0 (``versions``).  What differs between them and
is handled here:

  * q/k norms: v0.8.0 builds them as ``comfy.ldm.flux.layers.RMSNorm`` (a ``.scale`` parameter,
    eps 1e-6 in its forward); v0.33.0 as ``operations.RMSNorm`` (``torch.nn.RMSNorm``: ``.weight``,
    ``eps=None`` = the input dtype's machine epsilon, 2^-7 for bf16) whose weight ComfyUI's ops
    cast per call.  ``ComfyWeights.norm`` takes the module's one own parameter through
    ``comfy.ops.cast_bias_weight`` when the module is one of ComfyUI's ops (DynamicVRAM staging,
    low-VRAM offload, weight patches such as on-the-fly LoRA), else the way v0.8.0's forward does
    (``comfy.model_management.cast_to``); ``norm_eps`` reads the module's own epsilon rule.
  * DynamicVRAM (comfy-aimdo, v0.33's default on NVIDIA): weights live in a virtual buffer and
    are staged by ``cast_bias_weight`` per call; ``release()`` hands them back
    (``uncast_bias_weight``) once the block's kernels are queued.  Linear layers are always called
    as modules except the MLP up-projection when the GEMM epilogue is on: ``ComfyWeights.linear``
    hands out its weights only for ComfyUI's plain ``Linear`` op with unquantized storage (the same
    ``F.linear`` the op would run), else None and the module is called.
  * block call: v0.33 blocks apply ``transformer_options["patches"]["attn1_patch"]`` /
    ``["attn1_output_patch"]`` and take ``modulation_dims`` (Kontext ``index_timestep_zero``)
    through the original block's closure; ``call_problem`` names them so that call runs stock.

The VAE patch's weights come through ``op_weights`` the same way (``ComfyWeights.module``).
DynamicVRAM staging per block, residency keys and the CUDA-graph checks live in ``residency``.

Other versions: every block's type is checked (``block_problem``); anything not a FLUX.1 block
runs stock with a log line naming the reason.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from ...flux_core.context import Weights, own_tensors


# ----------------------------------------------------------------------------- weights
def compute_device() -> Optional[torch.device]:
    """The device ComfyUI runs models on (``comfy.model_management.get_torch_device``), None when
    ComfyUI is not importable or says nothing (``--cpu`` gives a CPU device)."""
    try:
        import comfy.model_management as mm
        return torch.device(mm.get_torch_device())
    except Exception:
        return None


def _is_comfy_op(m) -> bool:
    import comfy.ops
    return isinstance(m, comfy.ops.CastWeightBiasOp)


_FP8 = getattr(torch, "float8_e4m3fn", None)


def _has_weight_functions(m) -> bool:
    """The op applies weight / bias functions per call (on-the-fly LoRA, low-VRAM patches)."""
    return bool(getattr(m, "weight_function", None) or getattr(m, "bias_function", None))


def _casts_per_call(m) -> bool:
    return bool(getattr(m, "comfy_cast_weights", False)) or _has_weight_functions(m)


def _plain_tensor(t) -> bool:
    return t is None or type(t.data) is torch.Tensor


def _stored_dtype(t):
    """The dtype ComfyUI keeps a weight in on the GPU: DynamicVRAM stages a parameter in its model dtype
    (``_model_dtype``, e.g. fp8 e4m3 for UNETLoader's weight_dtype fp8_e4m3fn) while the tensor the
    module holds on the CPU stays as the file has it (bf16 for a bf16 checkpoint loaded as fp8)."""
    return getattr(t, "_model_dtype", None) or getattr(t, "dtype", None)


def _is_tensor(t) -> bool:
    """A plain tensor or Parameter (not a QuantizedTensor or other subclass) -- what a cast returned."""
    return type(t) is torch.Tensor or isinstance(t, torch.nn.Parameter)


def _plain_linear_op(lin) -> bool:
    """ComfyUI's plain Linear op (its forward is F.linear on the cast weights) with unquantized
    storage and no per-tensor weight scale: the only Linear whose weights the fused path reads."""
    import comfy.ops
    return (type(lin).forward is comfy.ops.disable_weight_init.Linear.forward
            and getattr(lin, "weight", None) is not None and _plain_tensor(lin.weight) and _plain_tensor(lin.bias)
            and getattr(lin, "scale_weight", None) is None)


_FP8_LAYOUTS = ("TensorCoreFP8Layout", "TensorCoreFP8E4M3Layout")  # comfy.quant_ops: per-tensor-scaled e4m3


def _fp8_qdata(w):
    """(fp8 e4m3 data [N, K], fp32 scale) of a per-tensor-scaled e4m3 ``QuantizedTensor`` (ComfyUI's
    ``comfy.quant_ops`` layouts from comfy-kitchen: ``_qdata`` / ``_params.scale``, the names
    ComfyUI's own mixed-precision ops read), else None (plain tensors, padded storage, other layouts)."""
    q = getattr(w, "_qdata", None)
    params = getattr(w, "_params", None)
    scale = getattr(params, "scale", None)
    if not isinstance(q, torch.Tensor) or not isinstance(scale, torch.Tensor) or scale.numel() != 1:
        return None
    if getattr(w, "_layout_cls", None) not in _FP8_LAYOUTS or q.dtype != _FP8:
        return None
    if q.ndim != 2 or tuple(q.shape) != tuple(w.shape):
        return None
    return q, scale


def _scaled_fp8_linear(lin) -> bool:
    """ComfyUI's mixed-precision Linear (scaled fp8 checkpoints: ``comfy.ops.mixed_precision_ops``)
    whose weight is a per-tensor-scaled e4m3 QuantizedTensor, unless the checkpoint asks for this
    layer's matmul in full precision (``full_precision_matrix_mult``).  (ComfyUI also runs the
    dequantized matmul where it finds no fp8 compute; whether fp8 GEMMs run here is the fast
    profile's own check, ``flux_core.fast.support``.)"""
    if getattr(lin, "quant_format", None) != "float8_e4m3fn" or getattr(lin, "_full_precision_mm_config", False):
        return False
    return _fp8_qdata(getattr(lin, "weight", None)) is not None


@contextlib.contextmanager
def op_weights(m, like):
    """``(weight, bias)`` of a module for input ``like``, the way ComfyUI's op forward gets them:
    through ``cast_bias_weight`` (handed back on exit) when the op casts per call or carries weight
    functions, else the module's own tensors.  Used by the VAE patch's GroupNorm."""
    if _casts_per_call(m):
        import comfy.ops
        w, b, state = comfy.ops.cast_bias_weight(m, like, offloadable=True)
        try:
            yield w, b
        finally:
            comfy.ops.uncast_bias_weight(m, w, b, state)
    else:
        yield m.weight, m.bias


def fp8_stored_block(kind, blk) -> bool:
    """Every block GEMM weight is stored in fp8 e4m3 -- unscaled (UNETLoader's fp8_e4m3fn) or a
    per-tensor-scaled checkpoint -- so the fast profile uses them as they are (nothing re-quantised)."""
    from ...flux_core import fast
    try:
        return _FP8 is not None and all(_scaled_fp8_linear(lin) or _stored_dtype(getattr(lin, "weight", None)) == _FP8
                                        for lin in fast.block_linears(kind, blk))
    except Exception:
        return False


class ComfyWeights(Weights):
    """``flux_core.blocks.Weights`` for ComfyUI modules: weights obtained the way ComfyUI's ops do."""

    def __init__(self):
        self._staged = []  # (module, weight, bias, offload state) to hand back in release()

    def _cast(self, m, like):
        import comfy.ops
        w, b, state = comfy.ops.cast_bias_weight(m, like, offloadable=True)
        self._staged.append((m, w, b, state))
        return w, b

    def norm(self, m, like):
        if _is_comfy_op(m):
            if _casts_per_call(m):
                w, _ = self._cast(m, like)
            else:
                w = m.weight
            if w is None:
                raise ValueError(f"{type(m).__name__} has no weight")
            if w.device != like.device or w.dtype != like.dtype:
                w = w.to(device=like.device, dtype=like.dtype)
            return w
        # not an op (v0.8.0's flux RMSNorm): its one parameter, moved/cast as its own forward does
        ps = list(m.parameters(recurse=False))
        if len(ps) != 1:
            raise ValueError(f"{type(m).__name__} has {len(ps)} own parameters, expected one RMSNorm scale")
        import comfy.model_management as mm
        return mm.cast_to(ps[0], dtype=like.dtype, device=like.device)

    def linear(self, lin, x):
        if not _is_comfy_op(lin):
            return super().linear(lin, x)
        if not _plain_linear_op(lin):
            return None  # fp8 / quantized (QuantizedTensor) / scaled / custom op: only its forward knows the math
        if not _casts_per_call(lin):
            return own_tensors(lin, x)  # F.linear on the module's own tensors: what the op's forward runs
        w, b = self._cast(lin, x)
        if not _is_tensor(w) or w.dtype != x.dtype \
                or w.device != x.device or (b is not None and (b.dtype != x.dtype or b.device != x.device)):
            return None  # unusual cast result: the module is called (the staged copy is released later)
        return w, b

    def linear_fp8(self, lin, x):
        """The fast profile's fp8 hand-off: (weight e4m3 [N, K] on x's device, bias in x's dtype,
        per-tensor scale or None) for a Linear whose stored weight is fp8 e4m3 --
          * ComfyUI's plain Linear op holding e4m3 without a scale (UNETLoader's ``fp8_e4m3fn`` /
            ``fp8_e4m3fn_fast`` weight dtypes): staged by ``cast_bias_weight`` with no dtype cast;
          * a scaled fp8 checkpoint (``_scaled_fp8_linear``: ComfyUI's mixed-precision Linear with an
            fp8 e4m3 ``QuantizedTensor`` of one per-tensor scale): staged the same way, its fp8
            data and scale handed out as they are --
        DynamicVRAM / offload as usual; the stored weights are the GEMM's operand, no bf16 round
        trip, no second copy.  None for anything else (bf16 storage, other quantized formats,
        on-the-fly weight functions: those go through ``linear`` or run the exact path)."""
        import comfy.ops
        if _FP8 is None or not _is_comfy_op(lin) or _has_weight_functions(lin):
            return None
        if _scaled_fp8_linear(lin):
            logical = lin.weight.dtype  # a QuantizedTensor's dtype is its dequantized dtype: no cast
            wq, b, state = comfy.ops.cast_bias_weight(lin, None, dtype=logical, device=x.device,
                                                      bias_dtype=x.dtype, offloadable=True)
            self._staged.append((lin, wq, b, state))
            q = _fp8_qdata(wq)
            if q is None:
                return None
            return q[0], b, q[1]
        if not _plain_linear_op(lin) or _stored_dtype(lin.weight) != _FP8:
            return None
        w = lin.weight
        if _casts_per_call(lin) or w.device != x.device or w.dtype != _FP8:
            wq, b, state = comfy.ops.cast_bias_weight(lin, None, dtype=_FP8, device=x.device, bias_dtype=x.dtype,
                                                      offloadable=True)
            self._staged.append((lin, wq, b, state))
        else:
            wq, b = w, lin.bias
            if b is not None and (b.dtype != x.dtype or b.device != x.device):
                b = b.to(device=x.device, dtype=x.dtype)
        if not _is_tensor(wq) or wq.dtype != _FP8:
            return None
        return wq, b, None

    def linear_ok(self, lin, x) -> bool:
        """``linear`` (or, for a scaled fp8 checkpoint, ``linear_fp8``) would hand out weights (the
        same conditions, nothing cast)."""
        if not _is_comfy_op(lin):
            return super().linear_ok(lin, x)
        if _scaled_fp8_linear(lin):
            return not _has_weight_functions(lin)
        if not _plain_linear_op(lin):
            return False
        if not _casts_per_call(lin):
            return own_tensors(lin, x) is not None
        return True  # cast_bias_weight casts to the input's dtype and device

    def release(self):
        if not self._staged:
            return
        import comfy.ops
        staged, self._staged = self._staged, []
        for m, w, b, state in staged:
            comfy.ops.uncast_bias_weight(m, w, b, state)


# ----------------------------------------------------------------------------- blocks
def stock_rope():
    """The RoPE stock FLUX calls (``comfy.ldm.flux.math.apply_rope``: comfy-kitchen's kernel where
    ComfyUI has it), or None."""
    try:
        import comfy.ldm.flux.math as fm
        return fm.apply_rope
    except Exception:
        return None


def flux_types():
    """(Flux, DoubleStreamBlock, SingleStreamBlock) of the running ComfyUI."""
    from comfy.ldm.flux import layers, model
    return model.Flux, layers.DoubleStreamBlock, layers.SingleStreamBlock


def _gelu_tanh(m) -> bool:
    return isinstance(m, torch.nn.GELU) and getattr(m, "approximate", "none") == "tanh"


def _norm_problem(owner, where) -> Optional[str]:
    norm = getattr(owner, "norm", None)
    for name in ("query_norm", "key_norm"):
        m = getattr(norm, name, None)
        if not isinstance(m, torch.nn.Module):
            return f"{where} has no norm.{name}"
        own = list(m.parameters(recurse=False))
        if len(own) != 1 and not (_is_comfy_op(m) and hasattr(m, "weight")):
            return f"{where} norm.{name} ({type(m).__name__}) is not an RMSNorm with one scale"
    return None


def block_problem(kind: str, blk) -> Optional[str]:
    """None when ``blk`` is a stock FLUX.1 block that flux_core.blocks computes exactly."""
    _, Double, Single = flux_types()
    if kind == "double":
        if type(blk) is not Double:
            return f"double block is {type(blk).__name__}, not comfy.ldm.flux DoubleStreamBlock"
        if not getattr(blk, "modulation", False):
            return "double block without its own modulation (FLUX.2/Chroma style)"
        if getattr(blk, "flipped_img_txt", False):
            return "double block with flipped img/txt order"
        for name in ("img_mlp", "txt_mlp"):
            mlp = getattr(blk, name, None)
            if not (hasattr(mlp, "__getitem__") and len(mlp) == 3 and _gelu_tanh(mlp[1])):
                return f"double block {name} is not Linear-GELU(tanh)-Linear"
        return _norm_problem(blk.img_attn, "double block img_attn") or _norm_problem(blk.txt_attn, "double block txt_attn")
    if type(blk) is not Single:
        return f"single block is {type(blk).__name__}, not comfy.ldm.flux SingleStreamBlock"
    if getattr(blk, "modulation", None) is None:
        return "single block without its own modulation (FLUX.2/Chroma style)"
    if getattr(blk, "yak_mlp", False) or not _gelu_tanh(getattr(blk, "mlp_act", None)) \
            or blk.mlp_hidden_dim_first != blk.mlp_hidden_dim:
        return "single block MLP is not GELU(tanh)"
    return _norm_problem(blk, "single block")


def _closure(fn):
    out = []
    for cell in (getattr(fn, "__closure__", None) or ()):
        try:
            out.append(cell.cell_contents)
        except ValueError:
            continue
    return out


def resolve_block(kind, index, extra, model_ref):
    """The block ComfyUI would run for this call: the ``block`` cell of ``extra["original_block"]``
    (forward_orig's loop variable -- right with clones, object patches and torch.compile wrappers),
    else ``diffusion_model.{kind}_blocks.{index}`` read from the model now."""
    for c in _closure((extra or {}).get("original_block")):
        if isinstance(c, torch.nn.Module):
            return c
    base = model_ref() if model_ref is not None else None
    if base is None:
        return None
    import comfy.utils
    try:
        return comfy.utils.get_attr(base, f"diffusion_model.{kind}_blocks.{index}")
    except Exception:
        return None


PATCHES_IN_BLOCKS = ("attn1_patch", "attn1_output_patch")  # applied inside v0.33's FLUX blocks
ATTENTION_OVERRIDE = "optimized_attention_override"  # transformer_options key ComfyUI's attention obeys


def attention_override(topts):
    """The attention override another node installed (``transformer_options
    ["optimized_attention_override"]``, obeyed by ComfyUI's ``wrap_attn``), or None."""
    return (topts or {}).get(ATTENTION_OVERRIDE)


def flux_attention():
    """The attention function stock FLUX calls (``comfy.ldm.flux.math``'s binding, else ComfyUI's
    ``optimized_attention``)."""
    try:
        import comfy.ldm.flux.math as fm
        return fm.optimized_attention
    except Exception:
        from comfy.ldm.modules.attention import optimized_attention
        return optimized_attention


def block_attention(blk):
    """The attention function the checkpoint chose for this block (ComfyUI 0.36+: the block's
    ``comfy_attention`` module, filled from checkpoint metadata -- e.g. comfy-kitchen's int8 attention;
    stock FLUX passes it to ComfyUI's attention as ``preferred_attention``), or None (none chosen, or
    not available on this device: stock then runs its default attention too)."""
    ca = getattr(blk, "comfy_attention", None) if blk is not None else None
    fn = getattr(ca, "function", None)
    return fn if callable(fn) else None


def compiler_recording() -> Optional[str]:
    """Why CUDA graphs of the pack must stand down now, or None: ComfyUI's model compiler (0.36+,
    ``--disable-comfy-compiler`` turns it off) is recording this thread's allocations for the forward
    (``comfy.model_prefetch``'s per-thread malloc-graph table; a capture of ours inside its recording
    would allocate under it)."""
    import sys
    import threading
    mp = sys.modules.get("comfy.model_prefetch")
    if mp is None:
        return None
    tid = threading.get_ident()
    for name in ("ACTIVE_MALLOC_GRAPHS", "MALLOC_GRAPHS"):
        table = getattr(mp, name, None)
        g = table.get(tid) if isinstance(table, dict) else None
        if g is not None and getattr(g, "_comfy_active", True):
            return ("ComfyUI's model compiler is recording this forward's allocations "
                    "(--disable-comfy-compiler turns it off)")
    return None


def default_sdpa_attention() -> bool:
    """True when FLUX's attention is ComfyUI's plain PyTorch SDPA path (``attention_pytorch``: no
    --use-sage / --use-flash / xformers / split / sub-quadratic choice by the user).  That path only
    adds a backend order around ``F.scaled_dot_product_attention`` (v0.8.0: cuDNN first on Windows, torch's order -- FLASH first -- elsewhere; v0.33:
    FLASH first -- on an H200 pytorch's flash kernel takes ~0.85 ms where cuDNN takes ~0.45 ms at
    FLUX's 4608 tokens), so the pack may run SDPA with the backend it measured fastest instead."""
    try:
        from comfy.ldm.modules import attention as ca
        return flux_attention() is getattr(ca, "attention_pytorch", None)
    except Exception:
        return False


def call_problem(args, extra) -> Optional[str]:
    """Why this block call must run stock although the block is supported (None: it need not):
    host features applied inside the block that the fused path does not implement."""
    topts = args.get("transformer_options") or {}
    patches = topts.get("patches") or {}
    used = [k for k in PATCHES_IN_BLOCKS if patches.get(k)]
    if used:
        return f"transformer_options patches {used} (applied inside the block; the fused path does not run them)"
    for c in _closure((extra or {}).get("original_block")):
        if isinstance(c, dict) and any(k.startswith("modulation_dims") and v is not None for k, v in c.items()):
            return "modulation_dims (Kontext index_timestep_zero: per-token modulation rows)"
    return None
