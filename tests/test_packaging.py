"""Packaging: requirements.txt == pyproject dependencies, every third-party import of the shipped
code is declared, LICENSE and the pyproject metadata ComfyUI's registry reads."""
import ast
import os
import re
import sys

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = None

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = ["__init__.py", "_pack.py", "run.py", "bench.py", "bench/e2e/_bench_setup.py", "bench/e2e/_bench_diag.py",
           "bench/timing.py", "nodes", "cuda_kernels", "flux_core"]

# import name -> the distribution that provides it (as named in requirements.txt)
DIST = {
    "PIL": "Pillow",
    "skimage": "scikit-image",
    "numba": "numba-cuda",     # numba-cuda requires numba and provides numba.cuda
    "llvmlite": "numba-cuda",  # numba's own dependency, version-locked by numba: not declared apart
}
# provided by the host (ComfyUI brings torch, and is the only place its own modules exist)
HOST = {"torch", "comfy", "comfy_api", "folder_paths", "server", "comfyui_version",
        "comfy_aimdo"}  # comfy-aimdo: ComfyUI v0.33's DynamicVRAM (imported only where ComfyUI runs it)
# the pack's own modules (imported by name from the repo root or bench/)
LOCAL = {"_pack", "flux_numba_pack", "gpu_vae", "_bench_setup", "_bench_diag", "timing"}


def _name(req):
    return re.split(r"[\s<>=!~\[;]", req.strip(), maxsplit=1)[0].lower()


def requirements():
    with open(os.path.join(ROOT, "requirements.txt")) as f:
        return [ln.split("#", 1)[0].strip() for ln in f if ln.split("#", 1)[0].strip()]


def pyproject_text():
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        return f.read()


def pyproject():
    if tomllib is not None:
        with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
            return tomllib.load(f)
    return None


def pyproject_dependencies():
    d = pyproject()
    if d is not None:
        return d["project"]["dependencies"]
    block = re.search(r"^dependencies\s*=\s*\[(.*?)\]", pyproject_text(), re.S | re.M).group(1)
    return re.findall(r'"([^"]+)"', block)


def shipped_files():
    for entry in SHIPPED:
        path = os.path.join(ROOT, entry)
        if os.path.isfile(path):
            yield path
        else:
            for dp, _, fs in os.walk(path):
                yield from (os.path.join(dp, f) for f in fs if f.endswith(".py"))


def third_party_imports():
    """{top-level module: [files]} of absolute imports that are not the standard library."""
    found = {}
    for path in shipped_files():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for n in names:
                top = n.split(".")[0]
                if top not in sys.stdlib_module_names and top not in LOCAL:
                    found.setdefault(top, []).append(os.path.relpath(path, ROOT))
    return found


def test_requirements_txt_and_pyproject_list_the_same_packages():
    assert requirements() == pyproject_dependencies()


def test_no_pin_that_would_downgrade_numpy():
    for req in requirements():
        if _name(req) == "numpy":
            assert not re.search(r"<|==|~=", req), req  # see cuda_kernels/_numpy_compat.py


def test_every_third_party_import_is_declared():
    declared = {_name(r) for r in requirements()}
    missing = {}
    for mod, files in sorted(third_party_imports().items()):
        if mod in HOST:
            continue
        dist = DIST.get(mod, mod).lower()
        if dist not in declared:
            missing[mod] = sorted(set(files))
    assert not missing, f"imported by shipped code but not in requirements.txt/pyproject: {missing}"
    assert "torch" not in declared  # ComfyUI's own torch must never be replaced


def test_license_and_registry_metadata():
    with open(os.path.join(ROOT, "LICENSE")) as f:
        lic = f.read()
    assert lic.startswith("MIT License") and "flux-numba contributors" in lic
    text = pyproject_text()
    assert not re.search(r'^\s*Icon\s*=\s*""', text, re.M)  # no empty icon key (there is no icon)
    d = pyproject()
    if d is not None:
        assert d["project"]["license"] == {"text": "MIT"}
        cls = d["project"]["classifiers"]
        assert "License :: OSI Approved :: MIT License" in cls and "Environment :: GPU :: NVIDIA CUDA" in cls
        assert "Icon" not in d["tool"]["comfy"] or d["tool"]["comfy"]["Icon"]
        repo = d["project"]["urls"]["Repository"]
        with open(os.path.join(ROOT, "README.md")) as f:
            assert f"git clone {repo}" in f.read()  # the README clones the repository pyproject names


def test_install_script_runs_before_requirements():
    """install.py runs before anything of requirements.txt is there (ComfyUI-Manager may run it
    alone): its imports (and those of its probes, _install_probe.py) are the standard library, and
    packaging with pip's copy as the fallback."""
    tops = set()
    for name in ("install.py", "_install_probe.py"):
        with open(os.path.join(ROOT, name), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        tops |= _tops(tree)
    assert tops - set(sys.stdlib_module_names) <= {"packaging", "pip"}, tops


def _tops(tree):
    tops = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            tops |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            tops.add(node.module.split(".")[0])
    return tops


def test_requirements_leave_torchs_cuda_alone():
    """requirements.txt never names torch, its CUDA wheels or a numba-cuda CUDA extra (those would
    replace what ComfyUI's torch pins); install.py adds the CUDA pieces at torch's version."""
    for req in requirements():
        name = _name(req)
        assert name != "torch" and not name.startswith(("nvidia-", "cuda-")), req
        assert "[" not in req, req
