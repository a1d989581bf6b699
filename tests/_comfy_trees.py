"""Where the ComfyUI tests find ComfyUI, and when they run (one place for every test file).

Tests that need a ComfyUI tree carry ``pytest.mark.comfyui``.  They run per tree, in a subprocess
each, from tests/test_comfyui_matrix.py::test_comfyui_tree[vX.Y.Z]:

    <COMFYUI_PYTHON or sys.executable> -m pytest -q -m comfyui tests
        with COMFYUI_PATH=<tree> and FLUX_NUMBA_IN_TREE_RUN=1

Trees are found in COMFYUI_PATHS (os.pathsep-separated), else COMFYUI_PATH, else <repo>/.carry/ComfyUI-*;
each tree's version is comfyui_version.py's ``__version__``.

In the outer process the comfyui-marked tests run only when FLUX_NUMBA_IN_TREE_RUN=1 (the per-tree
run) or when COMFYUI_PATH is set (direct use: ``COMFYUI_PATH=... pytest tests/test_comfyui.py``);
then the matrix does not run that tree a second time.  Otherwise they skip with "runs per tree in
test_comfyui_matrix".  A path given explicitly (COMFYUI_PATHS / COMFYUI_PATH) that is not a ComfyUI
tree is an error, not a skip: tests/conftest.py stops the session before any test runs (one line,
exit 2), and test_comfyui_matrix::test_explicit_comfyui_paths states the same check.
"""
import glob
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUPPORTED = ("0.8.0", "0.33.0")  # tested on every change (README: Supported ComfyUI versions)
IN_TREE_ENV = "FLUX_NUMBA_IN_TREE_RUN"
MATRIX_SKIP = "runs per tree in test_comfyui_matrix"


def in_tree_run() -> bool:
    return os.environ.get(IN_TREE_ENV) == "1"


def tree_version(path):
    """``__version__`` from the tree's comfyui_version.py, or None."""
    try:
        with open(os.path.join(path, "comfyui_version.py")) as f:
            m = re.search(r"""^__version__\s*=\s*["']([^"']+)["']""", f.read(), re.M)
    except OSError:
        return None
    return m.group(1) if m else None


def candidate_paths():
    """(source, [paths]): COMFYUI_PATHS, else COMFYUI_PATH, else <repo>/.carry/ComfyUI-*."""
    if os.environ.get("COMFYUI_PATHS"):
        return "COMFYUI_PATHS", [p for p in os.environ["COMFYUI_PATHS"].split(os.pathsep) if p]
    if os.environ.get("COMFYUI_PATH"):
        return "COMFYUI_PATH", [os.environ["COMFYUI_PATH"]]
    return ".carry", sorted(p for p in glob.glob(os.path.join(ROOT, ".carry", "ComfyUI-*")) if os.path.isdir(p))


def tree_problem(path):
    """None when ``path`` is a ComfyUI tree the tests can use, else why not (one line)."""
    if not os.path.exists(path):
        return f"{path} does not exist"
    if not os.path.isdir(path):
        return f"{path} is not a folder"
    if not os.path.isfile(os.path.join(path, "main.py")) or not os.path.isdir(os.path.join(path, "comfy")):
        return f"{path} is not a ComfyUI tree (no main.py / comfy/)"
    if not tree_version(path):
        return f"{path} has no comfyui_version.py with a __version__"
    return None


def explicit_path_errors():
    """['COMFYUI_PATHS: why' ...] for every path given explicitly that is not a ComfyUI tree: each
    entry of COMFYUI_PATHS (the per-tree runs) and COMFYUI_PATH (the in-process comfyui tests use it,
    COMFYUI_PATHS set or not).  A test command given a wrong path stops at once (tests/conftest.py,
    at session start), it does not skip.  .carry/ComfyUI-* (found, not given) never counts."""
    errors = []
    many = os.environ.get("COMFYUI_PATHS")
    if many:
        paths = [p for p in many.split(os.pathsep) if p]
        if not paths:
            errors.append("COMFYUI_PATHS is set but names no path")
        errors += [f"COMFYUI_PATHS: {why}" for why in map(tree_problem, paths) if why]
    one = os.environ.get("COMFYUI_PATH")
    if one and tree_problem(one):
        errors.append(f"COMFYUI_PATH: {tree_problem(one)}")
    return errors


def find_trees():
    """{version: abspath} of the ComfyUI trees found (the first of each version wins)."""
    trees = {}
    for p in candidate_paths()[1]:
        if not os.path.isfile(os.path.join(p, "main.py")):
            continue
        v = tree_version(p)
        if v:
            trees.setdefault(v, os.path.abspath(p))
    return trees


def comfy_python():
    return os.environ.get("COMFYUI_PYTHON") or sys.executable


PROBE = ("import sys; sys.argv = ['probe', '--cpu']; sys.path.insert(0, '.'); "
         "import comfy.options; comfy.options.enable_args_parsing(); import comfy.model_management")


def probe_interpreter(py, tree, timeout=300):
    """None when ``py`` imports the tree's comfy.model_management (argv --cpu), else the reason."""
    try:
        r = subprocess.run([py, "-c", PROBE], cwd=tree, capture_output=True, text=True, timeout=timeout,
                           env=dict(os.environ, NUMBA_ENABLE_CUDASIM=os.environ.get("NUMBA_ENABLE_CUDASIM", "1")))
    except Exception as e:  # pragma: no cover - depends on the environment
        return f"cannot run {py}: {type(e).__name__}: {e}"
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["exit %d" % r.returncode])[-1]
        return f"{py} cannot import this tree's dependencies (set COMFYUI_PYTHON): {last}"
    return None


def comfyui_path():
    """(tree, None) for a comfyui-marked test in this process, or (None, skip reason)."""
    p = os.environ.get("COMFYUI_PATH")
    if not p:
        if in_tree_run():
            return None, f"{IN_TREE_ENV}=1 but COMFYUI_PATH is not set"
        return None, MATRIX_SKIP + " (or set COMFYUI_PATH to a ComfyUI tree to run them here)"
    if not os.path.isfile(os.path.join(p, "main.py")):
        return None, f"COMFYUI_PATH={p} has no main.py"
    return os.path.abspath(p), None


def required_frontend(tree):
    """The ``comfyui-frontend-package==X`` pin of the tree's requirements.txt, or None."""
    try:
        with open(os.path.join(tree, "requirements.txt")) as f:
            m = re.search(r"^comfyui-frontend-package==([\w.]+)", f.read(), re.M)
    except OSError:
        return None
    return m.group(1) if m else None


def frontend_args(tree, py):
    """``--front-end-root DIR`` for main.py when a copy of the frontend the tree pins lies in
    FLUX_NUMBA_FRONTENDS (default <py's venv>/frontends)/<version> (tests/comfy_venv.sh puts the pins
    that differ from the installed frontend there), so each tree runs with its own frontend; else []."""
    v = required_frontend(tree)
    base = os.environ.get("FLUX_NUMBA_FRONTENDS") or os.path.join(os.path.dirname(os.path.dirname(py)), "frontends")
    static = os.path.join(base, v or "-", "comfyui_frontend_package", "static")
    return ["--front-end-root", static] if v and os.path.isfile(os.path.join(static, "index.html")) else []


def version_label(path):
    return "v" + (tree_version(path) or "?")
