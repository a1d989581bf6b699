"""ComfyUI-Manager runs this after requirements.txt: add the CUDA toolkit wheels numba-cuda needs.

numba-cuda compiles kernels with NVVM and links with nvJitLink; its extras ``[cu12]`` / ``[cu13]``
bring them as pip wheels (no system CUDA toolkit, no C compiler).  The right one follows the
CUDA major version of the installed PyTorch.  A CPU-only PyTorch gets nothing extra (the pack
then passes models through unpatched).
"""
import subprocess
import sys


def main():
    try:
        import torch
    except ImportError:
        print("[flux-numba] torch not importable; skipping CUDA toolkit wheels")
        return
    cuda = getattr(torch.version, "cuda", None)
    if not cuda:
        print("[flux-numba] CPU-only torch; the Numba kernels will stay off")
        return
    major = cuda.split(".")[0]
    extra = {"12": "cu12", "13": "cu13"}.get(major)
    if extra is None:
        print(f"[flux-numba] torch built for CUDA {cuda}: no numba-cuda toolkit extra for it; kernels may not compile")
        return
    cmd = [sys.executable, "-m", "pip", "install", f"numba-cuda[{extra}]>=0.30.4", "numpy<2.5"]
    print("[flux-numba] " + " ".join(cmd))
    subprocess.call(cmd)


if __name__ == "__main__":
    main()
