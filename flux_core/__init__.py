"""Functional FLUX core, usable without ComfyUI: checkpoints, blocks, model, sampler."""
from .checkpoint import (FluxConfig, FLUX1_DEV, CheckpointError, NotFluxError, inspect_checkpoint,  # noqa: F401
                         load_state_dict, save_state_dict, infer_config)
from .blocks import BlockContext, double_block, single_block  # noqa: F401
from .model import FluxModel  # noqa: F401
from .sampling import flux_schedule, euler_sample  # noqa: F401
from .tiny import TINY, COMFY_MIN, tiny_state_dict, comfy_min_state_dict, random_state_dict  # noqa: F401
