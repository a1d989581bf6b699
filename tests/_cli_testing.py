"""Shared by the command-line tests (test_cli.py: the README's main job, install.py and the test
runner; test_cli_bench.py: the benchmark harness and the bench/ tools): a script run as a user runs
it, strict JSON reading, the bad input files, the one-line-error check."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args, env_extra=None, check=True):
    env = dict(os.environ)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    env.update(env_extra or {})
    p = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if check and p.returncode:
        raise AssertionError(p.stdout + p.stderr)
    return p


def _no_nan(name):
    raise ValueError(f"not strict JSON: {name}")


def strict_load(path):
    """json.load that refuses NaN / Infinity / -Infinity (Python's json writes and reads them by default)."""
    with open(path) as f:
        return json.loads(f.read(), parse_constant=_no_nan)


def _bad_files(tmp_path):
    junk = tmp_path / "x.safetensors"  # a valid safetensors file with no tensors
    junk.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    six = tmp_path / "six.safetensors"  # corrupt: shorter than a safetensors length field
    six.write_bytes(b"abcdef")
    vae = tmp_path / "vae.safetensors"  # a real safetensors file, not a FLUX diffusion model
    from safetensors.torch import save_file
    import torch
    save_file({"decoder.conv_in.weight": torch.zeros(4, 4), "encoder.conv_in.weight": torch.zeros(4, 4)}, str(vae))
    garbage = tmp_path / "garbage.safetensors"  # length field says more than the file holds
    garbage.write_bytes(b"\xff" * 64)
    notjson = tmp_path / "notjson.safetensors"
    notjson.write_bytes(b"\x04\x00\x00\x00\x00\x00\x00\x00{{{{")
    listjson = tmp_path / "list.safetensors"  # a JSON header that is not a {name: tensor} table
    listjson.write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00[]")
    trunc = tmp_path / "trunc.safetensors"  # header promises data the file does not hold
    hdr = b'{"img_in.weight":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}'
    trunc.write_bytes(len(hdr).to_bytes(8, "little") + hdr + b"\0" * 4)
    afile = tmp_path / "afile"
    afile.write_text("x")
    return dict(junk=junk, six=six, vae=vae, garbage=garbage, notjson=notjson, listjson=listjson, trunc=trunc,
                afile=afile, folder=tmp_path, missing=tmp_path / "missing.safetensors")


def _one_line_exit_2(p, prog):
    """Exit 2 and ONE line on stderr, starting with '<prog>: error: ', no traceback."""
    err = p.stderr.strip()
    assert p.returncode == 2, p.stdout + p.stderr
    assert "Traceback" not in p.stdout + p.stderr and len(err.splitlines()) == 1, p.stdout + p.stderr
    assert err.startswith(f"{prog}: error: "), err
    return err
