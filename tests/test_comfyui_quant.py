"""Quantised FLUX checkpoints under ComfyUI itself (the tree at $COMFYUI_PATH, CPU): fp8 scaled
safetensors and GGUF Q8_0 (the ComfyUI-GGUF node pack), as users download them for 12-24 GB cards.

Marked ``comfyui`` (test_comfyui_matrix runs it per tree).  The GGUF tests need ComfyUI-GGUF's own
files -- the folder at $COMFYUI_GGUF_PATH or ``.carry/custom_nodes/ComfyUI-GGUF`` (ignored; export of
city96/ComfyUI-GGUF) -- and the ``gguf`` package; they skip with the reason otherwise.  Direct use::

    COMFYUI_PATH=.carry/ComfyUI-0.33.0 /work/venv-comfy/bin/python -m pytest -q tests/test_comfyui_quant.py

fp8 scaled: the file bench/e2e/_server_quant.py writes for the server benchmark (block weights e4m3 with a
``scale_weight`` each and the ``scaled_fp8`` marker), loaded by ComfyUI's own ``load_diffusion_model``
(v0.33 turns it into ``comfy_quant`` layers); exact equals stock, the fast profile takes the stored
e4m3 weights as they are.

GGUF:
A tiny FLUX is written as a GGUF file the way ComfyUI-GGUF's tools/convert.py writes one (arch
"flux", 2-D weights Q8_0 through gguf-py's own quantizer, the rest F32), loaded by ComfyUI-GGUF's
loader exactly as its UnetLoaderGGUF node does (gguf_sd_loader -> load_diffusion_model_state_dict
with GGMLOps -> GGUFModelPatcher).  Then FluxNumbaPatch (exact) must equal stock on those weights
-- its fused ops around ComfyUI-GGUF's dequantising Linear, never the raw Q8_0 bytes -- and each
block must run the pack's path (no fallback).  The fast profile must not read the quantised bytes
either (it keeps ComfyUI-GGUF's Linear for those GEMMs)."""
import importlib
import importlib.util
import os
import sys

import numpy as np
import pytest
import torch

import test_comfyui as tc
from test_comfyui import Patch, _inputs, forward, patch_stats, rel_err

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GGUF_PACK = os.environ.get("COMFYUI_GGUF_PATH") or os.path.join(ROOT, ".carry", "custom_nodes", "ComfyUI-GGUF")


def _why_not():
    if not os.path.isfile(os.path.join(GGUF_PACK, "ops.py")):
        return f"ComfyUI-GGUF not found at {GGUF_PACK} (set COMFYUI_GGUF_PATH to an export of city96/ComfyUI-GGUF)"
    if importlib.util.find_spec("gguf") is None:
        return "the gguf package (ComfyUI-GGUF's requirement) is not installed in this Python"
    return None


pytestmark = tc.pytestmark
needs_gguf = pytest.mark.skipif(_why_not() is not None, reason=_why_not() or "")
comfy = tc.comfy


def _server_quant():
    spec = importlib.util.spec_from_file_location("_bench_server_quant", os.path.join(ROOT, "bench", "e2e", "_server_quant.py"))
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def test_fp8_scaled_file_through_comfyui_loader(comfy, tmp_path):
    """The server benchmark's fp8-scaled file, loaded by ComfyUI's loader: every block GEMM weight
    stored e4m3 with its scale; FluxNumbaPatch exact == stock (ComfyUI's quantised Linear called),
    the fast profile's blocks read the stored fp8 weights (fp8_stored_block)."""
    import comfy.sd
    from safetensors.torch import save_file
    from flux_numba_pack.flux_core import random_state_dict
    from flux_numba_pack.nodes.host import flux as host
    src = str(tmp_path / "tiny.safetensors")
    save_file({k: v.to(torch.bfloat16) for k, v in random_state_dict(gguf_config(), 4).items()}, src)
    path = _server_quant().write_fp8_scaled(src)
    with torch.inference_mode():
        try:
            mp = comfy.sd.load_diffusion_model(path)
        except ValueError as e:  # v0.8.0 reads 24 heads: FLUX.1's own widths
            if "num_heads" not in str(e):
                raise
            src = str(tmp_path / "full_heads.safetensors")
            save_file({k: v.to(torch.bfloat16) for k, v in random_state_dict(gguf_config(True), 4).items()}, src)
            mp = comfy.sd.load_diffusion_model(_server_quant().write_fp8_scaled(src))
    dm = mp.model.diffusion_model
    assert host.fp8_stored_block("double", dm.double_blocks[0]) and host.fp8_stored_block("single", dm.single_blocks[0])
    dt = dm.img_in.weight.dtype  # the compute dtype ComfyUI picked for this device (bf16 / fp32 on CPU)
    inp = _inputs(dt)
    stock = forward(mp, inp)
    pm, = Patch().patch(mp, backend="torch", profile="exact")
    got = forward(pm, inp)
    st = patch_stats(pm)
    assert st["calls"] > 0 and st["fallbacks"] == 0, st
    assert rel_err(got, stock) < 2e-2, rel_err(got, stock)


