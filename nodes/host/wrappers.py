"""ComfyUI's model-patcher extension points the pack hooks into: diffusion-model / sampler
wrappers, the wrapper chain seen from inside a wrapper, the sampler's arguments, unload callbacks."""
from __future__ import annotations

import logging
from typing import List, Optional

log = logging.getLogger("flux_numba")


def _install_wrapper(model_patcher, kind: str, key: str, wrapper):
    """(Re)place the ``WrappersMP.<kind>`` wrapper ``key`` of a (cloned) ModelPatcher with ``wrapper``."""
    import comfy.patcher_extension as pe
    kind = getattr(pe.WrappersMP, kind)
    model_patcher.remove_wrappers_with_key(kind, key)
    model_patcher.add_wrapper_with_key(kind, key, wrapper)


def install_diffusion_wrapper(model_patcher, key: str, wrapper):
    """(Re)place the DIFFUSION_MODEL wrapper ``key`` of a (cloned) ModelPatcher with ``wrapper``."""
    _install_wrapper(model_patcher, "DIFFUSION_MODEL", key, wrapper)
    return wrapper


def install_sampling_wrappers(model_patcher, key: str, outer_sample, apply_model):
    """(Re)place the OUTER_SAMPLE and APPLY_MODEL wrappers ``key`` (the step timer)."""
    _install_wrapper(model_patcher, "OUTER_SAMPLE", key, outer_sample)
    _install_wrapper(model_patcher, "APPLY_MODEL", key, apply_model)


def inner_wrappers(executor) -> Optional[List]:
    """The wrappers a ``WrapperExecutor`` will still run inside the current one (None: not visible)."""
    wrappers = getattr(executor, "wrappers", None)
    idx = getattr(executor, "idx", None)
    if wrappers is None or idx is None:
        return None
    return list(wrappers[idx + 1:])


def run_innermost(executor, fn, *args, **kwargs):
    """Run the wrappers ``executor`` would still run inside the current one first, and ``fn(executor',
    *args, **kwargs)`` innermost -- right around the wrapped function (``executor'`` calls it): a
    wrapper that must see only the model's own forward (a CUDA graph over it) stays inside wrappers
    added after it (EasyCache's host-side decisions and ``.item()`` reads then run outside the graph).
    The other wrappers see the same arguments and the same result: ours adds nothing of its own.
    Only where ``inner_wrappers(executor)`` sees the chain; where this ComfyUI's executor cannot be
    rebuilt that way (another constructor), ``fn`` runs where it stands (the wrappers stay inside it:
    its graph then stays off, with the reason logged)."""
    try:
        chain = type(executor)(executor.original, executor.class_obj, inner_wrappers(executor) + [fn], 0)
        run = chain.execute
    except Exception as e:
        log.info("[flux_numba] cannot reorder the diffusion-model wrappers (%s: %s)", type(e).__name__, e)
        return fn(executor, *args, **kwargs)
    return run(*args, **kwargs)


def wrapped_object(executor):
    """The object a wrapper executor calls (the diffusion model, the sampler's guider ...)."""
    return executor.class_obj


def sampler_sigmas(args, kwargs):
    """The sigmas of an OUTER_SAMPLE call (``CFGGuider.outer_sample(noise, latent_image, sampler,
    sigmas, ...)``), or None."""
    return args[3] if len(args) > 3 else kwargs.get("sigmas")


def guider_transformer_options(executor) -> dict:
    """The sampled model's ``transformer_options`` as an OUTER_SAMPLE wrapper sees them (the guider's
    ``model_options``), or {}."""
    try:
        return executor.class_obj.model_options.get("transformer_options", {}) or {}
    except Exception:
        return {}


def guider_device(executor) -> str:
    """The device the sampled model runs on (its patcher's ``load_device``), "cpu" when unknown."""
    try:
        return str(executor.class_obj.model_patcher.load_device)
    except Exception:
        return "cpu"


def drop_on_unload(model_patcher, key, drop):
    """Call ``drop()`` when ComfyUI unloads the model (``ModelPatcher.detach(unpatch_all=True)``);
    v0.8.0's ``load_models_gpu`` also detaches with ``unpatch_all=False`` on every load (weights stay
    put: kept).  Returns False where the host has no patcher callbacks."""
    def on_detach(mp, unpatch_all=True, *a, **k):
        if unpatch_all:
            drop()
    try:
        import comfy.patcher_extension as pe
        model_patcher.add_callback_with_key(pe.CallbacksMP.ON_DETACH, key, on_detach)
        return True
    except Exception:
        return False


