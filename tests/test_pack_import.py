"""The pack's entry point and node schemas, without ComfyUI.

* the root ``__init__`` loads under the names ComfyUI gives it (folder name; full path with "." ->
  "_x_"), including folder names ending in "numba", where numba-cuda's import redirector would
  recurse forever on ``<name>.cuda_kernels`` (the guard re-registers the root under an alias);
* the V3 entry point (``comfy_entrypoint``; no V1 mappings at the root, which ComfyUI would take
  first) and every node module importing cleanly without ComfyUI (the classes need ``comfy_api``:
  their schemas are tested per ComfyUI tree in test_node_schemas.py);
* FluxNumbaPatch's option checks;
* the loader's header check (FLUX.1 accepted, other files refused with a clear message).
"""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LOAD_SCRIPT = r"""
import importlib, importlib.util, json, sys
name, root = sys.argv[1], sys.argv[2]
spec = importlib.util.spec_from_file_location(name, root + "/__init__.py")
mod = importlib.util.module_from_spec(spec)
sys.modules[name] = mod
spec.loader.exec_module(mod)
importlib.import_module(mod.PACKAGE + ".cuda_kernels")
importlib.import_module(mod.PACKAGE + ".flux_core.blocks")
nodes = sys.modules[mod.PACKAGE + ".nodes"]
print("RESULT " + json.dumps({"package": mod.PACKAGE, "modules": nodes._nodes_loaded,
                              "display": sorted(nodes.NODE_DISPLAY_NAME_MAPPINGS), "web": mod.WEB_DIRECTORY,
                              "entry": callable(getattr(mod, "comfy_entrypoint", None)),
                              "v1": hasattr(mod, "NODE_CLASS_MAPPINGS"), "errors": nodes.LOAD_ERRORS}))
"""


def _env():
    env = dict(os.environ)
    env.setdefault("NUMBA_ENABLE_CUDASIM", "1")
    return env


def _load_as(name):
    r = subprocess.run([sys.executable, "-c", LOAD_SCRIPT, name, ROOT], capture_output=True, text=True,
                       timeout=120, env=_env())
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, f"loading the pack as {name!r} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.parametrize("name", ["ComfyUI-FluxNumba", "comfyui-flux-numba",
                                  "/opt/ComfyUI/custom_nodes/comfyui-flux-numba"])
def test_root_loads_under_comfyui_names(name):
    res = _load_as(name)
    assert {"loader", "patch", "timer", "report", "quality", "vae_patch"} <= set(res["modules"])
    assert {"FluxNumbaLoader", "FluxNumbaPatch", "FluxNumbaVAEPatch"} <= set(res["display"])
    assert res["entry"] and not res["v1"] and res["web"] == "./web"
    assert not res["errors"], res["errors"]
    if name.endswith("numba"):
        assert res["package"] != name and "numba.cuda" not in res["package"] + ".cuda_kernels"
    else:
        assert res["package"] == name


def test_redirector_trap_is_real():
    """Control: without the guard, a package named '...numba' cannot import its cuda_kernels."""
    if importlib.util.find_spec("_numba_cuda_redirector") is None:
        pytest.skip("numba-cuda's redirector is not installed here")
    # importlib.util first: the redirector calls it without importing it, and where nothing else has
    # (a fresh venv) it dies of AttributeError before it can show the recursion this control is about
    script = ("import sys, types, importlib.util; sys.setrecursionlimit(400); m = types.ModuleType('x-numba'); "
              f"m.__path__ = [{ROOT!r}]; sys.modules['x-numba'] = m\n"
              "try:\n    import importlib; importlib.import_module('x-numba.cuda_kernels'); print('IMPORTED')\n"
              "except RecursionError:\n    print('RECURSION')\n")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=_env())
    assert "RECURSION" in r.stdout, r.stdout + r.stderr


# ----------------------------------------------------------------------------- schemas
def _pack_nodes():
    from flux_numba_pack.nodes import NODE_MODULES, NODE_DISPLAY_NAME_MAPPINGS, LOAD_ERRORS
    return NODE_MODULES, NODE_DISPLAY_NAME_MAPPINGS, LOAD_ERRORS


def test_nodes_package_without_comfyui():
    """Outside ComfyUI every node module imports (nothing logged as an error) and every node has its
    display name; the V3 classes are defined only when asked for (they need comfy_api)."""
    modules, names, errors = _pack_nodes()
    assert not errors, errors
    assert set(modules) == set(names)
    assert {"FluxNumbaLoader", "FluxNumbaPatch", "FluxNumbaStepTimer", "FluxNumbaTimingReport",
            "FluxNumbaQualityCompare", "FluxNumbaVAEPatch"} == set(names)


