#!/usr/bin/env python3
"""Install what the pack needs (ComfyUI-Manager runs this after requirements.txt).

Default (what ComfyUI-Manager does): add the CUDA wheels numba-cuda needs besides what the
installed PyTorch already ships, at the CUDA version of that PyTorch.  numba-cuda compiles kernels
with NVVM and uses NVRTC, nvJitLink, the CUDA runtime headers and CCCL (pip wheels: no system CUDA
toolkit, no C compiler).  A CUDA build of PyTorch ships NVRTC, nvJitLink and the runtime as wheels
(``nvidia-cuda-nvrtc-cu12==12.8.93`` ...); those are used as they are.  What is missing (NVVM,
CCCL, or all of them when torch bundles its CUDA libraries) is added from ``cuda-toolkit[...]`` at
torch's own CUDA version: ``==13.0.3`` when torch pins that meta package (CUDA 13 builds),
``==12.8.*`` for a CUDA 12.8 torch, and so on.  Nothing is added when every piece is there already
(or a system CUDA toolkit of torch's CUDA major provides NVVM).  One line says which.

Nothing already installed is upgraded, downgraded or replaced: every pip run is first made with
``--dry-run --report`` and with every installed distribution pinned as a constraint; when pip
cannot add the wheels without changing an installed distribution (or its report shows a change),
the run is refused with the reason (one line, exit 2) and nothing is installed.  A CPU-only
PyTorch gets nothing (the pack then passes models through unpatched).  A PyTorch that is installed
but fails to import is reported with its error (exit 2) and never replaced.

``--standalone`` (the README's main-job and test commands, outside ComfyUI): also PyTorch when
none is installed (``torch==2.13.0``; pip/setuptools/wheel may be upgraded for it), then the lines
of requirements.txt that are not satisfied yet, one at a time as ComfyUI-Manager installs them.
``--tests`` adds pytest.  ``--dry-run`` prints the pip commands (safe to paste; the real run adds
``-c <installed distributions pinned>``) and installs nothing.
"""
import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.abspath(__file__))
TORCH_FOR_STANDALONE = "torch==2.13.0"  # only when no torch is installed (never replaces the user's)
BUILD_TOOLS = ("pip", "setuptools", "wheel")  # may be upgraded for a standalone torch install only
PREFIX = "[flux-numba] "
MIN_PIP = (22, 2)  # pip install --dry-run --report

# what numba-cuda uses, per CUDA major: component -> (wheel that provides it, cuda-toolkit extra)
COMPONENTS = {
    12: {"nvvm": ("nvidia-cuda-nvcc-cu12", "nvcc"), "nvrtc": ("nvidia-cuda-nvrtc-cu12", "nvrtc"),
         "nvjitlink": ("nvidia-nvjitlink-cu12", "nvjitlink"), "cudart": ("nvidia-cuda-runtime-cu12", "cudart"),
         "cccl": ("nvidia-cuda-cccl-cu12", "cccl")},
    13: {"nvvm": ("nvidia-nvvm", "nvvm"), "nvrtc": ("nvidia-cuda-nvrtc", "nvrtc"),
         "nvjitlink": ("nvidia-nvjitlink", "nvjitlink"), "cudart": ("nvidia-cuda-runtime", "cudart"),
         "cccl": ("nvidia-cuda-cccl", "cccl")},
}
SHIPPED_BY_TORCH = ("nvrtc", "nvjitlink", "cudart")  # what a CUDA torch wheel brings (its pins)
LABEL = {"nvvm": "NVVM", "nvrtc": "NVRTC", "nvjitlink": "nvJitLink", "cudart": "cudart", "cccl": "CCCL"}



