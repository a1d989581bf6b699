"""Tests that run ComfyUI itself (a source tree at $COMFYUI_PATH, on CPU; v0.8.0 and v0.33.0 supported).

Marked ``comfyui``: tests/test_comfyui_matrix.py runs them once per tree found (see
tests/_comfy_trees.py); skipped otherwise.  Direct use, with the venv that has ComfyUI's requirements::

    COMFYUI_PATH=.carry/ComfyUI-0.8.0 /work/venv-comfy/bin/python -m pytest -q tests/test_comfyui.py

(a) the pack loads in ``main.py --quick-test-for-ci`` from a custom_nodes folder whose name ends in
    "numba" (the redirector trap), and ComfyUI's own ``validate_prompt`` accepts the example workflow;
(b) FluxNumbaPatch's forward equals ComfyUI's stock Flux forward on the same weights (torch backend:
    exactly; numba kernels in the CUDA simulator: within bf16 tolerance);
(c) sampling through ComfyUI's own sampler (``nodes.common_ksampler``) gives the stock result, and the
    original model still samples stock afterwards.
Everything runs under ``torch.inference_mode()`` where ComfyUI does (its executor wraps nodes in it).
"""
import json
import logging
import os
import subprocess
import sys
import weakref

import pytest
import torch

from _comfy_trees import comfyui_path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMFYUI_PATH, _reason = comfyui_path()
WORKFLOW = os.path.join(ROOT, "example_workflows", "flux1_dev_numba.json")


# FLUX_NUMBA_REAL_GPU=1 with a CUDA GPU: models and kernels on the GPU (real numba, no simulator)
DEVICE = torch.device("cuda" if os.environ.get("FLUX_NUMBA_REAL_GPU") == "1" and torch.cuda.is_available()
                      else "cpu")

pytestmark = [pytest.mark.comfyui, pytest.mark.skipif(_reason is not None, reason=_reason or "")]


@pytest.fixture(scope="module")
def comfy():
    """ComfyUI imported in-process on CPU (args parsed from nothing, --cpu set)."""
    if COMFYUI_PATH not in sys.path:
        sys.path.insert(0, COMFYUI_PATH)
    try:
        import comfy.options
        comfy.options.enable_args_parsing(False)
        from comfy.cli_args import args
        args.cpu = DEVICE.type == "cpu"
        import comfy.model_management  # noqa: F401
        import comfy.model_patcher  # noqa: F401
        import comfy.supported_models  # noqa: F401
        import comfy.ldm.flux.model  # noqa: F401
        import comfy.sample  # noqa: F401
    except Exception as e:  # pragma: no cover - depends on the environment
        pytest.skip(f"ComfyUI at {COMFYUI_PATH} does not import here: {type(e).__name__}: {e}")
    return sys.modules["comfy"]


def tiny_patcher(comfy, dtype=torch.float32, seed=0):
    """A ModelPatcher around ComfyUI's own model_base.Flux with the pack's tiny FLUX config."""
    from flux_numba_pack.flux_core import TINY, tiny_state_dict
    import comfy.model_patcher
    import comfy.supported_models
    cfg = dict(TINY.comfy_kwargs(), image_model="flux")
    mc = comfy.supported_models.Flux(cfg)
    mc.set_inference_dtype(dtype, None)
    bm = mc.get_model({}, device=DEVICE)
    sd = mc.process_unet_state_dict({k: v.to(dtype) for k, v in tiny_state_dict(seed).items()})  # v0.33: .scale -> .weight
    bm.diffusion_model.load_state_dict(sd, strict=True)
    return comfy.model_patcher.ModelPatcher(bm, load_device=DEVICE, offload_device=torch.device("cpu"))


def _inputs(dtype, B=2, hw=8, txt=5, seed=1):
    from flux_numba_pack.flux_core import TINY
    g = torch.Generator().manual_seed(seed)
    d = dict(x=torch.randn(B, 16, hw, hw, generator=g).to(dtype),
             timestep=torch.rand(B, generator=g),
             context=torch.randn(B, txt, TINY.context_in_dim, generator=g).to(dtype),
             y=torch.randn(B, TINY.vec_in_dim, generator=g).to(dtype),
             guidance=torch.full((B,), 3.5))
    return {k: v.to(DEVICE) for k, v in d.items()}


