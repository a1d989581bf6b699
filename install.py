"""ComfyUI-Manager runs this after requirements.txt: add the CUDA toolkit wheels numba-cuda needs.

numba-cuda compiles kernels with NVVM and links with nvJitLink; its extras ``[cu12]`` / ``[cu13]``
bring them as pip wheels (no system CUDA toolkit, no C compiler).  The right one follows the
CUDA major version of the installed PyTorch.  A CPU-only PyTorch gets nothing extra (the pack
then passes models through unpatched).
"""
import subprocess
import sys


def pip_command(torch_cuda_version):
    """The pip command for torch built against ``torch_cuda_version`` (e.g. "12.8"), or None with
    the reason."""
    if not torch_cuda_version:
        return None, "CPU-only torch; the Numba kernels will stay off"
    extra = {"12": "cu12", "13": "cu13"}.get(str(torch_cuda_version).split(".")[0])
    if extra is None:
        return None, f"torch built for CUDA {torch_cuda_version}: no numba-cuda toolkit extra for it; kernels may not compile"
    return [sys.executable, "-m", "pip", "install", f"numba-cuda[{extra}]>=0.30.4", "numpy<2.5"], None


def main():
    try:
        import torch
    except ImportError:
        print("[flux-numba] torch not importable; skipping CUDA toolkit wheels")
        return
    cmd, why = pip_command(getattr(torch.version, "cuda", None))
    if cmd is None:
        print("[flux-numba] " + why)
        return
    print("[flux-numba] " + " ".join(cmd))
    subprocess.call(cmd)


if __name__ == "__main__":
    main()
