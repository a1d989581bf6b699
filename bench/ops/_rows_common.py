"""Pieces shared by the row-kernel GPU scripts (gpu_fused.py, gpu_fp8.py): NaN-poisoned
``torch.empty`` (an output a kernel forgot to write shows up), a strict forced-backend call, and
seeded-by-torch bf16 random tensors on the script's device."""
import torch

from flux_numba_pack.cuda_kernels import registry


class Poison:
    """torch.empty returns NaN-filled tensors inside the block (catches unwritten outputs; an
    unwritten fp8 byte reads as NaN too)."""

    def __enter__(self):
        self.real = torch.empty

        def nan_empty(*a, **kw):
            t = self.real(*a, **kw)
            if t.is_floating_point():
                t.fill_(float("nan"))
            return t
        torch.empty = nan_empty

    def __exit__(self, *exc):
        torch.empty = self.real


def run(op, backend, *args, **kw):
    """``op`` on exactly ``backend`` (strict: an unavailable backend raises instead of falling back)."""
    registry.strict = True
    try:
        with registry.force(backend, ops=[op]):
            return registry.call(op, *args, **kw)
    finally:
        registry.strict = False


def make_rnd(device):
    def rnd(*shape, scale=1.0, offset=0.0):
        return (torch.randn(*shape, device=device) * scale + offset).to(torch.bfloat16)
    return rnd
