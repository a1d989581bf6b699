"""The VAE decoder patched by FluxNumbaVAEPatch against stock, in ComfyUI (split from test_vae.py,
whose fixtures it uses; marked ``comfyui``: tests/test_comfyui_matrix.py runs it once per ComfyUI
tree; directly: COMFYUI_PATH -> a ComfyUI tree, with an interpreter that can import it): NCHW and
NHWC decoders, the layout choice and its failure path, the low-res CUDA graph, re-patching,
DynamicVRAM staging.
"""
import math
import os
import sys
import types

import pytest
import torch

from flux_numba_pack.cuda_kernels import registry
from _comfy_trees import comfyui_path
from test_vae import DEV, _fast_simulator, _node_module, _plan_of, strict  # noqa: F401  (fixtures)


# ------------------------------------------------------------------ decoder level (ComfyUI)
def _comfy():
    p, why = comfyui_path()
    if why:
        pytest.skip(why)
    if not os.path.isdir(os.path.join(p, "comfy")):
        pytest.skip(f"COMFYUI_PATH={p} has no comfy/ package")
    if p not in sys.path:
        sys.path.insert(0, p)
    try:
        from comfy.cli_args import args
        if not torch.cuda.is_available():
            args.cpu = True
        import comfy.model_patcher  # noqa: F401
        import comfy.ldm.modules.diffusionmodules.model as M
    except Exception as e:
        pytest.skip(f"ComfyUI not importable here ({type(e).__name__}: {e})")
    return M


def _small_decoder(M, dtype):
    torch.manual_seed(0)
    dec = M.Decoder(ch=32, out_ch=3, ch_mult=[1, 2], num_res_blocks=1, attn_resolutions=[], in_channels=3,
                    resolution=16, z_channels=16)
    with torch.no_grad():
        for name, p in dec.named_parameters():  # ComfyUI's ops skip init: fill every parameter
            if name.endswith("norm1.weight") or name.endswith("norm2.weight") or "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif p.ndim == 1:
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / math.sqrt(p[0].numel()))
    return dec.eval().to(DEV, dtype)


def _small_vae(M, dtype):
    """(decoder, its first_stage_model, a VAE-like object with a ModelPatcher) for the node."""
    import comfy.model_patcher
    dec = _small_decoder(M, dtype)
    fsm = torch.nn.Module()
    fsm.decoder = dec
    dev = torch.device(DEV)
    vae = types.SimpleNamespace(first_stage_model=fsm, latent_channels=16,
                                patcher=comfy.model_patcher.ModelPatcher(fsm, load_device=dev, offload_device=dev))
    return dec, fsm, vae


@pytest.mark.comfyui
def test_decoder_patched_matches_stock(strict):
    M = _comfy()
    node = _node_module()
    dec, fsm, vae = _small_vae(M, torch.float32)
    z = torch.randn(1, 16, 3, 5, device=DEV)  # odd latent: mid 3x5, then 6x10
    with torch.no_grad():
        stock = fsm.decoder(z)

    out = node.apply(vae)[0]
    assert out is not vae and out.patcher is not vae.patcher
    assert fsm.decoder is dec and not vae.patcher.object_patches  # input untouched
    out.patcher.patch_model(load_weights=False)
    try:
        assert fsm.decoder is not dec and type(fsm.decoder).__name__ == "FluxNumbaDecoder"
        assert fsm.decoder.conv_in is dec.conv_in  # leaves shared, keys unchanged
        assert set(fsm.decoder.state_dict()) == set(dec.state_dict())
        registry.take_usage()
        with torch.no_grad(), registry.force("numba", ops=["groupnorm_silu"]):
            got = fsm.decoder(z)
        used = registry.take_usage().get("groupnorm_silu", {})
        assert used == {"numba": 14}, used  # 6 ResnetBlocks x 2 + mid attention + norm_out
    finally:
        vae.patcher.unpatch_model()  # the stock clone restores the shared backup
    assert fsm.decoder is dec and type(dec) is M.Decoder
    tol = 1e-4 if DEV == "cpu" else 3e-3   # (on a GPU cuDNN's fp32 convolutions run TF32)
    torch.testing.assert_close(got, stock, atol=tol, rtol=tol)

    # a non-FLUX (4-channel) VAE passes through
    sd_vae = types.SimpleNamespace(first_stage_model=fsm, latent_channels=4, patcher=vae.patcher)
    assert node.apply(sd_vae)[0] is sd_vae


