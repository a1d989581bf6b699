"""Stock stays stock: the pack's cuDNN-first attention leaves torch's process-wide SDPA backend order
exactly as torch itself would have it.

torch settles its default order lazily, at the first attention dispatch (cuDNN first on Hopper /
Blackwell with a recent cuDNN); ``sdpa_kernel(set_priority=True)`` saves the order on entry and
restores it on exit.  Emulated here on the CPU as torch's C++ does it (``Torch``): used before that
first dispatch, the save / restore made the generic flash-first list the process's order for good
(ComfyUI v0.8.0 stock then ran torch's flash kernel, ~11% slower per image, in a server whose first
prompt was a patched one); ``settle_default_order`` makes the pack's first use settle it first."""
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from flux_numba_pack.cuda_kernels import attention as attn

GENERIC = [int(SDPBackend.FLASH_ATTENTION), int(SDPBackend.EFFICIENT_ATTENTION), int(SDPBackend.MATH),
           int(SDPBackend.CUDNN_ATTENTION), int(SDPBackend.OVERRIDEABLE)]
HOPPER = [int(SDPBackend.CUDNN_ATTENTION), int(SDPBackend.FLASH_ATTENTION), int(SDPBackend.EFFICIENT_ATTENTION),
          int(SDPBackend.MATH), int(SDPBackend.OVERRIDEABLE)]


class Torch:
    """``Context::sDPPriorityOrder`` and ``priority_order()``'s one-time default (sdp_utils.cpp)."""

    def __init__(self, monkeypatch):
        self.order, self.init, self.used = list(GENERIC), False, []
        real = F.scaled_dot_product_attention

        def sdpa(q, k, v, *a, **kw):
            if not self.init:  # priority_order(): the device's default, once per process
                self.init = True
                self.order = list(HOPPER)
            self.used.append(self.order[0])
            return real(q, k, v, *a, **kw)
        monkeypatch.setattr(torch._C, "_get_sdp_priority_order", lambda: list(self.order))
        monkeypatch.setattr(torch._C, "_set_sdp_priority_order", lambda o: setattr(self, "order", list(o)))
        monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
        monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: True)
        monkeypatch.setattr(attn, "_ORDER_SET", set())


def _qkv():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, 2, 16, 32, generator=g) for _ in range(3)]


@pytest.mark.skipif(attn._PRIORITY is None, reason="this torch cannot set an SDPA backend order")
def test_pack_first_leaves_stock_on_torchs_default_order(monkeypatch):
    t = Torch(monkeypatch)
    q, k, v = _qkv()
    out = attn.cudnn_attention(q, k, v)                      # the pack's attention is the process's first
    assert torch.allclose(out, attn.reference(q, k, v), atol=1e-6)
    assert t.used[-1] == int(SDPBackend.CUDNN_ATTENTION)
    F.scaled_dot_product_attention(q, k, v)                   # a later stock attention
    assert t.order == HOPPER and t.used[-1] == int(SDPBackend.CUDNN_ATTENTION)


@pytest.mark.skipif(attn._PRIORITY is None, reason="this torch cannot set an SDPA backend order")
def test_without_settling_the_generic_order_sticks(monkeypatch):
    """The defect the settling prevents, reproduced with the same emulation."""
    t = Torch(monkeypatch)
    monkeypatch.setattr(attn, "settle_default_order", lambda device: None)
    q, k, v = _qkv()
    attn.cudnn_attention(q, k, v)
    F.scaled_dot_product_attention(q, k, v)
    assert t.order == GENERIC and t.used[-1] == int(SDPBackend.FLASH_ATTENTION)
