"""FluxNumbaPatch: MODEL -> MODEL, every FLUX.1 block through the pack's fused Numba-CUDA ops
(``runner.patch_model``: a clone with per-block replacements, CUDA graphs, kernel warm-up; the input
model is never touched).  V3 schema (``comfy_api``); ``options`` checks the widget values."""
from __future__ import annotations

import functools

from .host import api
from .plan import ATTENTIONS, BACKENDS, CUDA_GRAPHS, NODE_ID, PROFILES, PatchPlan  # noqa: F401
from .runner import patch_model, runner_of, stats  # noqa: F401

DISPLAY_NAME = "FLUX Numba Patch (fused blocks)"
DESCRIPTION = ("Runs every FLUX.1 double/single block through this pack's fused Numba-CUDA ops. Returns a patched "
               "clone; the input model is untouched. Without a CUDA GPU / numba the model passes through unchanged "
               "(except backend 'torch', the A/B baseline).")
TOOLTIPS = {
    "model": "A FLUX.1 model (e.g. from FluxNumbaLoader or Load Diffusion Model).",
    "profile": "exact: fused ops with bf16-exact math. stock-order: the pack's blocks in ComfyUI's op order (no "
               "fusion), for A/B. fast: exact's fusion with the block GEMMs in fp8 e4m3 (per-token / per-channel "
               "scales; GPUs with row-wise fp8 scales such as H100/H200, else exact), a small quality loss; "
               "fp8-stored weights (weight_dtype fp8_e4m3fn, scaled fp8 checkpoints) are used as they are, bf16 "
               "weights are quantised again every step (no extra memory). fast-cached: as fast, bf16 weights "
               "quantised once and kept: faster, at the cost of an fp8 copy of the block weights on the GPU "
               "(~12 GB for FLUX.1-dev).",
    "route_norms": "Route LayerNorm/modulate, q/k RMSNorm+RoPE, GELU and gated residuals through the pack's "
                   "kernels (off: torch for those).",
    "attention": "auto: the op registry decides per shape (ComfyUI's attention when it picks torch's). sdpa: "
                 "ComfyUI's own optimized_attention (honours --use-*-attention and attention overrides). "
                 "numba-bf16 / numba-8bit: the pack's own attention kernels, forced (bf16, or int8 Q K^T with a "
                 "small error); auto does not pick them.",
    "backend": "auto: fastest usable backend per op (measured once per shape on this GPU). torch: every op on its "
               "torch reference (faithful A/B baseline, also on CPU). numba: force the Numba kernels.",
    "cuda_graph": "auto: replay the FLUX forward as CUDA graphs (removes launch and host overhead): the whole step "
                  "where possible, else each block on its own while its weights are resident (DynamicVRAM, "
                  "ControlNet, masks, partial offload); blocks with streamed weights run eagerly; the log "
                  "says why. Holds activation buffers per image size until the model is unloaded. off: every step "
                  "eager.",
}


def options(profile="exact", route_norms=True, attention="auto", backend="auto", cuda_graph="auto") -> PatchPlan:
    """The node's widget values, checked (ValueError naming the node and the input): a ``PatchPlan``."""
    return PatchPlan(profile, route_norms, attention, backend, cuda_graph)


def apply(model, profile="exact", route_norms=True, attention="auto", backend="auto", cuda_graph="auto",
          unique_id=None):
    """What the node does: ``(patched clone,)``."""
    return patch_model(model, options(profile, route_norms, attention, backend, cuda_graph), unique_id)


@functools.lru_cache(maxsize=None)
def node_class():
    """The V3 node class, defined on first use (it needs ComfyUI's ``comfy_api``)."""
    io = api.io()

    class FluxNumbaPatch(io.ComfyNode):
        @classmethod
        def define_schema(cls):
            t = TOOLTIPS
            return io.Schema(
                node_id=NODE_ID, display_name=DISPLAY_NAME, category="FluxNumba", description=DESCRIPTION,
                inputs=[io.Model.Input("model", tooltip=t["model"]),
                        io.Combo.Input("profile", options=PROFILES, default="exact", tooltip=t["profile"]),
                        io.Boolean.Input("route_norms", default=True, label_on="on", label_off="off",
                                         tooltip=t["route_norms"]),
                        io.Combo.Input("attention", options=ATTENTIONS, default="auto", tooltip=t["attention"]),
                        io.Combo.Input("backend", options=BACKENDS, default="auto", tooltip=t["backend"]),
                        io.Combo.Input("cuda_graph", options=CUDA_GRAPHS, default="auto", tooltip=t["cuda_graph"])],
                outputs=[io.Model.Output(display_name="model", tooltip="The patched clone of the model.")],
                hidden=[io.Hidden.unique_id])

        @classmethod
        def execute(cls, model, profile="exact", route_norms=True, attention="auto", backend="auto",
                    cuda_graph="auto"):
            return io.NodeOutput(*apply(model, profile, route_norms, attention, backend, cuda_graph,
                                        api.unique_id(cls)))

    return FluxNumbaPatch
