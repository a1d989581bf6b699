"""The fp8 e4m3 quantising kernels (issue #13 fast profile) vs their torch references: the
conversion itself (software fallback and device helpers vs torch's cast), the row format
(``fp8_format``), ln_modulate_fp8, gated_residual_ln_modulate_fp8, quantize_fp8, gelu_tanh_fp8,
attn_gelu_fp8.  Simulator on CPU (tiny shapes), the GPU with FLUX_NUMBA_REAL_GPU=1 (then also the
FLUX 1024^2 shapes and a ``torch._scaled_mm`` smoke check).

Outputs are NaN-poisoned (torch.empty returns NaN-filled tensors: an unwritten fp8 byte reads as
0x7F = NaN), every call is forced to numba with ``registry.strict``.  q must equal the reference
or differ by one e4m3 step (fp32 rounding order: LN statistics, FMA contraction, the approximate
GELU), on at most a few elements; scales to 1e-6 relative; dequantised values within one e4m3
step of the fp32 values.
"""

import pytest
import torch

from flux_numba_pack.cuda_kernels import registry
from flux_numba_pack.cuda_kernels import jit
from flux_numba_pack.cuda_kernels import fp8_format as F8, fp8_rows as FR
from flux_numba_pack.cuda_kernels import ln_modulate as LM, gated_residual as GR
from flux_numba_pack.cuda_kernels.config import FP8_ROWS

from _kernel_testing import DEV, BF, ROW_VARIANTS, rnd, strict_and_poison  # noqa: F401  (autouse fixture)
FP8_OPS = ("ln_modulate_fp8", "gated_residual_ln_modulate_fp8", "quantize_fp8", "gelu_tanh_fp8", "attn_gelu_fp8")

pytestmark = [pytest.mark.skipif(not jit.NUMBA_OK, reason="numba not importable"),
              pytest.mark.skipif(F8.FP8 is None, reason="torch without float8_e4m3fn")]
gpu_only = pytest.mark.skipif(DEV != "cuda", reason="GPU test (FLUX_NUMBA_REAL_GPU=1 on a CUDA machine)")


def numba():
    return registry.force("torch", **{op: "numba" for op in FP8_OPS})


def ordinal(q):
    """e4m3 codes as signed step counts (monotonic; +0 and -0 both 0)."""
    b = q.view(torch.uint8).int()
    return (b & 0x7F) * (1 - 2 * (b >> 7))


def assert_fp8(got, ref, x32=None, max_frac=0.02):
    """got / ref: (q, scale).  x32: the fp32 values quantised (error bound of the dequantised q)."""
    q, s = got
    qr, sr = ref
    assert q.dtype == F8.FP8 and s.dtype == torch.float32
    assert q.shape == qr.shape and s.shape == sr.shape == (q.shape[0], 1)
    assert q.is_contiguous() and s.is_contiguous()
    assert not torch.isnan(q.float()).any(), "unwritten (NaN) fp8 bytes"
    assert not torch.isnan(s).any() and bool((s > 0).all()) and bool(torch.isfinite(s).all())
    rel = ((s - sr).abs() / sr).max().item()
    assert rel <= 1e-6, f"scales differ by {rel:.2e} relative"
    d = (ordinal(q) - ordinal(qr)).abs()
    assert d.max().item() <= 1, f"fp8 codes differ by {d.max().item()} steps"
    n = int((d > 0).sum())
    assert n <= max(2, max_frac * q.numel()), f"{n} of {q.numel()} codes one step off"
    if x32 is not None:
        x = x32.reshape(q.shape).float()
        v = x / s  # in units of the row scale: one e4m3 step is <= 2^-3 |v| (normal) or 2^-9 (subnormal)
        err = (F8.dequant(q, s) - x).abs() / s
        bound = torch.clamp(v.abs(), max=F8.E4M3_MAX) * 2.0 ** -3 + 2.0 ** -9
        assert bool((err <= bound * 1.0001).all()), f"dequantised error {(err / bound).max().item():.3f} x bound"


