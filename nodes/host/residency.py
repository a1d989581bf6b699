"""DynamicVRAM residency and CUDA-graph safety of ComfyUI's FLUX weights (part of the host package).

  * DynamicVRAM staging per block: ``staged_block`` stages every weight of a fused block at once
    through ComfyUI's own block prefetch (``comfy.model_prefetch``: the queue other v0.33 models
    use), so the block's ops then find their weights staged -- one offload-stream round trip per
    block instead of one per op (each op's own cast syncs the compute stream with an offload stream
    and back); stock FLUX at v0.33 does not use it.  Unstaged (and a no-op) where the module has no
    DynamicVRAM weights or the host lacks the prefetch queue (v0.8.0).
  * CUDA graphs (the FLUX forward's, the VAE decoder's low-resolution stage): ``graph_state`` is the
    per-call check both run before a replay -- weights resident on the device, no DynamicVRAM staging
    or weight functions (which a graph would freeze), and the weights' addresses (a change
    re-captures).
  * Per-block graphs: ``block_residency`` keys a block's weights as a graph sees them (comfy-aimdo page
    signatures, other parameters' addresses, the weight-patch epoch); ``capture_headroom`` says when a
    capture cannot make the memory manager move weights inside it; ``streamed_weights`` finds the
    weights comfy-aimdo streams on every call (beyond its budget).
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from .flux import _has_weight_functions

def _prefetch_module():
    try:
        import comfy.model_prefetch as mp
    except Exception:
        return None
    if not (hasattr(mp, "make_prefetch_queue") and hasattr(mp, "prefetch_queue_pop")):
        return None
    return mp


def dynamic_block(blk) -> bool:
    """True when the block's weights are DynamicVRAM (comfy-aimdo vbar) weights."""
    return any(hasattr(m, "_v") for m in blk.modules())


def _pop_takes_dtype(mp) -> bool:
    import inspect
    try:
        ps = inspect.signature(mp.prefetch_queue_pop).parameters
    except (TypeError, ValueError):
        return False
    return "dtype" in ps or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in ps.values())


def _vbar_modules(blk, skip):
    """The DynamicVRAM (vbar) modules of ``blk``, minus the modules in ``skip`` (ids)."""
    return [m for m in blk.modules() if "_v" in m.__dict__ and id(m) not in skip]


@contextlib.contextmanager
def staged_block(blk, device, dynamic: bool, dtype=None, skip=frozenset()):
    """Stage the DynamicVRAM weights of ``blk`` for the duration of the block, the way ComfyUI's own
    block prefetch does (``make_prefetch_queue`` / ``prefetch_queue_pop``: fault the weights, one
    offload-stream sync; on exit the offload stream waits for the block's work and the weights are
    unpinned).  The block's ops (and our casts through ``ComfyWeights``) then take the staged
    weights without a per-op stream round trip.  ``dynamic``: ``dynamic_block(blk)``, cached by the
    caller; ``skip``: ids of modules the call will not cast (Linears served by the fast profile's
    kept fp8 copy), left unstaged -- on a card too small for the model their bf16 weights are not
    streamed.  ``dtype`` (a capture's preparation): each staged weight is also resolved the way
    ComfyUI's own graph path does before a capture (copied, cast, LoRA-patched and written back to
    its VRAM page), so the capture itself only reads resident weights.

    Yields None when nothing was staged (not dynamic, no prefetch queue on this host, ComfyUI
    declined: no offload streams, a CPU device), else whether every staged weight is resident now
    (False: a capture now would record their copy / patch work)."""
    mp = _prefetch_module() if dynamic else None
    mods = _vbar_modules(blk, skip) if mp is not None else []
    if mp is not None and not mods:
        yield True  # every vbar weight is served elsewhere: nothing to stage
        return
    root = blk if not skip else tuple(mods)
    q = mp.make_prefetch_queue([root], device, {"prefetch_dynamic_vbars": True}) if mp is not None else None
    if q is None:
        yield None
        return
    if dtype is not None and _pop_takes_dtype(mp):
        mp.prefetch_queue_pop(q, device, None, dtype=dtype)  # stages root (queue[0] after the leading None)
    else:  # (a host without the resolve step: weights not resident before are reported as such)
        mp.prefetch_queue_pop(q, device, None)
    try:
        yield all(bool((getattr(m, "_prefetch", None) or {}).get("resident")) for m in mods)
    finally:
        mp.prefetch_queue_pop(q, device, None)  # offload stream waits on the block's work; unpin


# ----------------------------------------------------------------------------- model-level facts
def weight_epoch(base_model):
    """Identity of the weight patches (LoRA ...) ComfyUI has applied to the model's weights now
    (``current_weight_patches_uuid``); caches of converted weights key on it."""
    return getattr(base_model, "current_weight_patches_uuid", None) if base_model is not None else None


