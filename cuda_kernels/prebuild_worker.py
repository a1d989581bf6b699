"""Worker process of the background kernel build (``prebuild``): ``python prebuild_worker.py FOLDER
OFFSET``.

Reads FOLDER/plan.json (the parent's package name and pack root, the GPU's compute capability, the
jobs: factory module, qualname, plain arguments, numba signature), imports the pack's
``cuda_kernels`` under the parent's package name, and builds the jobs not yet claimed by another
worker (an ``O_EXCL`` claim file each), starting at OFFSET.  Each result is numba's own cache
payload of the kernel (PTX and cubin for that compute capability), written atomically to
FOLDER/<job>.bin (a failure: FOLDER/<job>.err), one JSON line per job on stdout.  The process
never creates a CUDA context: the parent starts it with ``CUDA_VISIBLE_DEVICES`` empty, and the
two places numba-cuda 0.30 asks the current device (its compute capability) are answered from the
plan.  Standard library only until the package is set up; exits when its parent is gone.
"""
import json
import os
import sys
import time


def sig_spec(sig):
    out = []
    for t in sig:
        if hasattr(t, "ndim") and hasattr(t, "dtype"):
            out.append(["A", str(t.dtype), int(t.ndim)])
        else:
            out.append([str(t)])
    return out


def _sig_from_spec(spec):
    from numba.core import types as nt
    return tuple(nt.Array(getattr(nt, s[1]), s[2], "A") if s[0] == "A" else getattr(nt, s[0]) for s in spec)


def full_cc(cc):
    """numba-cuda's code-library key for a compute capability: (major, minor, 'a' from sm_90 on)."""
    return (int(cc[0]), int(cc[1]), "a" if tuple(cc[:2]) >= (9, 0) else "")


def _setup_package(package: str, root: str):
    """Make ``package`` (the pack root's package name in the parent process) importable here."""
    import types
    if not package:
        sys.path.insert(0, root)
        return
    if package not in sys.modules:
        mod = types.ModuleType(package)
        mod.__path__ = [root]
        mod.__file__ = os.path.join(root, "__init__.py")
        mod.__package__ = package
        sys.modules[package] = mod


def _numba_without_gpu(cc):
    """Let numba-cuda compile for ``cc`` in a process that has no CUDA context (numba-cuda 0.30's
    dispatcher and code library ask the current device only for its compute capability)."""
    from numba.cuda import codegen as cg
    from numba.cuda import dispatcher as dp

    class _Device:
        compute_capability = tuple(cc)
        id = 0

    dp.get_current_device = lambda: _Device
    key = full_cc(cc)
    cg.CUDACodeLibrary._ensure_cc = lambda self, c: c if c is not None else key


def _build_one(job, cc):
    """Compile one job; returns the pickled cache payload (numba's own ``reduce`` of the kernel)."""
    import importlib

    from numba.cuda import dispatcher as dp
    from numba.cuda.serialize import dumps
    module, qualname, args, spec = job
    fac = importlib.import_module(module)
    for part in qualname.split("."):
        fac = getattr(fac, part)
    disp = fac(*args)
    sig = _sig_from_spec(spec)
    kernel = dp._Kernel(disp.py_func, sig, **disp.targetoptions)
    if getattr(kernel, "launch_config_sensitive", False):
        raise RuntimeError("launch-config-sensitive kernel: built where it is used")
    kernel._codelibrary.get_cubin(cc=full_cc(cc))
    return dumps(disp._cache._impl.reduce(kernel))


def worker_main(folder: str, first: int = 0) -> int:
    """Build the jobs of FOLDER/plan.json that no other worker claimed, starting at ``first``."""
    with open(os.path.join(folder, "plan.json")) as f:
        plan_ = json.load(f)
    try:
        os.nice(plan_.get("nice", 10))
    except (AttributeError, OSError):
        pass
    parent = os.getppid()
    _setup_package(plan_["package"], plan_["root"])
    import numpy as np
    if not hasattr(np, "row_stack"):  # numpy 2.5 (see cuda_kernels/_numpy_compat.py)
        np.row_stack = np.vstack
    _numba_without_gpu(plan_["cc"])
    jobs = plan_["jobs"]
    for n in range(len(jobs)):
        i = (first + n) % len(jobs)
        if os.name == "posix" and os.getppid() != parent:
            return 1  # the process that asked for the build is gone
        try:
            os.close(os.open(os.path.join(folder, f"{i}.claim"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            continue
        t0 = time.perf_counter()
        try:
            data = _build_one(jobs[i], plan_["cc"])
            tmp = os.path.join(folder, f"{i}.tmp")
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, os.path.join(folder, f"{i}.bin"))
            rec = {"job": i, "s": round(time.perf_counter() - t0, 3)}
        except Exception as e:  # reported; the parent compiles this one where it is used
            rec = {"job": i, "error": f"{type(e).__name__}: {e}"[:400]}
            with open(os.path.join(folder, f"{i}.err"), "w") as f:
                f.write(rec["error"])
        print(json.dumps(rec), flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[2].isdigit():
        sys.exit(worker_main(sys.argv[1], int(sys.argv[2])))
    print("usage: prebuild_worker.py FOLDER OFFSET (started by cuda_kernels.prebuild, not by hand)", file=sys.stderr)
    sys.exit(2)
