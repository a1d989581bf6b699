"""ComfyUI's server and file side: messages to the frontend, the node's progress bar and text,
model files (``folder_paths``) and ComfyUI's model loader."""
from __future__ import annotations

from typing import List, Optional


def send_event(event: str, data) -> bool:
    """``PromptServer.instance.send_sync(event, data, <the prompt's client>)``; False outside a running
    ComfyUI server."""
    try:
        from server import PromptServer  # ComfyUI's server module
        inst = PromptServer.instance
    except Exception:
        return False
    if inst is None:
        return False
    inst.send_sync(event, data, getattr(inst, "client_id", None))
    return True


def send_progress_text(text: str, node_id) -> None:
    """The text under a node (``PromptServer.send_progress_text``), where the server has it."""
    if node_id is None:
        return
    try:
        from server import PromptServer
        PromptServer.instance.send_progress_text(text, str(node_id))
    except Exception:
        pass


def progress_bar(total: int, node_id):
    """ComfyUI's progress bar on a node (``comfy.utils.ProgressBar``), or None outside ComfyUI."""
    try:
        import comfy.utils
        return comfy.utils.ProgressBar(total, node_id=node_id)
    except Exception:
        return None


def model_names(folder: str = "diffusion_models") -> List[str]:
    import folder_paths
    return folder_paths.get_filename_list(folder)


def model_path(name: str, folder: str = "diffusion_models") -> Optional[str]:
    import folder_paths
    return folder_paths.get_full_path(folder, name)


def model_folders(folder: str = "diffusion_models") -> List[str]:
    import folder_paths
    return folder_paths.get_folder_paths(folder)


def load_diffusion_model(path: str, model_options: dict):
    """ComfyUI's own loader (``comfy.sd.load_diffusion_model``): its ModelPatcher, weight dtypes,
    DynamicVRAM and offloading as for UNETLoader."""
    import comfy.sd
    return comfy.sd.load_diffusion_model(path, model_options=model_options)


def oom_exceptions() -> tuple:
    """ComfyUI's out-of-memory exception types (``model_management.OOM_EXCEPTION``)."""
    try:
        import comfy.model_management as mm
        e = mm.OOM_EXCEPTION
        return e if isinstance(e, tuple) else (e,)
    except Exception:
        return ()
