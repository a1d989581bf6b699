"""Numba backends of the fused FLUX ops vs their torch references (simulator on CPU, or the GPU
with FLUX_NUMBA_REAL_GPU=1).

Every call is forced to the numba backend with ``registry.strict`` (an unusable backend raises),
outputs are NaN-poisoned (``torch.empty`` returns NaN-filled tensors inside the tests) so an
unwritten element fails, sizes are odd (batch 2, L not a multiple of anything, C 64/96, two
parts with L 5 and 7, row-strided views, unaligned rows that take the scalar path).
"""
import pytest
import torch

from flux_numba_pack.cuda_kernels import registry
from flux_numba_pack.cuda_kernels import jit
from flux_numba_pack.cuda_kernels import ln_modulate as LM
from flux_numba_pack.cuda_kernels import gelu_tanh as GT
from flux_numba_pack.cuda_kernels import gated_residual as GR
from flux_numba_pack.cuda_kernels import qk_norm_rope as QK
from flux_numba_pack.flux_core import blocks
from flux_numba_pack.cuda_kernels.config import QkConfig
from _kernel_testing import DEV, BF, ROW_VARIANTS, rnd, strict_and_poison  # noqa: F401  (autouse fixture)
from _fused_testing import FUSED_OPS, TinyDouble, TinySingle, _rel, close, numba, ref_of, rope_pe


pytestmark = pytest.mark.skipif(not jit.NUMBA_OK, reason="numba not importable")


# ------------------------------------------------------------------------------------ ln_modulate
@pytest.fixture(params=["pipe", "late", "early"])
def late(request):
    """Every row-kernel variant (``ROW_VARIANTS``, passed as ``config=``): pipelined (16-byte rows),
    one row per block with the modulation vectors loaded in the last pass / with x.  The
    simulator's 2x2x2 grid makes each block stride over several rows (the pipeline's prefetch of
    the next row is exercised)."""
    return request.param


def row_key(C, GATED, late):
    """The launcher a row kernel call must have used (C % 4: int16 scalars; C % 8: 8-byte
    words; else 16-byte pairs -- the pipelined kernel when enabled); a config other than the
    default is the key's last element."""
    if late == "pipe" and C % 8 == 0:
        return ("pipe", GATED, ROW_VARIANTS[late])
    key = (1, GATED, 1) if C % 4 else (4, GATED, 1) if C % 8 else (4, GATED, 2)
    return key + ((1,) if late != "early" else ()) + (ROW_VARIANTS[late],)


@pytest.mark.parametrize("B,L,C,offset", [(2, 7, 64, 0.0), (1, 5, 96, 30.0), (2, 3, 66, 0.5), (2, 3, 68, -1.0),
                                          (1, 9, 520, 2.0)])
def test_ln_modulate(B, L, C, offset, late):
    torch.manual_seed(B * 100 + L + C)
    x = rnd(B, L, C, scale=2.0, offset=offset)
    mod = rnd(B, 1, 6 * C)  # shift/scale are chunks: unit stride on C, batch stride 6C
    sh, sc = mod[..., C:2 * C], mod[..., 2 * C:3 * C]
    with numba():
        y = registry.call("ln_modulate", x, sh, sc, 1e-6, config=ROW_VARIANTS[late])
    assert registry.last["ln_modulate"] == "numba"
    close(y, ref_of("ln_modulate")(x, sh, sc, 1e-6))
    # variant (VEC, GATED, VW): C % 4 -> int16 scalar; C % 8 -> 8-byte words; else 16-byte pairs
    assert LM._launchers[row_key(C, 0, late)].kernel is not None


def test_ln_modulate_broadcast_batch():
    torch.manual_seed(1)
    x = rnd(2, 5, 64)
    sh, sc = rnd(1, 1, 64), rnd(1, 1, 64)
    with numba():
        y = registry.call("ln_modulate", x, sh, sc, 1e-6)
    close(y, ref_of("ln_modulate")(x, sh, sc, 1e-6))


# ------------------------------------------------------------------------------- gated residual
@pytest.mark.parametrize("B,L,C", [(2, 7, 64), (1, 5, 96), (2, 3, 66), (2, 3, 68)])
def test_gated_residual_bit_exact(B, L, C):
    torch.manual_seed(B + L + C)
    x = rnd(B, L, C, scale=4.0)
    y = rnd(B, L, C)
    g = rnd(B, 1, 3 * C)[..., C:2 * C]
    x1, x2 = x.clone(), x.clone()
    with numba():
        r = registry.call("gated_residual", x1, g, y)
    assert r is x1
    ref_of("gated_residual")(x2, g, y)
    assert torch.equal(x1, x2), "gate*y rounded then added: must match stock bit for bit"
    key = ("gated", 1, 1) if C % 4 else ("gated", 4, 1) if C % 8 else ("gated", 4, 2)
    assert GR._launchers[key].kernel is not None