def forward(mp, inp, inference=True):
    """The diffusion model's forward with this patcher's transformer_options (what sampling passes)."""
    to = dict(mp.model_options["transformer_options"])
    with torch.inference_mode(inference):
        return mp.model.diffusion_model(inp["x"].clone(), inp["timestep"], inp["context"], y=inp["y"],
                                        guidance=inp["guidance"], transformer_options=to)


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def patch_mod():
    import flux_numba_pack.nodes.runner as m
    return m


class Patch:
    """FluxNumbaPatch as ComfyUI runs it: the V3 class's ``execute`` (``patch(model, **widgets)`` ->
    its result tuple)."""

    def patch(self, model, **widgets):
        from flux_numba_pack.nodes import node_classes
        return node_classes()["FluxNumbaPatch"].EXECUTE_NORMALIZED(model, **widgets).result


def patch_stats(mp):
    from flux_numba_pack.nodes.patch import stats
    return stats(mp.model_options["transformer_options"]["flux_numba"]["id"])


def assert_ran_patched(mp):
    """The pack's blocks ran (a fallback to ComfyUI's block would make a stock-equality check vacuous)."""
    st = patch_stats(mp)
    assert st["calls"] > 0 and st["fallbacks"] == 0, st


N_BLOCKS = 4  # TINY: 2 double + 2 single


# ----------------------------------------------------------------------------- (a) ComfyUI main.py
PROBE = r'''
import asyncio, atexit, importlib.util, json, os
NODE_CLASS_MAPPINGS = {}

def _report():
    import nodes, execution
    out = {"nodes": sorted(k for k in nodes.NODE_CLASS_MAPPINGS if k.startswith("FluxNumba"))}
    try:
        spec = importlib.util.spec_from_file_location("flux_numba_wf_test", os.environ["FLUX_NUMBA_WF_TEST"])
        wt = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(wt)
        with open(os.environ["FLUX_NUMBA_WORKFLOW"]) as f:
            wf = json.load(f)
        prompt = wt.ui_to_api(wf, lambda t: nodes.NODE_CLASS_MAPPINGS[t].INPUT_TYPES())
        valid, err, outs, node_errors = asyncio.run(execution.validate_prompt("probe", prompt, None))
        out["validate"] = {"valid": valid, "error": err, "outputs": list(outs), "node_errors": node_errors}
    except Exception as e:
        out["validate"] = {"valid": False, "error": f"{type(e).__name__}: {e}"}
    print("PROBE " + json.dumps(out, default=str), flush=True)

atexit.register(_report)
'''


@pytest.fixture(scope="module")
def comfy_main(tmp_path_factory):
    base = tmp_path_factory.mktemp("comfy_base")
    cn = base / "custom_nodes"
    cn.mkdir()
    os.symlink(ROOT, cn / "comfyui-flux-numba")  # folder name ending in "numba": the redirector trap
    (cn / "zz_flux_numba_probe.py").write_text(PROBE)
    for sub, name in (("diffusion_models", "flux1-dev.safetensors"), ("text_encoders", "clip_l.safetensors"),
                      ("text_encoders", "t5xxl_fp16.safetensors"), ("vae", "ae.safetensors")):
        (base / "models" / sub).mkdir(parents=True, exist_ok=True)
        (base / "models" / sub / name).write_bytes(b"")  # names for validation only, never loaded
    env = dict(os.environ, FLUX_NUMBA_WF_TEST=os.path.join(ROOT, "tests", "test_workflows.py"),
               FLUX_NUMBA_WORKFLOW=WORKFLOW)
    env.setdefault("NUMBA_ENABLE_CUDASIM", "1")
    cmd = [sys.executable, "main.py", "--cpu", "--quick-test-for-ci", "--base-directory", str(base),
           "--database-url", "sqlite:///:memory:", "--disable-auto-launch", "--disable-api-nodes"]
    r = subprocess.run(cmd, cwd=COMFYUI_PATH, capture_output=True, text=True, timeout=200, env=env)
    log = r.stdout + r.stderr
    probe = [ln for ln in log.splitlines() if ln.startswith("PROBE ")]
    return r.returncode, log, json.loads(probe[-1][6:]) if probe else None


