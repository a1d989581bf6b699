"""FluxNumbaVAEPatch: the FLUX VAE decoder through the op registry, NHWC end to end.

VAE -> VAE.  The input VAE object is never mutated: the node returns a copy whose patcher carries the
patched decoder as an object patch (``host.vae.patch_vae``); the NHWC math is ``flux_core.vae``.
Layout "nhwc" (default; bf16 decoders, backend not "torch"): channels_last from the latent to the
image, cuDNN's NHWC convolutions without layout conversions, the pack's GroupNorm+SiLU / upsample /
bias+residual / attention-softmax kernels between them; the low-resolution stage replays as a CUDA
graph from the third decode of a shape on (``cuda_graph`` auto).  Layout "nchw" (and fp32 / fp16 VAEs):
stock layout, GroupNorm+SiLU fused.  An exception inside the NHWC path (other than out-of-memory,
which ComfyUI's own tiled fallback handles) is logged once and that latent shape then runs the NCHW
path.  V3 schema.
"""
from __future__ import annotations

import functools
import logging

import torch

from ..cuda_kernels import runtime
from .host import api

log = logging.getLogger("flux_numba")

NODE_ID = "FluxNumbaVAEPatch"
BACKENDS = ("auto", "numba", "torch")
LAYOUTS = ("nhwc", "nchw")
CUDA_GRAPHS = ("auto", "off")


DISPLAY_NAME = "FLUX VAE Patch (Numba GroupNorm+SiLU, NHWC)"


def apply(vae, enabled=True, backend="auto", layout="nhwc", cuda_graph="auto"):
    """What the node does: ``(patched copy of the VAE,)``, or ``(vae,)`` passed through (logged)."""
    if backend not in BACKENDS:
        raise ValueError(f"{NODE_ID}: backend must be one of {list(BACKENDS)}, got {backend!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"{NODE_ID}: layout must be one of {list(LAYOUTS)}, got {layout!r}")
    if cuda_graph not in CUDA_GRAPHS:
        raise ValueError(f"{NODE_ID}: cuda_graph must be one of {list(CUDA_GRAPHS)}, got {cuda_graph!r}")
    if not isinstance(enabled, (bool, int)):
        raise ValueError(f"{NODE_ID}: enabled must be a boolean, got {enabled!r}")
    if not enabled:
        log.info("[flux_numba] %s disabled: VAE passes through stock", NODE_ID)
        return (vae,)
    why = runtime.numba_status()
    if why is None and not runtime.SIMULATOR and not torch.cuda.is_available():
        why = "no CUDA device"
    if why:
        log.warning("[flux_numba] %s passes the VAE through unpatched: %s", NODE_ID, why)
        return (vae,)
    from .host.vae import patch_vae
    out, info = patch_vae(vae, backend, layout, cuda_graph)
    if isinstance(info, str):
        log.info("[flux_numba] %s passes the VAE through unpatched: %s", NODE_ID, info)
        return (vae,)
    log.info("[flux_numba] %s: decoder patched (%d ResnetBlocks, %d AttnBlocks, %d Upsamples, norm_out), "
             "backend %s, layout %s, cuda_graph %s", NODE_ID, info["ResnetBlock"], info["AttnBlock"],
             info["Upsample"], backend, layout, cuda_graph)
    return (out,)


@functools.lru_cache(maxsize=None)
def node_class():
    """The V3 node class, defined on first use (it needs ComfyUI's ``comfy_api``)."""
    io = api.io()

    class FluxNumbaVAEPatch(io.ComfyNode):
        @classmethod
        def define_schema(cls):
            return io.Schema(
                node_id=NODE_ID, display_name=DISPLAY_NAME, category="FluxNumba",
                description="Clones the VAE and runs the FLUX VAE decoder NHWC end to end: Numba-CUDA "
                            "GroupNorm+SiLU, upsample, conv bias+residual and attention-softmax kernels between "
                            "cuDNN's NHWC convolutions (no layout conversions). The input VAE is untouched; other "
                            "VAEs pass through.",
                inputs=[io.Vae.Input("vae"),
                        io.Boolean.Input("enabled", default=True),
                        io.Combo.Input("backend", options=list(BACKENDS), default="auto",
                                       tooltip="auto: fastest accepted backend; torch: stock math and layout (A/B)"),
                        io.Combo.Input("layout", options=list(LAYOUTS), default="nhwc", optional=True,
                                       tooltip="nhwc: the whole bf16 decoder channels_last (cuDNN's NHWC convolutions, "
                                               "no layout conversions); nchw: stock layout, fused GroupNorm+SiLU only"),
                        io.Combo.Input("cuda_graph", options=list(CUDA_GRAPHS), default="auto", optional=True,
                                       tooltip="auto: from the third decode of a latent size on, replay the decoder's "
                                               "low-resolution stage (host-bound when issued op by op) as a CUDA "
                                               "graph; holds that stage's activations in VRAM between decodes. Under "
                                               "DynamicVRAM while the weights stay resident; eager with low-VRAM "
                                               "offload (logged). off: eager")],
                outputs=[io.Vae.Output(display_name="vae")])

        @classmethod
        def execute(cls, vae, enabled=True, backend="auto", layout="nhwc", cuda_graph="auto"):
            return io.NodeOutput(*apply(vae, enabled, backend, layout, cuda_graph))

    return FluxNumbaVAEPatch