@pytest.mark.parametrize("B,L,C", [(2, 7, 64), (2, 3, 66), (1, 4, 68), (1, 9, 520)])
def test_gated_residual_ln_modulate(B, L, C, late):
    torch.manual_seed(7 + C)
    x = rnd(B, L, C, scale=3.0)
    y = rnd(B, L, C)
    mod = rnd(B, 1, 6 * C)
    g, sh, sc = mod[..., 2 * C:3 * C], mod[..., 3 * C:4 * C], mod[..., 4 * C:5 * C]
    x1, x2 = x.clone(), x.clone()
    with numba():
        h1 = registry.call("gated_residual_ln_modulate", x1, g, y, sh, sc, 1e-6, config=ROW_VARIANTS[late])
    h2 = ref_of("gated_residual_ln_modulate")(x2, g, y, sh, sc, 1e-6)
    assert torch.equal(x1, x2)
    close(h1, h2)
    assert LM._launchers[row_key(C, 1, late)].kernel is not None


# ------------------------------------------------------------------------------------ gelu_tanh
def test_gelu_tanh_into_strided_out():
    torch.manual_seed(3)
    B, L, C, M = 2, 5, 32, 128
    lin1 = rnd(B, L, 3 * C + M, scale=3.0)
    mlp = lin1[..., 3 * C:]  # row-strided input
    buf = torch.full((B, L, C + M), float("nan"), dtype=BF, device=DEV)
    with numba():
        r = registry.call("gelu_tanh", mlp, out=buf[..., C:])
    assert r.data_ptr() == buf[..., C:].data_ptr()
    close(buf[..., C:], ref_of("gelu_tanh")(mlp), tol=1e-2)
    assert torch.isnan(buf[..., :C]).all(), "wrote outside out"
    assert GT._launchers[(4, 2)].kernel is not None  # 16-byte pairs


@pytest.mark.parametrize("shape", [(2, 3, 40), (1, 7, 50), (2, 3, 36), (1, 2, 600)])
def test_gelu_tanh_alloc(shape):
    torch.manual_seed(4)
    x = rnd(*shape, scale=4.0)
    with numba():
        y = registry.call("gelu_tanh", x)
    close(y, ref_of("gelu_tanh")(x), tol=1e-2)
    W = shape[-1]
    assert GT._launchers[(1, 1) if W % 4 else (4, 1) if W % 8 else (4, 2)].kernel is not None


def test_gelu_tanh_extremes():
    """Large |x| (exp overflow / underflow of the fast formula), zeros, inf, NaN propagation."""
    v = [-1e4, -300.0, -90.0, -20.0, -5.0, -0.0, 0.0, 1e-30, 3.0, 20.0, 1e4, float("inf"), float("-inf"), float("nan")]
    x = torch.tensor(v + [0.5] * 2, dtype=BF, device=DEV).reshape(1, 1, 16)
    with numba():
        y = registry.call("gelu_tanh", x)
    r = ref_of("gelu_tanh")(x)
    assert torch.equal(torch.isnan(y), torch.isnan(r))
    m = ~torch.isnan(r)
    torch.testing.assert_close(y[m].float(), r[m].float(), rtol=1e-2, atol=1e-2)


def test_gelu_tanh_unaligned_view():
    torch.manual_seed(5)
    base = rnd(2, 3, 61, scale=3.0)
    x = base[..., 1:58]  # odd offset and width: int16 scalar path
    with numba():
        y = registry.call("gelu_tanh", x)
    close(y, ref_of("gelu_tanh")(x), tol=1e-2)
    assert GT._launchers[(1, 1)].kernel is not None  # scalar (int16) variant


def _qk_case(parts, pe, H, **kw):
    with numba():
        q, k, v = registry.call("qk_norm_rope", parts, pe, H, 1e-6, **kw)
    qr, kr, vr = ref_of("qk_norm_rope")(parts, pe, H, 1e-6)
    for o in (q, k, v):  # [B, H, L, D] views of [B, L, H, D] memory (attention output reshapes for free)
        assert o.transpose(1, 2).is_contiguous()
    close(q, qr)
    close(k, kr)
    assert torch.equal(v, vr)


