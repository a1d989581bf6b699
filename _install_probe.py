"""install.py's probes: what the torch of an interpreter says (version, torch.version.cuda, or why it
does not import) and where numba-cuda would load NVVM from outside the environment's wheels (a system
CUDA toolkit), each asked in a child interpreter so that a broken torch cannot take install.py down.
Standard library only (install.py runs before anything of requirements.txt is there)."""
import json
import os
import re
import subprocess
import sys

PROBE_TAG = "FLUX_NUMBA_PROBE "


TORCH_PROBE = (
    "import json\n"
    "out = {}\n"
    "try:\n"
    "    import torch\n"
    "    out['version'] = str(getattr(torch, '__version__', '?'))\n"
    "    v = getattr(torch, 'version', None)\n"
    "    out['cuda'] = getattr(v, 'cuda', None)\n"
    "except BaseException as e:\n"
    "    out['error'] = (type(e).__name__ + ': ' + str(e)).strip().splitlines()[0][:300]\n"
    "    out['missing'] = isinstance(e, ModuleNotFoundError) and getattr(e, 'name', '') == 'torch'\n"
    f"print({PROBE_TAG!r} + json.dumps(out))\n")

NVVM_PROBE = (
    "import json\n"
    "try:\n"
    "    from cuda.pathfinder import load_nvidia_dynamic_lib\n"
    "    lib = load_nvidia_dynamic_lib('nvvm')\n"
    "    out = {'path': lib.abs_path, 'via': getattr(lib, 'found_via', '?')}\n"
    "except BaseException as e:\n"
    "    out = {'error': type(e).__name__ + ': ' + str(e)[:200]}\n"
    f"print({PROBE_TAG!r} + json.dumps(out))\n")


def _probe(code, python=None, env=None, timeout=300):
    try:
        r = subprocess.run([python or sys.executable, "-c", code], capture_output=True, text=True, env=env,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    for ln in reversed(r.stdout.splitlines()):
        if ln.startswith(PROBE_TAG):
            return json.loads(ln[len(PROBE_TAG):])
    tail = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
    return {"error": f"the interpreter died ({'signal ' + str(-r.returncode) if r.returncode < 0 else 'exit ' + str(r.returncode)}): {tail[:300]}"}


def torch_state(inst, python=None, env=None):
    """("absent", None, None) | ("ok", version, torch.version.cuda) | ("broken", version, error)."""
    dist = inst.get("torch")
    p = _probe(TORCH_PROBE, python, env)
    if "error" not in p:
        return "ok", p["version"], p.get("cuda")
    if p.get("missing") and dist is None:
        return "absent", None, None
    return "broken", dist[1] if dist else "?", p["error"]


def system_toolkit(python=None):
    """(root, "M.m") of the CUDA toolkit whose NVVM numba-cuda would load from outside the
    environment's wheels, or None."""
    p = _probe(NVVM_PROBE, python)
    path = p.get("path")
    if not path or p.get("via") == "site-packages":
        return None
    root = os.path.dirname(os.path.realpath(path))
    while root != os.path.dirname(root) and not os.path.isdir(os.path.join(root, "nvvm")):
        root = os.path.dirname(root)
    ver = None
    try:
        with open(os.path.join(root, "version.json")) as f:
            ver = json.load(f)["cuda"]["version"]
    except (OSError, ValueError, KeyError, TypeError):
        m = re.search(r"cuda-(\d+\.\d+)", os.path.realpath(root))
        ver = m.group(1) if m else None
    return (root, ver) if ver else None
