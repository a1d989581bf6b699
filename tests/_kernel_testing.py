"""Shared by the kernel-vs-reference test modules (test_kernels_fused, test_fp8_kernels): the test
device (the simulator on CPU; the GPU with FLUX_NUMBA_REAL_GPU=1), bf16 random tensors on it, and
an autouse fixture (import it into the module) that NaN-poisons ``torch.empty`` -- an output
element a kernel forgot to write fails the comparison -- and sets ``registry.strict`` (a forced
backend that cannot run raises instead of falling back)."""
import os

import pytest
import torch

from flux_numba_pack.cuda_kernels import registry

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
