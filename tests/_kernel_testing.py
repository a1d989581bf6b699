"""Shared by the kernel-vs-reference test modules (test_kernels_fused, test_fp8_kernels): the test
device (the simulator on CPU; the GPU with FLUX_NUMBA_REAL_GPU=1), bf16 random tensors on it, and
an autouse fixture (import it into the module) that NaN-poisons ``torch.empty`` -- an output
element a kernel forgot to write fails the comparison -- and sets ``registry.strict`` (a forced
backend that cannot run raises instead of falling back)."""
import os

import pytest
import torch

from flux_numba_pack.cuda_kernels import registry
from flux_numba_pack.cuda_kernels.config import RowsConfig

DEV = "cuda" if os.environ.get("FLUX_NUMBA_REAL_GPU") == "1" else "cpu"
BF = torch.bfloat16


def rnd(*shape, scale=1.0, offset=0.0):
    return (torch.randn(*shape, device=DEV) * scale + offset).to(BF)


@pytest.fixture(autouse=True)
def strict_and_poison(monkeypatch):
    real_empty = torch.empty

    def nan_empty(*a, **kw):
        t = real_empty(*a, **kw)
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", nan_empty)
    old = registry.strict
    registry.strict = True
    try:
        yield
    finally:
        registry.strict = old


# the row kernel's variants, passed as ``config=``: pipelined 16-byte rows (the gated one too), one
# row per block with the modulation vectors read late / with x
ROW_VARIANTS = {"pipe": RowsConfig(pipe_blocks=8, pipe_blocks_gated=7, late=True, late_gated=True),
                "late": RowsConfig(pipe_blocks=0, pipe_blocks_gated=0, late=True, late_gated=True),
                "early": RowsConfig(pipe_blocks=0, pipe_blocks_gated=0, late=False, late_gated=False)}
