"""Time and check the kept attention kernels at the FLUX shape (run on the H200 from the repo root).

    python bench/ops/gpu_attn_kernels.py                     # [1,24,4608,128], < 2 min
    FLUX_ATTN_DRYRUN=1 python bench/ops/gpu_attn_kernels.py  # CPU simulator smoke test (tiny shape)

Every kernel is passed its config explicitly (``attention.configs``): the two bf16 kernels (mma,
wgmma) and the two 8-bit kernels (mma, wgmma), each alone (inputs prepared outside the timing:
tile_kv images, pre-pass) and as the op (``numba_attention`` / ``numba_attention_8bit`` with that
config, pre-pass and relayouts included), plus the 8-bit op fed by a qk_norm_rope-style per-token
pack (the FLUX blocks' path).  Device time: 10 calls captured in one CUDA graph, median of 20
replays / 10; cuDNN SDPA and comfy-kitchen's int8_attention timed the same way in the same process.  Error: relative Frobenius
norm vs fp32 attention (bars: bf16 <= 1.1 x SDPA's, 8-bit <= 2%).  Reference numbers (H200,
BENCHMARKS.md): bf16 wgmma op 0.61-0.62 ms, 8-bit wgmma op 0.65 (pack-fed 0.61), errors 0.228% /
1.26%.  Prints a table last; JSON to $OUT/gpu_attn_kernels.json if $OUT is set.
"""
import sys
import traceback

import _attn_common as AC  # bench/ops/: this script's folder

DRY = AC.script_env()

import torch  # noqa: E402

if not DRY and not torch.cuda.is_available():  # before any kernel is built or tensor made
    print("gpu_attn_kernels.py: error: no CUDA GPU (torch sees none); FLUX_ATTN_DRYRUN=1 runs the CPU "
          "simulator smoke test", file=sys.stderr)
    sys.exit(2)

import _pack  # noqa: E402

_pack.load()
from flux_numba_pack.cuda_kernels import attention as A  # noqa: E402
from flux_numba_pack.cuda_kernels.attention import launch as LA  # noqa: E402

AC.init(DRY)
DEV = "cpu" if DRY else "cuda"
B, H, L, D = (1, 1, 130, 32) if DRY else (1, 24, 4608, 128)
FLOP = 4 * B * H * L * L * D
C = A.configs
rows = []


def add(name, what, fn, out, ref, bar):
    """Time fn (device time), check ``out`` (filled by fn) against ref; one table row."""
    try:
        out.fill_(float("nan"))
        fn()
        torch.cuda.synchronize()
        err = AC.rel(out, ref)
        t = AC.graph_ms(fn)
        ok = err <= bar
        rows.append((name, what, f"{t:.4f} ms", f"{FLOP / t / 1e9:.0f} TFLOP/s", f"{err:.3%}", "PASS" if ok else "FAIL"))
        AC.note(f"{name} / {what}", ms=round(t, 4), tflops=round(FLOP / t / 1e9, 1), err=err, ok=ok)
    except Exception as ex:
        traceback.print_exc()
        rows.append((name, what, type(ex).__name__, "", "", "ERR"))


def kernel_bf16(cfg, q, k, v, dst, marr):
    """The bf16 kernel of cfg alone: K / V tiled beforehand when the kernel wants tile images."""
    kern = A.build(cfg, D, False)
    kk, vv = A.tile_kv(k, v, kern.tile_kv) if kern.tile_kv else (k, v)
    kk, vv = kk.clone(), vv.clone()
    return lambda: LA._launch(kern, q, kk, vv, dst, marr, [0, 0, 0])


