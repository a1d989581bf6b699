"""Load this repo as the package ``flux_numba_pack`` without ComfyUI (CLI, benchmark, tests).

Inside ComfyUI the pack is imported by path as ``custom_nodes/<repo>``; outside it the repo folder
can have any name, so this registers a package object whose ``__path__`` is the repo root.  The
root ``__init__`` (ComfyUI's entry point) is not executed: subpackages are imported on demand.
"""
import os
import sys
import types

ROOT = os.path.dirname(os.path.abspath(__file__))
NAME = "flux_numba_pack"  # not "...numba": numba-cuda's redirector recurses on names containing "numba.cuda"


def load(name: str = NAME):
    mod = sys.modules.get(name)
    if mod is None:
        mod = types.ModuleType(name)
        mod.__path__ = [ROOT]
        mod.__file__ = os.path.join(ROOT, "__init__.py")
        mod.__package__ = name
        sys.modules[name] = mod
    return mod