# ------------------------------------------------------------------------------ the conversion
def conversion_values():
    """Every e4m3 value, every midpoint (ties) and +-1 fp32 ulp around both, beyond 448, inf,
    fp32 subnormals, e4m3 subnormal ties, and random magnitudes over 24 binades; both signs."""
    v = torch.arange(0, 256, dtype=torch.uint8).view(F8.FP8).float()
    v = torch.sort(v[~torch.isnan(v)].unique()).values
    mid = (v[1:] + v[:-1]) / 2

    def step(t, d):
        return torch.nextafter(t, torch.full_like(t, d))
    g = torch.Generator().manual_seed(0)
    extra = torch.tensor([448., 449., 464., 464.0001, 465., 479., 480., 1e6, 3e38, float("inf"), 0., 1e-40, 1e-45,
                          2. ** -10, 3 * 2. ** -10, 5 * 2. ** -10, 2. ** -6, 2. ** -6 - 2. ** -10, 15 * 2. ** -10])
    rand = torch.randn(4000, generator=g) * torch.exp2(torch.randint(-16, 9, (4000,), generator=g).float())
    xs = torch.cat([v, mid, step(mid, 1e9), step(mid, -1e9), step(v, 1e9), step(v, -1e9), extra, rand])
    return torch.cat([xs, -xs])


def torch_e4m3(x):
    return x.clamp(-F8.E4M3_MAX, F8.E4M3_MAX).to(F8.FP8).view(torch.uint8)


def test_software_conversion_matches_torch():
    xs = conversion_values()
    ref = torch_e4m3(xs)
    sw = torch.tensor([F8.e4m3_bits(f) for f in xs.tolist()], dtype=torch.uint8)
    bad = (sw != ref).nonzero()[:, 0]
    assert bad.numel() == 0, [(xs[i].item(), int(sw[i]), int(ref[i])) for i in bad[:8]]
    assert F8.e4m3_bits(float("nan")) & 0x7F == 0x7F
    assert F8.e4m3_bits(-0.0) == 0x80 and F8.e4m3_bits(1e-40) == 0


def test_device_conversion_helpers_match_torch():
    """e4m3x8 / e4m3x4 / e4m3_1 inside a kernel (simulator: the software fallback, GPU: the
    cvt.rn.satfinite.e4m3x2.f32 PTX) give torch's bytes, in the right byte order."""
    xs = conversion_values()
    if DEV == "cpu":  # the simulator runs Python per element: a strided sample keeps it fast
        xs = torch.cat([xs[:400], xs[400::7]])
    ref = torch_e4m3(xs).to(DEV)
    for name, got in zip(("e4m3x8", "e4m3x4", "e4m3_1"), F8.convert_bytes(xs.to(DEV))):
        bad = (got != ref).nonzero()[:, 0]
        assert bad.numel() == 0, (name, [(xs[i].item(), int(got[i]), int(ref[i])) for i in bad[:8]])


def test_reference_format():
    x = torch.randn(5, 48) * torch.tensor([1., 0., 1e-3, 1e4, 1.])[:, None]
    x[4, 7] = 1e30  # one huge value: the row's other values go to zero / subnormals
    q, s = F8.quantize_rows_reference(x)
    assert q.dtype == F8.FP8 and q.shape == (5, 48) and s.shape == (5, 1) and s.dtype == torch.float32
    assert bool((q[1].float() == 0).all()) and s[1].item() == pytest.approx(F8.AMAX_FLOOR / 448, rel=1e-6)
    assert s[1].item() > 0
    amax = x.abs().amax(-1, keepdim=True)
    torch.testing.assert_close(s[[0, 2, 3, 4]], (amax / 448)[[0, 2, 3, 4]], rtol=1e-7, atol=0)
    assert bool((q.float().abs().amax(-1)[[0, 2, 3, 4]] == 448).all())  # the amax element maps to 448
    assert q[4, 7].float().item() == 448 and torch.isfinite(F8.dequant(q, s)).all()
    assert_fp8((q, s), (q, s), x)
    # batched input: rows are the product of the leading dims
    q3, s3 = F8.quantize_rows_reference(x.view(1, 5, 48))
    assert torch.equal(q3.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s3, s)


# ------------------------------------------------------------------------------- row kernels
@pytest.fixture(params=["pipe", "late", "early"])
def late(request):
    """The row kernel's variants (``ROW_VARIANTS``, passed as ``config=``: pipelined 16-byte rows,
    one row per block with the vectors read late / with x); the simulator's 2x2x2 grid makes each
    block stride over several rows."""
    return request.param


def view_of(B, L, C, align, scale=2.0, offset=0.0):
    """bf16 [B, L, C] whose rows are 16-byte aligned (align 16), only 8-byte aligned (8), or 2-byte
    aligned (2): the kernel's 16-byte pairs, 8-byte words, int16 scalars."""
    pad = {16: 0, 8: 4, 2: 1}[align]
    base = rnd(B, L, C + 8 + pad, scale=scale, offset=offset)
    return base[..., pad:pad + C]