def kernel_int8(cfg, q, k, v, dst, marr):
    """The 8-bit kernel of cfg alone on the pre-pass's per-block scales (quantized beforehand)."""
    kern = A.build(cfg, D, False)
    q8, k8, qs, ks, Lp = [x.clone() if torch.is_tensor(x) else x for x in A.quantize_8bit_numba(q, k)]
    if kern.tile_kv:
        k8 = A.tile_kv(k8.view(torch.int16), None, kern.tile_kv)[0].clone()
        k8a = LA._words(k8)
    else:
        k8a = LA._arr(k8)
    if kern.v_s8:     # integer P V: s8 V^T tiles + channel scales, packed beforehand
        vb = A.pack_vt8(v, kern.tile_kv).clone()
        vw, vst = LA._c_arr(vb.view(-1)), (vb.stride(0), vb.stride(1), 0)
    else:
        vv = A.tile_kv(v, None, kern.tile_kv, chunk_major=kern.v_chunk_major)[0].clone() if kern.tile_kv else v
        vw, vst = LA._words(vv), (vv.stride(0) // 2, vv.stride(1) // 2, vv.stride(2) // 2)
    args = (LA._arr(q8), k8a, vw, LA._c_arr(qs), LA._c_arr(ks), LA._words(dst), marr,
            *vst, dst.stride(0) // 2, dst.stride(1) // 2,
            0, 0, 0, L, Lp, H, LA._LOG2E / D ** 0.5)
    return lambda: LA._go(kern, L, B * H, args, q.device)


def chain(ref, dst, cfgs):
    """The FLUX block's attention chain as the pack runs it: qk_norm_rope (RMSNorm + RoPE of the
    qkv projection, text + image parts) then attention -- cuDNN SDPA, or an 8-bit kernel fed by
    qk_norm_rope's quantising pack (quant8="qv": Q8 + per-token scales + V's tile image)."""
    from flux_numba_pack.cuda_kernels import qk_norm_rope as QK
    g = torch.Generator(device=DEV).manual_seed(1)
    L1 = 512 if not DRY else 30
    bf = lambda *s_, sc=1.0: (torch.randn(*s_, device=DEV, generator=g) * sc).to(torch.bfloat16)  # noqa: E731
    parts = [(bf(B, L1, 3 * H * D), bf(D, sc=0.1) + 1, bf(D, sc=0.1) + 1),
             (bf(B, L - L1, 3 * H * D), bf(D, sc=0.1) + 1, bf(D, sc=0.1) + 1)]
    ang = torch.rand(1, 1, L, D // 2, device=DEV, generator=g) * 6.283
    pe = torch.stack([ang.cos(), -ang.sin(), ang.sin(), ang.cos()], -1).reshape(1, 1, L, D // 2, 2, 2)
    q, k, v = QK.numba_qk_norm_rope(parts, pe, H, 1e-6)
    cref = AC.ref32(q, k, v)
    t = AC.graph_ms(lambda: QK.numba_qk_norm_rope(parts, pe, H, 1e-6))
    rows.append(("chain", "  qk_norm_rope alone", f"{t:.4f} ms", "", "", ""))
    add("chain", "qk_norm_rope + cuDNN SDPA",
        lambda: A.reference(*QK.numba_qk_norm_rope(parts, pe, H, 1e-6), out=dst), dst, cref, 0.01)
    for cfg in cfgs:
        def run(cfg=cfg):
            q_, k_, v_, pk = QK.numba_qk_norm_rope(parts, pe, H, 1e-6, quant8="qv")
            A.numba_attention_8bit(q_, k_, v_, out=dst, q8=pk, config=cfg)
        add("chain", f"qk_norm_rope(qv pack) + int8 {cfg.kind}{' u8s8' if cfg.pv == 'u8s8' else ''}", run, dst, cref, 0.02)


def main():
    print("device:", torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    g = torch.Generator(device=DEV).manual_seed(0)
    q, k, v = [torch.randn(B, H, L, D, device=DEV, generator=g).to(torch.bfloat16) for _ in range(3)]
    ref = AC.ref32(q, k, v)
    dst = torch.empty(B, L, H * D, dtype=torch.bfloat16, device=DEV)
    marr, _ = LA._mask_args(None, B, H, L, q.device)
    sd = A.reference(q, k, v)
    e16 = AC.rel(sd, ref)
    t = AC.graph_ms(lambda: A.reference(q, k, v, out=dst))
    rows.append(("cuDNN SDPA", "op (sdpa + copy)", f"{t:.4f} ms", f"{FLOP / t / 1e9:.0f} TFLOP/s", f"{e16:.3%}", ""))
    AC.note("sdpa", ms=round(t, 4), err=e16)
    cc = A.capability(q.device)
    wg_ok = A.wgmma_ok(cc, D, DRY)
    bf = [C.BF16_MMA] + ([C.BF16_WGMMA] if wg_ok else [])
    i8 = [C.INT8_MMA] + ([C.INT8_WGMMA, C.INT8_WGMMA_U8S8] if wg_ok else [])
    print(f"sm_{cc[0]}{cc[1]}: default bf16 {A.select_bf16(cc, D)}, 8-bit {A.select_int8(cc, D)}", flush=True)
    for cfg in bf:
        name = f"bf16 {cfg.kind}"
        add(name, "kernel alone", kernel_bf16(cfg, q, k, v, dst, marr), dst, ref, 1.1 * e16 + 1e-4)
        if cfg.bulk:
            t = AC.graph_ms(lambda: A.tile_kv(k, v, cfg.keys))
            rows.append((name, "  tile_kv (K + V relayout)", f"{t:.4f} ms", "", "", ""))
        add(name, "op", lambda: A.numba_attention(q, k, v, out=dst, config=cfg), dst, ref, 1.1 * e16 + 1e-4)
    pk = A.reference_pack(q, k)
    for cfg in i8:
        name = f"int8 {cfg.kind}" + (" u8s8 (integer P V)" if cfg.pv == "u8s8" else "")
        add(name, "kernel alone", kernel_int8(cfg, q, k, v, dst, marr), dst, ref, 0.02)
        if cfg.pv == "u8s8":
            tk = A.build(cfg, D, False).tile_kv
            t = AC.graph_ms(lambda: A.pack_vt8(v, tk))
            rows.append((name, "  pack_vt8 (V -> s8 V^T tiles)", f"{t:.4f} ms", "", "", ""))
        add(name, "op (pre-pass + kernel)", lambda: A.numba_attention_8bit(q, k, v, out=dst, config=cfg), dst, ref, 0.02)

        add(name, "op fed by a per-token pack", lambda: A.numba_attention_8bit(q, k, v, out=dst, q8=pk, config=cfg),
            dst, ref, 0.02)
    t = AC.graph_ms(lambda: A.quantize_8bit_numba(q, k))
    rows.append(("int8", "  pre-pass alone", f"{t:.4f} ms", "", "", ""))
    chain(ref, dst, [cfg for cfg in i8 if cfg.kind == "wgmma"])
    try:   # comfy-kitchen's int8 attention (SageAttention-style; what ComfyUI's own int8 path runs)
        import comfy_kitchen as ck
        if not DRY and ck.int8_attention_is_available():
            add("comfy-kitchen int8_attention", "op (+ layout copy)",
                lambda: dst.view(B, L, H, D).copy_(ck.int8_attention(q, k, v).transpose(1, 2)), dst, ref, 0.02)
    except Exception as ex:
        rows.append(("comfy-kitchen int8_attention", f"unavailable: {type(ex).__name__}: {str(ex)[:60]}", "", "", "", ""))
    AC.finish("gpu_attn_kernels.json", AC.results,
              f"\n=== attention kernels at [{B},{H},{L},{D}] (device time, error vs fp32) ===", rows)


if __name__ == "__main__":
    main()
