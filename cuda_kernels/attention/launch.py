"""Launch plumbing shared by the attention kernels (the bottom layer of the package).

``Kernel``: what every factory returns -- the numba kernel and its launch geometry (query rows
per block, threads, whether K / V come as ``tile_kv`` images, dynamic shared memory).
Numba array views of torch tensors, the mask conversion (one additive fp32 [Bm, Hm, L, L] view,
broadcast with stride 0), the output buffer, and the launch on torch's stream with the
> 48 KB dynamic shared memory opt-in.  Constants every kernel shares: the pre-pass granularity
(Q scales per 16 rows, K scales per 64 keys), log2(e), shared-memory alignments."""
import math as _math
from dataclasses import dataclass

import torch

from .. import runtime as _rt

try:  # numba is a hard requirement of the numba backends only; the reference needs torch alone
    from numba import cuda, int32, int64, float32
    from .. import mma as _mma
except Exception:  # pragma: no cover - reported by runtime.numba_status()
    cuda = int32 = int64 = float32 = _mma = None

_BN = 64                # the pre-pass's tile: K scales per 64 keys (Q per 16 rows), Lp a multiple of 64
_LOG2E = 1.4426950408889634
# ldmatrix rows and cp.async destinations must be 16-byte aligned (numba's default is the dtype's);
# the simulator rejects the alignment argument, and checks the alignment itself (mma.py).
SMEM_ALIGN = None if _rt.SIMULATOR else 16
SMEM_ALIGN_WG = None if _rt.SIMULATOR else 1024


@dataclass(frozen=True)
class Kernel:
    """A built attention kernel: ``kern[grid, threads, stream, dyn_smem](*args)`` with grid
    (ceil(L / rows), B * H).  tile_kv > 0: K and V are passed as ``tile_kv(x, tile_kv)`` images
    (the bulk-copy kernels).  dyn_smem > 0: that many bytes of dynamic shared memory, opted in
    once per device before the first launch.  v_chunk_major: V as ``tile_kv(v, None, tile_kv,
    chunk_major=True)``.  v_s8: V as ``vt8.pack_vt8(v, tile_kv)`` (s8 V^T tiles + channel scales:
    the integer-P V kernel)."""
    kern: object
    rows: int
    threads: int
    tile_kv: int = 0
    dyn_smem: int = 0
    v_chunk_major: bool = False
    v_s8: bool = False


def normalize_mask(mask):
    if mask is not None:
        if mask.ndim == 2:
            mask = mask.unsqueeze(0)
        if mask.ndim == 3:
            mask = mask.unsqueeze(1)
    return mask


def _words(t):
    """1-D int32 view (numba array) spanning a 16-bit tensor whose last dim is contiguous."""
    span = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    flat = torch.as_strided(t, (span,), (1,), t.storage_offset()).view(torch.int32)
    if _rt.SIMULATOR:
        return flat.detach().numpy()
    from numba import cuda
    return cuda.as_cuda_array(flat.detach(), sync=False)


def _f32_1d(t):
    span = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    flat = torch.as_strided(t, (span,), (1,), t.storage_offset())
    if _rt.SIMULATOR:
        return flat.detach().numpy()
    from numba import cuda
    return cuda.as_cuda_array(flat.detach(), sync=False)


_dummy_mask = {}


def _cp_ok(t):
    """16-byte cp.async needs 16-byte aligned rows."""
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(s % 8 == 0 for s in t.stride()[:-1]))


def _prep_mask(mask, B, H, L, device):
    m = normalize_mask(mask)
    if m.dtype == torch.bool:
        m = torch.zeros(m.shape, dtype=torch.float32, device=device).masked_fill_(~m, -1e30)
    else:  # finite floor: the kernel is built with fast-math (no infinities)
        m = m.to(torch.float32).clamp(min=-1e30)
    m = m.expand(B if m.shape[0] != 1 else 1, H if m.shape[1] != 1 else 1, L, L)
    if m.stride(-1) != 1:
        m = m.contiguous()
    st = [0 if m.shape[i] == 1 else m.stride(i) for i in range(3)]
    return m, st


_dyn_done = set()


