"""The pack's ComfyUI nodes, V3 schema: ``comfy_entrypoint()`` hands ComfyUI a ``ComfyExtension``
listing the node classes (``node_classes()``: node id -> class, each module's ``node_class()``,
defined on first use since it needs ComfyUI's ``comfy_api``); ``NODE_DISPLAY_NAME_MAPPINGS``.

Each node module is imported on its own: one that is missing or fails to import (or whose class
fails to define) is logged and recorded in ``LOAD_ERRORS`` without taking the others down.
Outside ComfyUI the modules import and the work behind each node runs (tests, benches).
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
                if "def node_class(" in f.read():
                    extra.append(name)
        except OSError:
            pass
    return list(MODULES) + extra


NODE_DISPLAY_NAME_MAPPINGS = {}  # node id -> display name
NODE_MODULES = {}  # node id -> its module
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
    _id = getattr(_mod, "NODE_ID", None)
    if _id is None or not callable(getattr(_mod, "node_class", None)):
        LOAD_ERRORS[_name] = "no NODE_ID / node_class()"
        continue
    if _id in NODE_MODULES:
        log.warning("[flux_numba] node module %s redefines %s", _name, _id)
    NODE_MODULES[_id] = _mod
    NODE_DISPLAY_NAME_MAPPINGS[_id] = getattr(_mod, "DISPLAY_NAME", _id)
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


def node_classes() -> dict:
    """Node id -> V3 node class (needs ComfyUI's ``comfy_api``); a class that fails to define is
    logged and left out, the others stay."""
    out = {}
    for node_id, mod in NODE_MODULES.items():
        try:
            out[node_id] = mod.node_class()
        except Exception as e:
            LOAD_ERRORS[mod.__name__.rsplit(".", 1)[-1]] = f"{type(e).__name__}: {e}"
            log.exception("[flux_numba] node %s failed to define", node_id)
    return out


def comfy_entrypoint():
    """ComfyUI's V3 entry point: the extension that lists the pack's node classes."""
    from .host import api
    classes = list(node_classes().values())

    class FluxNumbaExtension(api.extension_base()):
        async def get_node_list(self):
            return classes

    return FluxNumbaExtension()


__all__ = ["NODE_DISPLAY_NAME_MAPPINGS", "NODE_MODULES", "LOAD_ERRORS", "node_classes", "comfy_entrypoint"]
