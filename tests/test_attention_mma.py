"""The tensor-core helpers of cuda_kernels/mma.py on their own (split from test_attention.py): mma
fragment layouts, bit tricks, and the Hopper wgmma descriptor layouts, emulated lane by lane in
the simulator.
"""
import pytest
import torch

from flux_numba_pack.cuda_kernels import runtime


# ---------------------------------------------------------------- the mma helpers on their own
from numba import cuda, int32  # noqa: E402  (conftest chose simulator / GPU before this import)
from flux_numba_pack.cuda_kernels import mma  # noqa: E402

SCR = mma.SCR_WORDS


def _frag_kernel(kind):
    """One warp: load A/B fragments by the documented layout (plain indexing, no ldmatrix),
    run the helper, store D by the documented layout.  On a GPU (FLUX_NUMBA_REAL_GPU=1) this
    checks the inline-PTX mma against the same layout."""
    @cuda.jit
    def k(aw, bw, d):
        # aw: [16, K/E] int32 words of A rows; bw: [8, K/E] words of B columns (B^T rows)
        scr = cuda.shared.array(SCR, int32)
        lane = cuda.threadIdx.x
        g, t = lane // 4, lane % 4
        # 8 words per row for both 16-bit (k16) and 8-bit (k32) operands: a2/a3/b1 are words t + 4
        a0, a1, a2, a3 = aw[g, t], aw[g + 8, t], aw[g, t + 4], aw[g + 8, t + 4]
        b0, b1 = bw[g, t], bw[g, t + 4]
        if kind == 0:
            r = mma.mma_bf16(a0, a1, a2, a3, b0, b1, 0.0, 0.0, 0.0, 0.0, scr)
        elif kind == 1:
            r = mma.mma_f16(a0, a1, a2, a3, b0, b1, 0.0, 0.0, 0.0, 0.0, scr)
        else:
            r = mma.mma_s8(a0, a1, a2, a3, b0, b1, 0, 0, 0, 0, scr)
        d[g, 2 * t], d[g, 2 * t + 1], d[g + 8, 2 * t], d[g + 8, 2 * t + 1] = r[0], r[1], r[2], r[3]
    return k


def test_bits_f32_and_magic_bias():
    # mma.bits_f32 reinterprets an int32 as float32 (no conversion): bits(x + 0x4B400000) ==
    # 12582912 + x exactly for |x| < 2^22 (any int32 Q8 K8^T dot product)
    import numpy as np
    xs = np.array([0, 1, -1, 2064512, -2064512, 12345, -(1 << 22) + 1, (1 << 22) - 1], dtype=np.int32)
    raw = np.array([0x3F800000, -0x40800000, 0x7F7FFFFF, 1], dtype=np.int32)   # 1.0, -1.0, max, denormal

    @cuda.jit
    def k(x, r, outm, outr):
        i = cuda.threadIdx.x
        if i < x.size:
            outm[i] = mma.bits_f32(x[i] + 0x4B400000) - np.float32(12582912.0)
        if i < r.size:
            outr[i] = mma.bits_f32(r[i])

    outm = np.zeros(xs.size, dtype=np.float32)
    outr = np.zeros(raw.size, dtype=np.float32)
    if runtime.SIMULATOR:
        k[1, 32](xs, raw, outm, outr)
    else:
        dm, dr = cuda.to_device(outm), cuda.to_device(outr)
        k[1, 32](cuda.to_device(xs), cuda.to_device(raw), dm, dr)
        outm, outr = dm.copy_to_host(), dr.copy_to_host()
    assert np.array_equal(outm, xs.astype(np.float32))
    assert np.array_equal(outr.view(np.int32), raw)


@pytest.mark.parametrize("kind", ["bf16", "f16", "s8"])
def test_mma_fragment_layout(kind):
    import numpy as np
    g = torch.Generator().manual_seed(1)
    K = 32 if kind == "s8" else 16
    if kind == "s8":
        a = torch.randint(-127, 128, (16, K), generator=g, dtype=torch.int8)
        b = torch.randint(-127, 128, (K, 8), generator=g, dtype=torch.int8)
        ref = a.int() @ b.int()
    else:
        dt = torch.bfloat16 if kind == "bf16" else torch.float16
        a = torch.randn(16, K, generator=g).to(dt)
        b = torch.randn(K, 8, generator=g).to(dt)
        ref = a.double() @ b.double()
    aw = a.contiguous().view(torch.int32).numpy()       # [16, 8] words
    bw = b.t().contiguous().view(torch.int32).numpy()   # [8, 8] words
    d = np.zeros((16, 8), dtype=np.int32 if kind == "s8" else np.float32)
    _frag_kernel({"bf16": 0, "f16": 1, "s8": 2}[kind])[1, 32](aw, bw, d)
    assert np.allclose(d, ref.numpy(), rtol=1e-5, atol=1e-4)