def row_key(GATED, late, align):
    if late == "pipe" and align == 16:
        return ("pipe", GATED, "fp8", ROW_VARIANTS[late])
    key = {16: (4, GATED, 2), 8: (4, GATED, 1), 2: (1, GATED, 1)}[align]
    return key + ((1,) if late != "early" else ()) + ("fp8", ROW_VARIANTS[late])


@pytest.mark.parametrize("B,L,C,align", [(2, 5, 64, 16), (1, 7, 96, 16), (2, 3, 48, 8), (2, 3, 32, 2), (1, 3, 160, 16)])
def test_ln_modulate_fp8(B, L, C, align, late):
    torch.manual_seed(B * 100 + L + C + align)
    x = view_of(B, L, C, align, offset=0.5)
    mod = rnd(B, 1, 6 * C)
    sh, sc = mod[..., C:2 * C], mod[..., 2 * C:3 * C]
    if B == 2:  # a row of zeros out of LN + modulate: x row 0 and shift 0 -> y row 0
        x[1, 1] = 0
        mod[1, :, C:2 * C] = 0
    x[0, L - 1, 3] = 900.0  # one huge value
    with numba():
        got = registry.call("ln_modulate_fp8", x, sh, sc, 1e-6, config=ROW_VARIANTS[late])
    assert registry.last["ln_modulate_fp8"] == "numba"
    assert LM._launchers[row_key(0, late, align)].kernel is not None
    assert_fp8(got, LM.reference_fp8(x, sh, sc, 1e-6), LM.modulate_fp32(x, sh, sc, 1e-6))
    if B == 2:
        q, s = got
        assert bool((q[L + 1].float() == 0).all()) and s[L + 1].item() == pytest.approx(F8.AMAX_FLOOR / 448, rel=1e-6)


def test_ln_modulate_fp8_broadcast_vectors():
    torch.manual_seed(2)
    x = rnd(2, 5, 64)
    sh, sc = rnd(1, 1, 64), rnd(1, 1, 64)
    with numba():
        got = registry.call("ln_modulate_fp8", x, sh, sc, 1e-6)
    assert_fp8(got, LM.reference_fp8(x, sh, sc, 1e-6), LM.modulate_fp32(x, sh, sc, 1e-6))


@pytest.mark.parametrize("B,L,C,align", [(2, 5, 64, 16), (1, 3, 48, 8), (2, 3, 32, 2)])
def test_gated_residual_ln_modulate_fp8(B, L, C, align, late):
    torch.manual_seed(7 + C + align)
    x = view_of(B, L, C, align, scale=3.0)
    y = view_of(B, L, C, align)
    mod = rnd(B, 1, 6 * C)
    g, sh, sc = mod[..., 2 * C:3 * C], mod[..., 3 * C:4 * C], mod[..., 4 * C:5 * C]
    y[0, 1, 5] = 300.0
    x1, x2 = x.clone(), x.clone()
    with numba():
        got = registry.call("gated_residual_ln_modulate_fp8", x1, g, y, sh, sc, 1e-6, config=ROW_VARIANTS[late])
    assert LM._launchers[row_key(1, late, align)].kernel is not None
    ref = GR.reference_ln_fp8(x2, g, y, sh, sc, 1e-6)
    assert torch.equal(x1, x2), "the updated residual is stock's bf16, bit for bit"
    assert_fp8(got, ref, LM.modulate_fp32(x2, sh, sc, 1e-6))


def test_gated_fp8_matches_bf16_sibling_residual():
    """The fp8 variant leaves exactly the residual the bf16 kernel leaves."""
    torch.manual_seed(3)
    x = rnd(2, 3, 64, scale=3.0)
    y = rnd(2, 3, 64)
    mod = rnd(2, 1, 6 * 64)
    g, sh, sc = mod[..., 128:192], mod[..., 192:256], mod[..., 256:320]
    x1, x2 = x.clone(), x.clone()
    with registry.force("numba", ops=["gated_residual_ln_modulate_fp8", "gated_residual_ln_modulate"]):
        registry.call("gated_residual_ln_modulate_fp8", x1, g, y, sh, sc, 1e-6)
        registry.call("gated_residual_ln_modulate", x2, g, y, sh, sc, 1e-6)
    assert torch.equal(x1, x2)


# ------------------------------------------------------------------------ quantize / GELU rows
@pytest.mark.parametrize("B,L,K,align", [(2, 5, 64, 16), (1, 3, 48, 8), (2, 3, 32, 2), (1, 2, 256, 16)])
def test_quantize_fp8(B, L, K, align):
    torch.manual_seed(K + align)
    x = view_of(B, L, K, align)
    x[0, 1] = 0
    if L > 2:
        x[B - 1, 2, 7] = 1e30  # one huge value (bf16 range)
    with numba():
        got = registry.call("quantize_fp8", x)
    assert FR._launchers[{16: (4, 2), 8: (4, 1), 2: (1, 1)}[align]].kernel is not None
    assert_fp8(got, FR.reference_quantize(x), x.float(), max_frac=0)
    q, s = got
    assert bool((q[1].float() == 0).all()) and s[1].item() == pytest.approx(F8.AMAX_FLOOR / 448, rel=1e-6)