def _decode(vae, fsm, z, **patch_kw):
    """(patched decoder output, registry usage) with ``vae`` patched by the node, then unpatched."""
    out = _node_module().apply(vae, **patch_kw)[0]
    out.patcher.patch_model(load_weights=False)
    try:
        registry.take_usage()
        with torch.no_grad():
            got = fsm.decoder(z)
        return got, registry.take_usage()
    finally:
        vae.patcher.unpatch_model()


@pytest.mark.comfyui
def test_decoder_nhwc_matches_stock(strict, monkeypatch):
    """bf16 decoder, layout nhwc: channels_last between entry and exit, every GroupNorm and the
    upsample on the Numba NHWC kernels, the conv biases (+ residuals) on bias_residual_nhwc or folded
    into the next GroupNorm, NCHW image out; close to stock bf16 and to fp32."""
    M = _comfy()
    dec, fsm, vae = _small_vae(M, torch.bfloat16)
    dec.mid.attn_1.optimized_attention = M.pytorch_attention     # ComfyUI's choice on CUDA (CPU: split)
    z = torch.randn(2, 16, 4, 5, device=DEV).to(torch.bfloat16)   # 2 images, odd width (20 tokens: vae_attention takes L % 4 == 0)
    with torch.no_grad():
        stock = fsm.decoder(z).float()
        d32 = _small_decoder(M, torch.float32)
        d32.mid.attn_1.optimized_attention = M.pytorch_attention
        fp32 = d32(z.float())
    seen = []
    conv2d = torch.nn.functional.conv2d

    def spy(x, w, b=None, *a, **k):  # every convolution of the NHWC path: channels_last in, no bias
        seen.append((x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous(), b is None))
        return conv2d(x, w, b, *a, **k)

    monkeypatch.setattr(torch.nn.functional, "conv2d", spy)
    monkeypatch.setattr(registry, "autotune", False)   # on a GPU: priority order, not tiny-shape timings
    with registry.force("numba", ops=["groupnorm_silu_nhwc", "upsample_nearest2x", "vae_attention"]):
        got, used = _decode(vae, fsm, z)
    monkeypatch.undo()
    assert used.get("groupnorm_silu_nhwc") == {"numba": 14}, used   # 6 ResnetBlocks x 2 + mid attn + norm_out
    assert used.get("upsample_nearest2x") == {"numba": 1}, used
    # conv2 x 6 (+ residual), the 32->64 shortcut, the upsample's conv, conv_in, q / k / v / proj_out;
    # conv_out's 3 channels are not a multiple of 8: torch's add (conv1's biases went into norm2)
    assert used.get("bias_residual_nhwc") == {"numba": 13, "torch": 1}, used
    assert used.get("vae_attention") == {"numba": 1}, used
    assert "groupnorm_silu" not in used
    assert len(seen) == 20 and all(nhwc and nob for nhwc, nob in seen), seen   # 12 + shortcut + 4 attn + in, up, out
    assert got.dtype == torch.bfloat16 and got.is_contiguous() and got.shape == stock.shape
    e_ours = ((got.float() - fp32).norm() / fp32.norm()).item()
    e_stock = ((stock - fp32).norm() / fp32.norm()).item()
    assert e_ours <= 1.5 * e_stock + 1e-3, (e_ours, e_stock)