# ---------------------------------------------------------------- Hopper wgmma (variants "wg", "wg2", 8-bit "wg")
def _wg_layout(B, kind, transb):
    """Shared-memory image (int32 words) of B [K, N] in the no-swizzle core-matrix layout the
    attention kernels use, and the descriptor's (LBO, SBO)."""
    import numpy as np
    K, N = B.shape
    eb = 1 if kind in ("s8", "u8s8") else 2
    ce = 16 // eb                       # elements per 16-byte core-matrix row
    raw = (B.numpy().astype(np.int8).view(np.uint8) if eb == 1
           else B.contiguous().view(torch.int16).numpy().view(np.uint8).reshape(K, N, 2))
    img = np.zeros(K * N * eb, dtype=np.uint8)
    if not transb:   # K-major: chunk (n, k // ce) at (n // 8) * SBO + (k // ce) * LBO + (n % 8) * 16
        lbo, sbo = 128, (K // ce) * 128
    else:            # MN-major: chunk (k, n // ce) at (k // 8) * LBO + (n // ce) * SBO + (k % 8) * 16
        lbo, sbo = (N // ce) * 128, 128
    for k in range(K):
        for n in range(N):
            if not transb:
                a = (n // 8) * sbo + (k // ce) * lbo + (n % 8) * 16 + (k % ce) * eb
            else:
                a = (k // 8) * lbo + (n // ce) * sbo + (k % 8) * 16 + (n % ce) * eb
            img[a:a + eb] = raw[k, n]
    return img.view(np.int32).copy(), lbo, sbo


def _wg_kernel(N, transb, kind, words, lbo, sbo):
    from numba import float32, int64
    wg = mma.wgmma_op(N, transb, kind)
    NA = N // 2
    ACC = int32 if kind in ("s8", "u8s8") else float32
    HI = ((lbo >> 4) << 16) | ((sbo >> 4) << 32)
    AL = None if runtime.SIMULATOR else 128

    @cuda.jit
    def k(aw, bimg, d):
        sm = cuda.shared.array(words, int32, alignment=AL)
        scr = cuda.shared.array(SCR, int32)
        tid = cuda.threadIdx.x
        for i in range(tid, words, 128):
            sm[i] = bimg[i]
        mma.fence_proxy_async()
        cuda.syncthreads()
        w, lane = tid // 32, tid % 32
        g, t = lane // 4, lane % 4
        r = 16 * w + g
        a0, a1, a2, a3 = aw[r, t], aw[r + 8, t], aw[r, t + 4], aw[r + 8, t + 4]
        acc = cuda.local.array(NA, ACC)
        for i in range(NA):
            acc[i] = 0
        desc = HI | (int64(mma.smem_base(sm)) >> 4)
        mma.wg_fence()
        wg(acc, a0, a1, a2, a3, desc, 0, sm, scr)
        mma.wg_commit()
        mma.wg_wait0()
        for j in range(N // 8):
            d[r, 8 * j + 2 * t] = acc[4 * j]
            d[r, 8 * j + 2 * t + 1] = acc[4 * j + 1]
            d[r + 8, 8 * j + 2 * t] = acc[4 * j + 2]
            d[r + 8, 8 * j + 2 * t + 1] = acc[4 * j + 3]
    return k


@pytest.mark.parametrize("kind,N,transb", [("bf16", 64, 0), ("bf16", 32, 1), ("s8", 64, 0), ("u8s8", 64, 0)])
def test_wgmma_descriptor_layout(kind, N, transb):
    """One warpgroup: A (64 x K) from registers in the mma.m16n8k16/k32 fragment layout, B from
    shared memory through a no-swizzle descriptor (K-major or MN-major).  On an H200
    (FLUX_NUMBA_REAL_GPU=1) this checks our reading of the wgmma descriptor rules."""
    import numpy as np
    if not runtime.SIMULATOR and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("wgmma needs sm_90")
    g = torch.Generator().manual_seed(4)
    K = 16 if kind == "bf16" else 32
    if kind == "s8":
        a = torch.randint(-127, 128, (64, K), generator=g, dtype=torch.int8)
        b = torch.randint(-127, 128, (K, N), generator=g, dtype=torch.int8)
        ref = a.int() @ b.int()
    elif kind == "u8s8":    # A unsigned: bytes >= 128 must read as 128..255, not negative
        a = torch.randint(0, 256, (64, K), generator=g, dtype=torch.uint8)
        b = torch.randint(-127, 128, (K, N), generator=g, dtype=torch.int8)
        ref = a.int() @ b.int()
    else:
        a = torch.randn(64, K, generator=g).to(torch.bfloat16)
        b = torch.randn(K, N, generator=g).to(torch.bfloat16)
        ref = a.double() @ b.double()
    img, lbo, sbo = _wg_layout(b, kind, transb)
    aw = a.contiguous().view(torch.int32).numpy()          # [64, 8] words
    d = np.zeros((64, N), dtype=np.float32 if kind == "bf16" else np.int32)
    if runtime.SIMULATOR:
        _wg_kernel(N, transb, kind, img.size, lbo, sbo)[1, 128](aw, img, d)
    else:
        dd = cuda.to_device(d)
        _wg_kernel(N, transb, kind, img.size, lbo, sbo)[1, 128](cuda.to_device(aw), cuda.to_device(img), dd)
        d = dd.copy_to_host()
    assert np.allclose(d, ref.numpy(), rtol=1e-5, atol=1e-3)
