"""Load this repo as the package ``flux_numba_pack`` without ComfyUI (CLI, benchmark, tests).

Inside ComfyUI the pack is imported by path as ``custom_nodes/<repo>``; outside it the repo folder
can have any name, so this registers a package object whose ``__path__`` is the repo root.  The
root ``__init__`` (ComfyUI's entry point) is not executed: subpackages are imported on demand.
"""
import importlib.util
import os
import sys
import types

ROOT = os.path.dirname(os.path.abspath(__file__))
NAME = "flux_numba_pack"  # not "...numba": numba-cuda's redirector recurses on names containing "numba.cuda"


def numpy_compat():
    """Run ``cuda_kernels/_numpy_compat.py`` (numpy 2.5's missing ``row_stack``, see there) on its
    own, without importing the kernels package: a script or test may import numba-cuda right
    after ``load()``, before anything from ``cuda_kernels``."""
    path = os.path.join(ROOT, "cuda_kernels", "_numpy_compat.py")
    spec = importlib.util.spec_from_file_location("_flux_numba_numpy_compat", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.APPLIED


def load(name: str = NAME):
    numpy_compat()
    mod = sys.modules.get(name)
    if mod is None:
        mod = types.ModuleType(name)
        mod.__path__ = [ROOT]
        mod.__file__ = os.path.join(ROOT, "__init__.py")
        mod.__package__ = name
        sys.modules[name] = mod
    return mod


# ---------------------------------------------------------------------------- CLI argument checks
def nearest_existing(path):
    """The path itself or its nearest ancestor that exists."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def create_problem(folder):
    """Why no file can be created in the existing ``folder`` (one phrase), or None.  Tried, not only
    asked: os.access says yes to root on read-only and virtual file systems (/proc), so a temporary
    file is made there and removed at once."""
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"{folder} is not writable"
    import tempfile
    try:
        fd, tmp = tempfile.mkstemp(prefix=".flux_numba_write_check_", dir=folder)
    except OSError as e:
        return f"no file can be created in {folder}: {e.strerror or e}"
    os.close(fd)
    os.unlink(tmp)
    return None


def folder_out_problem(path):
    """Why ``path`` (a folder a command makes or writes into later) cannot be, or None; leaves
    nothing behind."""
    if not path:
        return "empty path"
    if os.path.exists(path) and not os.path.isdir(path):
        return f"{path} exists and is not a folder"
    base = nearest_existing(path)
    if not os.path.isdir(base):
        return f"cannot create folder {path} ({base} is not a folder)"
    why = create_problem(base)
    if why:
        return f"{'cannot write into folder' if base == os.path.abspath(path) else 'cannot create folder'} {path} ({why})"
    return None


def file_out_problem(path, example="out.json"):
    """Why ``path`` (a file a command writes later) cannot be written, or None; leaves nothing
    behind (run.py and bench.py check their output paths before any work)."""
    if not path:
        return "empty path"
    if os.path.isdir(path):
        return f"{path} is a folder; give a file name, e.g. {os.path.join(path, example)}"
    base = nearest_existing(os.path.dirname(os.path.abspath(path)))
    if not os.path.isdir(base):
        return f"cannot write {path} ({base} is not a folder)"
    why = create_problem(base)
    if why:
        return f"cannot write {path} ({why})"
    if os.path.exists(path) and not os.access(path, os.W_OK):
        return f"cannot write {path} (permission denied)"
    return None
