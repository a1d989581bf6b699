"""The README's main-job command, install.py and the test runner, run as a user would (CPU); the
benchmark harness and the bench/ tools: test_cli_bench.py."""
import json
import os
import shlex
import subprocess
import sys

import pytest

from _cli_testing import ROOT, _bad_files, _no_nan, _one_line_exit_2, run, strict_load


def test_strict_load_refuses_nan():
    with pytest.raises(ValueError):
        json.loads('{"a": Infinity}', parse_constant=_no_nan)


def agrees(rec, min_db):
    """Same math, different op order: identical, or agreement far beyond bf16 noise."""
    return rec["identical"] if rec["psnr_db"] is None else rec["psnr_db"] > min_db


def test_main_job_on_embedded_model(tmp_path):
    p = run("run.py", "--steps", "3", "--width", "128", "--height", "96", "--out", str(tmp_path))
    out = p.stdout
    assert "embedded tiny FLUX" in out and "agreement stock vs patched" in out
    rec = strict_load(tmp_path / "run.json")
    assert len(rec["stock_ms"]) == len(rec["patched_ms"]) == 3
    assert agrees(rec, 60)
    # on the CPU both paths run on torch: identical latents, written as null + identical (no Infinity)
    assert rec["identical"] is True and rec["psnr_db"] is None and rec["max_abs_diff"] == 0
    assert "identical outputs" in out
    # no Numba kernel ran: the times are flagged, in run.json and in the printed table
    assert rec["speed_measurement"] is False and "no Numba kernel ran" in rec["speed_note"]
    assert "NOT a speed measurement" in out and "[not a speed measurement]" in out
    # the picture is named and described as what it is: the latent, not a decoded image
    assert (tmp_path / "latents.safetensors").exists() and (tmp_path / "latent_preview.png").exists()
    assert not (tmp_path / "patched_preview.png").exists()
    assert rec["latent_preview"]["file"] == "latent_preview.png" and "not a decoded image" in out


def test_main_job_with_a_written_model_batch_two(tmp_path):
    path = tmp_path / "tiny.safetensors"
    run("run.py", "--write-model", str(path))
    p = run("run.py", "--model", str(path), "--steps", "2", "--batch", "2", "--width", "64", "--height", "64",
            "--out", str(tmp_path / "o"))
    assert "hidden 128" in p.stdout
    rec = strict_load(tmp_path / "o" / "run.json")
    assert agrees(rec, 60) and rec["batch"] == 2


# (arguments, what the one line must contain); {name} = a file from _bad_files
BAD = [
    (["--width", "1000"], ["--width", "multiple of 16"]),
    (["--height", "0"], ["--height", "multiple of 16"]),
    (["--width", "abc"], ["--width"]),
    (["--steps", "0"], ["--steps", ">= 1"]),
    (["--steps", "-3"], ["--steps", ">= 1"]),
    (["--steps", "two"], ["--steps"]),
    (["--batch", "0"], ["--batch", ">= 1"]),
    (["--txt-len", "0"], ["--txt-len", ">= 1"]),
    (["--txt-len", "-5"], ["--txt-len"]),
    (["--guidance", "nan"], ["--guidance", "finite"]),
    (["--guidance", "inf"], ["--guidance", "finite"]),
    (["--seed", "1.5"], ["--seed"]),
    (["--device", "gpu"], ["--device", "invalid choice", "gpu"]),
    (["--device", "cuda"], ["--device", "no CUDA GPU"]),
    (["--dtype", "fp64"], ["--dtype", "invalid choice"]),
    (["--attention", "bogus"], ["--attention", "invalid choice", "bogus"]),
    (["--no-such-flag"], ["unrecognized arguments", "--no-such-flag"]),
    (["--comfy-min"], ["--comfy-min", "--write-model"]),
    (["--model", "{missing}"], ["--model", "no such file", "missing.safetensors"]),
    (["--model", "{folder}"], ["--model", "folder"]),
    (["--model", "{six}"], ["--model", "six.safetensors", "too short"]),
    (["--model", "{junk}"], ["--model", "x.safetensors", "not a FLUX.1 diffusion model"]),
    (["--model", "{vae}"], ["--model", "vae.safetensors", "not a FLUX.1 diffusion model", "a VAE"]),
    (["--model", "{garbage}"], ["--model", "garbage.safetensors", "not a safetensors file"]),
    (["--model", "{notjson}"], ["--model", "notjson.safetensors", "not a safetensors file"]),
    (["--model", "{listjson}"], ["--model", "list.safetensors", "not a safetensors file"]),
    (["--model", "{trunc}"], ["--model", "trunc.safetensors", "truncated"]),
    (["--out", "{afile}"], ["--out", "afile", "not a folder"]),
    (["--write-model", "{afile}/sub/m.safetensors"], ["--write-model", "m.safetensors"]),
    (["--write-model", "{folder}"], ["--write-model", "is a folder", "tiny.safetensors"]),
    (["--write-model", ""], ["--write-model", "empty path"]),
    (["--model", ""], ["--model", "empty path"]),
    (["--out", ""], ["--out", "empty path"]),
    (["--out", "{afile}/sub"], ["--out", "afile", "not a folder"]),
]