@pytest.fixture(scope="module")
def gguf_pack(comfy):
    if _why_not():
        pytest.skip(_why_not())
    """ComfyUI-GGUF imported as ComfyUI imports a custom node folder (a package of its own name)."""
    name = "ComfyUI_GGUF_under_test"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(GGUF_PACK, "__init__.py"),
                                                      submodule_search_locations=[GGUF_PACK])
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        try:
            spec.loader.exec_module(mod)
        except Exception as e:  # pragma: no cover - depends on the pack's version vs this ComfyUI
            pytest.skip(f"ComfyUI-GGUF does not import under this ComfyUI: {type(e).__name__}: {e}")
    return {m: importlib.import_module(f"{name}.{m}") for m in ("ops", "loader", "nodes")}


def gguf_config(full_heads=False):
    """The tiny FLUX at head dim 128 (v0.33's FLUX detection reads the head count as hidden / 128);
    ``full_heads``: FLUX.1's 24 heads of 128 (COMFY_MIN, one block of each kind), for trees whose
    detection assumes 24 heads (v0.8.0)."""
    import dataclasses
    from flux_numba_pack.flux_core import TINY, COMFY_MIN
    return COMFY_MIN if full_heads else dataclasses.replace(TINY, hidden_size=256, num_heads=2, axes_dim=[16, 56, 56])


