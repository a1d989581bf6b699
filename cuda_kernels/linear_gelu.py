"""Linear + GELU(tanh), optionally written into a row-strided slice of a larger buffer.

``linear_gelu(x, weight, bias, out=None)``: x [..., K], weight [N, K], bias [N] -> GELU_tanh(x W^T + b).
Used for the double blocks' MLP up-projection.  (Measured on the H200: writing the epilogue's
output into a row-strided slice -- the single block's linear2 buffer -- makes cuBLAS go through a
copy, slower than Linear then GELU; so the single block keeps one
linear1 GEMM and the Numba GELU kernel that writes into the buffer.)
The ``cublaslt`` backend folds the GELU (and bias) into the GEMM's epilogue
(``torch._addmm_activation``), so the activation never makes its own pass over memory: at
FLUX 1024² that pass is 19 x 2 x 4096x12288 + 38 x 4608x12288 bf16 read+written = ~13 GB per
step, ~3.5 ms at 3.7 TB/s.  The epilogue computes GELU on the fp32 accumulator before rounding
(one bf16 rounding instead of two).  Once per device a probe checks the epilogue is at least as
accurate as stock against the fp32 tanh-GELU; if not, the backend declines with the reason.
"""
import functools

import torch
import torch.nn.functional as F

from .registry import registry

OP = "linear_gelu"


def reference(x, weight, bias, out=None):
    y = F.gelu(F.linear(x, weight, bias), approximate="tanh")
    if out is None:
        return y
    out.copy_(y)
    return out


def cublaslt(x, weight, bias, out=None):
    x2 = x.reshape(-1, x.shape[-1])
    if out is None:
        y = torch._addmm_activation(bias, x2, weight.t(), use_gelu=True)
        return y.view(*x.shape[:-1], weight.shape[0])
    o2 = out.view(-1, out.shape[-1]) if out.is_contiguous() else out.flatten(0, -2)
    torch._addmm_activation(bias, x2, weight.t(), use_gelu=True, out=o2)
    return out


@functools.lru_cache(maxsize=None)
def _epilogue_is_tanh(device_index: int, dtype: torch.dtype):
    """The epilogue must be at least as close to fp32 GELU_tanh(xW^T+b) as the stock sequence.

    (In 16-bit outputs the tanh and erf forms differ by less than one rounding step, so the test
    is the error against the fp32 tanh function, compared with stock Linear-then-GELU's error.)"""
    g = torch.Generator(device="cpu").manual_seed(0)
    dev = torch.device("cuda", device_index)
    x = torch.randn(512, 256, generator=g).to(dev, dtype)
    w = (0.0625 * torch.randn(384, 256, generator=g)).to(dev, dtype)
    b = (0.5 * torch.randn(384, generator=g)).to(dev, dtype)
    ref = F.gelu(F.linear(x.float(), w.float(), b.float()), approximate="tanh")
    e_ours = ((cublaslt(x, w, b).float() - ref).norm() / ref.norm()).item()
    e_stock = ((F.gelu(F.linear(x, w, b), approximate="tanh").float() - ref).norm() / ref.norm()).item()
    return e_ours <= 1.1 * e_stock, f"rel. error vs fp32 tanh-GELU: epilogue {e_ours:.3g}, stock {e_stock:.3g}"


def check(x, weight, bias, out=None):
    if not x.is_cuda:
        return "cuBLASLt epilogue needs CUDA tensors"
    if bias is None:
        return "no bias"
    if x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != x.dtype or bias.dtype != x.dtype:
        return f"dtypes x {x.dtype} w {weight.dtype} b {bias.dtype}: need one 16-bit float dtype"
    if weight.device != x.device or bias.device != x.device:
        return "weights on another device"
    if out is not None and out.stride(-1) != 1:
        return "out must have unit stride on its last dim"
    ok, why = _epilogue_is_tanh(x.device.index or 0, x.dtype)
    return None if ok else f"GELU epilogue less accurate than stock ({why})"


registry.register(OP, reference, doc=__doc__)
registry.register_backend(OP, "cublaslt", cublaslt, check=check, priority=10)