def test_pack_loads_in_comfyui_main(comfy_main):
    rc, log, probe = comfy_main
    assert rc == 0, log[-4000:]
    assert probe is not None, "probe did not run:\n" + log[-4000:]
    bad = [ln for ln in log.splitlines() if "IMPORT FAILED" in ln or "Cannot import" in ln]
    assert not [ln for ln in bad if "flux-numba" in ln or "flux_numba" in ln], bad
    assert "failed to import" not in log, log[-4000:]  # nodes/__init__ logs a broken node module
    assert {"FluxNumbaLoader", "FluxNumbaPatch", "FluxNumbaStepTimer"} <= set(probe["nodes"]), probe


def test_example_workflow_validates_in_comfyui(comfy_main):
    rc, log, probe = comfy_main
    assert probe is not None, log[-4000:]
    v = probe["validate"]
    assert v["valid"] is True, json.dumps(v, indent=1)[:4000]
    assert not v["node_errors"] and v["outputs"] == ["12"], v  # SaveImage is node 12


# ----------------------------------------------------------------------------- patch contract
def test_clone_untouched_and_pass_through_without_gpu(comfy, monkeypatch, caplog):
    monkeypatch.setattr(patch_mod(), "SIMULATOR_OK", False)
    mp = tiny_patcher(comfy)
    before = repr(mp.model_options)
    with caplog.at_level(logging.WARNING, logger="flux_numba"):
        out, = Patch().patch(mp, backend="auto")
    assert out is not mp and out.model is mp.model
    assert repr(mp.model_options) == before, "the input model must not be modified"
    info = out.model_options["transformer_options"]["flux_numba"]
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: pass-through on CPU not testable here")
    assert info["active"] is False and info["reason"]
    assert "patches_replace" not in out.model_options["transformer_options"]
    assert "passes the model through" in caplog.text
    inp = _inputs(torch.float32)
    assert torch.equal(forward(out, inp), forward(mp, inp))


@pytest.mark.parametrize("opts", [
    dict(profile="stock-order", attention="sdpa", route_norms=True),
    dict(profile="exact", attention="auto", route_norms=True),
    dict(profile="exact", attention="sdpa", route_norms=False),
], ids=["stock-order", "exact", "exact-no-norms"])
def test_forward_torch_backend_equals_stock(comfy, opts):
    mp = tiny_patcher(comfy)
    inp = _inputs(torch.float32)
    ref = forward(mp, inp)
    pm, = Patch().patch(mp, backend="torch", **opts)
    info = pm.model_options["transformer_options"]["flux_numba"]
    assert info["active"] and info["double_blocks"] == 2 and info["single_blocks"] == 2, info
    assert info["attention_route"] == "comfy"
    out = forward(pm, inp)
    st = patch_stats(pm)
    assert st["calls"] == N_BLOCKS and st["fallbacks"] == 0, st
    assert (out - ref).abs().max().item() <= 1e-5 * ref.abs().max().item(), rel_err(out, ref)
    assert torch.equal(forward(mp, inp), ref), "unpatched model must still run stock"


def test_forward_numba_simulator(comfy, monkeypatch):
    """Numba kernels (CUDA simulator on CPU; a GPU when FLUX_NUMBA_REAL_GPU=1) vs stock, bf16.

    Attention stays ComfyUI's ("sdpa"): the numba attention kernel takes ~15 s per call in the
    simulator (it has its own tests); its routing is checked with a spy below."""
    from flux_numba_pack.cuda_kernels import registry
    monkeypatch.setattr(patch_mod(), "SIMULATOR_OK", True)
    mp = tiny_patcher(comfy, torch.bfloat16)
    inp = _inputs(torch.bfloat16, B=1, hw=4, txt=3)
    ref = forward(mp, inp, inference=False)
    pm, = Patch().patch(mp, backend="numba", profile="exact", attention="sdpa")
    registry.take_usage()
    out = forward(pm, inp, inference=False)
    usage = registry.take_usage()
    st = patch_stats(pm)
    assert st["calls"] == N_BLOCKS and st["fallbacks"] == 0, st
    assert any("numba" in b for per in usage.values() for b in per), usage
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < 3e-2, (rel_err(out, ref), usage)