def _sibling(name):
    """A module next to install.py, loaded by its path (sys.path left as it is: install.py is also
    loaded by path, into other processes)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("flux_numba_" + name, os.path.join(ROOT, name + ".py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_probes = _sibling("_install_probe")  # what torch and a system CUDA toolkit say, asked in a child interpreter
torch_state, system_toolkit = _probes.torch_state, _probes.system_toolkit

try:
    from packaging.markers import default_environment
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.version import InvalidVersion, Version
except ImportError:  # an environment without packaging: pip's copy
    try:
        from pip._vendor.packaging.markers import default_environment
        from pip._vendor.packaging.requirements import InvalidRequirement, Requirement
        from pip._vendor.packaging.version import InvalidVersion, Version
    except ImportError:
        if __name__ == "__main__":
            sys.exit(f"install.py: error: {sys.executable} has neither pip nor packaging: install pip for it first")
        raise


class Refused(Exception):
    """A pip run (or the state of the environment) that install.py will not go on with: one line."""


# ------------------------------------------------------------------------------ what is installed
def canon(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def installed(path=None):
    """{canonical name: (name, version, [Requires-Dist])} of the distributions on ``path`` (default
    sys.path: the running interpreter's); the first one found per name wins, as for imports."""
    from importlib import metadata
    out = {}
    for d in metadata.distributions(**({} if path is None else {"path": list(path)})):
        name = d.metadata.get("Name")
        if not name or canon(name) in out:
            continue
        out[canon(name)] = (name, d.version, list(d.requires or []))
    return out


def _marker_env(extra=""):
    env = default_environment()
    env["extra"] = extra
    return env


def torch_pins(inst):
    """{canonical name: (specifier, extras)} of torch's requirements on ``nvidia-*`` / ``cuda-*``
    distributions that apply here (markers evaluated)."""
    pins = {}
    for line in (inst.get("torch") or (None, None, []))[2]:
        try:
            r = Requirement(line)
        except InvalidRequirement:
            continue
        if r.marker is not None and not r.marker.evaluate(_marker_env()):
            continue
        c = canon(r.name)
        if c.startswith(("nvidia-", "cuda-")):
            pins[c] = (str(r.specifier), sorted(r.extras))
    return pins


def _exact(spec):
    """'==13.0.3' -> '13.0.3' (None for any other specifier)."""
    m = re.fullmatch(r"==\s*([0-9][0-9A-Za-z.+!]*)", spec or "")
    return m.group(1) if m else None


def major_minor(v):
    """'12.8' / '12.8.93' -> (12, 8); None when it is not a CUDA version."""
    m = re.match(r"^(\d+)\.(\d+)", str(v or ""))
    return (int(m.group(1)), int(m.group(2))) if m else None


def satisfied(req, inst):
    """True when the requirement line is met by what is installed (extras: their wheels too)."""
    r = Requirement(req)
    have = inst.get(canon(r.name))
    if have is None:
        return False
    try:
        if not r.specifier.contains(Version(have[1]), prereleases=True):
            return False
    except InvalidVersion:
        return False
    for extra in r.extras:  # each requirement the extra adds must be installed as well
        for line in have[2]:
            try:
                sub = Requirement(line)
            except InvalidRequirement:
                continue
            if sub.marker is not None and sub.marker.evaluate(_marker_env(extra)) \
                    and not sub.marker.evaluate(_marker_env()):
                if not satisfied(str(Requirement(f"{sub.name}{sub.specifier}")), inst):
                    return False
    return True


# ------------------------------------------------------------------------------ the CUDA wheels
def plan_cuda(torch_version, torch_cuda, inst, system_toolkit=None):
    """(requirements, line): the CUDA wheels to add for this torch (``[]`` when none), and the one
    line that says what is used.  ``torch_cuda``: torch.version.cuda ("12.8"; None = CPU-only);
    ``system_toolkit``: (root, "12.8") of a CUDA toolkit whose NVVM numba-cuda finds, or None."""
    if not torch_cuda:
        return [], f"torch {torch_version} has no CUDA (CPU-only build): no CUDA wheels added; the Numba kernels will stay off"
    mm = major_minor(torch_cuda)
    if mm is None or mm[0] not in COMPONENTS:
        return [], (f"torch {torch_version} is built for CUDA {torch_cuda}: numba-cuda supports CUDA 12 and 13; "
                    "no CUDA wheels added, the Numba kernels may not compile")
    major, minor = mm
    comp = COMPONENTS[major]
    pins = torch_pins(inst)

    def have(c):
        d = inst.get(canon(comp[c][0]))
        return d if d and (major_minor(d[1]) or (0,))[0] == major else None

    shipped = [f"{LABEL[c]} {have(c)[1]}" for c in SHIPPED_BY_TORCH if have(c)]
    ships = " / ".join(shipped) if shipped else "no CUDA wheels (its CUDA libraries are bundled)"
    missing = [c for c in comp if not have(c)]
    if system_toolkit and (major_minor(system_toolkit[1]) or (0,))[0] == major:
        missing = [c for c in missing if c not in ("nvvm", "cccl")]
        if not missing:
            return [], (f"no CUDA wheels added: torch {torch_version} is CUDA {torch_cuda}; numba-cuda uses torch's "
                        f"{ships} and NVVM / CCCL of the CUDA {system_toolkit[1]} toolkit at {system_toolkit[0]}")
    if not missing:
        return [], (f"no CUDA wheels added: torch {torch_version} is CUDA {torch_cuda}; numba-cuda uses torch's {ships} "
                    f"and the NVVM {have('nvvm')[1]} / CCCL {have('cccl')[1]} wheels already installed")
    tk = _exact(pins.get("cuda-toolkit", ("", []))[0])  # CUDA 13 torch pins cuda-toolkit[...]==13.0.3
    version = tk if tk and major_minor(tk) == mm else f"{major}.{minor}.*"
    extras = ",".join(sorted(comp[c][1] for c in missing))
    req = f"cuda-toolkit[{extras}]=={version}"
    uses = f"; torch's {ships} are used as they are" if shipped else ""
    return [req], (f"torch {torch_version} is CUDA {torch_cuda}: adding {' / '.join(LABEL[m] for m in missing)} "
                   f"at its CUDA version ({req}){uses}")


def pip_command(torch_cuda_version):
    """The plain numba-cuda extra for ``torch_cuda_version`` ("12.8" -> ``numba-cuda[cu12]``), as
    numba-cuda's own docs give it, or (None, reason).  install.py does NOT run this: the extra asks
    for the newest CUDA minor (12.9 for a 12.8 torch) and would replace torch's pinned CUDA wheels
    and downgrade cuda-bindings; plan_cuda adds the missing pieces at torch's version instead."""
    if not torch_cuda_version:
        return None, "CPU-only torch; the Numba kernels will stay off"
    extra = {"12": "cu12", "13": "cu13"}.get(str(torch_cuda_version).split(".")[0])
    if extra is None:
        return None, f"torch built for CUDA {torch_cuda_version}: no numba-cuda toolkit extra for it; kernels may not compile"
    return pip(f"numba-cuda[{extra}]>=0.30.4"), None


def cuda_bindings_note(torch_cuda, inst):
    """A warning when the installed cuda-bindings is of another CUDA major than torch (None if not)."""
    mm, cb = major_minor(torch_cuda), inst.get("cuda-bindings")
    if not mm or not cb or (major_minor(cb[1]) or (0,))[0] == mm[0]:
        return None
    want = f"cuda-bindings>={mm[0]}.9.1,<{mm[0] + 1}" if mm[0] == 12 else f"cuda-bindings=={mm[0]}.*"
    return (f"note: cuda-bindings {cb[1]} is for CUDA {major_minor(cb[1])[0]}, torch is CUDA {torch_cuda}; left as it "
            f"is (install.py changes nothing installed). If numba-cuda cannot initialise CUDA, run: "
            f"{shlex.quote(sys.executable)} -m pip install {shlex.quote(want)}")


# ------------------------------------------------------------------------------ pip, checked
def pip(*args):
    return [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", *args]


def shown(cmd):
    """A command line that is safe to paste into a POSIX shell."""
    return shlex.join(cmd)


def constraints(inst, loose=()):
    """A pip constraints file's text: every installed distribution at its version (``loose``
    names are left out)."""
    lines = []
    for c, (name, ver, _) in sorted(inst.items()):
        if c in loose:
            continue
        try:
            Version(ver)
        except InvalidVersion:
            continue
        lines.append(f"{c}=={ver}")
    return "\n".join(lines) + "\n"


def changes(report, inst, loose=()):
    """['name old -> new'] for every installed distribution pip's report would replace."""
    out = []
    for item in report.get("install", []):
        md = item.get("metadata", {})
        c = canon(md.get("name", ""))
        if c in inst and c not in loose and inst[c][1] != md.get("version"):
            out.append(f"{inst[c][0]} {inst[c][1]} -> {md.get('version')}")
    return out


def additions(report, inst):
    """['name==version' / 'name[extras]==version'] that pip's report adds (new distributions)."""
    out = []
    for item in report.get("install", []):
        md = item.get("metadata", {})
        c = canon(md.get("name", ""))
        if c in inst:  # already there (a change of it is what changes() reports)
            continue
        ex = item.get("requested_extras") or []
        out.append(f"{md.get('name')}{'[' + ','.join(sorted(ex)) + ']' if ex else ''}=={md.get('version')}")
    return out


def pip_version(python=None):
    r = subprocess.run([python or sys.executable, "-m", "pip", "--version"], capture_output=True, text=True)
    m = re.match(r"pip (\d+)\.(\d+)", r.stdout)
    return (int(m.group(1)), int(m.group(2))) if r.returncode == 0 and m else None


def _conflict(stderr):
    """pip's reason for a failed resolution, on one line."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip() and "is ignored: it is neither" not in ln]
    if "conflict is caused by:" in stderr:
        i = next(i for i, ln in enumerate(lines) if "conflict is caused by" in ln)
        cause = []
        for ln in lines[i + 1:]:
            if ln.startswith(("To fix", "Additionally", "ERROR", "1.", "2.")):
                break
            if ln not in cause:
                cause.append(ln)
        return "; ".join(cause) or lines[-1]
    errs = [ln for ln in lines if ln.startswith("ERROR")]
    return (errs[0] if errs else (lines[-1] if lines else "no output"))[:400]


def dry_run(reqs, inst, loose=(), python=None):
    """(report, None) of ``pip install --dry-run --report -`` with every installed distribution
    pinned, or (None, (kind, reason)) with kind "conflict" (pip cannot add ``reqs`` without
    changing an installed distribution) or "pip" (anything else: index unreachable, no such
    version...)."""
    with tempfile.NamedTemporaryFile("w", suffix="-installed.txt", delete=False) as f:
        f.write(constraints(inst, loose))
        cons = f.name
    base = [python or sys.executable, "-m", "pip", "install", "--dry-run", "--disable-pip-version-check",
            "--no-input", "-c", cons]
    try:
        r = subprocess.run(base + ["--quiet", "--report", "-", *reqs], capture_output=True, text=True)
        if r.returncode and "ResolutionImpossible" in r.stderr:  # --quiet drops pip's "conflict is caused by"
            r2 = subprocess.run(base + list(reqs), capture_output=True, text=True)
            r = subprocess.CompletedProcess(r.args, r.returncode, r.stdout, r2.stdout + r2.stderr + r.stderr)
    finally:
        os.unlink(cons)
    if r.returncode:
        kind = "conflict" if ("ResolutionImpossible" in r.stderr or "conflict" in r.stderr) else "pip"
        return None, (kind, _conflict(r.stderr))
    try:
        return json.loads(r.stdout), None
    except ValueError:
        return None, ("pip", "pip's --report output is not JSON")


_PIP_OK = {}


def require_pip(python=None):
    """Raise Refused unless ``python -m pip`` works and can report what it would do."""
    python = python or sys.executable
    if python not in _PIP_OK:
        pv = pip_version(python)
        if pv is None:
            raise Refused(f"{python} has no working pip (python -m pip fails): install pip for it first")
        if pv < MIN_PIP:
            raise Refused(f"pip {pv[0]}.{pv[1]} cannot report what it would change (needs pip 22.2+ for "
                          f"--dry-run --report); upgrade it yourself ({shown([python, '-m', 'pip', 'install', '-U', 'pip'])}) "
                          "and run install.py again")
        _PIP_OK[python] = pv
    return _PIP_OK[python]


def checked_install(reqs, dry, loose=(), what=None, python=None, path=None):
    """Install ``reqs`` only if pip adds distributions and changes none; returns 0, or raises Refused.
    ``python`` / ``path``: the interpreter whose pip runs and its sys.path (default: this one)."""
    what = what or " ".join(reqs)
    require_pip(python)
    inst = installed(path)
    report, err = dry_run(reqs, inst, loose, python)
    if err:
        kind, why = err
        if kind == "conflict":
            raise Refused(f"refused: {what} cannot be installed without changing installed packages (pip: {why}); "
                          "nothing was installed")
        if dry:
            print(PREFIX + "would run: " + shown([python or sys.executable] + pip(*reqs)[1:]) + f"   (not checked with pip: {why})")
            return 0
        raise Refused(f"pip cannot plan {what}: {why}; nothing was installed")
    ch = changes(report, inst, loose)
    if ch:
        raise Refused(f"refused: {what} would change installed packages ({', '.join(ch)}); nothing was installed")
    add = additions(report, inst)
    if not add:
        print(PREFIX + f"{what}: already satisfied")
        return 0
    cmd = pip(*add)
    if python:
        cmd[0] = python
    print(PREFIX + ("would run: " if dry else "running: ") + shown(cmd))
    if dry:
        return 0
    with tempfile.NamedTemporaryFile("w", suffix="-installed.txt", delete=False) as f:
        f.write(constraints(inst, loose))
        cons = f.name
    try:
        rc = subprocess.call(cmd + ["-c", cons])
    finally:
        os.unlink(cons)
    if rc:
        raise Refused(f"pip failed (exit {rc}): {shown(cmd)}")
    after = installed(path)
    moved = [f"{inst[c][0]} {inst[c][1]} -> {after[c][1] if c in after else 'removed'}"
             for c in inst if c not in loose and (c not in after or after[c][1] != inst[c][1])]
    if moved:
        raise Refused(f"pip changed installed packages although its dry run did not ({', '.join(moved)})")
    return 0



def requirement_lines(path=os.path.join(ROOT, "requirements.txt")):
    out = []
    with open(path) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                out.append(line)
    return out


# ------------------------------------------------------------------------------ main
def importable_torch(inst):
    """torch_state, with a torch that is installed but does not import refused (never replaced)."""
    state, version, detail = torch_state(inst)
    if state == "broken":
        raise Refused(f"torch {version} is installed but does not import ({detail}); install.py never replaces "
                      "an installed torch: repair it (or use a fresh venv) and run install.py again")
    return state, version, detail


def cuda_step(dry):
    inst = installed()
    state, version, cuda = importable_torch(inst)
    if state == "absent":
        print(PREFIX + "torch is not installed: no CUDA wheels added (ComfyUI's torch comes first; "
              "outside ComfyUI: install.py --standalone)")
        return 0
    mm = major_minor(cuda)
    tk = None
    if mm and mm[0] in COMPONENTS and canon(COMPONENTS[mm[0]]["nvvm"][0]) not in inst:
        tk = system_toolkit()
    reqs, line = plan_cuda(version, cuda, inst, tk)
    print(PREFIX + line)
    note = cuda_bindings_note(cuda, inst)
    if note:
        print(PREFIX + note)
    return checked_install(reqs, dry, what=" ".join(reqs)) if reqs else 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--standalone", action="store_true",
                   help="outside ComfyUI: install torch if none is installed, then requirements.txt")
    p.add_argument("--tests", action="store_true", help="with --standalone: also pytest")
    p.add_argument("--dry-run", action="store_true", help="print what would be installed; install nothing")
    p.error = lambda msg: p.exit(2, f"install.py: error: {msg} (--help lists the options)\n")
    a, extra = p.parse_known_args(argv)
    if extra:  # quoted: an empty or blank argument is visible
        p.error(f"unrecognized arguments: {' '.join(map(repr, extra))}")
    standalone = a.standalone or a.tests
    try:
        if standalone:
            state, version, err = importable_torch(installed())
            if state == "absent":
                print(PREFIX + f"no torch installed: installing {TORCH_FOR_STANDALONE}")
                checked_install([TORCH_FOR_STANDALONE], a.dry_run, loose=BUILD_TOOLS)
            todo = [r for r in requirement_lines() if not satisfied(r, installed())]
            if a.tests and not satisfied("pytest", installed()):
                todo.append("pytest")
            for req in todo:
                checked_install([req], a.dry_run)
            if not todo:
                print(PREFIX + "requirements.txt" + (" and pytest" if a.tests else "") + ": already installed")
            if a.dry_run and state == "absent":
                print(PREFIX + "then: the CUDA wheels that match the torch just installed (planned once it is there)")
                return 0
        return cuda_step(a.dry_run)
    except Refused as e:
        print(f"install.py: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("install.py: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