@pytest.mark.comfyui
def test_decoder_nhwc_layout_choice(strict):
    """layout nchw, backend torch and an fp32 VAE keep the stock layout (the NCHW op runs)."""
    M = _comfy()
    dec, fsm, vae = _small_vae(M, torch.bfloat16)
    z = torch.randn(1, 16, 2, 3, device=DEV).to(torch.bfloat16)
    _, used = _decode(vae, fsm, z, layout="nchw")
    assert "groupnorm_silu_nhwc" not in used and "upsample_nearest2x" not in used, used
    _, used = _decode(vae, fsm, z, backend="torch")
    assert used.get("groupnorm_silu") == {"torch": 14} and "groupnorm_silu_nhwc" not in used, used
    fsm.decoder = dec.float()
    _, used = _decode(vae, fsm, z.float())
    assert "groupnorm_silu_nhwc" not in used, used


@pytest.mark.comfyui
def test_decoder_nhwc_failure_runs_nchw(monkeypatch, caplog):
    """An error inside the NHWC path: logged once, that latent shape then runs the NCHW path (and
    gives the stock-layout result); out-of-memory is re-raised for ComfyUI's tiled fallback."""
    M = _comfy()
    VP = _node_module()
    dec, fsm, vae = _small_vae(M, torch.bfloat16)
    z = torch.randn(1, 16, 2, 3, device=DEV).to(torch.bfloat16)
    ref, _ = _decode(vae, fsm, z, layout="nchw")
    calls = []
    from flux_numba_pack.flux_core import vae as FV
    from flux_numba_pack.nodes.host import vae as HV
    real = HV._upsample_forward

    def boom(self, x, *a, **k):
        calls.append(FV.is_nhwc(x))
        if FV.is_nhwc(x):
            raise RuntimeError("injected")
        return real(self, x, *a, **k)

    monkeypatch.setattr(registry, "strict", False)
    out = VP.apply(vae)[0]
    out.patcher.patch_model(load_weights=False)
    try:
        up = fsm.decoder.up[1].upsample
        monkeypatch.setattr(type(up), "forward", boom)
        with torch.no_grad(), caplog.at_level("WARNING", logger="flux_numba"):
            a = fsm.decoder(z)
            b = fsm.decoder(z)
        assert calls == [True, False, False], calls        # NHWC once, then NCHW for this shape
        assert sum("NHWC decoder path failed" in r.getMessage() for r in caplog.records) == 1
        torch.testing.assert_close(a, ref) and torch.testing.assert_close(b, ref)

        def oom(self, x, *a, **k):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected)")
        monkeypatch.setattr(type(up), "forward", oom)
        with torch.no_grad(), pytest.raises(torch.cuda.OutOfMemoryError):
            fsm.decoder(torch.randn(1, 16, 3, 3, device=DEV).to(torch.bfloat16))
    finally:
        vae.patcher.unpatch_model()


@pytest.mark.comfyui
def test_decoder_low_res_graph(strict):
    """cuda_graph auto: on a GPU two eager decodes of a shape, then the low-resolution stage replays
    as a CUDA graph -- equal to the eager decoder for fresh latents, re-captured when a weight moves;
    on the CPU every decode runs eagerly (reason recorded) with the same result."""
    M = _comfy()
    VP = _node_module()
    dec, fsm, vae = _small_vae(M, torch.bfloat16)
    dec.mid.attn_1.optimized_attention = M.pytorch_attention
    out = VP.apply(vae)[0]
    ref = VP.apply(vae, cuda_graph="off")[0]
    ref_dec = ref.patcher.object_patches["decoder"]
    pat = out.patcher.object_patches["decoder"]
    g = _plan_of(pat).graph
    from flux_numba_pack.flux_core.vae import LowResGraph
    assert isinstance(g, LowResGraph) and _plan_of(ref_dec).graph is None
    modes = []
    with torch.no_grad():
        for i in range(7):
            if i == 4 and DEV == "cuda":   # a weight's storage moves (model reloaded): warm up, re-capture
                w = dec.mid.block_1.conv1.weight
                w.data = w.data.clone()
            z = torch.randn(1, 16, 4, 4, device=DEV).to(torch.bfloat16)
            got = pat(z)
            modes.append(g.last_mode)
            want = ref_dec(z)
            tol = 0 if DEV == "cpu" else 2e-2   # (a captured cuDNN call may pick another algorithm)
            torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    if DEV == "cuda":
        assert modes == ["warm-up", "warm-up", "graph", "graph", "warm-up", "warm-up", "graph"], modes
        assert g.gf.captures == 2 and g.gf.replays == 3, (g.gf.captures, g.gf.replays)
        g.drop()
        assert g.gf is None
    else:
        assert all(m == "eager: not a CUDA device" for m in modes), modes


