#!/usr/bin/env python3
"""Install what the pack needs (ComfyUI-Manager runs this after requirements.txt).

Default (what ComfyUI-Manager does): add the CUDA toolkit wheels numba-cuda needs.  numba-cuda
compiles kernels with NVVM and links with nvJitLink; its extras ``[cu12]`` / ``[cu13]`` bring
them as pip wheels (no system CUDA toolkit, no C compiler).  The right one follows the CUDA
major version of the installed PyTorch; a CPU-only PyTorch gets nothing extra (the pack then
passes models through unpatched).  Nothing already installed is upgraded or downgraded.

``--standalone`` (the README's main-job and test commands, outside ComfyUI): also PyTorch when
none is importable (``torch==2.13.0``), then requirements.txt one line at a time, exactly as
ComfyUI-Manager installs it.  ``--tests`` adds pytest.  ``--dry-run`` prints the pip commands
and installs nothing.
"""
import argparse
import importlib.util
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.abspath(__file__))
TORCH_FOR_STANDALONE = "torch==2.13.0"  # only when no torch is importable (never replaces the user's)


def pip(*args):
    return [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", *args]


def pip_command(torch_cuda_version):
    """The pip command for torch built against ``torch_cuda_version`` (e.g. "12.8"), or None with
    the reason."""
    if not torch_cuda_version:
        return None, "CPU-only torch; the Numba kernels will stay off"
    extra = {"12": "cu12", "13": "cu13"}.get(str(torch_cuda_version).split(".")[0])
    if extra is None:
        return None, f"torch built for CUDA {torch_cuda_version}: no numba-cuda toolkit extra for it; kernels may not compile"
    return pip(f"numba-cuda[{extra}]>=0.30.4"), None


def requirement_lines(path=os.path.join(ROOT, "requirements.txt")):
    out = []
    with open(path) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                out.append(line)
    return out


def _torch_cuda():
    """(importable, torch.version.cuda) without importing torch in this process when absent."""
    if importlib.util.find_spec("torch") is None:
        return False, None
    r = subprocess.run([sys.executable, "-c", "import torch; print(torch.version.cuda or '')"],
                       capture_output=True, text=True)
    if r.returncode:
        return False, None
    return True, r.stdout.strip() or None


def plan(standalone=False, tests=False):
    """The pip commands to run, in order, and notes (list of str)."""
    cmds, notes = [], []
    have_torch, cuda_ver = _torch_cuda()
    if standalone:
        if not have_torch:
            cmds.append(pip(TORCH_FOR_STANDALONE))
            notes.append(f"no torch importable: installing {TORCH_FOR_STANDALONE}")
        for req in requirement_lines():
            cmds.append(pip(req))
        if tests and importlib.util.find_spec("pytest") is None:
            cmds.append(pip("pytest"))
    if have_torch:
        cmd, why = pip_command(cuda_ver)
        if cmd is None:
            notes.append(why)
        else:
            cmds.append(cmd)
    elif not standalone:
        notes.append("torch not importable; skipping CUDA toolkit wheels")
    return cmds, notes


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--standalone", action="store_true",
                   help="outside ComfyUI: install torch if none is importable, then requirements.txt")
    p.add_argument("--tests", action="store_true", help="with --standalone: also pytest")
    p.add_argument("--dry-run", action="store_true", help="print what would be installed; install nothing")
    a = p.parse_args(argv)
    cmds, notes = plan(standalone=a.standalone or a.tests, tests=a.tests)
    for n in notes:
        print("[flux-numba] " + n)
    if not cmds:
        print("[flux-numba] nothing to install")
        return 0
    for cmd in cmds:
        print("[flux-numba] " + ("would run: " if a.dry_run else "") + " ".join(cmd[2:]))
        if not a.dry_run:
            r = subprocess.call(cmd)
            if r:
                print(f"[flux-numba] pip failed (exit {r}): {' '.join(cmd[2:])}", file=sys.stderr)
                return r
    return 0


if __name__ == "__main__":
    sys.exit(main())
