"""ComfyUI's model-patcher extension points the pack hooks into: diffusion-model / sampler
wrappers, the wrapper chain seen from inside a wrapper, the sampler's arguments, unload callbacks."""
from __future__ import annotations

from typing import List, Optional


def install_diffusion_wrapper(model_patcher, key: str, wrapper):
    """(Re)place the DIFFUSION_MODEL wrapper ``key`` of a (cloned) ModelPatcher with ``wrapper``."""
    import comfy.patcher_extension as pe
    model_patcher.remove_wrappers_with_key(pe.WrappersMP.DIFFUSION_MODEL, key)
    model_patcher.add_wrapper_with_key(pe.WrappersMP.DIFFUSION_MODEL, key, wrapper)
    return wrapper


def install_sampling_wrappers(model_patcher, key: str, outer_sample, apply_model):
    """(Re)place the OUTER_SAMPLE and APPLY_MODEL wrappers ``key`` (the step timer)."""
    import comfy.patcher_extension as pe
    model_patcher.remove_wrappers_with_key(pe.WrappersMP.OUTER_SAMPLE, key)
    model_patcher.remove_wrappers_with_key(pe.WrappersMP.APPLY_MODEL, key)
    model_patcher.add_wrapper_with_key(pe.WrappersMP.OUTER_SAMPLE, key, outer_sample)
    model_patcher.add_wrapper_with_key(pe.WrappersMP.APPLY_MODEL, key, apply_model)


def inner_wrappers(executor) -> Optional[List]:
    """The wrappers a ``WrapperExecutor`` will still run inside the current one (None: not visible)."""
    wrappers = getattr(executor, "wrappers", None)
    idx = getattr(executor, "idx", None)
    if wrappers is None or idx is None:
        return None
    return list(wrappers[idx + 1:])


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