def _dyn_optin(kern, args, nbytes, dev):
    """CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = nbytes on the overload these args select
    (numba-cuda has no API for it; issue #94).  Compiles that overload now (the launch reuses it)."""
    key = (id(kern), str(dev))
    if key in _dyn_done:
        return
    from numba.cuda.cudadrv import driver as _drv
    k = kern.compile(tuple(kern.typeof_pyval(a) for a in args))
    cufunc = k._codelibrary.get_cufunc()
    attr = _drv.binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    _drv.driver.cuKernelSetAttribute(attr, int(nbytes), cufunc.handle, cufunc.device.id)
    _dyn_done.add(key)


def _dwords(t):
    """1-D int64 view spanning a 16-bit tensor (last dim contiguous, 4-element aligned)."""
    span = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    span = -(-span // 4) * 4
    flat = torch.as_strided(t, (span,), (1,), t.storage_offset()).view(torch.int64)
    if _rt.SIMULATOR:
        return flat.detach().numpy()
    from numba import cuda
    return cuda.as_cuda_array(flat.detach(), sync=False)


def _launch(kernel, q, k, v, dst, marr, mst):
    """One launch of a bf16 attention ``Kernel`` over [B, H, L, D] (k / v already tiled when the
    kernel wants tile images)."""
    B, H, L, D = q.shape
    sl2 = _LOG2E / _math.sqrt(D)
    args = (_words(q), _words(k), _words(v), _words(dst), marr,
            q.stride(0) // 2, q.stride(1) // 2, q.stride(2) // 2,
            k.stride(0) // 2, k.stride(1) // 2, k.stride(2) // 2,
            v.stride(0) // 2, v.stride(1) // 2, v.stride(2) // 2,
            dst.stride(0) // 2, dst.stride(1) // 2,
            mst[0], mst[1], mst[2], L, H, sl2)
    _go(kernel, L, B * H, args, q.device)


def _go(kernel, L, BH, args, dev):
    """Launch ``kernel`` over L query rows x BH heads on torch's stream (dynamic shared memory
    opted in first)."""
    grid = ((L + kernel.rows - 1) // kernel.rows, BH)
    if kernel.dyn_smem:
        _dyn_optin(kernel.kern, args, kernel.dyn_smem, dev)
        kernel.kern[grid, kernel.threads, _rt.stream(), kernel.dyn_smem](*args)
    else:
        kernel.kern[grid, kernel.threads, _rt.stream()](*args)


def _mask_args(mask, B, H, L, dev):
    """(numba view, [s0, s1, s2] strides) of the additive mask; a 1-element stand-in when None."""
    if mask is not None:
        m, mst = _prep_mask(mask, B, H, L, dev)
        return _f32_1d(m), mst
    marr = _dummy_mask.get(dev)
    if marr is None:
        marr = _dummy_mask[dev] = _f32_1d(torch.zeros(1, dtype=torch.float32, device=dev))
    return marr, [0, 0, 0]


def _out_buffer(out, q):
    """``out`` when the kernels can store into it (16-bit pairs, unit last stride), else a new
    [B, L, H*D] buffer (copied into ``out`` after the launch)."""
    B, H, L, D = q.shape
    if out is None or out.stride(-1) != 1 or out.stride(1) % 2 or out.stride(0) % 2 or out.data_ptr() % 4:
        return torch.empty((B, L, H * D), dtype=q.dtype, device=q.device)
    return out


def _arr(t):
    flat = t.reshape(-1)
    if flat.dtype in (torch.float16, torch.bfloat16):
        flat = flat.view(torch.int16)
    if flat.dtype in (torch.int8, torch.int16):
        flat = flat.view(torch.int32)
    if _rt.SIMULATOR:
        return flat.detach().numpy()
    from numba import cuda as _c
    return _c.as_cuda_array(flat.detach(), sync=False)


def _c_arr(t):
    if _rt.SIMULATOR:
        return t.detach().numpy()
    from numba import cuda as _c
    return _c.as_cuda_array(t.detach(), sync=False)


def _words_ok(x):
    return not (x.stride(-1) != 1 or x.stride(0) % 2 or x.stride(1) % 2 or x.stride(2) % 2 or x.data_ptr() % 4)
