"""The README's main-job command and the benchmark harness, run as a user would (CPU)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args, env_extra=None, check=True):
    env = dict(os.environ)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    env.update(env_extra or {})
    p = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if check and p.returncode:
        raise AssertionError(p.stdout + p.stderr)
    return p


def test_main_job_on_embedded_model(tmp_path):
    p = run("run.py", "--steps", "3", "--width", "128", "--height", "96", "--out", str(tmp_path))
    out = p.stdout
    assert "embedded tiny FLUX" in out and "agreement stock vs patched" in out
    rec = json.load(open(tmp_path / "run.json"))
    assert len(rec["stock_ms"]) == len(rec["patched_ms"]) == 3
    assert rec["psnr_db"] > 60  # same math, different op order: agreement far beyond bf16 noise
    assert (tmp_path / "latents.safetensors").exists() and (tmp_path / "patched_preview.png").exists()


def test_main_job_with_a_written_model_batch_two(tmp_path):
    path = tmp_path / "tiny.safetensors"
    run("run.py", "--write-model", str(path))
    p = run("run.py", "--model", str(path), "--steps", "2", "--batch", "2", "--width", "64", "--height", "64",
            "--out", str(tmp_path / "o"))
    assert "hidden 128" in p.stdout
    assert json.load(open(tmp_path / "o" / "run.json"))["psnr_db"] > 60


def test_main_job_bad_input(tmp_path):
    p = run("run.py", "--width", "1000", check=False)
    assert p.returncode != 0 and "multiples of 16" in p.stderr
    junk = tmp_path / "x.safetensors"
    junk.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    p = run("run.py", "--model", str(junk), check=False)
    assert p.returncode != 0 and "not a FLUX.1 diffusion model" in p.stderr


def test_main_job_in_the_simulator(tmp_path):
    """--simulator runs the Numba kernels (CUDA simulator) in the patched path on a tiny latent."""
    p = run("run.py", "--simulator", "--steps", "1", "--width", "16", "--height", "16", "--txt-len", "3",
            "--out", str(tmp_path))
    rec = json.load(open(tmp_path / "run.json"))
    assert "numba" in "".join(sum(rec["backends"].values(), []))
    assert rec["psnr_db"] > 30, rec


def test_benchmark_harness_smoke(tmp_path):
    out = tmp_path / "b.json"
    p = run("bench.py", "--config", "tiny", "--device", "cpu", "--res", "64", "--txt", "8", "--no-comfy",
            "--variants", "pack-torch,exact", "--reps", "2", "--warmup", "1", "--trajectory", "2", "--json", str(out))
    res = json.load(open(out))["results"]
    assert set(res) == {"pack-torch", "exact"}
    assert res["pack-torch"]["rel_err"] < 1e-5 and res["pack-torch"]["traj_psnr_db"] > 100
    assert "ms/step" in p.stdout
