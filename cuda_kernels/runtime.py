"""Numba-CUDA runtime glue: availability, torch <-> numba arrays, torch's stream.

Kernels never see torch tensors directly.  ``arr(t)`` gives the numba view:
  * on a CUDA device: ``cuda.as_cuda_array`` on the tensor (bf16/fp16 tensors are passed as
    an int16 bit view so that no dtype conversion or ml_dtypes round trip happens);
  * in the simulator (``NUMBA_ENABLE_CUDASIM=1``, CPU tensors): a numpy view of the same
    memory, so kernels write straight into the torch tensor.
Launches go on torch's current stream (``stream()``), which keeps them ordered with torch
ops and makes them capturable in a CUDA graph.
"""
from __future__ import annotations

import functools
import os
from typing import Optional

import torch

SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1"

_HALF = (torch.bfloat16, torch.float16)


@functools.lru_cache(maxsize=None)
def numba_status() -> Optional[str]:
    """None when numba-cuda can run kernels here, else the reason it cannot."""
    try:
        from numba import cuda  # noqa: F401
    except Exception as e:  # pragma: no cover - depends on the install
        return f"numba-cuda not importable ({type(e).__name__}: {e})"
    if SIMULATOR:
        return None
    try:
        if not cuda.is_available():
            return "numba-cuda finds no CUDA driver/GPU"
    except Exception as e:  # pragma: no cover
        return f"numba-cuda failed to initialise CUDA ({e})"
    return None


def device_ok(*tensors) -> Optional[str]:
    """Common check: numba usable and every tensor on a device numba can address."""
    why = numba_status()
    if why:
        return why
    for t in tensors:
        if t is None:
            continue
        if SIMULATOR:
            if t.device.type != "cpu":
                return "the CUDA simulator runs on CPU tensors only"
        elif t.device.type != "cuda":
            return f"tensor on {t.device.type}, numba kernels need CUDA tensors"
    return None


def arr(t: torch.Tensor):
    """Numba view of a tensor (bit view for 16-bit floats)."""
    if t.dtype in _HALF:
        t = t.view(torch.int16)
    if SIMULATOR:
        return t.detach().numpy()
    from numba import cuda
    return cuda.as_cuda_array(t.detach(), sync=False)


def tensor_version(t):
    """``t._version``, or None for inference-mode tensors (ComfyUI runs nodes, and loads models,
    under ``torch.inference_mode()``: such tensors have no version counter)."""
    if t.is_inference():  # asking ``_version`` there raises, and building that error costs ~40 us
        return None
    try:
        return t._version
    except Exception:
        return None


_streams = {}


def stream_scratch(cache: dict, key: tuple, make):
    """``make()``'s scratch buffers, cached in ``cache`` per ``key`` and torch's current stream
    (launches on one stream are ordered, so the next call's reuse is safe); never cached while a
    CUDA graph is being captured (the graph keeps the buffers it was captured with); the cache is
    emptied once it holds more than 8 entries."""
    capturing = (not SIMULATOR) and torch.cuda.is_current_stream_capturing()
    key = key + (0 if SIMULATOR else _raw_stream(),)
    ent = None if capturing else cache.get(key)
    if ent is None:
        ent = make()
        if not capturing:
            if len(cache) > 8:
                cache.clear()
            cache[key] = ent
    return ent


def _raw_stream() -> int:
    """Handle of torch's current CUDA stream on the current device, without building a
    ``torch.cuda.Stream`` object per launch (the C getters, where this torch has them)."""
    try:
        return torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice())
    except (AttributeError, TypeError):
        return torch.cuda.current_stream().cuda_stream


def stream():
    """numba stream object wrapping torch's current CUDA stream (None in the simulator)."""
    if SIMULATOR:
        return 0
    from numba import cuda
    ptr = _raw_stream()
    s = _streams.get(ptr)
    if s is None:
        s = _streams[ptr] = cuda.external_stream(ptr)
    return s


@functools.lru_cache(maxsize=None)
def sm_count() -> int:
    if SIMULATOR or not torch.cuda.is_available():
        return 4
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def grid_for(n_items: int, per_block: int, waves: int = 8) -> int:
    """Blocks for a grid-stride loop: enough to fill the device, never more than the work."""
    need = max(1, -(-n_items // per_block))
    if SIMULATOR:
        return min(need, 2)
    return min(need, sm_count() * waves)
