"""ComfyUI's node API, V3 (``comfy_api.latest``: ``io`` schemas, ``ComfyExtension``).

Imported when a node class is first defined (``<node module>.node_class()``, called by
``nodes.comfy_entrypoint`` when ComfyUI loads the pack), never at module import: outside ComfyUI
the node modules import and the work behind each node runs (tests, benches); only the classes need
ComfyUI."""
from __future__ import annotations


def io():
    """``comfy_api.latest.io`` (ImportError outside ComfyUI)."""
    from comfy_api.latest import io as _io
    return _io


def extension_base():
    """``comfy_api.latest.ComfyExtension``."""
    from comfy_api.latest import ComfyExtension
    return ComfyExtension


def unique_id(node_cls):
    """The node's id in the running prompt (V3's hidden ``unique_id``), or None."""
    hidden = getattr(node_cls, "hidden", None)
    return getattr(hidden, "unique_id", None) if hidden is not None else None