@pytest.mark.parametrize("D,pe_batch,pad", [(32, 1, 8), (16, 2, 8), (64, 0, 8), (32, 1, 4), (8, 1, 8), (4, 2, 4)])
def test_qk_norm_rope_two_parts(D, pe_batch, pad):
    torch.manual_seed(D + pe_batch)
    B, H, L1, L2 = 2, 2, 5, 7
    txt = rnd(B, L1, 3 * H * D, scale=2.0)
    img = rnd(B, L2, 3 * H * D + pad)[..., :3 * H * D]  # row-strided (pad 4: rows only 8-byte aligned)
    scales = [rnd(D, offset=1.0) for _ in range(4)]
    pe = None if pe_batch == 0 else (torch.randn(pe_batch, 1, L1 + L2, D // 2, 2, 2, device=DEV) if pe_batch == 2
                                     else rope_pe(1, L1 + L2, D))
    _qk_case([(txt, scales[0], scales[1]), (img, scales[2], scales[3])], pe, H)


def test_qk_norm_rope_head_chunks():
    """More heads than one block holds: grid z over head chunks, a partial last chunk, D=128."""
    cfg = QkConfig(max_threads=32, min_blocks=8)
    torch.manual_seed(12)
    B, H, D, L1, L2 = 1, 5, 128, 2, 3
    txt = rnd(B, L1, 3 * H * D, scale=2.0)
    img = rnd(B, L2, 3 * H * D)
    s = [rnd(D, offset=1.0) for _ in range(4)]
    assert QK._threads(D // 8, H, cfg.max_threads) == (32, 3)
    _qk_case([(txt, s[0], s[1]), (img, s[2], s[3])], rope_pe(1, L1 + L2, D), H, config=cfg)
    assert QK._launchers[(2, 0, 0, cfg)].kernel is not None


def test_qk_norm_rope_single_strided():
    torch.manual_seed(11)
    B, H, D, L, M = 2, 2, 32, 9, 128
    C = H * D
    lin1 = rnd(B, L, 3 * C + M)
    qs, ks = rnd(D, offset=1.0), torch.randn(D, device=DEV) + 1  # fp32 scale: rounded to bf16 like stock
    _qk_case([(lin1[..., :3 * C], qs, ks)], rope_pe(2, L, D), H)


def test_checks_decline_with_reason():
    x = torch.randn(1, 3, 64, device=DEV, dtype=torch.float16)
    sh = torch.zeros(1, 1, 64, device=DEV, dtype=torch.float16)
    b = registry.ops["ln_modulate"].backends["numba"]
    assert "bf16" in b.check(x, sh, sh)
    qkv = rnd(1, 3, 3 * 2 * 24)
    s = rnd(24)
    assert "head dim" in registry.ops["qk_norm_rope"].backends["numba"].check([(qkv, s, s)], None, 2)
    with pytest.raises(RuntimeError):
        with numba():
            registry.call("ln_modulate", x, sh, sh, 1e-6)


def test_blocks_fused_numba_vs_stock_torch():
    torch.manual_seed(0)
    h, heads, B, Lt, Li = 64, 2, 2, 5, 7
    dbl = TinyDouble(h, heads).to(DEV, BF)
    sgl = TinySingle(h, heads).to(DEV, BF)
    img, txt = rnd(B, Li, h, scale=2.0), rnd(B, Lt, h, scale=2.0)
    vec = rnd(B, h)
    pe = rope_pe(1, Lt + Li, h // heads)
    with torch.no_grad():
        with registry.force("torch"):
            ri, rt = blocks.double_block(dbl, img.clone(), txt.clone(), vec, pe, ctx=blocks.BlockContext(fused=False))
            rx = blocks.single_block(sgl, torch.cat((rt, ri), 1), vec, pe, ctx=blocks.BlockContext(fused=False))
            fi, ft = blocks.double_block(dbl, img.clone(), txt.clone(), vec, pe, ctx=blocks.BlockContext(fused=True))
            fx = blocks.single_block(sgl, torch.cat((ft, fi), 1), vec, pe, ctx=blocks.BlockContext(fused=True))
        registry.take_usage()
        with numba():
            ni, nt_ = blocks.double_block(dbl, img.clone(), txt.clone(), vec, pe, ctx=blocks.BlockContext(fused=True))
            nx = blocks.single_block(sgl, torch.cat((nt_, ni), 1), vec, pe, ctx=blocks.BlockContext(fused=True))
    used = registry.take_usage()
    for op in FUSED_OPS:
        assert used.get(op, {}).get("numba", 0) > 0, (op, used)
    # vs stock order on torch, and vs the fused order on torch
    for a, b in ((ni, ri), (nt_, rt), (nx, rx), (ni, fi), (nt_, ft), (nx, fx)):
        assert not torch.isnan(a).any()
        assert _rel(a, b) < 1e-2, _rel(a, b)
        torch.testing.assert_close(a.float(), b.float(), rtol=5e-2, atol=5e-2)


def test_qk_norm_rope_under_inference_mode_sees_inplace_scale_updates():
    """ComfyUI runs (and loads models) under torch.inference_mode(): no version counters.
    The numba path must run there, and an in-place change of a norm scale (LoRA) must be seen."""
    from flux_numba_pack.cuda_kernels import registry, qk_norm_rope
    from flux_numba_pack.flux_core.blocks import BlockContext
    with torch.inference_mode():
        B, L, H, D = 1, 5, 2, 16
        qkv = torch.randn(B, L, 3 * H * D, device=DEV).bfloat16()
        qs, ks = torch.ones(D, device=DEV).bfloat16(), torch.ones(D, device=DEV).bfloat16()
        pe = torch.randn(1, 1, L, D // 2, 2, 2, device=DEV)
        registry.strict = True
        try:
            with registry.force("numba"):
                q1, _, _ = registry.call("qk_norm_rope", [(qkv, qs, ks)], pe, H, 1e-6)
                qs.mul_(2)  # in place, no version bump in inference mode
                q2, _, _ = registry.call("qk_norm_rope", [(qkv, qs, ks)], pe, H, 1e-6)
        finally:
            registry.strict = False
        ref2, _, _ = qk_norm_rope.reference([(qkv, qs, ks)], pe, H, 1e-6)
        assert torch.allclose(q2.float(), ref2.float(), atol=0.05, rtol=0.02)
        assert not torch.allclose(q1.float(), q2.float())
        ctx = BlockContext()
        v1, v2 = torch.randn(1, 8), torch.randn(1, 8)
        assert torch.equal(ctx.silu(v1), torch.nn.functional.silu(v1)[:, None])
        assert torch.equal(ctx.silu(v2), torch.nn.functional.silu(v2)[:, None])


def test_cache_key_includes_sources_and_options():
    """jit_kernel's on-disk cache key: numba's own key + hash of every cuda_kernels/*.py + jit
    options (numba keys on the defining file only and ignores launch_bounds)."""
    import types

    calls = []

    def base_key(sig, codegen):
        calls.append(sig)
        return (sig, "numba")
    d1 = types.SimpleNamespace(_cache=types.SimpleNamespace(_index_key=base_key), targetoptions={"launch_bounds": (128, 8)})
    d2 = types.SimpleNamespace(_cache=types.SimpleNamespace(_index_key=base_key), targetoptions={"launch_bounds": None})
    jit.keyed_on_sources(d1)
    jit.keyed_on_sources(d1)  # idempotent
    jit.keyed_on_sources(d2)
    k1, k2 = d1._cache._index_key("sig", None), d2._cache._index_key("sig", None)
    assert k1[:2] == ("sig", "numba") and len(k1) == 3 and k1[2][1] == jit.source_hash()
    assert k1 != k2 and len(jit.source_hash()) == 16


def test_cache_key_covers_the_attention_package(tmp_path):
    """source_hash covers the files in cuda_kernels/ subfolders (attention/): an edit there must
    change the key, or a stale kernel would load."""
    import os
    import shutil
    here = os.path.dirname(os.path.abspath(jit.__file__))
    assert jit.source_hash() == jit.tree_hash(here)
    tree = tmp_path / "ck"
    shutil.copytree(here, tree, ignore=shutil.ignore_patterns("__pycache__"))
    h0 = jit.tree_hash(tree)
    assert h0 == jit.source_hash()
    f = tree / "attention" / "softmax.py"
    src = f.read_bytes()
    f.write_bytes(src + b"# edited\n")
    assert jit.tree_hash(tree) != h0
    f.write_bytes(src)
    assert jit.tree_hash(tree) == h0
    (tree / "attention" / "new_kernel.py").write_text("X = 1\n")      # a new file counts too
    assert jit.tree_hash(tree) != h0


def test_intrinsics_names_and_launching_state():
    """intrinsics re-exports the names of jit / device / launching; launching's state reads through it
    (its current value) and cannot be set through it (that would change nothing)."""
    from flux_numba_pack.cuda_kernels import device, intrinsics, launching
    assert intrinsics.jit_kernel is jit.jit_kernel and intrinsics.source_hash is jit.source_hash
    assert intrinsics.pack4 is device.pack4 and intrinsics.RED_SMEM == device.RED_SMEM
    assert intrinsics.Launcher is launching.Launcher and intrinsics.cached_launcher is launching.cached_launcher
    assert all(hasattr(intrinsics, n) for n in intrinsics.__all__)
    assert intrinsics.compile_gate is launching.compile_gate and intrinsics.PREPARED is launching.PREPARED
    for name in ("PREPARED", "_FAST_OK", "compile_gate"):
        with pytest.raises(AttributeError):
            setattr(intrinsics, name, getattr(launching, name))
