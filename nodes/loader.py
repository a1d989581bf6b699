"""FluxNumbaLoader: load a FLUX.1 diffusion model from ComfyUI's ``diffusion_models`` folder.

Same weight-dtype choices and the same loading call as ComfyUI's UNETLoader
(``comfy.sd.load_diffusion_model``, through ``host.ui``), but the safetensors header is inspected first (no tensor data
read, ``flux_core.checkpoint.inspect_checkpoint``) and a file that is not a FLUX.1 diffusion model
is refused with a message that says what it looks like.  Files that are not safetensors (.ckpt,
.pt...) cannot be inspected without reading them: they are loaded and then checked.  V3 schema.
"""
from __future__ import annotations

import functools
import logging
import os

from .host import api

log = logging.getLogger("flux_numba")

WEIGHT_DTYPES = ["default", "fp8_e4m3fn", "fp8_e4m3fn_fast", "fp8_e5m2"]
SAFETENSORS_EXT = (".safetensors", ".sft")


def weight_dtype_options(weight_dtype: str) -> dict:
    """UNETLoader's mapping of the weight_dtype widget to load_diffusion_model's model_options."""
    import torch
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"FluxNumbaLoader: weight_dtype must be one of {WEIGHT_DTYPES}, got {weight_dtype!r}")
    model_options = {}
    if weight_dtype == "fp8_e4m3fn":
        model_options["dtype"] = torch.float8_e4m3fn
    elif weight_dtype == "fp8_e4m3fn_fast":
        model_options["dtype"] = torch.float8_e4m3fn
        model_options["fp8_optimizations"] = True
    elif weight_dtype == "fp8_e5m2":
        model_options["dtype"] = torch.float8_e5m2
    return model_options


def check_flux_file(path: str):
    """FluxConfig of a FLUX.1 safetensors file (header only); raises ValueError otherwise.

    Returns None for formats whose header cannot be read without loading (checked after loading).
    """
    from ..flux_core.checkpoint import inspect_checkpoint, NotFluxError, CheckpointError
    name = os.path.basename(path)
    if not path.lower().endswith(SAFETENSORS_EXT):
        return None
    try:
        return inspect_checkpoint(path)
    except NotFluxError as e:
        raise NotFluxError(f"FluxNumbaLoader: unet_name {name}: {e}") from None
    except CheckpointError as e:
        raise CheckpointError(f"FluxNumbaLoader: unet_name {name}: {e}") from None


def check_loaded_model(model_patcher, name: str):
    """After loading: the model ComfyUI built must be FLUX.1 (not FLUX.2, Chroma, ...)."""
    from ..flux_core.checkpoint import NotFluxError
    base = getattr(model_patcher, "model", None)
    cfg = getattr(getattr(base, "model_config", None), "unet_config", {}) or {}
    kind = cfg.get("image_model")
    if kind != "flux":
        raise NotFluxError(f"FluxNumbaLoader: unet_name {name}: not a FLUX.1 diffusion model: ComfyUI detected "
                           f"{kind or type(base).__name__}")


NODE_ID = "FluxNumbaLoader"
DISPLAY_NAME = "FLUX Numba Loader (FLUX.1 diffusion model)"


def load(unet_name, weight_dtype="default"):
    """What the node does: ``(model,)`` loaded by ComfyUI after the header check."""
    model_options = weight_dtype_options(weight_dtype)
    if not isinstance(unet_name, str) or not unet_name:
        raise ValueError(f"{NODE_ID}: unet_name must be a file name from models/diffusion_models, got {unet_name!r}")
    from .host import ui
    path = ui.model_path(unet_name, "diffusion_models")
    if path is None:
        raise FileNotFoundError(f"{NODE_ID}: unet_name {unet_name!r} is not in models/diffusion_models "
                                f"(folders: {ui.model_folders('diffusion_models')})")
    cfg = check_flux_file(path)
    if cfg is not None:
        log.info("[flux_numba] %s: FLUX.1, hidden %d, %d double + %d single blocks, guidance %s",
                 unet_name, cfg.hidden_size, cfg.depth, cfg.depth_single_blocks, cfg.guidance_embed)
    model = ui.load_diffusion_model(path, model_options)
    check_loaded_model(model, unet_name)
    return (model,)


@functools.lru_cache(maxsize=None)
def node_class():
    """The V3 node class, defined on first use (it needs ComfyUI's ``comfy_api``)."""
    io = api.io()

    class FluxNumbaLoader(io.ComfyNode):
        @classmethod
        def define_schema(cls):
            from .host import ui
            try:
                names = ui.model_names("diffusion_models")
            except Exception:
                names = []
            return io.Schema(
                node_id=NODE_ID, display_name=DISPLAY_NAME, category="FluxNumba",
                description="Loads a FLUX.1 diffusion model (like Load Diffusion Model / UNETLoader) after checking "
                            "from the file header alone that it is FLUX.1; other files are refused with a clear message.",
                inputs=[io.Combo.Input("unet_name", options=names, tooltip="A FLUX.1 diffusion model in "
                                       "models/diffusion_models (e.g. flux1-dev.safetensors)."),
                        io.Combo.Input("weight_dtype", options=WEIGHT_DTYPES, default="default",
                                       tooltip="Storage dtype of the weights, as in Load Diffusion Model "
                                               "(fp8_e4m3fn_fast also uses fp8 matmuls where supported).")],
                outputs=[io.Model.Output(display_name="model", tooltip="The FLUX.1 diffusion model.")])

        @classmethod
        def execute(cls, unet_name, weight_dtype="default"):
            return io.NodeOutput(*load(unet_name, weight_dtype))

    return FluxNumbaLoader