def _freezes_per_call_work(m) -> bool:
    """Per-call weight work of a ComfyUI op that a captured graph would freeze or that moves memory:
    DynamicVRAM staging (comfy-aimdo vbar weights) and weight / bias functions (on-the-fly LoRA,
    low-VRAM patches).  A plain cast of weights resident on the device (fp8 storage with ComfyUI's
    manual_cast ops) is ordinary device work at fixed addresses and is captured like any op."""
    return "_v" in m.__dict__ or _has_weight_functions(m) or _tensor_patches(m)  # (ComfyUI sets ``m._v`` plainly)


def _tensor_patches(m) -> bool:
    """Patches kept on a weight tensor and applied in each call: ComfyUI-GGUF's LoRA on quantised
    weights (``GGMLTensor.patches``, moved to the device and merged after dequantising, per call).
    Only tensor subclasses are asked (a plain Parameter has no such attribute)."""
    for p in m._parameters.values():
        if p is not None and type(p) is not torch.nn.Parameter and getattr(p, "patches", None):
            return True
    return False


def graph_state(module: torch.nn.Module, device: torch.device):
    """(reasons a captured graph over ``module``'s weights is unsafe now, the weights' addresses) in
    one pass over the modules that own parameters -- the per-call check of a graph replayed every
    step / decode: one walk where a blocker check, a cast walk and an address walk were three
    (BENCHMARKS.md, VAE graph section, has the host cost).
    The module tree is walked afresh each call: a swapped submodule changes the addresses too.
    Reasons: weights off ``device`` (low-VRAM offload), per-call weight work
    (``_freezes_per_call_work``: DynamicVRAM staging, weight functions, GGUF LoRA patches), already
    inside a capture.
    The walk stops at the first module with per-call weight work (no key is needed then): under
    DynamicVRAM that is the model's first layer, where the whole walk cost ~1.5-3 ms of host time
    per step -- exposed wherever a wrapper reads the GPU on the host every step (EasyCache)."""
    if device.type != "cuda":
        return ["not a CUDA device"], None
    idx = device.index if device.index is not None else torch.cuda.current_device()
    ptrs, off, cast = [], None, None
    for m in module.modules():
        ps = m._parameters
        if not ps:
            continue
        if _freezes_per_call_work(m):
            cast = m
            break
        for n, p in ps.items():
            if p is None:
                continue
            if off is None and (not p.is_cuda or p.get_device() != idx):
                off = f"{type(m).__name__}.{n} on {p.device}"
            ptrs.append(p.data_ptr())
    why = []
    if off:
        why.append(f"weights not on cuda:{idx} (offloaded), e.g. {off}")
    if cast is not None:
        why.append(f"layers stage or patch their weights per call (DynamicVRAM / weight functions such as "
                   f"on-the-fly LoRA), e.g. a {type(cast).__name__}")
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        why.append("already inside a capture")
    return why, tuple(ptrs)



# ----------------------------------------------------------------------------- per-block graphs
def _model_vbar():
    try:
        import comfy_aimdo.model_vbar as mv
    except Exception:
        return None
    return mv if all(hasattr(mv, n) for n in ("vbar_fault", "vbar_unpin", "vbar_signature_compare")) else None


class _Residency:
    """A block's weights as a graph sees them: comfy-aimdo page signatures of its DynamicVRAM
    weights (compared with ``vbar_signature_compare``), the addresses of its other parameters, and
    ComfyUI's weight-patch identity.  Equal keys: a graph captured under one reads the same weights
    under the other."""
    __slots__ = ("sigs", "rest")
    __hash__ = None

    def __init__(self, sigs, rest):
        self.sigs, self.rest = sigs, rest

    def __eq__(self, other):
        if not isinstance(other, _Residency) or self.rest != other.rest or len(self.sigs) != len(other.sigs):
            return False
        if not self.sigs:
            return True
        cmp = _model_vbar().vbar_signature_compare
        return all(cmp(a, b) for a, b in zip(self.sigs, other.sigs))