@pytest.mark.parametrize("args,want", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_main_job_bad_input(tmp_path, args, want):
    """Each bad option or file: non-zero exit, ONE line of output naming it, no traceback, no files."""
    files = _bad_files(tmp_path)
    argv = [x.format(**files) for x in args]
    out = tmp_path / "out"
    if "--out" not in args:
        argv += ["--out", str(out)]
    p = run("run.py", *argv, check=False)
    text = (p.stdout + p.stderr).strip()
    assert p.returncode != 0, text
    assert "Traceback" not in text and len(text.splitlines()) == 1, text
    assert p.stdout == "" and text.startswith("run.py: error: "), text
    for w in want:
        assert w in text, (w, text)
    assert not out.exists(), "a failed run left its output folder"


def test_main_job_one_step_progress_and_wording(tmp_path):
    """--steps 1: the median is not said to exclude a first step; progress lines on long runs
    (--progress-every 0: one per step here)."""
    p = run("run.py", "--steps", "1", "--width", "16", "--height", "16", "--txt-len", "3", "--out", str(tmp_path / "o"))
    assert "first step excluded" not in p.stdout and "one step: it includes warm-up" in p.stdout
    p = run("run.py", "--steps", "3", "--width", "16", "--height", "16", "--txt-len", "3", "--out", str(tmp_path / "p"),
            "--progress-every", "0")
    assert "stock path: step 1/3" in p.stdout and "patched path: step 2/3" in p.stdout
    assert "first step excluded" in p.stdout


def test_main_job_ctrl_c_is_one_line_and_writes_nothing(tmp_path):
    import signal
    import time
    out = tmp_path / "o"
    env = dict(os.environ)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    proc = subprocess.Popen([sys.executable, "run.py", "--steps", "100000", "--width", "16", "--height", "16",
                             "--txt-len", "3", "--out", str(out), "--progress-every", "0.2"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        t0 = time.monotonic()
        line = ""
        while "step" not in line and time.monotonic() - t0 < 300:  # sampling has started
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
        assert "stock path: step" in line, line
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert err.strip().splitlines() == [err.strip()] and "interrupted at stock step" in err and "Traceback" not in err
    assert not out.exists()


@pytest.mark.parametrize("script", ["run.py", "bench.py"])
def test_before_install_is_one_line(script):
    """Run before install.py (here: no site-packages, so no torch): one line saying what to run."""
    p = subprocess.run([sys.executable, "-S", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    text = (p.stdout + p.stderr).strip()
    assert p.returncode == 2 and len(text.splitlines()) == 1 and "Traceback" not in text, text
    assert "is not installed" in text and "install.py --standalone" in text


def test_main_job_in_the_simulator(tmp_path):
    """--simulator runs the Numba kernels (CUDA simulator) in the patched path on a tiny latent."""
    p = run("run.py", "--simulator", "--steps", "1", "--width", "16", "--height", "16", "--txt-len", "3",
            "--out", str(tmp_path))
    rec = strict_load(tmp_path / "run.json")
    assert "numba" in "".join(sum(rec["backends"].values(), []))
    assert rec["psnr_db"] > 30, rec
    assert rec["speed_measurement"] is False and "simulator" in rec["speed_note"]
    assert "NOT a speed measurement" in p.stdout


def test_every_option_has_help():
    import importlib.util
    spec = importlib.util.spec_from_file_location("run_cli_under_test", os.path.join(ROOT, "run.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    actions = [x for x in mod.parser()._actions if x.option_strings]
    assert len(actions) >= 15
    for x in actions:
        assert x.help and x.help.strip(), x.option_strings


def _pip_freeze():
    return subprocess.run([sys.executable, "-m", "pip", "list", "--format=freeze", "--disable-pip-version-check"],
                          capture_output=True, text=True, timeout=120).stdout


def test_install_help_and_dry_run_install_nothing():
    before = _pip_freeze()
    h = run("install.py", "--help")
    assert "--dry-run" in h.stdout and "--standalone" in h.stdout
    d = run("install.py", "--dry-run", "--standalone", "--tests")
    lines = d.stdout.splitlines()
    assert lines and all(ln.startswith("[flux-numba] ") for ln in lines), d.stdout
    # what it would run (safe to paste), or that the CUDA wheels are there already: one line says which
    assert any(ln.startswith("[flux-numba] would run: ") or "no CUDA wheels added" in ln for ln in lines), d.stdout
    for ln in lines:
        if ln.startswith("[flux-numba] would run: "):
            cmd = shlex.split(ln[len("[flux-numba] would run: "):].split("   (not checked", 1)[0])
            assert cmd[1:4] == ["-m", "pip", "install"], ln
    assert "pip failed" not in d.stdout + d.stderr and "refused" not in d.stdout + d.stderr
    assert _pip_freeze() == before


def test_comfy_venv_script_usage():
    for args in ([], ["/tmp/no-such-venv-for-test"], ["/tmp/no-such-venv-for-test", "/no/such/tree"]):
        p = subprocess.run(["bash", "tests/comfy_venv.sh", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert p.returncode == 2 and p.stdout == "", p.stderr
        assert len(p.stderr.strip().splitlines()) == 1 and p.stderr.startswith("comfy_venv.sh: error: ")
        assert "unbound variable" not in p.stderr
    assert not os.path.exists("/tmp/no-such-venv-for-test")


def test_run_sh_without_python():
    p = subprocess.run(["bash", "tests/run.sh"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHON="no-such-python-for-test"))
    assert p.returncode == 2 and p.stderr.strip() == ("tests/run.sh: error: no-such-python-for-test not found "
                                                      "(set PYTHON=/path/to/python)")


# ---------------------------------------------------------------- first-hour wrong uses (issue #39)
def test_output_paths_that_cannot_be_written_are_refused_first(tmp_path):
    """/proc takes no new files, though os.access says yes to root: run.py --out, --write-model and
    bench.py --json are refused before any work, with one line, exit 2 (not after the whole job, not twice)."""
    if not os.path.isdir("/proc/self"):
        pytest.skip("no /proc here")
    for args, want in ((["--out", "/proc/x", "--steps", "1", "--width", "16", "--height", "16", "--txt-len", "3"],
                        ["--out", "/proc/x"]),
                       (["--write-model", "/proc/x.safetensors"], ["--write-model", "/proc/x.safetensors"])):
        p = run("run.py", *args, check=False)
        err = _one_line_exit_2(p, "run.py")
        assert p.stdout == "" and all(w in err for w in want), err
    p = run("bench.py", "--config", "tiny", "--device", "cpu", "--res", "32", "--txt", "8", "--no-comfy", "--no-ref",
            "--variants", "exact", "--reps", "1", "--warmup", "0", "--json", "/proc/x", check=False)
    err = _one_line_exit_2(p, "bench.py")
    assert "--json" in err and "/proc/x" in err and p.stdout == ""


def _fake_tree(path):
    (path / "comfy").mkdir(parents=True)
    (path / "main.py").write_text("")
    (path / "comfyui_version.py").write_text('__version__ = "0.8.0"\n')
    return path


@pytest.mark.parametrize("var,bad", [("COMFYUI_PATH", "{missing}"), ("COMFYUI_PATH", "{empty}"),
                                     ("COMFYUI_PATHS", "{tree}" + os.pathsep + "{empty}")])
def test_wrong_comfyui_path_stops_the_tests_at_once(tmp_path, var, bad):
    """A COMFYUI_PATH / COMFYUI_PATHS entry that is not a ComfyUI tree: pytest stops at session start,
    exit 2, one line naming it -- not a run of every other test first."""
    import time
    empty = tmp_path / "empty"
    empty.mkdir()
    value = bad.format(missing=tmp_path / "missing", empty=empty, tree=_fake_tree(tmp_path / "tree"))
    env = {k: v for k, v in os.environ.items() if k not in ("COMFYUI_PATH", "COMFYUI_PATHS")}
    env[var] = value
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "tests/test_cli.py::test_strict_load_refuses_nan"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 2, p.stdout + p.stderr
    assert time.monotonic() - t0 < 60 and "passed" not in p.stdout, p.stdout
    err = p.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, p.stderr
    assert var in err and str(tmp_path / ("missing" if "missing" in bad else "empty")) in err, err


def test_venv_in_the_clone_is_ignored():
    """The README's `python3 -m venv .venv` in the clone: git does not list it as untracked."""
    with open(os.path.join(ROOT, ".gitignore")) as f:
        lines = {ln.strip() for ln in f}
    assert lines & {".venv", ".venv/", "/.venv", "/.venv/"}, lines


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o002, 0o664)])
def test_written_safetensors_follow_the_umask(tmp_path, umask, mode):
    """run.py's --write-model model and latents.safetensors get a new file's usual mode (safetensors'
    save_file alone makes them 0600)."""
    env = dict(os.environ)
    env.pop("NUMBA_ENABLE_CUDASIM", None)

    def go(*args):
        p = subprocess.run([sys.executable, "run.py", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=600, preexec_fn=lambda: os.umask(umask))
        assert p.returncode == 0, p.stdout + p.stderr
    go("--write-model", str(tmp_path / "m.safetensors"))
    go("--steps", "1", "--width", "16", "--height", "16", "--txt-len", "3", "--out", str(tmp_path / "o"))
    for f in (tmp_path / "m.safetensors", tmp_path / "o" / "latents.safetensors"):
        assert oct(os.stat(f).st_mode & 0o777) == oct(mode), f


@pytest.mark.parametrize("arg", ["", " ", "a b"])
def test_install_unknown_argument_is_shown_quoted(arg):
    """An empty or blank argument is visible in the one error line (quoted)."""
    p = run("install.py", arg, check=False)
    err = _one_line_exit_2(p, "install.py")
    assert f"unrecognized arguments: {arg!r}" in err and p.stdout == ""


def test_browser_tools_says_what_it_found_and_never_fails():
    """tests/browser_tools.sh (what .ci/run uses before the browser tests): one line per tool, exit 0;
    without npm / apt-get it says so instead of failing (here: a PATH without them and no chromium)."""
    env = dict(os.environ, PATH="/nonexistent-bin", CHROMIUM_PATH="/nonexistent-chromium",
               PLAYWRIGHT_CORE_DIR="/nonexistent-pw")
    p = subprocess.run(["/bin/bash", "tests/browser_tools.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.strip().splitlines()
    assert len(lines) == 2 and all(ln.startswith("browser tools: ") for ln in lines), p.stdout
    assert "chromium" in lines[0] and "playwright-core" in lines[1]
    if not os.path.exists("/usr/bin/chromium") and not os.path.exists("/usr/bin/chromium-browser"):
        assert "no apt-get here" in lines[0], lines[0]
    if not os.path.isdir(os.path.join(ROOT, ".browser-tools")) and not os.path.isdir("/work/browser-tools"):
        assert "no npm here" in lines[1], lines[1]


def test_fast_default_set_and_full_set():
    """README's test command runs the fast set (not the tests marked slow) with per-file progress and
    says how long it takes; --full (what .ci/run runs) runs every test; the slow set is small."""
    run_sh = open(os.path.join(ROOT, "tests", "run.sh")).read()
    assert '-m "not slow"' in run_sh and run_sh.count("--file-progress") >= 2 and '"${1:-}" = "--full"' in run_sh
    assert "exec bash tests/run.sh --full" in open(os.path.join(ROOT, ".ci", "run")).read()
    readme = " ".join(open(os.path.join(ROOT, "README.md")).read().split())
    assert "bash tests/run.sh --full" in readme and "about 10 minutes" in readme and "about 15 minutes" in readme

    def collected(*args):
        p = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args,
                            "tests"], cwd=ROOT, capture_output=True, text=True, timeout=300)
        return [ln for ln in p.stdout.splitlines() if "::" in ln]
    slow, everything = collected("-m", "slow"), collected()
    assert 0 < len(slow) < 0.05 * len(everything), (len(slow), len(everything))


def test_file_progress_lines(tmp_path):
    """--file-progress: a line as a file starts and one as it ends, with its skips and their reason."""
    t = tmp_path / "test_progress_probe.py"
    t.write_text("import pytest\n\ndef test_a():\n    pass\n\ndef test_b():\n    pytest.skip('probe reason')\n")
    # tests/conftest.py (where the option lives) loaded as a plugin: the probe file is outside tests/
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest",
                        "--file-progress", "--rootdir", str(tmp_path), str(t)],
                       cwd=os.path.join(ROOT, "tests"), capture_output=True, text=True, timeout=300)
    out = p.stdout
    assert p.returncode == 0, out + p.stderr
    assert "% of 2 tests] " in out and "test_progress_probe.py (2 tests) ..." in out, out
    assert "test_progress_probe.py: 1 passed, 1 skipped in " in out and "skipped 1: probe reason" in out, out
