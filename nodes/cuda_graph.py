"""Replay the whole patched FLUX forward as a CUDA graph inside ComfyUI (DIFFUSION_MODEL wrapper).

Captured per input signature (latent/context shapes, dtypes) after a warm-up; replayed every
step.  Only when it is safe -- otherwise the step runs eagerly and the reason is logged once:
  * every weight on the GPU and no per-call weight casting (ComfyUI low-VRAM / manual cast),
  * no ControlNet, no reference latents (Kontext), no other per-step model patches,
  * not already capturing.
Weights patched in place (LoRA) keep their addresses, so replays see them; if weights move
(model unloaded and reloaded) the graph is re-captured.
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger("flux_numba")

KEY = "flux_numba_cuda_graph"


class GraphWrapper:
    def __init__(self, max_graphs: int = 2):
        self.max_graphs = max_graphs
        self.gf = None
        self._logged = set()
        self.last_mode = None  # "graph" | "eager: <reason>"

    def _eager(self, why, executor, *args, **kwargs):
        if why not in self._logged:
            self._logged.add(why)
            log.info("[flux_numba] CUDA graph off for this call: %s", why)
        self.last_mode = "eager: " + why
        return executor(*args, **kwargs)

    def __call__(self, executor, x, timestep, context, y=None, guidance=None, ref_latents=None, control=None,
                 transformer_options={}, **kwargs):
        args = (x, timestep, context, y, guidance, ref_latents, control, transformer_options)
        dm = executor.class_obj
        if not x.is_cuda:
            return self._eager("not a CUDA device", executor, *args, **kwargs)
        if control is not None or ref_latents is not None:
            return self._eager("ControlNet / reference latents change per step", executor, *args, **kwargs)
        if kwargs.get("attention_mask") is not None:
            return self._eager("attention mask", executor, *args, **kwargs)
        extra = {k for k, v in transformer_options.get("patches", {}).items() if v}
        if extra:
            return self._eager(f"other model patches present ({sorted(extra)})", executor, *args, **kwargs)
        from ..flux_core.graphs import GraphedForward, graph_blockers
        why = graph_blockers(dm, x.device)
        if why:
            return self._eager("; ".join(why), executor, *args, **kwargs)
        if self.gf is None:
            self.gf = GraphedForward(None, module=dm, max_graphs=self.max_graphs)
        has_y, has_g = y is not None, guidance is not None  # FLUX schnell has no guidance input

        def fn(xx, tt, cc, *rest):
            rest = list(rest)
            yy = rest.pop(0) if has_y else None
            gg = rest.pop(0) if has_g else None
            return executor(xx, tt, cc, yy, gg, None, None, transformer_options, **kwargs)
        # the executor and transformer_options of *this* call are what a capture records
        self.gf.fn = fn
        try:
            out = self.gf(x, timestep, context, *[v for v in (y, guidance) if v is not None])
        except Exception as e:  # capture failed: never break sampling
            self.gf = None
            return self._eager(f"capture failed ({type(e).__name__}: {e})", executor, *args, **kwargs)
        self.last_mode = "graph"
        return out


def install(model_patcher, wrapper: GraphWrapper = None):
    """Add the graph wrapper to a (cloned) ModelPatcher."""
    import comfy.patcher_extension
    w = wrapper or GraphWrapper()
    model_patcher.remove_wrappers_with_key(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, KEY)
    model_patcher.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, KEY, w)
    return w
