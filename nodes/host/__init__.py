"""The ComfyUI host adapter: the only place in the pack that names ComfyUI internals.

  * ``flux``: ComfyUI's FLUX modules and ops -- the blocks, their weights through ComfyUI's casts
    (DynamicVRAM staging, low-VRAM offload, fp8 storage, LoRA weight functions), attention choices,
    what a call carries that the fused path does not run;
  * ``residency``: DynamicVRAM staging per block, residency of a block's weights for per-block CUDA
    graphs, when a capture is safe;
  * ``memory``: device memory as ComfyUI budgets it (``--reserve-vram`` is not room);
  * ``vae``: ComfyUI's VAE decoder classes and the signatures it calls them with;
  * ``wrappers``: model-patcher wrappers and callbacks, the sampler's arguments;
  * ``ui``: the server (frontend messages, progress), model files and loading;
  * ``versions``: which ComfyUI this is and what it has, logged once.

Node modules import what they need from here (``from .host import X``).
"""
from .flux import (ATTENTION_OVERRIDE, PATCHES_IN_BLOCKS, ComfyWeights, attention_override,  # noqa: F401
                   block_attention, block_problem, call_problem, compiler_recording, compute_device,
                   default_sdpa_attention, flux_attention, flux_types, fp8_stored_block, op_weights, resolve_block,
                   stock_rope)
from .residency import (block_residency, capture_headroom, dynamic_block, graph_state, release_pins,  # noqa: F401
                        staged_block, streamed_weights, weight_epoch)
from .versions import TESTED, comfy_version, features, log_once  # noqa: F401
from .wrappers import (conds_to_device, drop_on_unload, guider_device, guider_transformer_options,  # noqa: F401
                       inner_wrappers, install_conds_on_device, install_diffusion_wrapper, install_sampling_wrappers,
                       run_innermost, sampler_sigmas, wrapped_object)
from .memory import device_room, reserved_memory  # noqa: F401
from . import ui, vae  # noqa: F401
