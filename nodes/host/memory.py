"""Device memory as ComfyUI budgets it.

ComfyUI keeps ``--reserve-vram`` (``comfy.model_management.extra_reserved_memory()``) free for other
programs and plans its loads inside the rest; memory the pack keeps for itself (the fast-cached
profile's fp8 weight copies) is weighed against the same view, so a user who reserves memory for
another program gets it, and a card that ComfyUI treats as small is treated as small by the pack too.
"""
from __future__ import annotations

from typing import Tuple

import torch


def reserved_memory() -> int:
    """Bytes ComfyUI keeps free for other programs (0 where this ComfyUI has no such setting)."""
    try:
        import comfy.model_management as mm
        return max(int(mm.extra_reserved_memory()), 0)
    except Exception:
        return 0


def device_room(device) -> Tuple[int, int]:
    """(free, total) bytes of ``device`` inside ComfyUI's budget: the driver's numbers less the memory
    ComfyUI reserves for other programs.  Raises where the driver cannot say."""
    free, total = torch.cuda.mem_get_info(device)
    r = reserved_memory()
    return max(int(free) - r, 0), max(int(total) - r, 1)