@pytest.mark.comfyui
def test_low_res_graph_failures(monkeypatch, caplog):
    """A failed capture: logged once, that decoder then stays eager (same result); out-of-memory
    (graphs dropped) and ComfyUI's interrupt propagate and do not turn the graph off."""
    M = _comfy()
    VP = _node_module()
    import flux_numba_pack.flux_core.graphs as FG
    import flux_numba_pack.nodes.host as H
    dec, fsm, vae = _small_vae(M, torch.bfloat16)
    pat = VP.apply(vae)[0].patcher.object_patches["decoder"]
    g = _plan_of(pat).graph
    z = torch.randn(1, 16, 2, 3, device=DEV).to(torch.bfloat16)
    with torch.no_grad():
        want = VP.apply(vae, cuda_graph="off")[0].patcher.object_patches["decoder"](z)

    class InterruptProcessingException(Exception):
        pass

    raised = []

    class Fake:
        def __init__(self, fn, **kw):
            self.graphs, self.replays = {}, 0

        def __call__(self, x, weights_key=None, can_capture=None):
            exc = raised.pop(0)
            raise exc

    monkeypatch.setattr(H, "graph_state", lambda mods, d: ([], ()))
    monkeypatch.setattr(FG, "GraphedForward", Fake)
    monkeypatch.setattr(registry, "strict", False)
    with torch.no_grad():
        raised.append(InterruptProcessingException("cancelled"))
        with pytest.raises(InterruptProcessingException):
            pat(z)
        assert g.failed is None
        raised.append(torch.cuda.OutOfMemoryError("CUDA out of memory (injected)"))
        with pytest.raises(torch.cuda.OutOfMemoryError):
            pat(z)
        assert g.failed is None and g.gf is None
        raised.append(RuntimeError("capture broke (injected)"))
        with caplog.at_level("INFO", logger="flux_numba"):
            a = pat(z)
            b = pat(z)   # not retried: nothing left in ``raised`` to pop
    assert g.failed.startswith("capture failed (RuntimeError") and g.gf is None
    assert sum("low-resolution CUDA graph off" in r.getMessage() for r in caplog.records) == 1
    torch.testing.assert_close(a, want, atol=0, rtol=0)
    torch.testing.assert_close(b, want, atol=0, rtol=0)


@pytest.mark.comfyui
def test_repatch_while_patched(strict):
    """ComfyUI applies the object patch in place: while a patched VAE is loaded the shared
    ``first_stage_model.decoder`` is our clone.  Running the node again then (new widget values, a
    second patch node on the VAE) patches the original decoder, not the clone, and does not refuse."""
    M = _comfy()
    VP = _node_module()
    from flux_numba_pack.nodes.host import vae as HV
    dec, fsm, vae = _small_vae(M, torch.float32)
    node = VP
    first = node.apply(vae)[0]
    first.patcher.patch_model(load_weights=False)
    try:
        assert HV.is_patched(fsm.decoder)
        second = node.apply(vae, layout="nchw", cuda_graph="off")[0]
        assert second is not vae, "refused to patch while the first patch is applied"
        d2 = second.patcher.object_patches["decoder"]
        assert d2 is not fsm.decoder and HV.original_decoder(d2) is dec and HV.original_decoder(fsm.decoder) is dec
        assert _plan_of(d2).layout == "nchw" and _plan_of(d2).graph is None
        assert set(d2.state_dict()) == set(dec.state_dict())   # the back-reference is no submodule
    finally:
        vae.patcher.unpatch_model()
    assert fsm.decoder is dec


