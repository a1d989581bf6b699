"""Shared by test_kernels_fused and test_kernels_quant8: the fused ops forced to numba, the
comparison, the references, RoPE tables and tiny FLUX double / single blocks."""
import torch
import torch.nn as nn

from flux_numba_pack.cuda_kernels import registry
from _kernel_testing import DEV


FUSED_OPS = ("ln_modulate", "gated_residual", "gated_residual_ln_modulate", "qk_norm_rope", "gelu_tanh")


def numba():
    """Our ops forced to numba; every other op (attention, ...) on the torch reference."""
    return registry.force("torch", **{op: "numba" for op in FUSED_OPS})


def close(out, ref, tol=1.6e-2):
    assert out.shape == ref.shape
    assert not torch.isnan(out).any(), "unwritten (NaN) elements"
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


def ref_of(op):
    return registry.ops[op].reference


# ---------------------------------------------------------------------------------- qk_norm_rope
def rope_pe(Bp, L, D, theta=10000.0):
    pos = torch.arange(L, dtype=torch.float64)[None].expand(Bp, L) + torch.arange(Bp)[:, None] * 3
    om = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    a = pos[..., None] * om
    pe = torch.stack([torch.cos(a), -torch.sin(a), torch.sin(a), torch.cos(a)], -1)
    return pe.reshape(Bp, 1, L, D // 2, 2, 2).float().to(DEV)


# --------------------------------------------------------------------------------- block level
class _Mod(nn.Module):
    def __init__(self, h, mult):
        super().__init__()
        self.multiplier = mult
        self.lin = nn.Linear(h, mult * h)


class _QKNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.query_norm = nn.Module()
        self.query_norm.scale = nn.Parameter(1 + 0.1 * torch.randn(d))
        self.key_norm = nn.Module()
        self.key_norm.scale = nn.Parameter(1 + 0.1 * torch.randn(d))


class _Attn(nn.Module):
    def __init__(self, h, d):
        super().__init__()
        self.qkv = nn.Linear(h, 3 * h)
        self.norm = _QKNorm(d)
        self.proj = nn.Linear(h, h)


class TinyDouble(nn.Module):
    def __init__(self, h=64, heads=2, mlp=128):
        super().__init__()
        self.num_heads = heads
        d = h // heads
        self.img_mod, self.txt_mod = _Mod(h, 6), _Mod(h, 6)
        self.img_attn, self.txt_attn = _Attn(h, d), _Attn(h, d)
        self.img_mlp = nn.Sequential(nn.Linear(h, mlp), nn.GELU(approximate="tanh"), nn.Linear(mlp, h))
        self.txt_mlp = nn.Sequential(nn.Linear(h, mlp), nn.GELU(approximate="tanh"), nn.Linear(mlp, h))


class TinySingle(nn.Module):
    def __init__(self, h=64, heads=2, mlp=128):
        super().__init__()
        self.num_heads, self.hidden_size, self.mlp_hidden_dim = heads, h, mlp
        self.modulation = _Mod(h, 3)
        self.linear1 = nn.Linear(h, 3 * h + mlp)
        self.linear2 = nn.Linear(h + mlp, h)
        self.norm = _QKNorm(h // heads)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()
