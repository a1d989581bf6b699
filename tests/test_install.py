"""install.py: the CUDA wheels it picks for the torch that is there, and its refusals.

Simulated environments: a folder (or a throw-away venv) whose installed metadata mirrors what a
torch cu126 / cu128 / cu130 wheel pins (fake ``*.dist-info/METADATA``, no real torch, no CUDA).
Everything but the last test runs offline; that one asks pip (``--dry-run``) against the package
index in real venvs and skips, saying why, when the index cannot be reached.
"""
import importlib.util
import os
import re
import shlex
import socket
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINUX = '; platform_system == "Linux" and platform_machine == "x86_64"'


def _load():
    spec = importlib.util.spec_from_file_location("flux_numba_install_under_test", os.path.join(ROOT, "install.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


inst_mod = _load()

# what the numba-cuda / requirements.txt step leaves in any of them (cuda-bindings 13.5.0 included)
PACK = {
    "numba-cuda": ("0.30.4", ["numba>=0.60.0", "cuda-bindings<14.0.0,>=12.9.1", "cuda-core<2.0.0,>=0.5.1",
                              "cuda-pathfinder<2.0.0,>=1.4.0", "packaging",
                              'cuda-bindings<13.0.0,>=12.9.1; extra == "cu12"',
                              'cuda-toolkit[cccl,cudart,nvcc,nvrtc]==12.*; extra == "cu12"',
                              'nvidia-nvjitlink-cu12<13.0.0,>=12.3.0; extra == "cu12"',
                              'cuda-bindings==13.*; extra == "cu13"',
                              'cuda-toolkit[cccl,cudart,nvrtc,nvvm]==13.*; extra == "cu13"',
                              'nvidia-nvjitlink<14.0.0,>=13.0.0; extra == "cu13"']),
    "cuda-bindings": ("13.5.0", ["cuda-pathfinder~=1.1"]),
    "cuda-core": ("1.2.2", []),
    "cuda-pathfinder": ("1.9.1", []),
    "numba": ("0.68.1", ["llvmlite<0.51,>=0.50.0dev0", "numpy>=1.24"]),
    "llvmlite": ("0.50.0", []),
    "numpy": ("2.5.5", []),
    "packaging": ("26.4", []),
}

CU128 = {  # torch 2.8.0 (PyPI, Linux x86_64): its CUDA pins
    "nvidia-cuda-nvrtc-cu12": "12.8.93", "nvidia-cuda-runtime-cu12": "12.8.90", "nvidia-cuda-cupti-cu12": "12.8.90",
    "nvidia-cudnn-cu12": "9.10.2.21", "nvidia-cublas-cu12": "12.8.4.1", "nvidia-cufft-cu12": "11.3.3.83",
    "nvidia-curand-cu12": "10.3.9.90", "nvidia-cusolver-cu12": "11.7.3.90", "nvidia-cusparse-cu12": "12.5.8.93",
    "nvidia-cusparselt-cu12": "0.7.1", "nvidia-nccl-cu12": "2.27.3", "nvidia-nvtx-cu12": "12.8.90",
    "nvidia-nvjitlink-cu12": "12.8.93", "nvidia-cufile-cu12": "1.13.1.3",
}
CU126 = {  # torch 2.7.1 (PyPI): NVRTC and nvJitLink of two different 12.6 updates
    "nvidia-cuda-nvrtc-cu12": "12.6.77", "nvidia-cuda-runtime-cu12": "12.6.77", "nvidia-cuda-cupti-cu12": "12.6.80",
    "nvidia-cudnn-cu12": "9.5.1.17", "nvidia-cublas-cu12": "12.6.4.1", "nvidia-cufft-cu12": "11.3.0.4",
    "nvidia-curand-cu12": "10.3.7.77", "nvidia-cusolver-cu12": "11.7.1.2", "nvidia-cusparse-cu12": "12.5.4.2",
    "nvidia-cusparselt-cu12": "0.6.3", "nvidia-nccl-cu12": "2.26.2", "nvidia-nvtx-cu12": "12.6.77",
    "nvidia-nvjitlink-cu12": "12.6.85", "nvidia-cufile-cu12": "1.11.1.6",
}
CU130_TOOLKIT = [  # cuda-toolkit 13.0.3's extras (the ones torch asks for, and cccl / nvvm)
    "nvidia-cuda-cccl==13.0.85.*; extra == 'cccl'", "nvidia-cuda-runtime==13.0.96.*; extra == 'cudart'",
    "nvidia-cublas==13.1.1.3.*; extra == 'cublas'", "nvidia-cuda-nvrtc==13.0.88.*; extra == 'cublas'",
    "nvidia-nvjitlink<14,>=13.0.88; extra == 'nvjitlink'", "nvidia-cuda-nvrtc==13.0.88.*; extra == 'nvrtc'",
    "nvidia-nvtx==13.0.85.*; extra == 'nvtx'", "nvidia-nvvm==13.0.88.*; extra == 'nvvm'",
]
CU130 = {"cuda-toolkit": "13.0.3.0", "nvidia-cuda-nvrtc": "13.0.88", "nvidia-cuda-runtime": "13.0.96",
         "nvidia-nvjitlink": "13.5.37", "nvidia-cublas": "13.1.1.3", "nvidia-nvtx": "13.0.85",
         "nvidia-cudnn-cu13": "9.20.0.48", "nvidia-nccl-cu13": "2.29.7"}

FLAVOURS = {
    # name: (torch version, torch.version.cuda, torch's Requires-Dist, installed CUDA dists)
    "cu126": ("2.7.1", "12.6", [f"{n}=={v}{LINUX}" for n, v in CU126.items()], CU126),
    "cu128": ("2.8.0", "12.8", [f"{n}=={v}{LINUX}" for n, v in CU128.items()], CU128),
    "cu130": ("2.13.0", "13.0",
              ['cuda-toolkit[cublas,cudart,nvjitlink,nvrtc,nvtx]==13.0.3; platform_system == "Linux"',
               'cuda-bindings<14,>=13.0.3; platform_system == "Linux"',
               'nvidia-cudnn-cu13==9.20.0.48; platform_system == "Linux"',
               'nvidia-nccl-cu13==2.29.7; platform_system == "Linux"'], CU130),
}
WANT = {  # what install.py adds per flavour (the requirement, and the versions pip picks for it)
    "cu126": ("cuda-toolkit[cccl,nvcc]==12.6.*", ["nvidia-cuda-nvcc-cu12==12.6."]),
    "cu128": ("cuda-toolkit[cccl,nvcc]==12.8.*", ["nvidia-cuda-nvcc-cu12==12.8.93", "nvidia-cuda-cccl-cu12==12.8.90"]),
    "cu130": ("cuda-toolkit[cccl,nvvm]==13.0.3", ["nvidia-nvvm==13.0.88", "nvidia-cuda-cccl==13.0.85"]),
}


def write_dist(site, name, version, requires=()):
    d = os.path.join(site, f"{name.replace('-', '_')}-{version}.dist-info")
    os.makedirs(d, exist_ok=True)
    extras = sorted(set(re.findall(r"extra == [\"']([\w-]+)[\"']", "\n".join(requires))))
    with open(os.path.join(d, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                + "".join(f"Provides-Extra: {e}\n" for e in extras)
                + "".join(f"Requires-Dist: {r}\n" for r in requires))
    with open(os.path.join(d, "INSTALLER"), "w") as f:
        f.write("fake\n")


def fake_env(site, flavour, torch_module=True, broken=None, pack=True):
    """Write a simulated ComfyUI environment into ``site``: torch's metadata (its CUDA pins), the
    CUDA dists those pins installed, what requirements.txt installed, and (torch_module) an
    importable ``torch`` that reports the CUDA version -- or raises ``broken`` on import."""
    os.makedirs(site, exist_ok=True)
    tv, cuda, requires, dists = FLAVOURS[flavour]
    write_dist(site, "torch", tv, requires)
    for n, v in dists.items():
        write_dist(site, n, v, CU130_TOOLKIT if n == "cuda-toolkit" else ())
    if pack:
        for n, (v, req) in PACK.items():
            write_dist(site, n, v, req)
    if torch_module:
        os.makedirs(os.path.join(site, "torch"), exist_ok=True)
        with open(os.path.join(site, "torch", "__init__.py"), "w") as f:
            f.write(f"raise {broken}\n" if broken else
                    f"__version__ = {tv!r}\nclass version:\n    cuda = {cuda!r}\n")


# ------------------------------------------------------------------------------ planning (offline)
@pytest.mark.parametrize("flavour", sorted(FLAVOURS))
def test_plan_matches_torchs_cuda_and_pins(tmp_path, flavour):
    fake_env(str(tmp_path), flavour, torch_module=False)
    inst = inst_mod.installed([str(tmp_path)])
    tv, cuda, _, dists = FLAVOURS[flavour]
    reqs, line = inst_mod.plan_cuda(tv, cuda, inst)
    assert reqs == [WANT[flavour][0]], (reqs, line)
    assert "\n" not in line and f"CUDA {cuda}" in line and WANT[flavour][0] in line
    nvrtc = dists.get("nvidia-cuda-nvrtc-cu12") or dists["nvidia-cuda-nvrtc"]
    assert f"NVRTC {nvrtc}" in line and "used as they are" in line  # torch's own, untouched
    # never the plain extra (it asks for the newest CUDA minor and replaces torch's pins)
    assert "numba-cuda[" not in " ".join(reqs)


def test_plan_cu130_with_nvvm_and_cccl_installed_adds_nothing(tmp_path):
    fake_env(str(tmp_path), "cu130", torch_module=False)
    inst_mod_dists = [("nvidia-nvvm", "13.0.88"), ("nvidia-cuda-cccl", "13.0.85")]
    for n, v in inst_mod_dists:
        write_dist(str(tmp_path), n, v)
    reqs, line = inst_mod.plan_cuda("2.13.0", "13.0", inst_mod.installed([str(tmp_path)]))
    assert reqs == [] and line.startswith("no CUDA wheels added") and "NVRTC 13.0.88" in line and "NVVM 13.0.88" in line


def test_plan_uses_a_system_toolkit_of_torchs_major(tmp_path):
    fake_env(str(tmp_path), "cu128", torch_module=False)
    inst = inst_mod.installed([str(tmp_path)])
    reqs, line = inst_mod.plan_cuda("2.8.0", "12.8", inst, ("/usr/local/cuda-12.8", "12.8"))
    assert reqs == [] and "/usr/local/cuda-12.8" in line and "NVRTC 12.8.93" in line
    # a toolkit of another major does not count
    reqs, _ = inst_mod.plan_cuda("2.8.0", "12.8", inst, ("/usr/local/cuda-13.0", "13.0"))
    assert reqs == ["cuda-toolkit[cccl,nvcc]==12.8.*"]


def test_plan_for_a_torch_that_bundles_its_cuda_libraries(tmp_path):
    """A CUDA torch with no nvidia-* wheels (Windows wheels ship the DLLs inside torch): every
    piece numba-cuda uses comes from cuda-toolkit at torch's CUDA version."""
    write_dist(str(tmp_path), "torch", "2.8.0+cu128", ["filelock"])
    reqs, line = inst_mod.plan_cuda("2.8.0+cu128", "12.8", inst_mod.installed([str(tmp_path)]))
    assert reqs == ["cuda-toolkit[cccl,cudart,nvcc,nvjitlink,nvrtc]==12.8.*"], reqs
    assert "bundled" not in line or "used as they are" not in line


@pytest.mark.parametrize("cuda,want", [(None, "CPU-only"), ("11.8", "CUDA 12 and 13")])
def test_plan_adds_nothing_for_cpu_or_unsupported_cuda(tmp_path, cuda, want):
    write_dist(str(tmp_path), "torch", "2.8.0", [])
    reqs, line = inst_mod.plan_cuda("2.8.0", cuda, inst_mod.installed([str(tmp_path)]))
    assert reqs == [] and want in line


def test_torch_pins_evaluate_markers(tmp_path):
    write_dist(str(tmp_path), "torch", "2.8.0", [
        'nvidia-cuda-nvrtc-cu12==12.8.93; platform_system == "Linux"',
        'nvidia-cuda-nvrtc-cu12==0.0.1; platform_system == "NoSuchOS"', "filelock",
        'cuda-toolkit[nvrtc]==13.0.3; extra == "x"'])
    pins = inst_mod.torch_pins(inst_mod.installed([str(tmp_path)]))
    if sys.platform.startswith("linux"):
        assert pins == {"nvidia-cuda-nvrtc-cu12": ("==12.8.93", [])}


# ------------------------------------------------------------------------------ refusals (offline)
# pip's dry run of the plain `numba-cuda[cu12]>=0.30.4` in a torch cu128 environment (issue #24)
ISSUE_REPORT = {"install": [
    {"metadata": {"name": n, "version": v}} for n, v in [
        ("cuda-bindings", "12.9.10"), ("cuda-toolkit", "12.9.2.0"), ("nvidia-cuda-cccl-cu12", "12.9.27"),
        ("nvidia-cuda-nvcc-cu12", "12.9.86"), ("nvidia-cuda-nvrtc-cu12", "12.9.86"),
        ("nvidia-cuda-runtime-cu12", "12.9.79")]]}


def test_changes_name_every_replaced_distribution(tmp_path):
    fake_env(str(tmp_path), "cu128", torch_module=False)
    inst = inst_mod.installed([str(tmp_path)])
    ch = inst_mod.changes(ISSUE_REPORT, inst)
    assert ch == ["cuda-bindings 13.5.0 -> 12.9.10", "nvidia-cuda-nvrtc-cu12 12.8.93 -> 12.9.86",
                  "nvidia-cuda-runtime-cu12 12.8.90 -> 12.9.79"]
    assert inst_mod.additions(ISSUE_REPORT, inst)[:2] == ["cuda-toolkit==12.9.2.0", "nvidia-cuda-cccl-cu12==12.9.27"]
    assert inst_mod.changes(ISSUE_REPORT, inst, loose=("cuda-bindings", "nvidia-cuda-nvrtc-cu12",
                                                       "nvidia-cuda-runtime-cu12")) == []


def test_a_run_that_would_change_anything_is_refused_and_installs_nothing(tmp_path, monkeypatch):
    fake_env(str(tmp_path), "cu128", torch_module=False)
    real = inst_mod.installed
    monkeypatch.setattr(inst_mod, "installed", lambda path=None: real([str(tmp_path)]))
    monkeypatch.setattr(inst_mod, "require_pip", lambda python=None: (24, 0))
    monkeypatch.setattr(inst_mod, "dry_run", lambda reqs, inst, loose=(), python=None: (ISSUE_REPORT, None))
    monkeypatch.setattr(inst_mod.subprocess, "call", lambda *a, **k: pytest.fail("pip must not run"))
    with pytest.raises(inst_mod.Refused) as e:
        inst_mod.checked_install(["numba-cuda[cu12]>=0.30.4"], dry=False)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("refused: numba-cuda[cu12]>=0.30.4 would change installed packages")
    assert "cuda-bindings 13.5.0 -> 12.9.10" in msg and "nothing was installed" in msg


def test_a_conflict_is_refused_with_pips_reason(monkeypatch):
    monkeypatch.setattr(inst_mod, "require_pip", lambda python=None: (24, 0))
    stderr = textwrap.dedent("""\
        ERROR: Cannot install numba-cuda[cu12]==0.30.4 because these package versions have conflicting dependencies.

        The conflict is caused by:
            The user requested (constraint) cuda-bindings==13.5.0
            numba-cuda[cu12] 0.30.4 depends on cuda-bindings<13.0.0 and >=12.9.1; extra == "cu12"

        To fix this you could try to:
        ERROR: ResolutionImpossible: for help visit https://pip.pypa.io/en/latest/topics/dependency-resolution/""")

    def fake_run(cmd, **kw):
        return subprocess.CompletedProcess(cmd, 1, "", stderr)
    monkeypatch.setattr(inst_mod.subprocess, "run", fake_run)
    monkeypatch.setattr(inst_mod.subprocess, "call", lambda *a, **k: pytest.fail("pip must not run"))
    with pytest.raises(inst_mod.Refused) as e:
        inst_mod.checked_install(["numba-cuda[cu12]>=0.30.4"], dry=False)
    msg = str(e.value)
    assert "\n" not in msg and "cannot be installed without changing installed packages" in msg
    assert "cuda-bindings==13.5.0" in msg and "cuda-bindings<13.0.0" in msg


def test_constraints_pin_every_installed_distribution(tmp_path):
    fake_env(str(tmp_path), "cu128", torch_module=False)
    inst = inst_mod.installed([str(tmp_path)])
    text = inst_mod.constraints(inst, loose=("numpy",))
    lines = text.split()
    assert "torch==2.8.0" in lines and "nvidia-cuda-nvrtc-cu12==12.8.93" in lines and "cuda-bindings==13.5.0" in lines
    assert not any(ln.startswith("numpy==") for ln in lines) and len(lines) == len(inst) - 1


def test_satisfied():
    inst = {"numpy": ("numpy", "2.5.5", []), "numba-cuda": ("numba-cuda", "0.30.4", PACK["numba-cuda"][1])}
    assert inst_mod.satisfied("numpy", inst) and inst_mod.satisfied("numba-cuda>=0.30.4", inst)
    assert not inst_mod.satisfied("numba-cuda>=0.31", inst) and not inst_mod.satisfied("pytest", inst)
    assert not inst_mod.satisfied("numba-cuda[cu12]>=0.30.4", inst)  # the extra's wheels are not there


def test_would_run_lines_are_safe_to_paste():
    cmd = inst_mod.pip("cuda-toolkit[cccl,nvcc]==12.8.1", "numba-cuda>=0.30.4")
    line = inst_mod.shown(cmd)
    assert shlex.split(line) == cmd and "'numba-cuda>=0.30.4'" in line


def test_legacy_pip_command_is_the_plain_extra():
    assert inst_mod.pip_command("12.8")[0][-1] == "numba-cuda[cu12]>=0.30.4"
    assert inst_mod.pip_command(None) == (None, "CPU-only torch; the Numba kernels will stay off")


# ------------------------------------------------------------------------------ end to end (offline)
def _bare_venv(path):
    """A venv without pip whose site-packages we fill by hand (+ packaging, which install.py reads
    metadata with), and its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    py = os.path.join(str(path), "bin", "python")
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    import packaging
    os.symlink(os.path.dirname(packaging.__file__), os.path.join(site, "packaging"))
    return py, site


def _run(py, *args, env=None):
    e = dict(os.environ)
    e.pop("PYTHONPATH", None)
    e.update(env or {})
    return subprocess.run([py, os.path.join(ROOT, "install.py"), *args], capture_output=True, text=True,
                          timeout=300, env=e, cwd=ROOT)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the venv layout and torch pins are Linux's")
@pytest.mark.parametrize("mode", [[], ["--standalone"]], ids=["comfyui", "standalone"])
def test_a_torch_that_fails_to_import_is_reported_never_replaced(tmp_path, mode):
    py, site = _bare_venv(tmp_path / "v")
    fake_env(site, "cu128", broken="OSError('libcudnn.so.9: cannot open shared object file: No such file or directory')")
    p = _run(py, *mode)
    err = p.stderr.strip()
    assert p.returncode == 2, p.stdout + p.stderr
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("install.py: error: torch 2.8.0 is installed but does not import (OSError: libcudnn.so.9")
    assert "never replaces" in err
    assert "torch==" not in p.stdout  # no torch install planned


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the venv layout and torch pins are Linux's")
def test_plan_line_end_to_end_and_no_pip(tmp_path):
    """install.py in a simulated cu128 environment says what it would add in one line; without a
    working pip it stops with one line (before anything is run)."""
    py, site = _bare_venv(tmp_path / "v")
    fake_env(site, "cu128")
    p = _run(py, "--dry-run")
    assert p.returncode == 2, p.stdout + p.stderr
    out = p.stdout.strip().splitlines()
    assert out == ["[flux-numba] torch 2.8.0 is CUDA 12.8: adding NVVM / CCCL at its CUDA version "
                   "(cuda-toolkit[cccl,nvcc]==12.8.*); torch's NVRTC 12.8.93 / nvJitLink 12.8.93 / cudart 12.8.90 "
                   "are used as they are",
                   "[flux-numba] note: cuda-bindings 13.5.0 is for CUDA 13, torch is CUDA 12.8; left as it is "
                   "(install.py changes nothing installed). If numba-cuda cannot initialise CUDA, run: "
                   f"{py} -m pip install 'cuda-bindings>=12.9.1,<13'"], out
    assert p.stderr.strip().endswith("has no working pip (python -m pip fails): install pip for it first")
    assert len(p.stderr.strip().splitlines()) == 1


def test_bad_option_is_one_line():
    p = _run(sys.executable, "--no-such-option")
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.strip().splitlines() == ["install.py: error: unrecognized arguments: '--no-such-option' "
                                             "(--help lists the options)"]


# ------------------------------------------------------------------------------ with pip and the index
def _index_reachable():
    """None when pip's index (PIP_INDEX_URL or pypi.org) answers on its port, else why not."""
    from urllib.parse import urlparse
    url = urlparse(os.environ.get("PIP_INDEX_URL") or "https://pypi.org/simple")
    host, port = url.hostname, url.port or (443 if url.scheme == "https" else 80)
    if url.scheme == "file":
        return None
    try:
        socket.create_connection((host, port), timeout=5).close()
        return None
    except OSError as e:
        return f"the package index {host}:{port} is unreachable ({e})"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the venv layout and torch pins are Linux's")
@pytest.mark.parametrize("flavour", sorted(FLAVOURS))
def test_dry_run_in_a_simulated_venv_against_the_index(tmp_path, flavour):
    """A real venv with pip whose metadata mirrors torch <flavour>: install.py --dry-run picks the
    wheels at torch's CUDA version, pip's dry run confirms they change nothing, `pip freeze` is the
    same before and after; the plain numba-cuda extra is refused there."""
    why = _index_reachable()
    if why:
        pytest.skip(why)
    venv = tmp_path / "v"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = str(venv / "bin" / "python")
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    fake_env(site, flavour)
    env = {"PIP_DEFAULT_TIMEOUT": "20", "PIP_RETRIES": "1"}
    freeze = lambda: subprocess.run([py, "-m", "pip", "list", "--format=freeze"], capture_output=True,  # noqa: E731
                                    text=True, timeout=120).stdout
    before = freeze()
    p = _run(py, "--dry-run", env=env)
    if "not checked with pip" in p.stdout:
        pytest.skip("pip could not reach the index: " + p.stdout.split("not checked with pip: ", 1)[1][:200])
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    assert any(WANT[flavour][0] in ln and "adding NVVM / CCCL" in ln for ln in lines), p.stdout
    run_line = [ln for ln in lines if ln.startswith("[flux-numba] would run: ")]
    assert len(run_line) == 1, p.stdout
    for w in WANT[flavour][1]:
        assert f"'{w}" in run_line[0] or f" {w}" in run_line[0], (w, run_line[0])
    assert freeze() == before
    # the plain extra numba-cuda's docs give: refused (it would downgrade cuda-bindings / replace torch's pins)
    plain = {"cu126": "cu12", "cu128": "cu12", "cu130": "cu13"}[flavour]
    if plain == "cu12":
        old = dict(os.environ)
        os.environ.update(env)
        try:
            with pytest.raises(inst_mod.Refused) as e:
                inst_mod.checked_install([f"numba-cuda[{plain}]>=0.30.4"], dry=True, python=py, path=[site])
        finally:
            os.environ.clear()
            os.environ.update(old)
        assert "without changing installed packages" in str(e.value) and "cuda-bindings" in str(e.value)
    assert freeze() == before