# ----------------------------------------------------------------------------- conditioning on the GPU
CONDS_KEY = "flux_numba_conds_on_device"
# ComfyUI's own tensor conditions whose whole state is ``.cond`` (``_copy_with`` rebuilds them from it);
# another node's subclass may carry more state and is left alone
_COND_CLASSES = ("CONDRegular", "CONDNoiseShape", "CONDCrossAttn", "CONDList")
CONDS_MAX_BYTES = 1 << 30  # a condition bigger than this stays where it is (not a text conditioning)
CONDS_DEVICE_TYPES = ("cuda",)  # devices the conds are moved to (tests add "cpu": the same path, no copy)


def _cond_to(cond, device, memo):
    """``cond`` with its tensor(s) on ``device`` (one copy per source tensor: ``memo``), or None when
    it is not one of ComfyUI's plain tensor conditions or is not on the CPU."""
    import torch
    import comfy.conds as cc
    if type(cond) not in tuple(getattr(cc, n) for n in _COND_CLASSES if hasattr(cc, n)):
        return None
    t = cond.cond
    ts = t if isinstance(t, list) else [t]
    if not ts or not all(isinstance(x, torch.Tensor) and x.device.type == "cpu" for x in ts):
        return None
    if sum(x.numel() * x.element_size() for x in ts) > CONDS_MAX_BYTES:
        return None

    def to(x):
        hit = memo.get(id(x))  # (source, copy): the source is held, so its id stays unique meanwhile
        if hit is None:
            hit = memo[id(x)] = (x, x.to(device))
        return hit[1]
    return cond._copy_with([to(x) for x in t] if isinstance(t, list) else to(t))


def conds_to_device(guider, device) -> int:
    """Move the tensor conditions of a guider's processed conds (``CFGGuider.conds`` inside
    ``inner_sample``: per-sampling copies made by ``process_conds``) to ``device`` once; returns how
    many were moved.  ComfyUI otherwise copies them from the CPU on every step (``_apply_model``:
    ``cast_to_device`` of the context, pooled vector, guidance), and a copy from pageable memory
    waits until the GPU has finished the previous step -- the host then does the next step's set-up
    while the GPU idles.  Values are unchanged (the same tensors, copied once; the dtype cast then
    runs on the GPU, with the same rounding)."""
    conds = getattr(guider, "conds", None)
    if not isinstance(conds, dict):
        return 0
    memo, moved = {}, 0
    for lst in conds.values():
        if not isinstance(lst, list):
            continue
        for i, c in enumerate(lst):
            mc = c.get("model_conds") if isinstance(c, dict) else None
            if not isinstance(mc, dict):
                continue
            new, here = dict(mc), 0
            for k, v in mc.items():
                m = _cond_to(v, device, memo)
                if m is not None:
                    new[k] = m
                    here += 1
            if here:
                moved += here
                c = dict(c)  # the list's own entry is replaced: nothing shared with the caller is mutated
                c["model_conds"] = new
                lst[i] = c
    return moved


def _conds_wrapper(executor, guider, *args, **kwargs):
    """SAMPLER_SAMPLE wrapper: ``conds_to_device`` on the sampled model's device, then the sampler."""
    try:
        dev = getattr(getattr(guider, "model_patcher", None), "load_device", None)
        if dev is not None and getattr(dev, "type", None) in CONDS_DEVICE_TYPES:
            conds_to_device(guider, dev)
    except Exception as e:  # never in the way of sampling: the conds stay where ComfyUI put them
        log.warning("[flux_numba] conditioning left on the CPU (%s: %s)", type(e).__name__, e)
    return executor(guider, *args, **kwargs)


def install_conds_on_device(model_patcher) -> bool:
    """(Re)place the SAMPLER_SAMPLE wrapper that moves the conditioning to the GPU once per sampling run
    (``conds_to_device``); False where the host has no such wrapper."""
    try:
        _install_wrapper(model_patcher, "SAMPLER_SAMPLE", CONDS_KEY, _conds_wrapper)
        return True
    except Exception:
        return False
