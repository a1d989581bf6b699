"""The benchmark harness (bench.py) and the bench/ tools run as a user would (CPU): smoke runs, bad
input refused first with one line, the no-GPU PTX tools without their libraries, the GPU tools'
checks before any work."""
import os
import re
import subprocess
import sys

import pytest

from _cli_testing import ROOT, _bad_files, _one_line_exit_2, run, strict_load


def test_benchmark_harness_smoke(tmp_path):
    out = tmp_path / "b.json"
    p = run("bench.py", "--config", "tiny", "--device", "cpu", "--res", "64", "--txt", "8", "--no-comfy",
            "--variants", "pack-torch,exact", "--reps", "2", "--warmup", "1", "--trajectory", "2", "--json", str(out))
    assert p.stdout.rstrip().splitlines()[-1] == f"results: {out}"  # it says where its JSON went
    res = strict_load(out)["results"]
    assert set(res) == {"pack-torch", "exact"}
    tr = res["pack-torch"]
    assert tr["rel_err"] < 1e-5 and (tr["traj_identical"] if tr["traj_psnr_db"] is None else tr["traj_psnr_db"] > 100)
    assert "ms/step" in p.stdout


def test_benchmark_outlier_stress_option(tmp_path):
    out = tmp_path / "b.json"
    run("bench.py", "--config", "tiny", "--device", "cpu", "--res", "32", "--txt", "8", "--no-comfy", "--no-ref",
        "--variants", "exact", "--reps", "1", "--warmup", "0", "--outliers", "4,30", "--json", str(out))
    assert strict_load(out)["info"]["outliers"] == {"channels": 4, "factor": 30.0}
    p = run("bench.py", "--outliers", "4", check=False)
    assert p.returncode == 2 and "--outliers: expected N,F" in p.stderr and "Traceback" not in p.stderr


def test_benchmark_default_variants_on_cpu(tmp_path):
    """The README's bench smoke command (default variants): what cannot run on a CPU (+graph, and
    stock without ComfyUI) is skipped with a note, the rest runs, exit 0, strict JSON."""
    out = tmp_path / "b.json"
    p = run("bench.py", "--config", "tiny", "--device", "cpu", "--res", "64", "--txt", "8", "--reps", "1",
            "--warmup", "1", "--no-comfy", "--json", str(out))
    assert "Traceback" not in p.stdout + p.stderr
    doc = strict_load(out)
    res = doc["results"]
    for v in ("exact+graph", "attn8+graph", "fast+graph"):
        assert "not a CUDA device" in res[v]["skipped"] and f"skipping variant {v}" in p.stdout
    assert "ComfyUI" in res["stock"]["skipped"]
    for v in ("pack-torch", "exact", "exact-sdpa", "attn8", "fast"):
        assert res[v]["ms"] > 0 and "error" not in res[v], res[v]
    assert doc["info"]["speed_measurement"] is False and "not a speed measurement" in p.stdout


# (arguments, extra environment, what the one line must contain); {name} = a file from _bad_files
BENCH_BAD = [
    (["--device", "gpu"], {}, ["--device", "invalid choice", "gpu"]),
    (["--device", "cuda"], {}, ["--device", "no CUDA GPU"]),
    (["--variants", "bogus"], {}, ["--variants", "unknown variant", "bogus"]),
    (["--variants", "exact,exact+grahp"], {}, ["--variants", "exact+grahp"]),
    (["--profile", "nope"], {}, ["--profile", "nope"]),
    (["--model", "{missing}"], {}, ["--model", "no such file"]),
    (["--model", "{vae}"], {}, ["--model", "vae.safetensors", "not a FLUX.1 diffusion model"]),
    (["--model", "{six}"], {}, ["--model", "too short"]),
    (["--model", ""], {}, ["--model", "empty path"]),
    (["--json", "{folder}"], {}, ["--json", "is a folder"]),
    (["--json", "{afile}/b.json"], {}, ["--json", "afile", "not a folder"]),
    (["--device", "cpu", "--res", "1024"], {}, ["flux1-dev on the CPU", "GB in fp32", "--config tiny"]),
    (["--config", "tiny"], {"COMFYUI_PATH": "{missing}"}, ["COMFYUI_PATH", "not a ComfyUI tree"]),
    (["--trajectory", "-1"], {}, ["--trajectory"]),
]


