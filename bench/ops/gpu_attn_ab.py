"""A/B timing of the 8-bit wgmma attention kernel across source trees, in one process (H200).

    python bench/ops/gpu_attn_ab.py new=cuda_kernels old=.gpu/old/cuda_kernels [--rounds 5]
    python bench/ops/gpu_attn_ab.py new=cuda_kernels --profile new     # one warm launch, for ncu
    FLUX_ATTN_DRYRUN=1 python bench/ops/gpu_attn_ab.py new=cuda_kernels  # CPU simulator smoke test

Each LABEL=PATH names a ``cuda_kernels`` folder (this repo's, or an older commit's exported with
``git archive COMMIT cuda_kernels | tar -x -C .gpu/old``); each is imported as its own package, so
the variants run side by side on the same inputs.  Per variant: the kernel alone at [1,24,4608,128]
(int8 Q / K from that tree's pre-pass, tile_kv images made beforehand -- what BENCHMARKS.md calls
"kernel"), device time of 10 launches captured in one CUDA graph, median of 20 replays; rounds
interleave the variants (A B A B ...) and the table gives each variant's median over rounds and its
ratio to the first.  cuDNN SDPA is timed in every round as the yardstick; error vs fp32 attention.
``--profile LABEL``: build and warm that variant, then launch its kernel once more with nothing
else after it (``ncu --kernel-name regex:int8_wgmma --launch-skip 2 --launch-count 1``).
"""
import argparse
import importlib.util
import os
import statistics
import sys

import _attn_common as AC  # bench/ops/: this script's folder

DRY = AC.script_env()

import torch  # noqa: E402

import _pack  # noqa: E402

_pack.numpy_compat()

AC.init(DRY)
DEV = "cpu" if DRY else "cuda"
B, H, L, D = (1, 1, 130, 32) if DRY else (1, 24, 4608, 128)
FLOP = 4 * B * H * L * L * D


def load_tree(label, path):
    """Import the ``cuda_kernels`` folder at ``path`` as the package ``abv_<label>``."""
    name = f"abv_{label}"
    path = os.path.abspath(path)
    spec = importlib.util.spec_from_file_location(name, os.path.join(path, "__init__.py"),
                                                  submodule_search_locations=[path])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return importlib.import_module(name + ".attention")


def kernel_fn(A, q, k, v, dst):
    """The tree's 8-bit wgmma kernel alone (its config INT8_WGMMA), inputs prepared beforehand."""
    LA = A.launch
    cfg = A.configs.INT8_WGMMA
    kern = A.build(cfg, D, False)
    marr, _ = LA._mask_args(None, B, H, L, q.device)
    q8, k8, qs, ks, Lp = [x.clone() if torch.is_tensor(x) else x for x in A.quantize_8bit_numba(q, k)]
    k8 = A.tile_kv(k8.view(torch.int16), None, kern.tile_kv)[0].clone()
    cm = getattr(kern, "v_chunk_major", False)        # (older trees: no such field, group-major V)
    vv = (A.tile_kv(v, None, kern.tile_kv, chunk_major=True) if cm else A.tile_kv(v, None, kern.tile_kv))[0].clone()
    args = (LA._arr(q8), LA._words(k8), LA._words(vv), LA._c_arr(qs), LA._c_arr(ks), LA._words(dst), marr,
            vv.stride(0) // 2, vv.stride(1) // 2, vv.stride(2) // 2, dst.stride(0) // 2, dst.stride(1) // 2,
            0, 0, 0, L, Lp, H, LA._LOG2E / D ** 0.5)
    keep = (q8, k8, vv, qs, ks)
    return lambda: (LA._go(kern, L, B * H, args, q.device), keep)[0]


