"""Shared by the attention tests (test_attention*.py): the test device, the fp32 reference, error
measure, a strict numba call, masks, random q/k/v (with outlier channels) and the d32 wgmma skip."""
import math

import pytest
import torch

from flux_numba_pack.cuda_kernels import registry
from flux_numba_pack.cuda_kernels import runtime
from flux_numba_pack.cuda_kernels import attention as A


DEV = "cpu" if runtime.SIMULATOR else "cuda"


def ref32(q, k, v, mask=None):
    B, H, L, D = q.shape
    s = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(D)
    if mask is not None:
        m = A.normalize_mask(mask)
        s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m.float()
    o = torch.softmax(s, -1) @ v.float()
    return o.transpose(1, 2).reshape(B, L, H * D)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def run_numba(backend, *args, **kw):
    registry.strict = True
    try:
        with registry.force(backend, ops=["attention"]):
            return registry.call("attention", *args, **kw)
    finally:
        registry.strict = False


def bool_mask(L, seed, col):
    """Random [L, L] bool mask (True = attend, ~70%) with column ``col`` always on: no fully
    masked row, on the test device."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(L, L, generator=g) > 0.3
    mask[:, col] = True
    return mask.to(DEV)


def make(B, H, L, D, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, L, D, generator=g) * s for s in (scale, scale, 1.0))
    return [x.to(torch.bfloat16).to(DEV) for x in (q, k, v)]


def outlier_channels(xs, n=4, f=30.0, seed=0):
    """``xs`` with the same ``n`` random channels scaled by ``f`` (the fp8 GEMM test's stress: a few
    channels 30x), bf16."""
    g = torch.Generator().manual_seed(seed)
    ch = torch.randperm(xs[0].shape[-1], generator=g)[:n].to(xs[0].device)
    out = []
    for x in xs:
        x = x.float().clone()
        x[..., ch] *= f
        out.append(x.to(torch.bfloat16))
    return out


def _wgmma_at_d32():
    """The D = 32 wgmma tests run the kernels' code in the simulator; on a GPU the wgmma kernels
    run at head dim 128 only (a forced wgmma config at D = 32 is refused) -- the *_d128 tests."""
    if not runtime.SIMULATOR:
        pytest.skip("simulator test (head dim 32); on the GPU the wgmma kernels run at head dim 128 "
                    "(test_attention_numba_default_hopper_d128 and the 8-bit d128 tests)")
