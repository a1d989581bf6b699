"""Shared pieces of the CLI, the benchmark and the step timer: device/dtype choice, timing,
agreement metrics, the kernel categories of a profile."""
from __future__ import annotations

import math
import statistics
import time
from typing import Callable, List

import torch


def pick_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    d = torch.device(name)
    if d.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda asked for, but torch sees no CUDA GPU")
    return d


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


class StepTimer:
    """Wall time of one step: CUDA events on a GPU, perf_counter (after the work) on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __enter__(self):
        if self.cuda:
            self.s, self.e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.s.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.e.record()
            self.e.synchronize()
            self.ms = self.s.elapsed_time(self.e)
        else:
            self.ms = (time.perf_counter() - self.t0) * 1e3


def step_times(fn: Callable, device: torch.device, warmup: int = 2, reps: int = 5) -> List[float]:
    """ms of each of ``reps`` calls after ``warmup`` calls (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        with StepTimer(device) as t:
            fn()
        out.append(t.ms)
    return out


def median_ms(fn: Callable, device, warmup: int = 2, reps: int = 5) -> float:
    """Median of ``step_times``."""
    return med(step_times(fn, torch.device(device), warmup, reps))


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """PSNR of b against a, peak = a's dynamic range (max - min)."""
    a, b = a.double(), b.double()
    mse = torch.mean((a - b) ** 2).item()
    rng = (a.max() - a.min()).item()
    if mse == 0:
        return float("inf")
    return 10 * math.log10(rng * rng / mse)


def rel_err(ref: torch.Tensor, x: torch.Tensor) -> float:
    ref, x = ref.double(), x.double()
    return ((x - ref).norm() / ref.norm()).item()


# ---------------------------------------------------------------------------------------------- profiles
KERNEL_CATEGORIES = ("attention", "gemm", "fused", "other")
_ATTN = ("attention", "flash", "fmha", "sdpa", "_efficient_attention", "cudnn_mha", "attn")
_GEMM = ("gemm", "matmul", "aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::_addmm",
         "cutlass", "nvjet", "xmma", "wgmma", "cublas", "gemv", "splitk", "sm90_", "sm80_", "ampere_", "hopper_")


def is_pack_kernel(name: str) -> bool:
    """A Numba kernel of this pack: mangled ``_ZN6cudapy...`` by older numba-cuda, demangled
    ``...cuda_kernels::<module>::...`` by newer (whatever the pack's folder is called)."""
    n = name.lower()
    return "cudapy" in n or "numba" in n or "cuda_kernels::" in n


def kernel_category(name: str, fused_names=()) -> str:
    """attention (torch's, cuDNN's or the pack's attention kernels) / gemm / fused (the pack's other
    kernels, or an op name in ``fused_names``) / other.  Attention is matched first: cuDNN's fused
    attention kernels carry GEMM-like names (``sm90_``, ``wgmma``)."""
    n = name.lower()
    if any(a in n for a in _ATTN):
        return "attention"
    if is_pack_kernel(n) or any(f in n for f in fused_names):
        return "fused"
    if any(g in n for g in _GEMM):
        return "gemm"
    return "other"