def test_policies_do_not_leak_between_models(comfy, monkeypatch):
    """Two differently patched models: each block runs under its own model's policy only."""
    from flux_numba_pack.cuda_kernels import registry
    from flux_numba_pack.cuda_kernels.registry import Backend
    monkeypatch.setattr(patch_mod(), "SIMULATOR_OK", True)
    op = registry.ops["gelu_tanh"]
    calls = []

    def spy(x, out=None):
        calls.append(1)
        return op.reference(x, out=out)
    monkeypatch.setitem(op.backends, "numba", Backend("numba", spy, None, 10))
    mp = tiny_patcher(comfy)
    inp = _inputs(torch.float32)
    a, = Patch().patch(mp, backend="torch")
    b, = Patch().patch(mp, backend="numba", attention="sdpa")
    calls.clear()  # on a GPU the patch node warms (JIT-compiles) its kernels once at patch time
    forward(a, inp)
    assert not calls
    forward(b, inp)
    n = len(calls)
    assert n == 2 * 2 + 2  # double: img + txt MLP, single: one GELU each
    forward(a, inp)
    assert len(calls) == n
    assert registry.requested("gelu_tanh") == "auto", "no global policy may be left behind"


@pytest.mark.parametrize("attention,backend,expect", [
    ("numba-bf16", "torch", "numba"), ("numba-8bit", "torch", "numba-8bit"), ("auto", "numba", "numba"),
    ("auto", "auto", "numba"), ("sdpa", "numba", None), ("auto", "torch", None)])
def test_attention_routing(comfy, monkeypatch, attention, backend, expect):
    """Which attention runs: a spy stands in for the (slow in the simulator) numba kernels."""
    from flux_numba_pack.cuda_kernels import registry
    from flux_numba_pack.cuda_kernels.registry import Backend
    monkeypatch.setattr(patch_mod(), "SIMULATOR_OK", True)
    monkeypatch.setattr(registry, "autotune", False)  # routing, not tuning: on a GPU the trial calls would count
    op = registry.ops["attention"]
    calls = []

    def spy(name):
        def fn(q, k, v, mask=None, out=None):
            calls.append(name)
            return op.reference(q, k, v, mask, out=out)
        return fn
    for name in ("numba", "numba-8bit"):
        monkeypatch.setitem(op.backends, name, Backend(name, spy(name), None, 10 if name == "numba" else 5))
    mp = tiny_patcher(comfy)
    inp = _inputs(torch.float32)
    ref = forward(mp, inp)
    pm, = Patch().patch(mp, backend=backend, attention=attention)
    calls.clear()  # on a GPU the patch node warms (JIT-compiles) the kernels it will use once
    out = forward(pm, inp)
    assert calls == ([expect] * N_BLOCKS if expect else []), calls
    assert rel_err(out, ref) < 1e-5


def test_sdpa_honours_attention_override(comfy):
    """attention "sdpa" is ComfyUI's optimized_attention: transformer_options overrides apply."""
    mp = tiny_patcher(comfy)
    inp = _inputs(torch.float32)
    ref = forward(mp, inp)
    pm, = Patch().patch(mp, backend="torch", attention="sdpa")
    seen = []

    def override(func, q, k, v, heads, *a, **kw):
        seen.append((tuple(q.shape), heads, kw.get("skip_reshape")))
        return func(q, k, v, heads, *a, **kw)
    pm.model_options["transformer_options"]["optimized_attention_override"] = override
    out = forward(pm, inp)
    assert_ran_patched(pm)
    assert len(seen) == N_BLOCKS and all(h == 4 and sr for _, h, sr in seen), seen
    assert torch.equal(out, ref)


def test_failure_inside_our_path_falls_back(comfy, monkeypatch, caplog):
    """A block that raises after updating img in place: the update is undone and stock runs."""
    from flux_numba_pack.flux_core import blocks
    mp = tiny_patcher(comfy)
    inp = _inputs(torch.float32)
    ref = forward(mp, inp)
    pm, = Patch().patch(mp, backend="torch")

    def broken(blk, img, txt, *a, **k):
        img.add_(1.0)
        raise RuntimeError("synthetic kernel failure")
    monkeypatch.setattr(blocks, "double_block", broken)
    with caplog.at_level(logging.WARNING, logger="flux_numba"):
        out = forward(pm, inp)
        forward(pm, inp)
    assert torch.equal(out, ref)
    st = patch_stats(pm)
    # the first failure turns the pack's path off for this model at this input signature: every
    # later block call goes straight to stock (no checks, no copies, no retries)
    assert st["fallbacks"] == 1 and st["calls"] == 1 and st["stock"] == 2 * N_BLOCKS - 1, st
    assert len(st["off"]) == 1 and "synthetic kernel failure" in next(iter(st["off"].values())), st
    assert caplog.text.count("synthetic kernel failure") == 2  # the failure and the turn-off, once each
    other = _inputs(torch.float32, B=1)  # another signature still tries the pack's path
    forward(pm, other)
    assert patch_stats(pm)["calls"] == 2, patch_stats(pm)