def block_residency(blk, device, epoch, skip=frozenset(), extra=()):
    """(residency key or None, why not, pinned vbar allocations) of a FLUX block for one call.

    DynamicVRAM weights: faulted (made resident and pinned) through comfy-aimdo's ``vbar_fault`` --
    the block's ``_v_block`` where ComfyUI made the block a DynamicVRAM unit, else each module's
    ``_v`` (the allocations ComfyUI's ops fault per call) -- the way ComfyUI's own block graphs
    (``comfy.model_prefetch``) check residency; the caller unpins them (``release_pins``) once the
    block's work is queued.  A fault that finds no room (streamed weights) -> None.  Other
    parameters must be on ``device`` (else: offloaded -> None); weight / bias functions (on-the-fly
    LoRA) and patches kept on quantised weight tensors (ComfyUI-GGUF's LoRA) -> None (a graph would
    freeze them, and their per-call host-to-device copies cannot be captured).  ``skip``: ids of modules the call does not read
    (Linears served by the fast profile's kept fp8 copy: neither faulted nor checked; their
    copies' identity comes in ``extra``)."""
    if device.type != "cuda":
        return None, "not a CUDA device", ()
    idx = device.index if device.index is not None else torch.cuda.current_device()
    mv = None
    allocs, rest = [], [epoch, tuple(extra)]
    vblock = blk.__dict__.get("_v_block") if not skip else None
    if vblock is not None:
        allocs.append(vblock)
    for m in blk.modules():
        if id(m) in skip:
            continue
        d = m.__dict__
        if _has_weight_functions(m):
            return None, f"weight functions on a {type(m).__name__} (on-the-fly LoRA / patches)", ()
        if _tensor_patches(m):
            return None, f"LoRA patches merged per call into a {type(m).__name__}'s quantised weight (GGUF)", ()
        if "_v" in d:
            if vblock is None:
                allocs.append(d["_v"])
            continue
        for n, p in m._parameters.items():
            if p is None:
                continue
            if not p.is_cuda or p.get_device() != idx:
                return None, f"weights offloaded ({type(m).__name__}.{n} on {p.device})", ()
            rest.append(p.data_ptr())
    sigs, pinned = [], []
    if allocs:
        mv = _model_vbar()
        if mv is None:
            return None, "DynamicVRAM weights but comfy_aimdo.model_vbar has no fault API", ()
        for a in allocs:
            s = mv.vbar_fault(a)
            if s is None:  # (unpinned only after a fault that succeeded, as ComfyUI's ops do)
                release_pins(pinned)
                return None, "weights not resident (DynamicVRAM streams them)", ()
            pinned.append(a)
            sigs.append(s)
    return _Residency(tuple(sigs), tuple(rest)), None, tuple(pinned)


VBAR_PAGE = 32 << 20  # comfy-aimdo's VBAR_PAGE_SIZE
CAPTURE_HEADROOM = 3 << 30  # free device memory a block capture needs around it (its allocations)
BUDGET_SLACK_PAGES = 2  # pages of a vbar's budget left unused before the pack captures over it


def _pages(nbytes) -> int:
    """comfy-aimdo pages spanned by ``nbytes`` from a vbar's start (rounded up)."""
    return -(-int(nbytes) // VBAR_PAGE)


def capture_headroom(pinned, device, partial: bool = False) -> Optional[str]:
    """None when capturing a block now cannot make the memory manager move weights inside the
    capture, else why.  A capture allocates the block's temporaries; if that allocation has to make
    room -- comfy-aimdo evicting weight pages when its DynamicVRAM budget is used up -- the capture
    is invalidated (seen with ``--reserve-vram 118`` while a bf16 model was streamed).  So every
    vbar the block's weights live in must hold all of the model's weight pages within its budget
    (comfy-aimdo's watermark) -- or, with ``partial`` (the call reads only some of the model's
    weights: the fast profile's kept fp8 copies serve the block GEMMs, whose bf16 pages are never
    faulted), have room below the budget for the pages resident now plus ``BUDGET_SLACK_PAGES`` --
    and ``device`` must have ``CAPTURE_HEADROOM`` free."""
    if device.type != "cuda":
        return None
    seen = set()
    for a in pinned:
        vb = a[0]
        if id(vb) in seen:
            continue
        seen.add(id(vb))
        try:
            used = _pages(vb.offset)
            budget = int(vb.get_watermark())
            loaded = _pages(vb.loaded_size()) if partial and budget < used else 0
        except Exception as e:
            return f"cannot read the DynamicVRAM budget ({type(e).__name__})"
        if budget < used and not partial:
            return (f"the DynamicVRAM budget holds {budget} of the model's {used} weight pages "
                    f"(weights are streamed: no graphs under memory pressure)")
        if budget < used and loaded + BUDGET_SLACK_PAGES > budget:
            return (f"the DynamicVRAM budget ({budget} of the model's {used} weight pages) is used up by the "
                    f"{loaded} pages resident now (weights are streamed: no graphs under memory pressure)")
    try:
        free = torch.cuda.mem_get_info(device)[0]
    except Exception as e:
        return f"cannot read free device memory ({type(e).__name__})"
    if free < CAPTURE_HEADROOM:
        return f"{free / 2 ** 30:.1f} GB free on {device} (a capture needs {CAPTURE_HEADROOM >> 30} GB)"
    return None


def streamed_weights(m) -> bool:
    """True when ``m``'s DynamicVRAM weights lie beyond comfy-aimdo's budget: the vbar keeps the pages
    below its watermark resident and streams every page above it on each call (the layout is fixed
    when the model is first loaded: ComfyUI places the largest weights first).  False for anything
    else (not DynamicVRAM, or the budget cannot be read)."""
    v = m.__dict__.get("_v")
    if v is None:
        return False
    try:
        vb, addr, size = v
        return _pages(int(addr) - int(vb.base_addr) + int(size)) > int(vb.get_watermark())
    except Exception:
        return False


def release_pins(pinned):
    """Unpin what ``block_residency`` faulted (after the block's work is queued, as ComfyUI's ops do)."""
    if pinned:
        mv = _model_vbar()
        for a in pinned:
            mv.vbar_unpin(a)