@pytest.mark.parametrize("B,L,M,align", [(2, 5, 96, 16), (1, 3, 48, 8), (2, 3, 32, 2)])
def test_gelu_tanh_fp8(B, L, M, align):
    torch.manual_seed(M + align)
    x = view_of(B, L, M, align, scale=3.0)
    x[B - 1, 0] = 0
    x[0, L - 1, 2] = 2000.0  # gelu(x) = x: dominates the row's scale
    x[0, L - 1, 3] = -2000.0  # gelu -> -0
    with numba():
        got = registry.call("gelu_tanh_fp8", x)
    assert_fp8(got, FR.reference_gelu(x), FR._gelu32(x))
    q, s = got
    assert bool((q[(B - 1) * L].float() == 0).all())


@pytest.mark.parametrize("B,L,C,M,align", [(2, 5, 32, 64, 16), (1, 3, 16, 48, 8), (2, 3, 16, 32, 2)])
def test_attn_gelu_fp8_single_block_layout(B, L, C, M, align):
    """attn and mlp as row-strided column views of one linear1-like buffer (attention written
    over the v columns, mlp the last M columns): one fp8 row [attn | gelu(mlp)], one scale."""
    torch.manual_seed(C + M + align)
    pad = {16: 0, 8: 4, 2: 1}[align]
    lin1 = rnd(B, L, 3 * C + M + 8 + pad, scale=2.0)[..., pad:pad + 3 * C + M]
    a, m = lin1[..., 2 * C:3 * C], lin1[..., 3 * C:]
    a[0, 0] = 0
    m[0, 0] = 0  # a row of zeros across both parts
    a[B - 1, L - 1, 1] = 800.0  # one huge attention value sets the whole row's scale
    with numba():
        got = registry.call("attn_gelu_fp8", a, m)
    x32 = torch.cat((a.float(), FR._gelu32(m)), -1)
    assert_fp8(got, FR.reference_cat(a, m), x32)
    q, s = got
    assert q.shape == (B * L, C + M)
    assert bool((q[0].float() == 0).all())
    # the attention part is quantised from its bf16 values exactly
    qa = ordinal(q[:, :C])
    qra = ordinal(FR.reference_cat(a, m)[0][:, :C])
    assert torch.equal(qa, qra)


def test_rows_ops_take_2d_inputs():
    torch.manual_seed(5)
    x = rnd(7, 48)
    with numba():
        got = registry.call("quantize_fp8", x)
        assert_fp8(got, FR.reference_quantize(x), x.float(), max_frac=0)
        got = registry.call("attn_gelu_fp8", x[:, :16], x[:, 16:])
    assert_fp8(got, FR.reference_cat(x[:, :16], x[:, 16:]))


def test_attn_gelu_fp8_separate_buffers():
    torch.manual_seed(11)
    a, m = rnd(2, 3, 48), rnd(2, 3, 80, scale=3.0)
    with numba():
        got = registry.call("attn_gelu_fp8", a, m)
    assert_fp8(got, FR.reference_cat(a, m), torch.cat((a.float(), FR._gelu32(m)), -1))


def test_checks_decline_with_reason():
    x = rnd(1, 3, 40)  # K % 16
    why = registry.ops["quantize_fp8"].backends["numba"].check(x)
    assert "multiple of 16" in why
    assert "multiple of 16" in LM.check_fp8(x, rnd(1, 1, 40), rnd(1, 1, 40))
    assert "bf16" in registry.ops["gelu_tanh_fp8"].backends["numba"].check(rnd(1, 3, 32).float())
    assert "[B, L" in registry.ops["quantize_fp8"].backends["numba"].check(rnd(1, 3, 2, 32))
    assert "differ" in registry.ops["attn_gelu_fp8"].backends["numba"].check(rnd(1, 3, 32), rnd(1, 4, 32))
    assert "row width" in registry.ops["gelu_tanh_fp8"].backends["numba"].check(rnd(1, 1, FP8_ROWS.max_k + 16))
    # declined -> the reference runs (not strict), with the same format
    registry.strict = False
    with numba():
        q, s = registry.call("quantize_fp8", x)
    assert q.shape == (3, 40) and registry.last["quantize_fp8"] == "torch"


