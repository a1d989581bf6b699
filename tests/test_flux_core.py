"""Functional FLUX core: config inference, loading, an independent reference forward, bad input."""
import math
import os

import pytest
import torch
import torch.nn.functional as F

from flux_numba_pack.flux_core import (TINY, BlockContext, CheckpointError, FluxModel, NotFluxError,
                                       flux_schedule, euler_sample, inspect_checkpoint, load_state_dict,
                                       random_state_dict, save_state_dict, tiny_state_dict, infer_config)
from flux_numba_pack.flux_core.checkpoint import FLUX1_DEV, expected_shapes
from flux_numba_pack.cuda_kernels import registry


# ---------------------------------------------------------------------- an independent reference
def ref_forward(sd, cfg, x, t, ctx, y, guidance):
    """FLUX.1 forward written from the model's definition, straight on the state dict (fp32),
    sharing no code with flux_core: einsum attention, explicit RoPE with complex numbers."""
    W = lambda n: sd[n + ".weight"].float()
    Bv = lambda n: sd[n + ".bias"].float() if n + ".bias" in sd else None
    lin = lambda n, a: F.linear(a, W(n), Bv(n))
    C, H = cfg.hidden_size, cfg.num_heads
    D = C // H

    def temb(tt):
        half = 128
        f = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float64) / half)
        a = (1000 * tt.double())[:, None] * f[None]
        return torch.cat([a.cos(), a.sin()], -1).float()

    def mlp_emb(n, a):
        return lin(n + ".out_layer", F.silu(lin(n + ".in_layer", a)))

    def ln(a):
        mu = a.mean(-1, keepdim=True)
        var = ((a - mu) ** 2).mean(-1, keepdim=True)
        return (a - mu) / torch.sqrt(var + 1e-6)

    def rms(a, s):
        return a / torch.sqrt((a * a).mean(-1, keepdim=True) + 1e-6) * s

    Bn, Cl, h, w = x.shape
    hl, wl = h // 2, w // 2
    img = x.reshape(Bn, Cl, hl, 2, wl, 2).permute(0, 2, 4, 1, 3, 5).reshape(Bn, hl * wl, Cl * 4)
    Lt = ctx.shape[1]
    # positions: text (0,0,0); image (0, row, col)
    pos = torch.zeros(Lt + hl * wl, 3, dtype=torch.float64)
    rr, cc = torch.meshgrid(torch.arange(hl), torch.arange(wl), indexing="ij")
    pos[Lt:, 1], pos[Lt:, 2] = rr.flatten().double(), cc.flatten().double()
    angles = []
    for ax, dim in enumerate(cfg.axes_dim):
        omega = 1.0 / (cfg.theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        angles.append(pos[:, ax:ax + 1] * omega[None])
    ang = torch.cat(angles, -1)  # [L, D/2]
    rot = torch.polar(torch.ones_like(ang), ang)

    def rope(a):  # [B, H, L, D]
        ac = torch.view_as_complex(a.double().reshape(*a.shape[:-1], D // 2, 2).contiguous())
        return torch.view_as_real(ac * rot).reshape(a.shape).float()

    def attn(q, k, v):
        s = torch.einsum("bhld,bhmd->bhlm", q, k) / math.sqrt(D)
        return torch.einsum("bhlm,bhmd->bhld", s.softmax(-1), v).transpose(1, 2).reshape(Bn, -1, C)

    img = lin("img_in", img)
    vec = mlp_emb("time_in", temb(t)) + mlp_emb("guidance_in", temb(guidance)) + mlp_emb("vector_in", y)
    txt = lin("txt_in", ctx)
    sv = F.silu(vec)[:, None]
    for i in range(cfg.depth):
        p = f"double_blocks.{i}."
        mods = {s: lin(p + f"{s}_mod.lin", sv).chunk(6, -1) for s in ("img", "txt")}
        qkv = {}
        for s, a in (("txt", txt), ("img", img)):
            sh, sc = mods[s][0], mods[s][1]
            z = lin(p + f"{s}_attn.qkv", ln(a) * (1 + sc) + sh).reshape(Bn, -1, 3, H, D).permute(2, 0, 3, 1, 4)
            qkv[s] = (rms(z[0], sd[p + f"{s}_attn.norm.query_norm.scale"].float()),
                      rms(z[1], sd[p + f"{s}_attn.norm.key_norm.scale"].float()), z[2])
        q = rope(torch.cat([qkv["txt"][0], qkv["img"][0]], 2))
        k = rope(torch.cat([qkv["txt"][1], qkv["img"][1]], 2))
        v = torch.cat([qkv["txt"][2], qkv["img"][2]], 2)
        o = attn(q, k, v)
        outs = {"txt": o[:, :Lt], "img": o[:, Lt:]}
        new = {}
        for s, a in (("txt", txt), ("img", img)):
            sh1, sc1, g1, sh2, sc2, g2 = mods[s]
            a = a + g1 * lin(p + f"{s}_attn.proj", outs[s])
            hmid = F.gelu(lin(p + f"{s}_mlp.0", ln(a) * (1 + sc2) + sh2), approximate="tanh")
            new[s] = a + g2 * lin(p + f"{s}_mlp.2", hmid)
        txt, img = new["txt"], new["img"]
    xs = torch.cat([txt, img], 1)
    M = cfg.mlp_hidden_dim
    for i in range(cfg.depth_single_blocks):
        p = f"single_blocks.{i}."
        sh, sc, g = lin(p + "modulation.lin", sv).chunk(3, -1)
        z = lin(p + "linear1", ln(xs) * (1 + sc) + sh)
        qkv, m = z[..., :3 * C], z[..., 3 * C:]
        qkv = qkv.reshape(Bn, -1, 3, H, D).permute(2, 0, 3, 1, 4)
        q = rope(rms(qkv[0], sd[p + "norm.query_norm.scale"].float()))
        k = rope(rms(qkv[1], sd[p + "norm.key_norm.scale"].float()))
        o = attn(q, k, qkv[2])
        xs = xs + g * lin(p + "linear2", torch.cat([o, F.gelu(m, approximate="tanh")], -1))
    img = xs[:, Lt:]
    shift, scale = lin("final_layer.adaLN_modulation.1", F.silu(vec))[:, None].chunk(2, -1)
    img = lin("final_layer.linear", ln(img) * (1 + scale) + shift)
    return img.reshape(Bn, hl, wl, Cl, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(Bn, Cl, h, w)


def inputs(cfg, B=2, h=8, w=6, Lt=7, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, cfg.in_channels, h, w, generator=g), torch.rand(B, generator=g),
            torch.randn(B, Lt, cfg.context_in_dim, generator=g), torch.randn(B, cfg.vec_in_dim, generator=g),
            torch.full((B,), 3.5))


@pytest.mark.parametrize("fused", [False, True])
def test_functional_forward_matches_independent_reference(fused):
    sd = tiny_state_dict(seed=3)
    m = FluxModel.from_state_dict(sd)
    x, t, ctx, y, g = inputs(m.cfg)
    with registry.force("torch"):
        out = m(x, t, ctx, y, g, BlockContext(fused=fused))
    ref = ref_forward(sd, m.cfg, x, t, ctx, y, g)
    rel = (out - ref).norm() / ref.norm()
    assert out.shape == x.shape
    assert rel < 5e-5, rel  # fp32 rounding through 4 blocks; a wrong op gives > 1e-2


def test_config_inference_full_flux_shapes():
    shapes = expected_shapes(FLUX1_DEV)
    cfg = infer_config(shapes)
    assert cfg == FLUX1_DEV
    assert 11.8e9 < cfg.n_params() < 12.0e9


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."])
def test_load_every_dtype(tmp_path, dtype, prefix):
    sd = tiny_state_dict(seed=0)
    path = str(tmp_path / "m.safetensors")
    save_state_dict({k: v.to(dtype) for k, v in sd.items()}, path, prefix=prefix)
    cfg = inspect_checkpoint(path)
    assert cfg == TINY
    loaded = load_state_dict(path)
    assert set(loaded) == set(sd) and all(v.dtype == dtype for v in loaded.values())
    m = FluxModel.from_state_dict(loaded, dtype=None if dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else torch.float32)
    x, t, ctx, y, g = inputs(m.cfg, B=1)
    with registry.force("torch"):
        out = m(x, t, ctx, y, g, dtype=torch.float32)
    ref = ref_forward({k: v.to(dtype).float() for k, v in sd.items()}, m.cfg, x, t, ctx, y, g)
    assert torch.isfinite(out).all()
    assert ((out - ref).norm() / ref.norm()) < 1e-4


def test_scaled_fp8_weights(tmp_path):
    sd = tiny_state_dict(seed=0)
    q = {}
    for k, v in sd.items():
        if v.ndim == 2:
            s = v.abs().max() / 448.0
            q[k] = (v / s).to(torch.float8_e4m3fn)
            q[k[:-len("weight")] + "scale_weight"] = s.reshape(())
        else:
            q[k] = v
    path = str(tmp_path / "scaled.safetensors")
    save_state_dict(q, path)
    assert inspect_checkpoint(path) == TINY
    m = FluxModel.from_state_dict(load_state_dict(path))
    x, t, ctx, y, g = inputs(m.cfg, B=1)
    with registry.force("torch"):
        out = m(x, t, ctx, y, g, dtype=torch.float32)
    ref = ref_forward(sd, m.cfg, x, t, ctx, y, g)
    assert ((out - ref).norm() / ref.norm()) < 0.1  # fp8 quantisation error, not a bug


def test_not_flux_file(tmp_path):
    path = str(tmp_path / "sdxl.safetensors")
    save_state_dict({"model.diffusion_model.input_blocks.0.0.weight": torch.zeros(4, 4)}, path)
    with pytest.raises(NotFluxError, match="not a FLUX.1 diffusion model.*UNet"):
        inspect_checkpoint(path)


def test_truncated_and_garbage_files(tmp_path):
    sd = tiny_state_dict(seed=0)
    path = str(tmp_path / "m.safetensors")
    save_state_dict(sd, path)
    data = open(path, "rb").read()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        inspect_checkpoint(str(cut))
    with pytest.raises(CheckpointError, match="truncated"):
        load_state_dict(str(cut))
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"hello world, not a checkpoint at all")
    with pytest.raises(CheckpointError):
        inspect_checkpoint(str(junk))
    with pytest.raises(CheckpointError, match="no such file"):
        inspect_checkpoint(str(tmp_path / "missing.safetensors"))


def test_wrong_shapes_rejected(tmp_path):
    sd = tiny_state_dict(seed=0)
    sd["double_blocks.1.img_attn.proj.weight"] = torch.zeros(3, 3)
    path = str(tmp_path / "bad.safetensors")
    save_state_dict(sd, path)
    with pytest.raises(NotFluxError, match="double_blocks.1.img_attn.proj.weight"):
        inspect_checkpoint(path)
    sd = tiny_state_dict(seed=0)
    del sd["single_blocks.0.linear2.bias"]
    save_state_dict(sd, path)
    with pytest.raises(NotFluxError, match="missing"):
        inspect_checkpoint(path)


def test_bad_latents_and_batch_two():
    m = FluxModel.from_state_dict(tiny_state_dict(seed=0))
    x, t, ctx, y, g = inputs(m.cfg, B=2)
    with pytest.raises(ValueError, match="multiples of 2"):
        m(torch.randn(2, 16, 7, 6), t, ctx, y, g)
    with pytest.raises(ValueError, match="latent must be"):
        m(torch.randn(2, 4, 8, 6), t, ctx, y, g)
    with pytest.raises(ValueError, match="context must be"):
        m(x, t, ctx[:1], y, g)
    with registry.force("torch"):
        both = m(x, t, ctx, y, g)
        one = m(x[1:], t[1:], ctx[1:], y[1:], g[1:])
    assert torch.allclose(both[1:], one, atol=1e-5)


def test_schedule_and_sampler():
    ts = flux_schedule(4, 4096)
    assert ts[0] == 1.0 and ts[-1] == 0.0 and all(a > b for a, b in zip(ts, ts[1:]))
    # mu = 1.15 at 4096 tokens: t=0.5 -> e^1.15 / (e^1.15 + 1)
    assert abs(flux_schedule(2, 4096)[1] - math.exp(1.15) / (math.exp(1.15) + 1)) < 1e-12
    seen = []
    x = euler_sample(lambda x, t: torch.ones_like(x), torch.zeros(1, 2, 2, 2), ts, lambda i, x: seen.append(i))
    assert seen == [0, 1, 2, 3] and torch.allclose(x, torch.full_like(x, -1.0))


def test_random_state_dict_is_deterministic():
    a, b = random_state_dict(TINY, 5), random_state_dict(TINY, 5)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_gemm_epilogue_path_matches_reference():
    """ctx.gemm_epilogue folds the double blocks' GELU into linear_gelu; same function."""
    from flux_numba_pack.flux_core.blocks import plain_weights
    sd = tiny_state_dict(seed=4)
    m = FluxModel.from_state_dict(sd)
    x, t, ctx, y, g = inputs(m.cfg)
    with registry.force("torch"):
        registry.take_usage()
        out = m(x, t, ctx, y, g, BlockContext(fused=True, gemm_epilogue=True))
        assert "linear_gelu" in registry.take_usage()
    ref = ref_forward(sd, m.cfg, x, t, ctx, y, g)
    assert ((out - ref).norm() / ref.norm()) < 5e-5
    lin = m.single_blocks[0].linear1
    assert plain_weights(lin, x.new_zeros(1, 128)) is not None
    assert plain_weights(lin, x.new_zeros(1, 128).double()) is None  # dtype differs: call the module
    lin.scale_weight = torch.tensor(1.0)
    assert plain_weights(lin, x.new_zeros(1, 128)) is None  # scaled fp8 storage: call the module

    class HostOp(torch.nn.Linear):  # a host's op (casts / patches / dequantizes per call): call the module
        def forward(self, x):
            return super().forward(x)
    hl = HostOp(128, 64)
    assert plain_weights(hl, x.new_zeros(1, 128)) is None
    assert plain_weights(torch.nn.Linear(128, 64), x.new_zeros(1, 128)) is not None


def test_linear_gelu_reference_and_backend_check():
    from flux_numba_pack.cuda_kernels import linear_gelu
    xx, w, b = torch.randn(2, 5, 16), torch.randn(24, 16), torch.randn(24)
    buf = torch.full((2, 5, 40), float("nan"))
    linear_gelu.reference(xx, w, b, out=buf[..., 16:])
    assert torch.allclose(buf[..., 16:], F.gelu(F.linear(xx, w, b), approximate="tanh"))
    assert torch.isnan(buf[..., :16]).all()
    assert "CUDA" in linear_gelu.check(xx, w, b)
