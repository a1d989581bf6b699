"""Test setup: load the pack as ``flux_numba_pack``; use the Numba CUDA simulator when there is no GPU.

FLUX_NUMBA_REAL_GPU=1 runs the kernel tests on a real GPU instead of the simulator.
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _has_gpu():
    if os.environ.get("FLUX_NUMBA_REAL_GPU") == "1":
        return True
    return False


if not _has_gpu():
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
    # the simulator's block manager busy-polls its threads: a short switch interval makes it 5-10x faster
    sys.setswitchinterval(5e-5)

if os.environ.get("FLUX_TEST_MATH_SDPA") == "1":
    # bench/sanitize.sh synccheck: cuDNN's SDPA kernels trip synccheck's mbarrier check (a false
    # positive that poisons the context), so the torch references use the math backend
    import torch
    torch.backends.cuda.enable_cudnn_sdp(False)
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)

sys.path.insert(0, ROOT)
import _pack  # noqa: E402

_pack.load()


def pytest_terminal_summary(terminalreporter):
    """One line per ComfyUI tree that test_comfyui_matrix ran (its inner pytest summary and time)."""
    m = sys.modules.get("test_comfyui_matrix")
    for label, tree, summary, secs in getattr(m, "RESULTS", ()):
        terminalreporter.write_line(f"ComfyUI {label} ({tree}): {summary} [{secs:.0f} s]")
