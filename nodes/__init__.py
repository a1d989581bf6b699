"""The pack's ComfyUI nodes (V1 style): merged NODE_CLASS_MAPPINGS / NODE_DISPLAY_NAME_MAPPINGS.

Each node module is imported on its own: one that is missing or fails to import is logged (and
recorded in ``LOAD_ERRORS``) without taking the others down.  Node modules import ComfyUI lazily,
so this package imports without ComfyUI (schema tests).
"""
import importlib
import logging

log = logging.getLogger("flux_numba")

MODULES = ("loader", "patch", "timer", "report", "quality", "vae_patch")
REQUIRED = ("loader", "patch")


def _discover():
    """MODULES first, then any other module in this folder that defines node mappings."""
    import os
    here = os.path.dirname(os.path.abspath(__file__))
    extra = []
    for fn in sorted(os.listdir(here)):
        name, ext = os.path.splitext(fn)
        if ext != ".py" or name.startswith("_") or name in MODULES:
            continue
        try:
            with open(os.path.join(here, fn), encoding="utf-8") as f:
                if "NODE_CLASS_MAPPINGS" in f.read():
                    extra.append(name)
        except OSError:
            pass
    return list(MODULES) + extra


NODE_CLASS_MAPPINGS = {}
NODE_DISPLAY_NAME_MAPPINGS = {}
LOAD_ERRORS = {}  # module -> "ExcType: message"
_nodes_loaded = []

for _name in _discover():
    try:
        _mod = importlib.import_module(f"{__name__}.{_name}")
    except ModuleNotFoundError as _e:
        if _e.name == f"{__name__}.{_name}" and _name not in REQUIRED:
            log.info("[flux_numba] optional node module %s not present", _name)
            continue
        LOAD_ERRORS[_name] = f"{type(_e).__name__}: {_e}"
        log.exception("[flux_numba] node module %s failed to import", _name)
        continue
    except Exception as _e:  # one broken module must not break the pack
        LOAD_ERRORS[_name] = f"{type(_e).__name__}: {_e}"
        log.exception("[flux_numba] node module %s failed to import", _name)
        continue
    _dup = set(NODE_CLASS_MAPPINGS) & set(getattr(_mod, "NODE_CLASS_MAPPINGS", {}))
    if _dup:
        log.warning("[flux_numba] node module %s redefines %s", _name, sorted(_dup))
    NODE_CLASS_MAPPINGS.update(getattr(_mod, "NODE_CLASS_MAPPINGS", {}))
    NODE_DISPLAY_NAME_MAPPINGS.update(getattr(_mod, "NODE_DISPLAY_NAME_MAPPINGS", {}))
    _nodes_loaded.append(_name)

def _start_kernel_build():
    """Build the kernels the default graph runs in background processes from ComfyUI's start on
    (``cuda_kernels.prebuild``), on the CUDA device ComfyUI runs models on; nothing otherwise."""
    try:
        from .host import compute_device
        dev = compute_device()
        if dev is None or dev.type != "cuda":
            return
        from ..cuda_kernels import prebuild
        prebuild.start(dev)
    except Exception as e:  # the kernels then compile where they are first used
        log.info("[flux_numba] background kernel build not started (%s: %s)", type(e).__name__, e)


if "patch" in _nodes_loaded:
    _start_kernel_build()

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "LOAD_ERRORS"]