def write_tiny_gguf(path, seed=0, full_heads=False):
    """The pack's tiny FLUX as a GGUF file: 2-D weights whose rows split into 32-value blocks as Q8_0
    (gguf-py's quantizer), everything else F32.  Returns the names stored as Q8_0."""
    import gguf
    from flux_numba_pack.flux_core import random_state_dict
    w = gguf.GGUFWriter(path=None, arch="flux")
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    quantised = []
    for k, v in random_state_dict(gguf_config(full_heads), seed).items():
        a = v.float().numpy()
        if v.ndim == 2 and v.shape[1] % 32 == 0:
            w.add_tensor(k, gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            quantised.append(k)
        else:
            w.add_tensor(k, np.ascontiguousarray(a, dtype=np.float32))
    w.write_header_to_file(path=str(path))
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return quantised


def load_gguf(comfy, gguf_pack, path):
    """UnetLoaderGGUF.load_unet's steps (default dequant / patch dtypes)."""
    import comfy.sd
    g = gguf_pack
    sd = g["loader"].gguf_sd_loader(str(path))
    ops = g["ops"].GGMLOps()
    model = comfy.sd.load_diffusion_model_state_dict(sd, model_options={"custom_operations": ops})
    if model is None:
        pytest.fail("ComfyUI did not detect the tiny GGUF as a model")
    return g["nodes"].GGUFModelPatcher.clone(model)


@pytest.fixture(scope="module")
def gguf_model(comfy, gguf_pack, tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf")
    for full_heads in (False, True):
        path = folder / f"flux_tiny_Q8_0_{int(full_heads)}.gguf"
        quantised = write_tiny_gguf(path, full_heads=full_heads)
        try:
            with torch.inference_mode():
                return load_gguf(comfy, gguf_pack, path), quantised
        except ValueError as e:  # v0.8.0: "Hidden size 256 must be divisible by num_heads 24"
            if full_heads or "num_heads" not in str(e):
                raise


@needs_gguf
def test_gguf_file_loads_as_comfyui_gguf_quantised_linears(gguf_model, gguf_pack):
    mp, quantised = gguf_model
    dm = mp.model.diffusion_model
    assert type(mp.model).__name__ == "Flux" and any("double_blocks" in k for k in quantised)
    qkv = dm.double_blocks[0].img_attn.qkv
    assert isinstance(qkv, gguf_pack["ops"].GGMLOps.Linear)
    assert gguf_pack["ops"].GGMLLayer.is_ggml_quantized(qkv)


@needs_gguf
def test_gguf_exact_equals_stock_with_fused_ops_around_gguf_linears(gguf_model, gguf_pack, caplog):
    """Exact: the pack's blocks run (no fallback) and give stock's output (torch backend: fp32 sums
    in another order, so 1e-5 of the output)."""
    mp, _ = gguf_model
    from flux_numba_pack.nodes.host import flux as host
    qkv = mp.model.diffusion_model.double_blocks[0].img_attn.qkv
    assert not host._plain_linear_op(qkv), "a GGUF Linear must never be read as a plain weight"
    inp = _inputs(torch.float32)
    stock = forward(mp, inp)
    pm, = Patch().patch(mp, backend="torch", profile="exact")
    got = forward(pm, inp)
    st = patch_stats(pm)
    assert st["calls"] > 0 and st["fallbacks"] == 0, st
    assert rel_err(got, stock) < 1e-5, rel_err(got, stock)
    assert torch.equal(forward(mp, inp), stock)  # the unpatched model is untouched


@needs_gguf
def test_gguf_fast_keeps_gguf_linears(gguf_model, monkeypatch):
    """Fast profiles: the quantised GGUF GEMMs are not fp8 operands (no fp8 hand-off of Q8_0 bytes);
    the result stays close to stock."""
    mp, _ = gguf_model
    from flux_numba_pack.nodes.host import flux as host
    dm = mp.model.diffusion_model
    assert not host.fp8_stored_block("double", dm.double_blocks[0])
    assert not host.fp8_stored_block("single", dm.single_blocks[0])
    w = host.ComfyWeights()
    x = torch.zeros(1, 4, dm.double_blocks[0].img_attn.qkv.in_features)
    assert w.linear_fp8(dm.double_blocks[0].img_attn.qkv, x) is None
    assert w.linear(dm.double_blocks[0].img_attn.qkv, x) is None
    w.release()


@needs_gguf
def test_gguf_lora_patches_run_per_call_and_are_never_captured(gguf_model):
    """A LoRA on a GGUF model (ComfyUI-GGUF keeps it on the quantised tensor, ``weight.patches``,
    merged after dequantising in each call): exact still equals stock with the LoRA, and the
    graph checks see per-call work in the patched Linear (a capture would freeze the LoRA and its
    host-to-device patch copies cannot be captured)."""
    mp, _ = gguf_model
    from flux_numba_pack.nodes.host import residency
    dm = mp.model.diffusion_model
    qkv = dm.double_blocks[0].img_attn.qkv
    key = "diffusion_model.double_blocks.0.img_attn.qkv.weight"
    g = torch.Generator().manual_seed(5)
    lp = mp.clone()
    assert lp.add_patches({key: (0.05 * torch.randn(tuple(qkv.weight.shape), generator=g),)}, 1.0) == [key]
    inp = _inputs(torch.float32)
    base = forward(mp, inp)
    with torch.inference_mode():
        lp.patch_model()
    try:
        assert getattr(qkv.weight, "patches", None), "ComfyUI-GGUF keeps the LoRA on the tensor"
        assert residency._freezes_per_call_work(qkv)
        assert not residency._freezes_per_call_work(dm.double_blocks[0].img_mod.lin)  # quantised, no LoRA
        stock = forward(lp, inp)
        assert rel_err(stock, base) > 1e-4  # the LoRA changes the output
        pm, = Patch().patch(lp, backend="torch", profile="exact")
        got = forward(pm, inp)
        assert rel_err(got, stock) < 1e-5, rel_err(got, stock)
    finally:
        lp.unpatch_model()
    assert not getattr(qkv.weight, "patches", None)
    assert not residency._freezes_per_call_work(qkv)
