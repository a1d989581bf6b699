"""The ComfyUI tests (``-m comfyui``) once per supported ComfyUI version, each in its own process.

For each version in _comfy_trees.SUPPORTED: find its tree (COMFYUI_PATHS, COMFYUI_PATH or
<repo>/.carry/ComfyUI-*), check that the interpreter (COMFYUI_PYTHON, else this one) imports that
tree's dependencies, then run ``-m pytest -q -m comfyui tests`` there with COMFYUI_PATH=<tree> and
FLUX_NUMBA_IN_TREE_RUN=1; exit 0 passes.  Skips with the reason when no tree of the version is
found or the interpreter cannot run it; a path given in COMFYUI_PATHS / COMFYUI_PATH that is not a
ComfyUI tree fails test_explicit_comfyui_paths.  FLUX_NUMBA_TREE_TIMEOUT (s, default 2400) bounds one run.
"""
import os
import re
import subprocess
import time

import pytest

import _comfy_trees as ct

RESULTS = []  # (label, tree, summary, seconds): conftest prints them in the terminal summary
_SUMMARY = re.compile(r"^=*\s*(\d+ (passed|failed|skipped|error|errors|deselected|xfailed|xpassed)\b.*)$")


def _summary_line(out):
    for ln in reversed(out.splitlines()):
        m = _SUMMARY.match(ln.strip())
        if m:
            return m.group(1).strip(" =")
    return "(no pytest summary line)"


def test_explicit_comfyui_paths():
    """Every path given in COMFYUI_PATHS / COMFYUI_PATH is a ComfyUI tree: a wrong one fails here
    (with the reason) instead of turning the per-version tests into skips.  Nothing given: nothing
    to check (the trees in .carry/ComfyUI-* are found, not given)."""
    errors = ct.explicit_path_errors()
    assert not errors, "; ".join(errors)


@pytest.mark.parametrize("version", ct.SUPPORTED, ids=["v" + v for v in ct.SUPPORTED])
def test_comfyui_tree(version):
    if ct.in_tree_run():
        pytest.skip(f"{ct.IN_TREE_ENV}=1: this is a per-tree run already")
    source, paths = ct.candidate_paths()
    trees = ct.find_trees()
    tree = trees.get(version)
    if tree is None:
        found = ", ".join(f"v{v}: {p}" for v, p in sorted(trees.items())) or "none"
        where = {"COMFYUI_PATHS": "in COMFYUI_PATHS", "COMFYUI_PATH": "at COMFYUI_PATH",
                 ".carry": f"in COMFYUI_PATHS, COMFYUI_PATH or {os.path.join(ct.ROOT, '.carry', 'ComfyUI-*')}"}[source]
        pytest.skip(f"no ComfyUI v{version} tree {where} (found: {found})")
    if source == "COMFYUI_PATH":
        pytest.skip(f"COMFYUI_PATH={tree} is set: the comfyui tests run in this process against it "
                    "(use COMFYUI_PATHS for the per-tree runs)")
    py = ct.comfy_python()
    why = ct.probe_interpreter(py, tree)
    if why:
        pytest.skip(f"v{version} at {tree}: {why}")
    env = dict(os.environ, COMFYUI_PATH=tree, COMFYUI_PYTHON=py)
    env[ct.IN_TREE_ENV] = "1"
    env.pop("COMFYUI_PATHS", None)
    timeout = float(os.environ.get("FLUX_NUMBA_TREE_TIMEOUT", "2400"))
    t0 = time.monotonic()
    try:
        r = subprocess.run([py, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", "-m", "comfyui", "tests"],
                           cwd=ct.ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        out, rc = r.stdout + r.stderr, r.returncode
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        out, rc = out + f"\n(timed out after {timeout:.0f} s)", None
    secs = time.monotonic() - t0
    summary = _summary_line(out)
    RESULTS.append((f"v{version}", tree, summary, secs, inner_skips(out)))
    print(f"ComfyUI v{version} ({tree}): {summary} [{secs:.0f} s]")
    assert rc == 0, f"ComfyUI v{version} at {tree}: exit {rc}, {summary}\n--- tail of the run ---\n{_tail(out)}"


_SKIPPED = re.compile(r"^SKIPPED \[(\d+)\] ([^:]+):\d+: (.*)$")


def inner_skips(out):
    """The per-tree run's skips (its -rs lines), counted per test file and reason: [(n, file, reason)],
    so the outer summary says which ComfyUI tests did not run there and why (e.g. the browser tests
    without chromium / playwright-core)."""
    counts = {}
    for ln in out.splitlines():
        m = _SKIPPED.match(ln.strip())
        if m:
            key = (os.path.basename(m.group(2)), m.group(3).strip())
            counts[key] = counts.get(key, 0) + int(m.group(1))
    return [(n, f, why) for (f, why), n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]


def _tail(out, n=6000):
    """The last n characters, widened to start at pytest's short test summary when that is earlier."""
    i = out.rfind("short test summary info")
    start = max(len(out) - n, 0)
    if 0 <= i < start:
        start = max(i - 2000, 0)
    return out[start:]


def test_inner_skips_counted_per_file_and_reason():
    """The per-tree run's skip lines reach the outer summary grouped by file and reason."""
    out = "\n".join([
        "SKIPPED [1] tests/test_browser_chart.py:139: Debian chromium not found (apt-get install -y chromium, or set CHROMIUM_PATH)",
        "SKIPPED [1] tests/test_browser_chart.py:146: Debian chromium not found (apt-get install -y chromium, or set CHROMIUM_PATH)",
        "SKIPPED [2] /abs/tests/test_comfyui.py:12: needs a GPU",
        "12 passed, 6 skipped in 3.0s",
    ])
    assert inner_skips(out) == [
        (2, "test_browser_chart.py", "Debian chromium not found (apt-get install -y chromium, or set CHROMIUM_PATH)"),
        (2, "test_comfyui.py", "needs a GPU")]
