"""bench/e2e/_server_quant.py: the quantised checkpoints the server benchmark makes from a bf16 file.

* Q8_0 blocks made with torch are byte for byte gguf-py's own quantiser (skipped without gguf);
* the GGUF file reads back with gguf-py's reader as ComfyUI-GGUF's convert.py would write it (arch
  "flux", 2-D weights Q8_0, 1-D / small tensors F32) and dequantises to the bf16 weights within Q8_0's
  step;
* the fp8-scaled file has e4m3 block weights with one fp32 scale each and the ``scaled_fp8`` marker,
  and dequantises within e4m3's step; other tensors byte for byte."""
import importlib.util
import os

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAVE_GGUF = importlib.util.find_spec("gguf") is not None


def _sq():
    spec = importlib.util.spec_from_file_location("_bench_server_quant", os.path.join(ROOT, "bench", "e2e", "_server_quant.py"))
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def _tiny_file(tmp_path):
    from safetensors.torch import save_file
    from flux_numba_pack.flux_core import TINY, random_state_dict
    sd = {k: v.to(torch.bfloat16) for k, v in random_state_dict(TINY, seed=3).items()}
    p = str(tmp_path / "tiny.safetensors")
    save_file(sd, p)
    return p, sd


@pytest.mark.skipif(not HAVE_GGUF, reason="the gguf package (ComfyUI-GGUF's requirement) is not installed")
def test_q8_0_blocks_match_gguf_py():
    import gguf
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 96, generator=g) * torch.logspace(-3, 1, 96)
    x[2, :32] = 0  # an all-zero block: d = 0, q = 0
    ref = gguf.quants.quantize(x.numpy(), gguf.GGMLQuantizationType.Q8_0)
    got = _sq().q8_0_blocks(x).numpy()
    assert got.shape == ref.shape == (7, 3 * 34)
    assert (got == ref).all()


@pytest.mark.skipif(not HAVE_GGUF, reason="the gguf package (ComfyUI-GGUF's requirement) is not installed")
def test_gguf_file_reads_back(tmp_path):
    import gguf
    sq = _sq()
    src, sd = _tiny_file(tmp_path)
    path = sq.write_gguf_q8_0(src)
    assert path == str(tmp_path / "tiny_Q8_0.gguf") and os.path.exists(path)
    r = gguf.GGUFReader(path)
    assert str(r.get_field("general.architecture").parts[-1], "utf-8") == "flux"
    seen = set()
    for t in r.tensors:
        seen.add(t.name)
        ref = sd[t.name].float()
        shape = tuple(int(v) for v in reversed(t.shape))
        assert shape == tuple(ref.shape) or (ref.ndim == 0 and shape == (1,)), t.name
        deq = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).reshape(ref.shape)
        if t.tensor_type == gguf.GGMLQuantizationType.Q8_0:
            assert ref.ndim == 2 and ref.numel() > sq.QUANTIZATION_THRESHOLD
            step = ref.reshape(ref.shape[0], -1, 32).abs().amax(-1, keepdim=True) / 127
            err = (deq.reshape(step.shape[0], -1, 32) - ref.reshape(step.shape[0], -1, 32)).abs()
            assert (err <= step * (0.5 + 127 * 2.0 ** -11) + 1e-12).all(), t.name  # (d is stored as fp16)
        else:
            assert t.tensor_type == gguf.GGMLQuantizationType.F32, t.name
            assert torch.equal(deq, ref), t.name
    assert seen == set(sd)
    assert any(t.tensor_type == gguf.GGMLQuantizationType.Q8_0 and t.name.startswith("double_blocks.") for t in r.tensors)
    mtime = os.path.getmtime(path)
    assert sq.write_gguf_q8_0(src) == path and os.path.getmtime(path) == mtime  # kept, not rewritten


def test_fp8_scaled_file(tmp_path):
    from safetensors.torch import load_file
    sq = _sq()
    src, sd = _tiny_file(tmp_path)
    path = sq.write_fp8_scaled(src)
    assert path == str(tmp_path / "tiny_fp8_scaled.safetensors")
    got = load_file(path)
    assert got.pop("scaled_fp8").dtype == torch.float8_e4m3fn
    scaled = [k for k in sd if sq._fp8_layer(k, sd[k].ndim)]
    assert scaled and all(k.startswith(("double_blocks.", "single_blocks.")) for k in scaled)
    for k, v in sd.items():
        if k in scaled:
            s = got.pop(k[: -len("weight")] + "scale_weight")
            w = got.pop(k)
            assert w.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.ndim == 0
            deq, ref = w.float() * s, v.float()
            assert (deq - ref).abs().max() <= ref.abs().max() / 448 * 16 * 1.01   # e4m3 step at the top binade
            assert torch.allclose(w.float().abs().max(), torch.tensor(448.0), rtol=0.07)
        else:
            assert torch.equal(got.pop(k), v), k
    assert not got


@pytest.mark.skipif(not HAVE_GGUF, reason="the gguf package (ComfyUI-GGUF's requirement) is not installed")
def test_planned_bytes_match_the_files(tmp_path):
    import json
    import struct
    sq = _sq()
    src, _ = _tiny_file(tmp_path)
    with open(src, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = {k: v for k, v in json.loads(f.read(n)).items() if k != "__metadata__"}
    for kind, write in (("fp8s", sq.write_fp8_scaled), ("gguf", sq.write_gguf_q8_0)):
        size = os.path.getsize(write(src))
        assert 0.9 * size <= sq.planned_bytes(header, kind) <= size, (kind, size, sq.planned_bytes(header, kind))