@pytest.mark.comfyui
def test_low_res_graph_dropped_on_detach():
    """ComfyUI unloading the patched VAE (its patcher's detach with unpatch_all) drops the low-res
    graphs: their memory is held only while the VAE stays loaded; the detach(unpatch_all=False)
    that v0.8.0's load_models_gpu applies to the loaded patcher on every load keeps them."""
    M = _comfy()
    VP = _node_module()
    dec, fsm, vae = _small_vae(M, torch.bfloat16)
    out = VP.apply(vae)[0]
    g = _plan_of(out.patcher.object_patches["decoder"]).graph
    dropped = []
    g.drop = lambda: dropped.append(True)
    out.patcher.patch_model(load_weights=False)
    out.patcher.detach(unpatch_all=False)   # what load_models_gpu does to the loaded patcher on every load
    assert dropped == []
    out.patcher.detach()                    # a real unload (weights to the offload device)
    assert dropped == [True]
    assert fsm.decoder is dec   # detach unpatched the object patch too


@pytest.mark.comfyui
def test_repatching_reuses_the_patched_decoder():
    """The node re-run on the same VAE with the same options (a workflow alternating with one without
    the node: ComfyUI runs it again) hands out the same patched decoder, its low-res graph included;
    other options get their own; the entry goes with the VAE's model."""
    import gc
    M = _comfy()
    VP = _node_module()
    from flux_numba_pack.nodes.host import vae as HV
    dec, fsm, vae = _small_vae(M, torch.bfloat16)
    a = VP.apply(vae)[0]
    b = VP.apply(vae)[0]
    assert a is not b and a.patcher is not b.patcher   # a new VAE object per run, as before
    da, db = (v.patcher.object_patches["decoder"] for v in (a, b))
    assert da is db and _plan_of(da).graph is not None
    dc = VP.apply(vae, cuda_graph="off")[0].patcher.object_patches["decoder"]
    assert dc is not da and _plan_of(dc).graph is None
    keys = [k for k in HV._REUSE if k[0] == id(fsm)]
    assert len(keys) == 2
    del a, b, da, db, dc, vae, fsm, dec
    gc.collect()
    assert not [k for k in HV._REUSE if k in keys], "the VAE's model is gone: so are its entries"


@pytest.mark.comfyui
def test_dynamic_vram_decoder_is_staged_once_per_decode(monkeypatch):
    """A DynamicVRAM decoder (vbar weights) decodes inside one ``staged_block`` over the whole decoder
    (every weight staged and pinned once, as ComfyUI's block prefetch does), not op by op; a plain
    decoder is not staged.  The result is the eager decoder's."""
    import contextlib
    M = _comfy()
    VP = _node_module()
    import flux_numba_pack.nodes.host as H
    dec, fsm, vae = _small_vae(M, torch.bfloat16)
    pat = VP.apply(vae, cuda_graph="off")[0].patcher.object_patches["decoder"]
    z = torch.randn(1, 16, 2, 3, device=DEV).to(torch.bfloat16)
    with torch.no_grad():
        want = pat(z)
    staged = []

    @contextlib.contextmanager
    def fake_staged(blk, device, dynamic):
        staged.append((blk, dynamic))
        yield dynamic
    monkeypatch.setattr(H, "staged_block", fake_staged)
    with torch.no_grad():
        pat(z)
    assert staged == [(pat, False)]
    monkeypatch.setattr(H, "dynamic_block", lambda blk: True)
    with torch.no_grad():
        got = pat(z)
        pat(z)
    assert staged[1:] == [(pat, True), (pat, True)]
    torch.testing.assert_close(got, want, atol=0, rtol=0)
