"""attention op: the numba backends vs an fp32 reference (simulator on CPU, tiny shapes).

The tensor-core helpers in cuda_kernels/mma.py are emulated lane by lane in the simulator with
the same fragment layouts, so these tests exercise the kernel's real indexing, tiling, ragged
tails, masking and online softmax.
"""
import os

import pytest
import torch

from flux_numba_pack.cuda_kernels import registry
from flux_numba_pack.cuda_kernels import runtime
from flux_numba_pack.cuda_kernels import attention as A
from flux_numba_pack.cuda_kernels.attention import int8_wgmma as W8
from flux_numba_pack.cuda_kernels.attention.launch import cuda as nbcuda   # (a global: the simulator swaps it)
from _attn_testing import DEV, _wgmma_at_d32, bool_mask, make, outlier_channels, ref32, rel, run_numba

# the slowest cases in the simulator: tests/run.sh's fast set leaves them out, --full and CI run
# them; each kernel keeps a small case there
SLOW = pytest.mark.slow


@pytest.mark.parametrize("L", [40, pytest.param(400, marks=SLOW)])
def test_attention_8bit_wgmma(L):
    # int8 wgmma: 128-key tiles through tile_kv + bulk copies, 2 ping-pong warpgroups (L=400: the ring
    # wraps, ragged)
    B, H, D = 1, 1, 32
    _wgmma_at_d32()
    q, k, v = make(B, H, L, D, seed=17)
    k = (k + 3.0).to(torch.bfloat16)
    out = torch.full((B, L, H * D), float("nan"), dtype=torch.bfloat16, device=DEV)
    A.numba_attention_8bit(q, k, v, out=out, config=A.configs.INT8_WGMMA)
    assert not torch.isnan(out).any()
    assert rel(out, ref32(q, k, v)) < 3e-2


# the int8 wgmma kernel's switches (Int8Config fields; int8_wgmma's header): all off = the kernel before them
WGMMA_SWITCHES = {"plain": dict(ones=False, tau=0.0, biasacc=False, exp_poly=0), "poly2": dict(exp_poly=2)}


def _check_switch_variant(cfg, B, H, L, D, seed, label):
    """The 8-bit op built from ``cfg`` against its quantized reference (K shifted off zero mean):
    finite, within 0.5% and well inside the reference's own error vs fp32."""
    q, k, v = make(B, H, L, D, seed=seed)
    k = (k + 1.0).to(torch.bfloat16)
    out = torch.full((B, L, H * D), float("nan"), dtype=torch.bfloat16, device=DEV)
    A.numba_attention_8bit(q, k, v, out=out, config=cfg)
    assert torch.isfinite(out).all()
    r8, r = A.attention8_reference(q, k, v), ref32(q, k, v)
    e8, eq = rel(out, r8), rel(r8, r)
    print(f"{label}: vs its reference {e8:.3%} (reference vs fp32 {eq:.3%})")
    assert e8 < 5e-3 and e8 < eq / 3, (e8, eq)


@SLOW
@pytest.mark.parametrize("name", list(WGMMA_SWITCHES))
def test_attention_8bit_wgmma_switches(name):
    """A config with other switches builds its own kernel (the config is the build key; V chunk-major
    only with the ones column) and that variant matches the quantized reference (L = 400: full tiles
    through the folded softmax, the ring wraps, ragged tail)."""
    import dataclasses
    _wgmma_at_d32()
    B, H, L, D = 1, 1, 400, 32
    cfg = dataclasses.replace(A.configs.INT8_WGMMA, **WGMMA_SWITCHES[name])
    kern = A.build(cfg, D, False)
    assert kern is not A.build(A.configs.INT8_WGMMA, D, False) and kern.v_chunk_major == cfg.ones
    _check_switch_variant(cfg, B, H, L, D, 19, f"8-bit wgmma {name}")