def test_bad_input_falls_back(comfy, caplog):
    mp = tiny_patcher(comfy)
    pm, = Patch().patch(mp, backend="torch")
    fn = pm.model_options["transformer_options"]["patches_replace"]["dit"][("double_block", 0)]
    sentinel = {"img": "original", "txt": "original"}
    blk = mp.model.diffusion_model.double_blocks[0]

    def original_block(args):  # like forward_orig's block_wrap: the block is a closure cell
        blk  # noqa: B018
        return sentinel
    args = {"img": torch.zeros(1, 4, 7), "txt": torch.zeros(1, 3, 7), "vec": torch.zeros(1, 7), "pe": None,
            "attn_mask": None, "transformer_options": {}}
    with caplog.at_level(logging.WARNING, logger="flux_numba"):
        assert fn(args, {"original_block": original_block}) is sentinel
    assert "expected [B, L, 128]" in caplog.text


def test_block_resolution(comfy):
    from flux_numba_pack.nodes.host import resolve_block as _resolve_block
    mp = tiny_patcher(comfy)
    dm = mp.model.diffusion_model
    blk = dm.single_blocks[1]

    def wrap(args):
        return blk(args)
    assert _resolve_block("single", 0, {"original_block": wrap}, None) is blk  # the running block wins
    assert _resolve_block("double", 1, {"original_block": lambda a: a}, weakref.ref(mp.model)) is dm.double_blocks[1]


# ----------------------------------------------------------------------------- (c) ComfyUI's sampler
def _sample(mp, latent, steps, seed=7):
    import nodes  # ComfyUI's nodes.py
    from flux_numba_pack.flux_core import TINY
    g = torch.Generator().manual_seed(3)
    ctx = torch.randn(1, 5, TINY.context_in_dim, generator=g)
    pooled = torch.randn(1, TINY.vec_in_dim, generator=g)
    pos = [[ctx, {"pooled_output": pooled, "guidance": 3.5}]]
    neg = [[torch.zeros_like(ctx), {"pooled_output": torch.zeros_like(pooled)}]]
    with torch.inference_mode():  # as ComfyUI's executor runs nodes
        out, = nodes.common_ksampler(mp, seed, steps, 1.0, "euler", "simple", pos, neg, {"samples": latent})
    return out["samples"]


def test_sampling_through_comfyui(comfy, monkeypatch):
    mp = tiny_patcher(comfy)
    latent = torch.zeros(1, 16, 8, 8)
    stock = _sample(mp, latent, 3)
    pm, = Patch().patch(mp, backend="torch", profile="exact")
    patched = _sample(pm, latent, 3)
    assert patch_stats(pm)["calls"] == 3 * N_BLOCKS and patch_stats(pm)["fallbacks"] == 0
    assert torch.allclose(patched, stock, rtol=1e-5, atol=1e-5), rel_err(patched, stock)
    assert torch.equal(_sample(mp, latent, 3), stock), "the original model must still sample stock"

    # numba kernels (simulator on CPU): bf16 model, 1 step, tiny latent
    monkeypatch.setattr(patch_mod(), "SIMULATOR_OK", True)
    mb = tiny_patcher(comfy, torch.bfloat16)
    small = torch.zeros(1, 16, 4, 4)
    stock_b = _sample(mb, small, 1)
    nb, = Patch().patch(mb, backend="numba", profile="exact", attention="sdpa")
    got = _sample(nb, small, 1)
    st = patch_stats(nb)
    assert st["calls"] == N_BLOCKS and st["fallbacks"] == 0, st
    assert rel_err(got, stock_b) < 3e-2
    assert torch.equal(_sample(mb, small, 1), stock_b)