def test_patch_options():
    from flux_numba_pack.nodes.patch import ATTENTIONS, BACKENDS, CUDA_GRAPHS, PROFILES, options
    assert PROFILES == ["exact", "stock-order", "fast", "fast-cached"]  # appended: saved workflows keep their values
    assert ATTENTIONS == ["auto", "sdpa", "numba-bf16", "numba-8bit"]
    assert BACKENDS == ["auto", "torch", "numba"]
    assert CUDA_GRAPHS == ["auto", "off"]
    o = options("stock-order", "off", "sdpa", "torch")
    assert o.as_dict() == {"profile": "stock-order", "route_norms": False, "attention": "sdpa", "backend": "torch",
                           "cuda_graph": "auto"}
    assert options(cuda_graph="off").cuda_graph == "off"
    assert not o.fused and not o.fast and o.op_policy(["ln_modulate", "attention"]) == (
        {"*": "torch", "ln_modulate": "torch"}, "comfy")
    f = options("fast-cached")
    assert f.fused and f.fast and f.keeps_fp8 and f.gemm_epilogue and f.graphs and hash(f) == hash(options("fast-cached"))
    for bad in (dict(profile="turbo"), dict(attention="flash"), dict(backend="cuda"), dict(cuda_graph="yes")):
        with pytest.raises(ValueError, match="^FluxNumbaPatch: "):
            options(**bad)


def test_loader_dtypes():
    from flux_numba_pack.nodes.loader import WEIGHT_DTYPES, weight_dtype_options
    assert WEIGHT_DTYPES == ["default", "fp8_e4m3fn", "fp8_e4m3fn_fast", "fp8_e5m2"]
    assert weight_dtype_options("default") == {}
    assert weight_dtype_options("fp8_e4m3fn") == {"dtype": torch.float8_e4m3fn}
    assert weight_dtype_options("fp8_e4m3fn_fast") == {"dtype": torch.float8_e4m3fn, "fp8_optimizations": True}
    assert weight_dtype_options("fp8_e5m2") == {"dtype": torch.float8_e5m2}
    with pytest.raises(ValueError):
        weight_dtype_options("int4")


# ----------------------------------------------------------------------------- loader header check
def test_loader_header_check(tmp_path):
    from safetensors.torch import save_file
    from flux_numba_pack.flux_core import TINY, tiny_state_dict, NotFluxError
    from flux_numba_pack.nodes.loader import check_flux_file

    flux = tmp_path / "tiny_flux.safetensors"
    save_file({"model.diffusion_model." + k: v.to(torch.bfloat16) for k, v in tiny_state_dict(0).items()}, str(flux))
    cfg = check_flux_file(str(flux))
    assert (cfg.hidden_size, cfg.depth, cfg.depth_single_blocks) == (TINY.hidden_size, TINY.depth, TINY.depth_single_blocks)

    sdxl = tmp_path / "sdxl_unet.safetensors"
    save_file({k: torch.zeros(2, 2) for k in ("input_blocks.0.0.weight", "label_emb.0.0.weight",
                                              "middle_block.0.in_layers.0.weight",
                                              "output_blocks.0.0.in_layers.0.weight")}, str(sdxl))
    with pytest.raises(ValueError) as ei:
        check_flux_file(str(sdxl))
    assert isinstance(ei.value, NotFluxError)
    msg = str(ei.value)
    assert "sdxl_unet.safetensors" in msg and "not a FLUX.1" in msg and "SDXL" in msg

    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError):
        check_flux_file(str(junk))
    assert check_flux_file(str(tmp_path / "model.ckpt")) is None  # not inspectable: checked after loading


def test_entry_point_loaded_as_plain_module():
    """pytest (and other tools) may load the repo root's __init__.py as a plain module, e.g. named
    '__init__' when the clone folder is not an identifier: the nodes must still import."""
    import importlib.util
    import os
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("__init__", os.path.join(root, "__init__.py"))
    mod = importlib.util.module_from_spec(spec)
    saved = sys.modules.get("__init__")
    sys.modules["__init__"] = mod
    try:
        spec.loader.exec_module(mod)
    finally:
        if saved is None:
            sys.modules.pop("__init__", None)
        else:
            sys.modules["__init__"] = saved
    assert mod.PACKAGE != "__init__"
    nodes = sys.modules[mod.PACKAGE + ".nodes"]
    assert {"patch", "loader", "timer"} <= set(nodes._nodes_loaded) and callable(mod.comfy_entrypoint)


def test_install_script_picks_the_toolkit_extra_of_torchs_cuda():
    import importlib.util
    import os
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("flux_numba_install", os.path.join(root, "install.py"))
    inst = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(inst)
    assert inst.pip_command("12.8")[0][-1] == "numba-cuda[cu12]>=0.30.4"
    assert inst.pip_command("13.0")[0][-1] == "numba-cuda[cu13]>=0.30.4"
    assert inst.pip_command(None) == (None, "CPU-only torch; the Numba kernels will stay off")
    assert inst.pip_command("11.8")[0] is None