def test_select_and_configs():
    """One select per dtype: the wgmma kernels on sm_90 at head dim 128, the mma kernels elsewhere;
    configs are frozen and reject settings their kernel cannot run."""
    C = A.configs
    assert A.select_bf16((9, 0), 128) == C.BF16_WGMMA and A.select_int8((9, 0), 128) == C.INT8_WGMMA
    for cc, D in (((9, 0), 64), ((8, 0), 128), ((8, 9), 128), ((10, 0), 128)):
        assert A.select_bf16(cc, D) == C.BF16_MMA and A.select_int8(cc, D) == C.INT8_MMA
    with pytest.raises(Exception):
        C.BF16_MMA.rows = 128
    for bad in (lambda: A.Bf16Config("wgmma", rows=128, keys=128, warpgroups=2, stages=3),   # no bulk
                lambda: A.Bf16Config("mma", rows=40, keys=64),
                lambda: A.Int8Config("mma", rows=64, keys=128),
                lambda: A.Int8Config("mma", rows=64, keys=64, ones=False),          # a wgmma-only switch
                lambda: A.Int8Config("wgmma", rows=128, keys=128, warpgroups=2, stages=4, bulk=True,
                                     ping_pong=True, exp_poly=3),                  # 16 n-tiles: 3 does not divide
                lambda: A.Bf16Config("w32", rows=128, keys=32)):
        with pytest.raises((AssertionError, ValueError)):
            bad()
    k1 = A.build(C.BF16_MMA, 32, False)
    assert A.build(C.BF16_MMA, 32, False) is k1 and (k1.rows, k1.threads, k1.tile_kv) == (64, 128, 0)
    k2 = A.build(C.INT8_WGMMA, 32, False, per_token=True)
    assert (k2.rows, k2.threads, k2.tile_kv) == (128, 256, 128)


