"""The per-call input check of a FLUX block call: what the fused path needs of ComfyUI's block
arguments (shapes, dtypes, batch of vec, RoPE table); anything else runs ComfyUI's original block."""
from __future__ import annotations

from typing import Optional

import torch


def input_problem(kind, blk, args) -> Optional[str]:
    C = blk.hidden_size
    img, vec = args.get("img"), args.get("vec")
    streams = [("img", img)] + ([("txt", args.get("txt"))] if kind == "double" else [])
    for name, t in streams:
        if not isinstance(t, torch.Tensor) or t.ndim != 3 or t.shape[-1] != C:
            return f"{name} is {desc(t)}, expected [B, L, {C}]"
        if not t.is_floating_point():
            return f"{name} has dtype {t.dtype}"
    if not isinstance(vec, torch.Tensor) or vec.ndim not in (2, 3) or vec.shape[-1] != C:
        return f"vec is {desc(vec)}, expected [B, {C}]"
    if vec.shape[0] not in (1, img.shape[0]):
        return f"vec batch {vec.shape[0]} vs img batch {img.shape[0]}"
    pe = args.get("pe")
    if pe is not None:
        L = img.shape[1] + (args["txt"].shape[1] if kind == "double" else 0)
        D = C // blk.num_heads
        if not isinstance(pe, torch.Tensor) or pe.ndim != 6 or pe.shape[2] != L or pe.shape[3] != D // 2:
            return f"pe is {desc(pe)}, expected [B, 1, {L}, {D // 2}, 2, 2]"
    return None


def desc(t):
    if hasattr(t, "shape"):
        return f"{tuple(t.shape)} {getattr(t, 'dtype', '')}"
    return type(t).__name__
