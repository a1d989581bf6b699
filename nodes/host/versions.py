"""Which ComfyUI this is, and what it has that the pack adapts to -- detected from ComfyUI itself
(never from a version number alone), logged once when a patch node first runs.

Tested on every change: ComfyUI v0.8.0 and v0.33.0 (``TESTED``).  What differs, and where the host
package handles it:
  * q/k norms: v0.8.0 ``layers.RMSNorm`` (``.scale``), v0.33+ ``operations.RMSNorm`` (``.weight``,
    ComfyUI's epsilon rule) -- ``flux.ComfyWeights.norm`` / ``norm_eps``;
  * DynamicVRAM (comfy-aimdo vbars, v0.33's default on NVIDIA) and ComfyUI's block prefetch queue
    (``comfy.model_prefetch``) -- ``residency.staged_block``, ``residency.block_residency``;
  * the model compiler (0.36+: allocation recording + its own graphs; ``--disable-comfy-compiler``)
    -- ``flux.compiler_recording`` makes the pack's graphs stand down while it records;
  * per-block attention chosen by the checkpoint (0.36+: ``comfy_attention``) -- ``flux.block_attention``;
    attention tensor containers (``AttentionTensorContainer``: in v0.33 for MiniMax, 0.36+ wraps
    q/k/v in them for attention overrides) -- the pack calls ComfyUI's attention with plain tensors
    and leaves overrides to ComfyUI's own path (``flux.attention_override``);
  * v0.33 blocks apply ``attn1_patch`` / ``attn1_output_patch`` and Kontext's ``modulation_dims``
    inside the block -- ``flux.call_problem`` runs those calls stock.
"""
from __future__ import annotations

import functools
import logging

log = logging.getLogger("flux_numba")

TESTED = ("0.8.0", "0.33.0")


@functools.lru_cache(maxsize=None)
def comfy_version() -> str:
    try:
        import comfyui_version
        return str(comfyui_version.__version__)
    except Exception:
        return "unknown"


def features() -> dict:
    """What this ComfyUI has, as the host adapter sees it (each probe fails closed)."""
    from . import residency
    f = {"version": comfy_version(), "tested": comfy_version() in TESTED}
    try:
        import comfy.memory_management as mem
        f["dynamic_vram"] = bool(getattr(mem, "aimdo_enabled", False))
    except Exception:
        f["dynamic_vram"] = False
    mp = residency._prefetch_module()
    f["block_prefetch"] = mp is not None
    f["model_compiler"] = mp is not None and hasattr(mp, "malloc_graph_enabled")
    try:
        from comfy.ldm.modules import attention as ca
        f["attention_containers"] = hasattr(ca, "AttentionTensorContainer")
    except Exception:
        f["attention_containers"] = False
    try:
        import comfy.ldm.flux.layers as fl
        f["qk_norm"] = "operations.RMSNorm (.weight)" if "operations.RMSNorm" in _source(fl.QKNorm) else "RMSNorm (.scale)"
    except Exception:
        f["qk_norm"] = "unknown"
    return f


def _source(obj) -> str:
    import inspect
    try:
        return inspect.getsource(obj)
    except Exception:
        return ""


_logged = []


def log_once():
    """One log line naming the ComfyUI version and the features the pack adapts to."""
    if _logged:
        return _logged[0]
    try:
        f = features()
    except Exception as e:  # never fail a node for a log line
        f = {"version": comfy_version(), "error": f"{type(e).__name__}: {e}"}
    _logged.append(f)
    extra = "" if f.get("tested") else f" (tested: {', '.join(TESTED)}; other versions: each block is checked, " \
                                      "anything the fused path does not cover runs stock with a log line)"
    log.info("[flux_numba] ComfyUI %s%s: %s", f.get("version"), extra,
             ", ".join(f"{k} {v}" for k, v in f.items() if k not in ("version", "tested")))
    return f