# ---------------------------------------------------------------- numba-8bit fed by qk_norm_rope(quant8=True)
@pytest.mark.parametrize("var", ["auto", *(pytest.param(v, marks=SLOW) for v in ("wgmma", "wgmma-q", "wgmma-qv", "mma-q"))])
def test_attention_8bit_fused_quant8_pack(monkeypatch, var):
    """q/k/v and the int8 pack from qk_norm_rope (txt + img parts, batch 2, ragged L = 41, K with a
    channel offset), passed as the op's q8 argument; the 8-bit kernel with per-token scales vs fp32
    attention, unmasked and masked; the pack is taken only for the very q/k objects it was made
    from.  wgmma: the Hopper kernel with the pack's Q8 + per-token Q scales and a K-only pre-pass
    (QTOK; in the simulator at D = 32, on the GPU only at D = 128 -> mma here).  "-q": a Q-only
    pack (quant8="q": Q8 and its scales equal the full pack's, no K8): the wgmma kernel takes it,
    the mma kernel (which reads K8) declines it and runs its pre-pass.  "wgmma-qv": quant8="qv" also
    writes V's tile image (pack.vt == tile_kv_reference(v, VT_KEYS, chunk_major=True), pad rows
    zero), which the op takes instead of running tile_kv -- only for the very v it was made from."""
    if var.startswith("wgmma"):
        _wgmma_at_d32()
    cfg = {"auto": None, "wgmma": A.configs.INT8_WGMMA, "wgmma-q": A.configs.INT8_WGMMA, "wgmma-qv": A.configs.INT8_WGMMA,
           "mma-q": A.configs.INT8_MMA}[var]
    g = torch.Generator().manual_seed(5)
    B, H, D, L1, L2 = 2, 1, 32, 6, 35
    L = L1 + L2
    bf = lambda *s, sc=1.0: (torch.randn(*s, generator=g) * sc).to(torch.bfloat16).to(DEV)  # noqa: E731
    txt, img = bf(B, L1, 3 * H * D, sc=2.0), bf(B, L2, 3 * H * D)
    img[..., H * D:2 * H * D] += 3.0
    s = [(1 + 0.1 * torch.randn(D, generator=g)).to(torch.bfloat16).to(DEV) for _ in range(4)]
    ang = torch.rand(1, 1, L, D // 2, generator=g) * 6.283
    pe = torch.stack([ang.cos(), -ang.sin(), ang.sin(), ang.cos()], -1).reshape(1, 1, L, D // 2, 2, 2).to(DEV)
    registry.strict = True
    try:
        with registry.force("numba", ops=["qk_norm_rope"]):
            q, k, v, pk = registry.call("qk_norm_rope", [(txt, s[0], s[1]), (img, s[2], s[3])], pe, H, 1e-6, quant8=True)
        if var.endswith("-q"):
            q8_full, qs_full = pk.q8.clone(), pk.qs.clone()
            with registry.force("numba", ops=["qk_norm_rope"]):
                q, k, v, pk = registry.call("qk_norm_rope", [(txt, s[0], s[1]), (img, s[2], s[3])], pe, H, 1e-6,
                                            quant8="q")
            assert pk.k8 is None and pk.ks is None
            assert torch.equal(pk.q8, q8_full) and torch.equal(pk.qs, qs_full)
        if var.endswith("-qv"):
            q8_full, qs_full = pk.q8.clone(), pk.qs.clone()
            with registry.force("numba", ops=["qk_norm_rope"]):
                q, k, v, pk = registry.call("qk_norm_rope", [(txt, s[0], s[1]), (img, s[2], s[3])], pe, H, 1e-6,
                                            quant8="qv")
            assert pk.k8 is None and pk.ks is None and pk.v is v
            assert torch.equal(pk.q8, q8_full) and torch.equal(pk.qs, qs_full)
            assert torch.equal(pk.vt, A.tile_kv_reference(v, A.VT_KEYS, chunk_major=True))
    finally:
        registry.strict = False
    assert pk is not None
    assert A.usable_pack(pk, q, k, needs_k=False) is pk and A.usable_pack(None, q, k, needs_k=False) is None
    assert A.usable_pack(pk, q.clone(), k, False) is None and A.usable_pack(pk, q, k.clone(), False) is None
    got, tiled = [], []
    orig = A.usable_pack
    monkeypatch.setattr(A, "usable_pack", lambda *a_, **kw_: got.append(orig(*a_, **kw_)) or got[-1])
    orig_t = A.tile_kv
    monkeypatch.setattr(A, "tile_kv", lambda *a_, **kw_: tiled.append(1) or orig_t(*a_, **kw_))
    if var.endswith("-qv"):
        assert A.pack_vt(pk, v.clone(), A.build(cfg, D, False, True)) is None
    for m in (None, bool_mask(L, 2, 1)):
        out = torch.full((B, L, H * D), float("nan"), dtype=torch.bfloat16, device=DEV)
        A.numba_attention_8bit(q, k, v, m, out=out, q8=pk, config=cfg)
        assert got[-1] is (None if var == "mma-q" else pk)
        assert bool(tiled) == (var in ("wgmma", "wgmma-q"))
        assert not torch.isnan(out).any()
        r = ref32(q, k, v, m)
        e, e16 = rel(out, r), rel(A.reference(q, k, v, m).float(), r)
        print(f"fused 8-bit rel err {e:.3%} (bf16 sdpa {e16:.3%})")
        assert e < 2e-2, e


@pytest.mark.parametrize("L,masked", [pytest.param(400, True, marks=SLOW), (20, False)])
def test_attention_numba_wgmma_pipelined(L, masked):
    # the bf16 wgmma kernel (128-key tiles through tile_kv and bulk copies, 2 warpgroups, 3-stage
    # ring): L=400 wraps the ring (4 tiles, ragged, zero-padded last tile) under a bool mask;
    # L=20: one tile + the phantom S after the last
    _wgmma_at_d32()
    B, H, D = 1, 1, 32
    q, k, v = make(B, H, L, D, seed=41 + L)
    mask = None
    if masked:
        mask = bool_mask(L, 15, 5)
    out = torch.full((B, L, H * D), float("nan"), dtype=torch.bfloat16, device=DEV)
    A.numba_attention(q, k, v, mask, out=out, config=A.configs.BF16_WGMMA)
    assert not torch.isnan(out).any()
    assert rel(out, ref32(q, k, v, mask)) < 1.2e-2


_PTX_SCRIPT = r'''
import os, sys, types
os.environ["NUMBA_ENABLE_CUDASIM"] = "0"
sys.path.insert(0, sys.argv[1])
import _pack; _pack.load()
import numba.cuda.dispatcher as _d
_d.get_current_device = lambda: types.SimpleNamespace(compute_capability=(9, 0))
from numba import cuda, types as nt
from flux_numba_pack.cuda_kernels import qk_norm_rope as QK, attention as A
for name in ("qk_norm_rope q8", "qk_norm_rope q8 q only", "qk kmean"):
    disp, sig = QK.PTX_CASES[name]()
    ptx, _ = cuda.compile_ptx(disp.py_func, sig, cc=(9, 0), fastmath=True,
                              launch_bounds=disp.targetoptions.get("launch_bounds"))
    assert "shfl.sync" in ptx and ".local" not in ptx, name
I32, F32, i64 = nt.Array(nt.int32, 1, "A"), nt.Array(nt.float32, 1, "A"), nt.int64
sig = (I32, I32, I32, F32, F32, I32, F32) + (i64,) * 11 + (nt.float64,)
ptx, _ = cuda.compile_ptx(A.build(A.configs.INT8_MMA, 32, True, per_token=True).kern.py_func, sig, cc=(9, 0),
                          fastmath=True)
assert "mma.sync.aligned.m16n8k32" in ptx and "cp.async.cg" in ptx
ptx, _ = cuda.compile_ptx(A.build(A.configs.INT8_WGMMA, 128, False, per_token=True).kern.py_func, sig, cc=(9, 0),
                          fastmath=True)
assert "k32.s32.s8.s8" in ptx and "k16.f32.bf16.bf16" in ptx
print("PTX OK")
'''


def test_fused_8bit_kernels_compile_for_sm90():
    """The real (non-simulator) code of the quant8 prologue kernels and the per-token 8-bit attention
    kernel type-checks and compiles for sm_90 without a GPU (the simulator cannot catch typing errors)."""
    import os
    import subprocess
    import sys
    from _toolkit import missing_toolkit
    why = missing_toolkit()
    if why:
        pytest.skip(why)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    r = subprocess.run([sys.executable, "-c", _PTX_SCRIPT, root], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and "PTX OK" in r.stdout, r.stderr[-3000:]


@pytest.mark.parametrize("L,BN,cm", [(40, 32, False), (64, 64, False), (5, 16, False), (40, 32, True),
                                     (150, 64, True)])
def test_tile_kv_layout(L, BN, cm):
    # every element lands at its shared-memory image position: byte (row // 8) * (D / 8) * 128 +
    # (col // 8) * 128 + (row % 8) * 16 + (col % 8) * 2 of its tile (cm, chunk-major: (col // 8) *
    # (BN / 8) * 128 + (row // 8) * 128 + ...); rows past L are zero
    B, H, D = 2, 3, 32
    x = torch.randn(B, H, L, D, device=DEV).to(torch.bfloat16).transpose(1, 2).contiguous().transpose(1, 2)
    t = A.tile_kv_reference(x, BN, chunk_major=cm)
    kt, vt = A.tile_kv(x, (x * 2).to(torch.bfloat16), BN, chunk_major=cm)   # the Numba kernel = the reference
    assert torch.equal(kt, t)
    assert torch.equal(vt, A.tile_kv_reference((x * 2).to(torch.bfloat16), BN, chunk_major=cm))
    k1, none = A.tile_kv(x, None, BN, chunk_major=cm)          # K alone (the 8-bit kernel's int8 K)
    assert none is None and torch.equal(k1, t)
    NT = -(-L // BN)
    assert t.shape == (B, H, NT * BN, D)
    flat = t.reshape(B, H, NT, BN * D).cpu()
    want = torch.zeros(B, H, NT, BN * D, dtype=torch.bfloat16)
    xc = x.cpu()
    for r in range(L):
        for c in range(D):
            rr = r % BN
            if cm:
                pos = ((c // 8) * (BN // 8) * 128 + (rr // 8) * 128 + (rr % 8) * 16 + (c % 8) * 2) // 2
            else:
                pos = ((rr // 8) * (D // 8) * 128 + (c // 8) * 128 + (rr % 8) * 16 + (c % 8) * 2) // 2
            want[:, :, r // BN, pos] = xc[:, :, r, c]
    assert torch.equal(flat, want)


def _hopper_gpu_only(sim_tests):
    """Skip unless on a Hopper GPU: the wgmma kernels run at head dim 128 only there (the simulator
    runs their code at head dim 32 in ``sim_tests``)."""
    if runtime.SIMULATOR:
        pytest.skip(f"GPU only: the simulator runs this kernel's code at head dim 32 ({sim_tests})")
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("wgmma needs sm_90")


@pytest.mark.parametrize("B,H,L,masked,strided", [(1, 2, 300, False, False), (2, 3, 1000, True, True),
                                                  (1, 1, 128, False, True), (1, 1, 5, True, False)])
def test_attention_numba_default_hopper_d128(B, H, L, masked, strided):
    # the op's default on Hopper at head dim 128 (FLUX): wgpp128x2s3b -- tile_kv + bulk copies;
    # ragged tails, one partial tile, masks, FLUX's strided q/k/v views, an out view
    _hopper_gpu_only("test_attention_numba_wgmma_pipelined")
    D = 128
    g = torch.Generator(device=DEV).manual_seed(L + B)
    if strided:   # [B, L, 3, H, D] like a qkv projection, viewed as [B, H, L, D]
        qkv = torch.randn(B, L, 3, H, D, device=DEV, generator=g).to(torch.bfloat16)
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    else:
        q, k, v = make(B, H, L, D, seed=L)
    assert A.select_bf16(A.capability(q.device), D) == A.configs.BF16_WGMMA
    mask = bool_mask(L, 7, 1) if masked else None
    buf = torch.full((B, L, H * D + 64), float("nan"), dtype=torch.bfloat16, device=DEV)
    out = run_numba("numba", q, k, v, mask, out=buf[..., :H * D])
    assert out.data_ptr() == buf.data_ptr() and torch.isnan(buf[..., H * D:]).all()
    assert not torch.isnan(out).any()
    r = ref32(q, k, v, mask)
    e, e16 = rel(out, r), rel(A.reference(q, k, v, mask).float(), r)
    # bar: cuDNN SDPA's bf16 error x 1.1; torch's math SDPA (FLUX_TEST_MATH_SDPA=1, under the
    # sanitizers) rounds less (0.17% vs 0.22% here), so it gets x 1.5
    slack = 1.5 if os.environ.get("FLUX_TEST_MATH_SDPA") == "1" else 1.1
    assert e <= slack * e16 + 1e-4, (e, e16)


@pytest.mark.parametrize("B,H,L,masked,fused", [(1, 3, 333, False, False), (2, 2, 1000, True, False),
                                                (1, 2, 64, False, False), (1, 3, 333, False, True),
                                                (2, 2, 700, False, True), (1, 2, 150, True, True)])
def test_attention_8bit_default_hopper_d128(B, H, L, masked, fused):
    # the 8-bit op's default on Hopper at head dim 128: the int8 wgmma kernel (ping-pong warpgroups, 4-stage ring,
    # K8 written tiled by the pre-pass); fused: fed a qk_norm_rope-style per-token Quant8 pack
    # (QTOK: its Q8 + per-token Q scales, K from a K-only pre-pass); ragged tails, partial tiles, masks
    _hopper_gpu_only("test_attention_8bit_wgmma, test_attention_8bit_fused_quant8_pack")
    D = 128
    q, k, v = make(B, H, L, D, seed=L + 3)
    k = (k + 1.0).to(torch.bfloat16)
    mask = bool_mask(L, 7, 1) if masked else None
    out = torch.full((B, L, H * D), float("nan"), dtype=torch.bfloat16, device=DEV)
    if fused:
        pk = A.reference_pack(q, k)
        run_numba("numba-8bit", q, k, v, mask, out=out, q8=pk)
    else:
        run_numba("numba-8bit", q, k, v, mask, out=out)
    assert not torch.isnan(out).any()
    e = rel(out, ref32(q, k, v, mask))
    assert e < 2e-2, e


@pytest.mark.parametrize("B,H,L1,L2,masked", [(1, 3, 40, 293, False), (2, 2, 0, 700, True)])
def test_attention_8bit_qv_pack_hopper_d128(monkeypatch, B, H, L1, L2, masked):
    # the FLUX path on Hopper at head dim 128: qk_norm_rope(quant8="qv") writes Q8 + per-token scales
    # and V's tile image (== tile_kv_reference(v, VT_KEYS, chunk_major=True), pad rows zero); the
    # 8-bit op takes both (K from its K-only pre-pass, no tile_kv launch); error vs fp32 attention
    _hopper_gpu_only("test_attention_8bit_fused_quant8_pack[wgmma-qv]")
    from flux_numba_pack.cuda_kernels import qk_norm_rope as QK
    D, L = 128, L1 + L2
    assert A.int8_pack_kind(torch.device(DEV), D) == "qv"
    g = torch.Generator(device=DEV).manual_seed(int(torch.randint(0, 2**31 - 1, (1,)).item()))
    bf = lambda *s_, sc=1.0: (torch.randn(*s_, device=DEV, generator=g) * sc).to(torch.bfloat16)  # noqa: E731
    img = bf(B, L2, 3 * H * D)
    img[..., H * D:2 * H * D] += 2.0
    parts = ([(bf(B, L1, 3 * H * D, sc=2.0), bf(D, sc=0.1) + 1, bf(D, sc=0.1) + 1)] if L1 else []) + \
        [(img, bf(D, sc=0.1) + 1, bf(D, sc=0.1) + 1)]
    ang = torch.rand(1, 1, L, D // 2, device=DEV, generator=g) * 6.283
    pe = torch.stack([ang.cos(), -ang.sin(), ang.sin(), ang.cos()], -1).reshape(1, 1, L, D // 2, 2, 2)
    q, k, v, pk = QK.numba_qk_norm_rope(parts, pe, H, 1e-6, quant8="qv")
    assert pk is not None and pk.k8 is None and pk.v is v
    assert torch.equal(pk.vt, A.tile_kv_reference(v, A.VT_KEYS, chunk_major=True))
    tiled = []
    orig_t = A.tile_kv
    monkeypatch.setattr(A, "tile_kv", lambda *a_, **kw_: tiled.append(1) or orig_t(*a_, **kw_))
    mask = bool_mask(L, 7, 1) if masked else None
    out = torch.full((B, L, H * D), float("nan"), dtype=torch.bfloat16, device=DEV)
    A.numba_attention_8bit(q, k, v, mask, out=out, q8=pk)
    assert not tiled and not torch.isnan(out).any()
    e = rel(out, ref32(q, k, v, mask))
    assert e < 2e-2, e
    e8 = rel(out, A.attention8_reference(q, k, v, mask, q_block=1))   # the pack's per-token Q scales
    assert e8 < 5e-3, (e8, e)


@pytest.mark.parametrize("name", list(WGMMA_SWITCHES))
def test_attention_8bit_wgmma_switches_hopper_d128(name):
    # the int8 wgmma kernel built with other switches (Int8Config fields) at head dim 128 vs its
    # quantized reference: the variants the switches select still compute the same attention
    import dataclasses
    _hopper_gpu_only("test_attention_8bit_wgmma_switches")
    B, H, L, D = 1, 2, 1000, 128
    cfg = dataclasses.replace(A.configs.INT8_WGMMA, **WGMMA_SWITCHES[name])
    _check_switch_variant(cfg, B, H, L, D, L + 13, f"8-bit d128 wgmma {name}")


@pytest.mark.parametrize("B,H,L,case,masked,fused", [(1, 2, 1000, "random", False, False),
                                                     (1, 2, 1000, "outliers", False, False),
                                                     (2, 2, 700, "outliers", True, False),
                                                     (1, 3, 1000, "outliers", False, True),
                                                     (1, 2, 4608, "random", False, True)])
def test_attention_8bit_reference_hopper_d128(B, H, L, case, masked, fused):
    # the Hopper 8-bit kernel at head dim 128 vs attention8_reference (its quantization in torch) on
    # random and outlier-channel inputs (4 channels 30x): finite, and within 0.5% / 1% of the reference
    # while int8 Q K alone puts both ~1% / ~10% from fp32; fused: fed a per-token pack (Q per token,
    # K from the K-only pre-pass per 64 keys)
    _hopper_gpu_only("test_attention_8bit_matches_its_reference")
    D = 128
    q, k, v = make(B, H, L, D, seed=L + 11)
    k = (k + 1.0).to(torch.bfloat16)
    if case == "outliers":
        q, k, v = outlier_channels((q, k, v), seed=L)
    mask = bool_mask(L, 5, 2) if masked else None
    out = torch.full((B, L, H * D), float("nan"), dtype=torch.bfloat16, device=DEV)
    if fused:
        pk = A.reference_pack(q, k)
        A.numba_attention_8bit(q, k, v, mask, out=out, q8=pk)
    else:
        A.numba_attention_8bit(q, k, v, mask, out=out)
    assert torch.isfinite(out).all()
    r8, r = A.attention8_reference(q, k, v, mask, q_block=1 if fused else 16), ref32(q, k, v, mask)
    e8, e, eq = rel(out, r8), rel(out, r), rel(r8, r)
    print(f"8-bit d128 {case} fused={fused}: vs its reference {e8:.3%}, vs fp32 {e:.3%} (reference {eq:.3%})")
    assert e8 < (5e-3 if case == "random" else 1e-2) and e8 < eq / 3, (e8, eq)


def test_capability_of_a_cpu_device(monkeypatch):
    """Off the simulator a CPU tensor has no compute capability to ask torch for (a CPU-only torch
    raises): the selection treats it as no GPU -- the 8-bit path then wants a full pack (mma)."""
    monkeypatch.setattr(A._rt, "SIMULATOR", False)
    assert A.capability(torch.device("cpu")) == (0, 0)
    assert A.int8_wants_k(torch.device("cpu"), 128) is True
    assert A.int8_pack_kind(torch.device("cpu"), 128) == "qk"


def test_exp2_fma_matches_reference_and_exp2():
    # the 8-bit wgmma kernel's polynomial exp2 (its FMA-pipe share of P = 2^x) on fresh random x:
    # the device function equals its torch reference within 2 ulp (the GPU contracts the cubic's
    # steps into FFMAs: 1-ulp differences on the H200; the simulator is bit-exact) -- the exponent
    # placement exact --, both within 1e-4 of 2^x above -120, and below -126 (clamped) a
    # non-negative denormal-or-zero, never a wrapped exponent
    @nbcuda.jit
    def k(x, y):
        i = nbcuda.blockIdx.x * nbcuda.blockDim.x + nbcuda.threadIdx.x
        if i < x.shape[0]:
            y[i] = W8.exp2_fma(x[i])

    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,)).item()))
    x = torch.cat([torch.rand(300, generator=g) * 139 - 131, torch.tensor([-126.0, -125.5, 0.0, 0.5, 8.0, -0.5])])
    xs = x.numpy().astype("float32")
    ys = xs.copy() * 0
    if runtime.SIMULATOR:
        k[(len(xs) + 63) // 64, 64](xs, ys)
        y = torch.from_numpy(ys)
    else:
        xd = nbcuda.to_device(xs)
        yd = nbcuda.to_device(ys)
        k[(len(xs) + 63) // 64, 64](xd, yd)
        y = torch.from_numpy(yd.copy_to_host())
    ref = W8.exp2_fma_reference(x)
    assert (y.view(torch.int32).long() - ref.view(torch.int32).long()).abs().max() <= 2
    hi = x > -120
    assert ((y[hi].double() / torch.exp2(x[hi].double()) - 1).abs().max() < 1e-4)
    assert (y >= 0).all() and (y[x < -126] < 1.2e-38).all()


# --- the integer-P V kernel (Int8Config pv="u8s8", int8_wgmma_u8s8; issue #38): u8 P per row and
# 64-key group x s8 V per channel on integer wgmma, against int8_pv_ref (its arithmetic in torch)

@pytest.mark.parametrize("L,masked", [(40, False), pytest.param(400, False, marks=SLOW), pytest.param(200, True, marks=SLOW)])
def test_attention_8bit_u8s8_matches_int8_pv_ref(L, masked):
    # simulator, head dim 32: one partial tile, the ring wrapping with a ragged tail, a mask; the
    # kernel's output vs the integer reference (both quantise Q K per block, V per channel, P per
    # row and 64-key group) within 0.5%, and vs fp32 inside the 2% bar
    from flux_numba_pack.cuda_kernels.attention import int8_pv_ref as R
    _wgmma_at_d32()
    B, H, D = 1, 1, 32
    q, k, v = make(B, H, L, D, seed=L + 29)
    k = (k + 1.0).to(torch.bfloat16)
    mask = bool_mask(L, 3, 0) if masked else None
    out = torch.full((B, L, H * D), float("nan"), dtype=torch.bfloat16, device=DEV)
    A.numba_attention_8bit(q, k, v, mask, out=out, config=A.configs.INT8_WGMMA_U8S8)
    assert torch.isfinite(out).all()
    ri, r = R.attention_int8_pv_reference(q, k, v, mask), ref32(q, k, v, mask)
    ei, e = rel(out, ri), rel(out, r)
    print(f"u8s8 L={L} masked={masked}: vs int8_pv_ref {ei:.3%}, vs fp32 {e:.3%}")
    assert ei < 5e-3 and e < 2e-2, (ei, e)


@pytest.mark.parametrize("B,H,L,case,masked", [(1, 2, 1000, "random", False), (1, 2, 1000, "outliers", False),
                                                (2, 2, 700, "outliers", True), (1, 2, 4608, "random", False),
                                                (1, 1, 5, "random", False)])
def test_attention_8bit_u8s8_hopper_d128(B, H, L, case, masked):
    # the integer-P V kernel at head dim 128 on Hopper (FLUX's shape at L=4608), random and
    # outlier-channel inputs (4 channels 30x), a mask, a tiny ragged L: finite, within 1% of
    # int8_pv_ref (its arithmetic in torch; the GPU's exp2 and fp32 sums round differently), within
    # 2% of fp32 on random inputs; through the registry's opt-in backend
    from flux_numba_pack.cuda_kernels.attention import int8_pv_ref as R
    _hopper_gpu_only("test_attention_8bit_u8s8_matches_int8_pv_ref")
    D = 128
    q, k, v = make(B, H, L, D, seed=L + 31)
    k = (k + 1.0).to(torch.bfloat16)
    if case == "outliers":
        q, k, v = outlier_channels((q, k, v), seed=L + 1)
    mask = bool_mask(L, 5, 2) if masked else None
    out = torch.full((B, L, H * D), float("nan"), dtype=torch.bfloat16, device=DEV)
    run_numba("numba-8bit-u8s8", q, k, v, mask, out=out)
    assert torch.isfinite(out).all()
    ri, r = R.attention_int8_pv_reference(q, k, v, mask), ref32(q, k, v, mask)
    ei, e, eq = rel(out, ri), rel(out, r), rel(ri, r)
    print(f"u8s8 d128 {case} L={L}: vs int8_pv_ref {ei:.3%}, vs fp32 {e:.3%} (reference {eq:.3%})")
    assert ei < 1e-2, (ei, eq)
    if case == "random":
        assert e < 2e-2, e
