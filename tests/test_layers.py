"""The pack's layers keep their imports pointing down: ``cuda_kernels`` imports neither ``flux_core``
nor ``nodes``; ``flux_core`` does not import ``nodes``; nothing outside ``nodes/host/`` names
ComfyUI's modules (``comfy``, ``comfy_api``, ``comfy_aimdo``, ``server``,
``folder_paths``); no node file is longer than ``NODE_FILE_MAX`` lines."""
import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMFY_MODULES = ("comfy", "comfy_api", "comfy_aimdo", "server", "folder_paths", "comfyui_version", "comfy_extras")


def _imports(path):
    """(absolute module names, relative (level, module) pairs) imported anywhere in a file."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    absolute, relative = [], []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            absolute += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                relative.append((node.level, node.module or ""))
            else:
                absolute.append(node.module or "")
    return absolute, relative


def _py_files(folder):
    for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, folder)):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for f in filenames:
            if f.endswith(".py"):
                yield os.path.join(dirpath, f)


def _target(path, level, module):
    """The pack-relative package a relative import reaches (e.g. 'flux_core.context')."""
    rel = os.path.relpath(os.path.dirname(path), ROOT).split(os.sep)
    base = rel[: len(rel) - (level - 1)] if level > 1 else rel
    return ".".join([p for p in base if p and p != "."] + ([module] if module else []))


@pytest.mark.parametrize("layer,forbidden", [("cuda_kernels", ("flux_core", "nodes")), ("flux_core", ("nodes",))])
def test_no_upward_imports(layer, forbidden):
    bad = []
    for path in _py_files(layer):
        absolute, relative = _imports(path)
        for level, module in relative:
            t = _target(path, level, module)
            if t.split(".")[0] in forbidden:
                bad.append(f"{os.path.relpath(path, ROOT)} -> {t}")
        bad += [f"{os.path.relpath(path, ROOT)} -> {m}" for m in absolute if m.split(".")[0] in COMFY_MODULES]
    assert not bad, bad


def test_only_the_host_package_names_comfyui():
    bad = []
    for path in _py_files("nodes"):
        if os.sep + "host" + os.sep in path:
            continue
        absolute, _ = _imports(path)
        bad += [f"{os.path.relpath(path, ROOT)} imports {m}" for m in absolute if m.split(".")[0] in COMFY_MODULES]
    assert not bad, bad


NODE_FILE_MAX = 150


def test_node_files_are_thin():
    """A node module holds its schema and wiring; the logic lives beside it."""
    import importlib
    nodes = importlib.import_module("flux_numba_pack.nodes")
    long = []
    for name in nodes.MODULES:
        path = os.path.join(ROOT, "nodes", name + ".py")
        n = sum(1 for _ in open(path, encoding="utf-8"))
        if n > NODE_FILE_MAX:
            long.append(f"nodes/{name}.py: {n} lines")
    assert not long, long