def op_parts(lab0, q, k, v, dst):
    """Device times (3 graph timings each) of the tree's op pieces and of the fused path's chain
    (qk_norm_rope with the int8 pack + the op) against qk_norm_rope + cuDNN, on the same inputs."""
    A = sys.modules[f"abv_{lab0}.attention"]
    QK = importlib.import_module(f"abv_{lab0}.qk_norm_rope")
    cfg = A.configs.INT8_WGMMA
    kern = A.build(cfg, D, False)
    cm = getattr(kern, "v_chunk_major", False)
    q8, k8, qs, ks, Lp, km = QK.quant8_reference(q, k)
    pk = QK.Quant8(q, k, q8, k8, qs.contiguous(), ks.contiguous(), km, Lp, {})
    pieces = {
        "pre-pass Q + K": lambda: A.quantize_8bit_numba(q, k),
        "K-only pre-pass (tiled K8)": lambda: A.int8_format._prepass(q, k, tiled=cfg.keys, konly=True),
        "tile_kv(V)": (lambda: A.tile_kv(v, None, cfg.keys, chunk_major=True)) if cm
        else (lambda: A.tile_kv(v, None, cfg.keys)),
        "op (pre-pass + tile_kv + kernel)": lambda: A.numba_attention_8bit(q, k, v, out=dst, config=cfg),
        "op fed by a per-token pack": lambda: A.numba_attention_8bit(q, k, v, out=dst, q8=pk, config=cfg),
    }
    # the fused FLUX path: qk_norm_rope over a [B, L, 3 H D] projection (+ RMSNorm scales, RoPE)
    g = torch.Generator(device=DEV).manual_seed(1)
    qkv = torch.randn(B, L, 3 * H * D, device=DEV, generator=g).to(torch.bfloat16)
    sc = (1 + 0.1 * torch.randn(D, device=DEV, generator=g)).to(torch.bfloat16)
    ang = torch.rand(1, 1, L, D // 2, device=DEV, generator=g) * 6.283
    pe = torch.stack([ang.cos(), -ang.sin(), ang.sin(), ang.cos()], -1).reshape(1, 1, L, D // 2, 2, 2)
    parts = [(qkv, sc, sc)]
    kind = "qv" if hasattr(QK, "VT_KEYS") else "q"
    nqr = QK.numba_qk_norm_rope

    def chain8():
        r = nqr(parts, pe, H, 1e-6, quant8=kind)
        return A.numba_attention_8bit(r[0], r[1], r[2], out=dst, q8=r[3], config=cfg)

    def chain_cudnn():
        r = nqr(parts, pe, H, 1e-6)
        return A.cudnn_attention(r[0], r[1], r[2], out=dst)
    r = nqr(parts, pe, H, 1e-6, quant8=kind)
    pieces.update({
        "qk_norm_rope": lambda: nqr(parts, pe, H, 1e-6),
        f"qk_norm_rope quant8={kind}": lambda: nqr(parts, pe, H, 1e-6, quant8=kind),
        f"op fed by qk_norm_rope's {kind} pack": lambda: A.numba_attention_8bit(r[0], r[1], r[2], out=dst, q8=r[3],
                                                                               config=cfg),
        "cuDNN on qk_norm_rope's q, k, v": lambda: A.cudnn_attention(r[0], r[1], r[2], out=dst),
        f"chain qk_norm_rope({kind}) + 8-bit op": chain8,
        "chain qk_norm_rope + cuDNN": chain_cudnn,
    })
    out = {}
    for name, fn in pieces.items():
        try:
            out[name] = [AC.graph_ms(fn) for _ in range(1 if DRY else 3)]
        except Exception as ex:
            print(f"{lab0}: {name} FAILED: {type(ex).__name__}: {ex}", flush=True)
    ref = AC.ref32(r[0], r[1], r[2])
    chain8()
    torch.cuda.synchronize()
    errs[f"{lab0}: chain qk_norm_rope({kind}) + 8-bit op"] = AC.rel(dst, ref)
    return out


errs = {}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trees", nargs="+", help="LABEL=PATH of a cuda_kernels folder")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--profile", default="", help="LABEL: one more launch of that variant, then exit")
    ap.add_argument("--parts", action="store_true",
                    help="also time the first tree's op pieces: K-only pre-pass, tile_kv(V), op, pack-fed op")
    a = ap.parse_args()
    g = torch.Generator(device=DEV).manual_seed(0)
    q, k, v = [torch.randn(B, H, L, D, device=DEV, generator=g).to(torch.bfloat16) for _ in range(3)]
    ref = AC.ref32(q, k, v)
    dst = torch.empty(B, L, H * D, dtype=torch.bfloat16, device=DEV)
    fns = {}
    for spec in a.trees:
        label, path = spec.split("=", 1)
        if a.profile and label != a.profile:
            continue
        try:
            A = load_tree(label, path)
            fns[label] = kernel_fn(A, q, k, v, dst)
            dst.fill_(float("nan"))
            fns[label]()
            torch.cuda.synchronize()
            errs[label] = AC.rel(dst, ref)
        except Exception as ex:   # a broken variant is reported and left out, the others still run
            print(f"{label}: {path} FAILED: {type(ex).__name__}: {ex}", flush=True)
            fns.pop(label, None)
            continue
        print(f"{label}: {path} error {errs[label]:.3%}", flush=True)
    if a.profile:
        fns[a.profile]()
        torch.cuda.synchronize()
        fns[a.profile]()       # the profiled launch (launch-skip 2: the two before it)
        torch.cuda.synchronize()
        return
    times = {lab: [] for lab in fns}
    times["cuDNN SDPA"] = []
    for r in range(a.rounds):
        for lab, fn in fns.items():
            times[lab].append(AC.graph_ms(fn))
        times["cuDNN SDPA"].append(AC.graph_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)))
        print(f"round {r}: " + ", ".join(f"{lab} {ts[-1]:.4f}" for lab, ts in times.items()), flush=True)
    if a.parts:     # where the op's time goes besides the kernel (every tree)
        for lab0 in fns:
            for name, ts in op_parts(lab0, q, k, v, dst).items():
                times[f"{lab0}: {name}"] = ts
                print(f"{lab0}: {name}: {ts}", flush=True)
    first = statistics.median(times[next(iter(fns))])
    rows = [("variant", "median ms", "min", "max", "vs first", "TFLOP/s", "error")]
    for lab, ts in times.items():
        m = statistics.median(ts)
        rows.append((lab, f"{m:.4f}", f"{min(ts):.4f}", f"{max(ts):.4f}", f"{m / first:.3f}",
                     f"{FLOP / m / 1e9:.0f}", f"{errs[lab]:.3%}" if lab in errs else ""))
        AC.note(lab, median_ms=round(m, 4), times=[round(t, 4) for t in ts], err=errs.get(lab))
    AC.finish("gpu_attn_ab.json", AC.results,
              f"\n=== 8-bit wgmma kernel alone at [{B},{H},{L},{D}], {a.rounds} interleaved rounds ===", rows)


if __name__ == "__main__":
    main()