# ------------------------------------------------------------------------- GPU, FLUX shapes
FLUX_C, FLUX_M, FLUX_LI, FLUX_LT, FLUX_LS = 3072, 12288, 4096, 512, 4608


@gpu_only
@pytest.mark.parametrize("L", [FLUX_LI, FLUX_LT, FLUX_LS])
def test_gpu_ln_modulate_fp8_flux(L):
    C = FLUX_C
    x = rnd(1, L, C, scale=2.0, offset=0.3)
    mod = rnd(1, 1, 6 * C)
    sh, sc = mod[..., :C], mod[..., C:2 * C]
    with numba():
        got = registry.call("ln_modulate_fp8", x, sh, sc, 1e-6)
    assert_fp8(got, LM.reference_fp8(x, sh, sc, 1e-6), LM.modulate_fp32(x, sh, sc, 1e-6), max_frac=1e-3)


@gpu_only
@pytest.mark.parametrize("L", [FLUX_LI, FLUX_LT])
def test_gpu_gated_residual_ln_modulate_fp8_flux(L):
    C = FLUX_C
    x, y = rnd(1, L, C, scale=4.0), rnd(1, L, C)
    mod = rnd(1, 1, 6 * C)
    g, sh, sc = mod[..., :C], mod[..., C:2 * C], mod[..., 2 * C:3 * C]
    x1, x2 = x.clone(), x.clone()
    with numba():
        got = registry.call("gated_residual_ln_modulate_fp8", x1, g, y, sh, sc, 1e-6)
    ref = GR.reference_ln_fp8(x2, g, y, sh, sc, 1e-6)
    assert torch.equal(x1, x2)
    assert_fp8(got, ref, LM.modulate_fp32(x2, sh, sc, 1e-6), max_frac=1e-3)


@gpu_only
def test_gpu_rows_flux():
    C, M, L = FLUX_C, FLUX_M, FLUX_LS
    lin1 = rnd(1, L, 3 * C + M, scale=2.0)
    a, m = lin1[..., 2 * C:3 * C], lin1[..., 3 * C:]
    with numba():
        assert_fp8(registry.call("attn_gelu_fp8", a, m), FR.reference_cat(a, m),
                   torch.cat((a.float(), FR._gelu32(m)), -1), max_frac=1e-3)
        x = rnd(1, FLUX_LI, M, scale=2.0)
        assert_fp8(registry.call("gelu_tanh_fp8", x), FR.reference_gelu(x), FR._gelu32(x), max_frac=1e-3)
        attn = rnd(1, FLUX_LT + FLUX_LI, C)
        img = attn[:, FLUX_LT:]
        assert_fp8(registry.call("quantize_fp8", img), FR.reference_quantize(img), img.float(), max_frac=0)


def test_scaled_mm_rowwise_takes_the_format():
    """q / scale go straight into torch._scaled_mm's row-wise scaling (A row-major, scale_a
    [M, 1]; W's per-output-channel rows transposed to column-major B, scale_b [1, N]; bf16 bias
    and output), and the product is close to the fp32 GEMM (e4m3 keeps 3 mantissa bits: ~3.5%
    relative error with random operands).  FLUX's img qkv shape on the GPU; tiny on the CPU
    (torch's CPU _scaled_mm; skipped where this torch has none)."""
    if DEV == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 GEMM needs sm_89+")
    Mr, K, N = (4096, 3072, 9216) if DEV == "cuda" else (7, 64, 48)
    torch.manual_seed(0)
    x = rnd(1, Mr, K)
    w = rnd(N, K, scale=K ** -0.5)
    b = rnd(N, scale=0.1)
    with numba():
        qa, sa = registry.call("quantize_fp8", x)
    qw, sw = F8.quantize_rows_reference(w.float())
    try:
        out = torch._scaled_mm(qa, qw.t(), scale_a=sa, scale_b=sw.t().contiguous(), bias=b, out_dtype=BF)
    except (RuntimeError, NotImplementedError) as e:
        if DEV == "cpu":
            pytest.skip(f"no CPU _scaled_mm in this torch: {e}")
        raise
    assert out.shape == (Mr, N) and out.dtype == BF
    ref = torch.nn.functional.linear(x.float().view(Mr, K), w.float(), b.float())
    rel = ((out.float() - ref).norm() / ref.norm()).item()
    assert rel < 0.06, rel
    deq = torch.nn.functional.linear(F8.dequant(qa, sa), F8.dequant(qw, sw), b.float())
    assert ((out.float() - deq).norm() / deq.norm()).item() < 1e-2  # the GEMM applies exactly these scales
