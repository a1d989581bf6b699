"""numpy 2.5 dropped ``np.row_stack``, which numba-cuda 0.30.x calls: the pack adds the alias
``row_stack = vstack`` only when it is missing, before numba-cuda is imported, and never pins or
changes numpy itself (no ``numpy<2.5`` pin that would downgrade a user's ComfyUI environment)."""
import importlib.util
import json
import os
import subprocess
import sys
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _compat():
    spec = importlib.util.spec_from_file_location("_compat_under_test", os.path.join(ROOT, "cuda_kernels", "_numpy_compat.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_alias_added_only_when_missing():
    compat = _compat()

    def vstack(*a):
        return "vstack"

    def row_stack(*a):
        return "row_stack"
    new = types.SimpleNamespace(vstack=vstack)  # numpy >= 2.5
    assert compat.apply(new) is True and new.row_stack is vstack
    old = types.SimpleNamespace(vstack=vstack, row_stack=row_stack)  # numpy < 2.5: left alone
    assert compat.apply(old) is False and old.row_stack is row_stack
    odd = types.SimpleNamespace()  # neither: nothing to alias
    assert compat.apply(odd) is False and not hasattr(odd, "row_stack")


SCRIPT = r"""
import importlib, importlib.metadata, importlib.util, json, sys
import numpy
root, drop = sys.argv[1], sys.argv[2] == "drop"
before = (numpy.__version__, importlib.metadata.version("numpy"), numpy.__file__)
orig = getattr(numpy, "row_stack", None)
if drop:
    del numpy.row_stack  # what numpy 2.5 looks like
spec = importlib.util.spec_from_file_location("pack_under_test", root + "/__init__.py")  # as ComfyUI does
mod = importlib.util.module_from_spec(spec)
sys.modules["pack_under_test"] = mod
spec.loader.exec_module(mod)
importlib.import_module(mod.PACKAGE + ".cuda_kernels")
from numba import cuda  # noqa: F401
after = (numpy.__version__, importlib.metadata.version("numpy"), numpy.__file__)
print("RESULT " + json.dumps({"before": before, "after": after, "is_vstack": numpy.row_stack is numpy.vstack,
                              "is_orig": numpy.row_stack is orig}))
"""


def _run(mode):
    env = dict(os.environ)
    env.setdefault("NUMBA_ENABLE_CUDASIM", "1")
    p = subprocess.run([sys.executable, "-c", SCRIPT, ROOT, mode], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads([ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")][-1][7:])


def test_importing_the_pack_leaves_numpy_alone():
    import numpy
    r = _run("keep")
    assert r["before"] == r["after"]
    if hasattr(numpy, "row_stack"):  # numpy < 2.5: its own row_stack stays
        assert r["is_orig"] and not r["is_vstack"]


def test_missing_row_stack_is_aliased_before_numba_cuda_loads():
    r = _run("drop")
    assert r["before"] == r["after"] and r["is_vstack"]


def test_pack_load_applies_it_without_importing_the_kernels():
    script = ("import sys, numpy; del numpy.row_stack; sys.path.insert(0, sys.argv[1]); import _pack; _pack.load(); "
              "assert numpy.row_stack is numpy.vstack; "
              "assert not any(m.startswith(('numba', 'flux_numba_pack.cuda_kernels')) for m in sys.modules), sorted(sys.modules)")
    p = subprocess.run([sys.executable, "-c", script, ROOT], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