@pytest.mark.parametrize("args,env,want", BENCH_BAD, ids=[" ".join(a) or str(e) for a, e, _ in BENCH_BAD])
def test_benchmark_bad_input(tmp_path, args, env, want):
    """Each bad option, file or environment: exit 2, ONE line naming it, no traceback, no JSON --
    before any model is built."""
    files = _bad_files(tmp_path)
    argv = [x.format(**files) for x in args]
    out = tmp_path / "res" / "b.json"
    if "--json" not in args:
        argv += ["--json", str(out)]
    p = run("bench.py", *argv, env_extra={k: v.format(**files) for k, v in env.items()}, check=False)
    text = (p.stdout + p.stderr).strip()
    assert p.returncode == 2, text
    assert "Traceback" not in text and len(text.splitlines()) == 1 and text.startswith("bench.py: error: "), text
    for w in want:
        assert w in text, (w, text)
    assert not out.exists() and "model ready" not in text


def _hide_libs(tmp_path):
    """A wrapper that runs a script with cuda.pathfinder unable to find the libraries in $HIDE."""
    w = tmp_path / "hide_libs.py"
    w.write_text(
        "import os, runpy, sys\n"
        "import cuda.pathfinder as pf\n"
        "orig, hide = pf.load_nvidia_dynamic_lib, os.environ['HIDE'].split(',')\n"
        "def load(name):\n"
        "    if name in hide:\n"
        "        raise pf.DynamicLibNotFoundError(f'Failure finding lib{name}.so: searched site-packages, conda, system')\n"
        "    return orig(name)\n"
        "pf.load_nvidia_dynamic_lib = load\n"
        "sys.argv = sys.argv[1:]\n"
        "sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    return str(w)


@pytest.mark.parametrize("cmd", [["bench/probes/ptx_hash_attention.py"], ["bench/ops/gpu_fp8.py", "--ptx-only"],
                                 ["bench/probes/sass_attention.py", "--nvdisasm", sys.executable]])
@pytest.mark.parametrize("lib", ["nvrtc", "nvvm"])
def test_ptx_tools_without_nvrtc_or_nvvm_are_one_line(tmp_path, cmd, lib):
    """The README's no-GPU PTX tools on a machine without libnvrtc / libnvvm: one line naming what is
    missing, exit 2 (not a 44-line traceback, not one error per kernel with exit 0)."""
    pytest.importorskip("cuda.pathfinder")
    p = run(_hide_libs(tmp_path), *cmd, env_extra={"HIDE": lib}, check=False)
    text = (p.stdout + p.stderr).strip()
    assert p.returncode == 2, text
    assert "Traceback" not in text and len(text.splitlines()) == 1, text
    assert text.startswith(os.path.basename(cmd[0]) + ": error: ")
    if not re.search(r"error: (ptxas|nvdisasm|\S+) not found on PATH", text):  # sass checks its tools first
        assert f"lib{lib}" in text and "not found" in text, text


# ---------------------------------------------------------------- first-hour wrong uses (issue #39)
@pytest.mark.parametrize("san", ["no-such-compute-sanitizer-for-test", None])
def test_sanitize_without_compute_sanitizer(tmp_path, san):
    """No compute-sanitizer: one line naming it, exit 2, before any log is written (not three
    "rc=127" lines and exit 0)."""
    import shutil
    env = dict(os.environ)
    if san is None:
        if shutil.which("compute-sanitizer"):
            pytest.skip("compute-sanitizer is on PATH here")
        env.pop("SAN", None)
    else:
        env["SAN"] = san
    logs = tmp_path / "san"
    p = subprocess.run(["bash", "bench/sanitize.sh", str(logs)], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=60)
    err = _one_line_exit_2(p, "sanitize.sh")
    assert (san or "compute-sanitizer") in err and "not found" in err and "SAN=" in err
    assert p.stdout == "" and not logs.exists()


def test_gpu_attn_kernels_without_a_gpu():
    """No CUDA GPU (hidden here): one line, exit 2, instead of torch's traceback."""
    p = run("bench/ops/gpu_attn_kernels.py", env_extra={"CUDA_VISIBLE_DEVICES": "", "FLUX_ATTN_DRYRUN": "0"}, check=False)
    err = _one_line_exit_2(p, "gpu_attn_kernels.py")
    assert "no CUDA GPU" in err and "FLUX_ATTN_DRYRUN=1" in err and p.stdout == ""


def test_gpu_server_bad_comfy_tree_or_no_gpu(tmp_path):
    """--comfy is checked (a folder with main.py), then the GPU it needs: one line, exit 2, nothing
    written (no random weights, no server started)."""
    weights = tmp_path / "w.safetensors"
    hide = {"CUDA_VISIBLE_DEVICES": ""}
    p = run("bench/e2e/gpu_server.py", "--comfy", "/nonexistent", "--weights", str(weights), env_extra=hide, check=False)
    err = _one_line_exit_2(p, "gpu_server.py")
    assert "--comfy" in err and "no ComfyUI tree at '/nonexistent'" in err and "no main.py" in err
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "main.py").write_text("")
    p = run("bench/e2e/gpu_server.py", "--comfy", str(tree), "--weights", str(weights), env_extra=hide, check=False)
    err = _one_line_exit_2(p, "gpu_server.py")
    assert "no CUDA GPU" in err and str(weights) in err
    assert not weights.exists() and p.stdout == ""


