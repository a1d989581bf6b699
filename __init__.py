"""ComfyUI entry point of the FLUX Numba pack (custom_nodes/<this folder>/__init__.py): V3 nodes
through ``comfy_entrypoint``, the web extension through ``WEB_DIRECTORY``.

numba-cuda's import redirector intercepts every module whose dotted name contains "numba.cuda"
and recurses forever.  ComfyUI imports this file under a name derived from the folder (the full
path with "." -> "_x_"), so a clone folder ending in "numba" (e.g. ``comfyui-flux-numba``) would
make ``<name>.cuda_kernels`` such a name.  In that case the pack root is registered under a safe
alias package and everything below it is imported through the alias.
"""
import hashlib
import importlib
import os
import sys
import types

ROOT = os.path.dirname(os.path.abspath(__file__))
WEB_DIRECTORY = "./web"
ALIAS = "flux_numba_pack"


def _unsafe(name: str) -> bool:
    """True when subpackages cannot be imported under ``name``: the redirector trap above, or this
    file loaded as a plain module rather than a package (pytest does that to a repo root with an
    __init__.py whose folder name is not an identifier, e.g. a CI clone called ``ci-check``)."""
    return "numba.cuda" in name + ".cuda_kernels" or globals().get("__path__") is None


def _package_name(name: str) -> str:
    """The package name subpackages are imported under: ``name`` itself when safe, else an alias."""
    if not _unsafe(name):
        return name
    alias = ALIAS
    mod = sys.modules.get(alias)
    if mod is not None and [os.path.abspath(p) for p in getattr(mod, "__path__", [])] != [ROOT]:
        alias = f"{ALIAS}_{hashlib.sha1(ROOT.encode()).hexdigest()[:10]}"
        mod = sys.modules.get(alias)
    if mod is None:
        mod = types.ModuleType(alias)
        mod.__path__ = [ROOT]
        mod.__file__ = os.path.join(ROOT, "__init__.py")
        mod.__package__ = alias
        mod.ROOT = ROOT
        sys.modules[alias] = mod
    return alias


PACKAGE = _package_name(__name__)
_nodes = importlib.import_module(PACKAGE + ".nodes")

# V3 nodes: ComfyUI calls comfy_entrypoint() (no NODE_CLASS_MAPPINGS here, which it would take first);
# the pack's nodes by id: ``nodes.node_classes()``
comfy_entrypoint = _nodes.comfy_entrypoint

__all__ = ["comfy_entrypoint", "WEB_DIRECTORY"]
