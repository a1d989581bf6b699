"""Nodes and options of the pack in ComfyUI (a tree at $COMFYUI_PATH; split from test_comfyui.py,
whose fixtures and helpers it uses; marked ``comfyui`` like it): the loader node, composing with
other block patches, the CUDA graph option, LoRA weight patches on the patched model, bench.py on
ComfyUI's modules, the timer / report widgets.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from test_comfyui import (COMFYUI_PATH, DEVICE, N_BLOCKS, Patch, _inputs, _sample, assert_ran_patched,  # noqa: F401
                          comfy, forward, patch_mod, patch_stats, pytestmark, rel_err, tiny_patcher)


# ----------------------------------------------------------------------------- loader under ComfyUI
def test_loader_node(comfy, tmp_path, monkeypatch):
    """FluxNumbaLoader: header check first (a non-FLUX file never reaches ComfyUI's loader), then
    comfy.sd.load_diffusion_model with UNETLoader's options, then the detected model type is checked."""
    import types
    import comfy.sd
    import folder_paths
    from safetensors.torch import save_file
    from flux_numba_pack.flux_core import tiny_state_dict, NotFluxError
    from flux_numba_pack.nodes import node_classes
    FluxNumbaLoader = node_classes()["FluxNumbaLoader"]

    save_file({k: torch.zeros(2, 2) for k in ("input_blocks.0.0.weight", "label_emb.0.0.weight")},
              str(tmp_path / "sdxl.safetensors"))
    save_file(tiny_state_dict(0), str(tmp_path / "tiny_flux.safetensors"))
    monkeypatch.setitem(folder_paths.folder_names_and_paths, "diffusion_models",
                        ([str(tmp_path)], folder_paths.supported_pt_extensions))
    monkeypatch.setattr(folder_paths, "filename_list_cache", {})
    from test_workflows import combo_options
    assert {"sdxl.safetensors", "tiny_flux.safetensors"} <= set(combo_options(FluxNumbaLoader.INPUT_TYPES(), "unet_name"))

    calls = []
    detected = {"image_model": "flux"}

    def fake_load(path, model_options={}):
        calls.append((os.path.basename(path), model_options))
        return types.SimpleNamespace(model=types.SimpleNamespace(model_config=types.SimpleNamespace(unet_config=detected)))
    monkeypatch.setattr(comfy.sd, "load_diffusion_model", fake_load)

    with pytest.raises(NotFluxError, match="sdxl.safetensors: not a FLUX.1 diffusion model.*SDXL"):
        FluxNumbaLoader.EXECUTE_NORMALIZED("sdxl.safetensors", "default")
    assert not calls, "a refused file must not be loaded"
    model, = FluxNumbaLoader.EXECUTE_NORMALIZED("tiny_flux.safetensors", "fp8_e4m3fn_fast").result
    assert calls == [("tiny_flux.safetensors", {"dtype": torch.float8_e4m3fn, "fp8_optimizations": True})]
    detected["image_model"] = "flux2"
    with pytest.raises(NotFluxError, match="flux2"):
        FluxNumbaLoader.EXECUTE_NORMALIZED("tiny_flux.safetensors", "default")


def test_patch_composes_with_other_block_patches(comfy):
    """Another node's replacement of a block keeps working (it wraps our block); patching twice
    replaces our own functions instead of stacking them."""
    mp = tiny_patcher(comfy)
    inp = _inputs(torch.float32)
    ref = forward(mp, inp)
    seen = []

    def foreign(args, extra):
        seen.append(1)
        return extra["original_block"](args)
    other = mp.clone()
    other.set_model_patch_replace(foreign, "dit", "double_block", 0)
    pm, = Patch().patch(other, backend="torch")
    pm2, = Patch().patch(pm, backend="torch", profile="stock-order")
    out = forward(pm2, inp)
    assert len(seen) == 1
    assert torch.equal(out, ref)
    assert patch_stats(pm2)["calls"] == N_BLOCKS and patch_stats(pm)["calls"] == 0
    assert_ran_patched(pm2)
    assert pm2.model_options["transformer_options"]["flux_numba"]["profile"] == "stock-order"


def test_cuda_graph_option(comfy, monkeypatch):
    """cuda_graph=auto adds a DIFFUSION_MODEL wrapper; where capture is unsafe (here: no CUDA device)
    it runs the step eagerly, says why, and the result is the unwrapped one. cuda_graph=off adds none."""
    import comfy.patcher_extension as pe
    from flux_numba_pack.nodes.cuda_graph import KEY
    monkeypatch.setattr(patch_mod(), "SIMULATOR_OK", True)
    mp = tiny_patcher(comfy)
    inp = _inputs(torch.float32)
    on, = Patch().patch(mp, backend="torch", cuda_graph="auto")
    off, = Patch().patch(mp, backend="torch", cuda_graph="off")
    assert not off.get_wrappers(pe.WrappersMP.DIFFUSION_MODEL, KEY)
    (w,) = on.get_wrappers(pe.WrappersMP.DIFFUSION_MODEL, KEY)
    assert on.model_options["transformer_options"]["flux_numba"]["cuda_graph"] == "auto"

    def fwd(p):
        to = dict(p.model_options["transformer_options"], wrappers=p.wrappers)
        with torch.inference_mode():
            return p.model.diffusion_model(inp["x"].clone(), inp["timestep"], inp["context"], y=inp["y"],
                                           guidance=inp["guidance"], transformer_options=to)
    a, b = fwd(on), fwd(off)
    if DEVICE.type != "cuda":
        assert w.last_mode == "eager: not a CUDA device"
    assert torch.equal(a, b)
    assert_ran_patched(on)
    assert_ran_patched(off)


def test_lora_weight_patches_apply_to_the_patched_model(comfy):
    """A LoRA-style weight patch (ComfyUI's add_patches, applied in place when sampling starts)
    changes the patched model exactly as it changes stock: the pack reads the live weights."""
    mp = tiny_patcher(comfy)
    latent = torch.zeros(1, 16, 8, 8)
    import comfy.utils as cu
    g = torch.Generator().manual_seed(5)
    norm_key = [n for n, _ in mp.model.named_parameters()  # .scale (v0.8.0) or .weight (v0.33)
                if n.startswith("diffusion_model.double_blocks.1.txt_attn.norm.key_norm.")]
    keys = ["diffusion_model.double_blocks.0.img_mlp.0.weight", "diffusion_model.single_blocks.1.linear1.weight",
            *norm_key]
    assert len(keys) == 3, keys
    patches = {}
    for k in keys:
        w = cu.get_attr(mp.model, k)
        patches[k] = (0.5 * torch.randn(w.shape, generator=g),)  # a "diff" patch, like a LoRA's merged delta
    base = _sample(mp, latent, 2)
    lora = mp.clone()
    lora.add_patches(patches, 1.0)
    stock_lora = _sample(lora, latent, 2)
    assert rel_err(stock_lora, base) > 1e-3, "the weight patch must matter"
    pm, = Patch().patch(lora, backend="torch", profile="exact")
    got = _sample(pm, latent, 2)
    assert_ran_patched(pm)
    assert torch.allclose(got, stock_lora, rtol=1e-5, atol=1e-5), rel_err(got, stock_lora)
    assert torch.equal(_sample(mp, latent, 2), base), "weights restored after sampling"


def test_bench_runs_the_node_paths_on_comfys_modules(tmp_path):
    """bench.py on ComfyUI's own Flux module gets the block weights the way the node does (its ops
    classes have their own forward: a plain-module weight lookup hands out none), so ``exact`` runs
    the GEMM-epilogue up-projection and ``fast`` its fp8 ops -- not silently the exact path."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "b.json"
    env = dict(os.environ, COMFYUI_PATH=COMFYUI_PATH)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    p = subprocess.run([sys.executable, "bench.py", "--config", "tiny", "--device", "cpu", "--res", "64", "--txt", "8",
                        "--reps", "1", "--warmup", "1", "--no-ref", "--variants", "exact,fast,fast-cached", "--json", str(out)],
                       cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    res = json.load(open(out))["results"]
    assert "linear_gelu" in res["exact"]["backends"], res["exact"]["backends"]
    for v in ("fast", "fast-cached"):
        assert {"ln_modulate_fp8", "gelu_tanh_fp8", "attn_gelu_fp8"} <= set(res[v]["backends"]), res[v]["backends"]


# ----------------------------------------------------------------------------- timer / report widgets
def _run_node(node_id, unique_id, inputs):
    """One pack node as ComfyUI's executor runs it: ``execution.get_input_data`` (widgets, hidden
    unique_id) then ``execution.get_output_data`` on an instance of the V3 class."""
    import asyncio
    import execution  # ComfyUI's execution.py
    from flux_numba_pack.nodes import node_classes
    cls = node_classes()[node_id]
    data, missing, v3_data = execution.get_input_data(inputs, cls, unique_id)
    assert not missing, missing
    with torch.inference_mode():
        out = asyncio.run(execution.get_output_data("flux-numba-test", unique_id, cls(), data, v3_data=v3_data))
    return out[0], out[1]


def _table_runs(text):
    """The run ids a report table lists (its 'run N [label] ...' lines)."""
    import re
    return sorted({int(m) for m in re.findall(r"^run (\d+) \[", text, re.M)})


def test_timer_empty_label_and_report_node_selection_run(comfy):
    """An emptied label runs as the node's id; a report selection of 'node:' runs as 'last'; a
    garbage selection still stops the node with its one-line error."""
    from flux_numba_pack.nodes import timing
    timing.clear_runs()
    try:
        mp = tiny_patcher(comfy)
        latent = torch.zeros(1, 16, 4, 4)
        outputs = {}
        for uid, label in (("12", ""), ("13", "   "), ("14", "stock")):
            out, _ = _run_node("FluxNumbaStepTimer", uid, {"model": mp, "label": label})
            _sample(out[0][0], latent, 1)
            outputs[uid] = timing.last_run(node_id=uid)
        assert [outputs[u]["label"] for u in ("12", "13", "14")] == ["12", "13", "stock"]
        last = [r["run"] for r in timing.select_runs("last")]
        assert len(last) == 3
        for sel in ("node:", "node:  "):
            out, ui = _run_node("FluxNumbaTimingReport", "20", {"samples": {"samples": latent}, "selection": sel,
                                                                "width": 256, "height": 128})
            assert _table_runs(ui["text"][0]) == last, ui["text"][0]
            assert tuple(out[0][0].shape) == (1, 128, 256, 3)
        out, ui = _run_node("FluxNumbaTimingReport", "20", {"samples": {"samples": latent}, "selection": "node:12",
                                                            "width": 256, "height": 128})
        assert _table_runs(ui["text"][0]) == [outputs["12"]["run"]], ui["text"][0]
        with pytest.raises(ValueError) as ei:
            _run_node("FluxNumbaTimingReport", "20", {"samples": {"samples": latent}, "selection": "run:abc"})
        msg = str(ei.value)
        assert msg.startswith("FluxNumbaTimingReport: selection 'run:abc'") and "\n" not in msg, msg
    finally:
        timing.clear_runs()