def test_benchmark_json_goes_only_where_asked(tmp_path):
    """$OUT set: bench.py writes its JSON to --json only (no silent copy into $OUT)."""
    outdir = tmp_path / "OUT"
    outdir.mkdir()
    out = tmp_path / "b.json"
    p = run("bench.py", "--config", "tiny", "--device", "cpu", "--res", "32", "--txt", "8", "--no-comfy", "--no-ref",
            "--variants", "exact", "--reps", "1", "--warmup", "0", "--json", str(out), env_extra={"OUT": str(outdir)})
    assert out.exists() and os.listdir(outdir) == []
    assert p.stdout.rstrip().splitlines()[-1] == f"results: {out}"


@pytest.mark.parametrize("script,args,want", [
    ("bench/e2e/gpu_server.py", ["--comfy", "{tree}", "--json", "/proc/x"], "argument --json: cannot write /proc/x"),
    ("bench/e2e/gpu_server.py", ["--comfy", "{tree}", "--logs", "/proc/x/logs"], "argument --logs: cannot create folder /proc/x/logs"),
    ("bench/e2e/gpu_server.py", ["--comfy", "{tree}", "--profile", "{file}"], "argument --profile: {file} exists and is not a folder"),
    ("bench/ops/gpu_jit.py", ["--json", "/proc/x"], "argument --json: cannot write /proc/x"),
    ("bench/e2e/gpu_fallback_cost.py", ["--comfy", "/nonexistent"], "argument --comfy: no ComfyUI tree at '/nonexistent'"),
    ("bench/e2e/gpu_fallback_cost.py", ["--comfy", "{tree}"], "no CUDA GPU"),
])
def test_bench_tools_check_outputs_and_inputs_first(tmp_path, script, args, want):
    """The GPU tools' output paths and --comfy trees are checked before any work (one line, exit 2,
    no traceback, nothing written) -- gpu_jit.py used to build for minutes, then fail on --json."""
    if not os.path.isdir("/proc/self"):
        pytest.skip("no /proc here")
    tree = tmp_path / "tree"
    (tree / "comfy").mkdir(parents=True)
    (tree / "main.py").write_text("")
    f = tmp_path / "file"
    f.write_text("")
    fmt = dict(tree=tree, file=f)
    p = run(script, *[a.format(**fmt) for a in args], env_extra={"CUDA_VISIBLE_DEVICES": ""}, check=False)
    err = _one_line_exit_2(p, os.path.basename(script))
    assert want.format(**fmt) in err, err
    assert sorted(os.listdir(tmp_path)) == ["file", "tree"] and p.stdout == ""
