"""FluxNumbaPatch: MODEL -> MODEL, every FLUX.1 block through the pack's fused Numba-CUDA ops
(``runner.patch_model``: a clone with per-block replacements, CUDA graphs, kernel warm-up; the input
model is never touched)."""
from __future__ import annotations

from .runner import ATTENTIONS, BACKENDS, CUDA_GRAPHS, PROFILES, patch_model, runner_of, stats  # noqa: F401


class FluxNumbaPatch:
    DESCRIPTION = ("Runs every FLUX.1 double/single block through this pack's fused Numba-CUDA ops. "
                   "Returns a patched clone; the input model is untouched. Without a CUDA GPU / numba "
                   "the model passes through unchanged (except backend 'torch', the A/B baseline).")
    CATEGORY = "FluxNumba"
    RETURN_TYPES = ("MODEL",)
    RETURN_NAMES = ("model",)
    OUTPUT_TOOLTIPS = ("The patched clone of the model.",)
    FUNCTION = "patch"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": ("MODEL", {"tooltip": "A FLUX.1 model (e.g. from FluxNumbaLoader or Load Diffusion Model)."}),
            "profile": (PROFILES, {"default": "exact", "tooltip":
                                   "exact: fused ops with bf16-exact math. stock-order: the pack's blocks in "
                                   "ComfyUI's op order (no fusion), for A/B. fast: exact's fusion with the block "
                                   "GEMMs in fp8 e4m3 (per-token / per-channel scales; GPUs with row-wise fp8 scales "
                                   "such as H100/H200, else exact), "
                                   "a small quality loss; fp8-stored weights (weight_dtype fp8_e4m3fn, scaled fp8 "
                                   "checkpoints) are used as they are, bf16 weights are quantised again every "
                                   "step (no extra memory). "
                                   "fast-cached: as fast, bf16 weights quantised once and kept: faster, at the "
                                   "cost of an fp8 copy of the block weights on the GPU (~12 GB for FLUX.1-dev)."}),
            "route_norms": ("BOOLEAN", {"default": True, "label_on": "on", "label_off": "off", "tooltip":
                                        "Route LayerNorm/modulate, q/k RMSNorm+RoPE, GELU and gated residuals "
                                        "through the pack's kernels (off: torch for those)."}),
            "attention": (ATTENTIONS, {"default": "auto", "tooltip":
                                       "auto: the op registry decides per shape (ComfyUI's attention when it picks "
                                       "torch's). sdpa: ComfyUI's own optimized_attention (honours --use-*-attention "
                                       "and attention overrides). numba-bf16 / numba-8bit: the pack's own attention "
                                       "kernels, forced (bf16, or int8 Q K^T with a small error); auto does not pick "
                                       "them."}),
            "backend": (BACKENDS, {"default": "auto", "tooltip":
                                   "auto: fastest usable backend per op (measured once per shape on this GPU). "
                                   "torch: every op on its torch reference (faithful A/B baseline, also on CPU). "
                                   "numba: force the Numba kernels."}),
            "cuda_graph": (CUDA_GRAPHS, {"default": "auto", "tooltip":
                                         "auto: replay the FLUX forward as CUDA graphs (removes launch and host "
                                         "overhead): the whole step where possible, else each block on its own "
                                         "while its weights are resident (DynamicVRAM, EasyCache, ControlNet, masks, "
                                         "partial offload); blocks with streamed weights run eagerly; the log says "
                                         "why. Holds activation buffers per image size until the model is unloaded. "
                                         "off: every step eager."}),
        },
            "hidden": {"unique_id": "UNIQUE_ID"}}

    @staticmethod
    def options(profile="exact", route_norms=True, attention="auto", backend="auto", cuda_graph="auto") -> dict:
        if isinstance(route_norms, str):
            route_norms = route_norms.lower() in ("on", "true", "1", "yes")
        for val, allowed, name in ((profile, PROFILES, "profile"), (attention, ATTENTIONS, "attention"),
                                   (backend, BACKENDS, "backend"), (cuda_graph, CUDA_GRAPHS, "cuda_graph")):
            if val not in allowed:
                raise ValueError(f"FluxNumbaPatch: {name} must be one of {allowed}, got {val!r}")
        return {"profile": profile, "route_norms": bool(route_norms), "attention": attention, "backend": backend,
                "cuda_graph": cuda_graph}

    def patch(self, model, profile="exact", route_norms=True, attention="auto", backend="auto", cuda_graph="auto",
              unique_id=None):
        return patch_model(model, self.options(profile, route_norms, attention, backend, cuda_graph), unique_id)


NODE_CLASS_MAPPINGS = {"FluxNumbaPatch": FluxNumbaPatch}
NODE_DISPLAY_NAME_MAPPINGS = {"FluxNumbaPatch": "FLUX Numba Patch (fused blocks)"}
