#!/usr/bin/env python3
"""Benchmark: stock ComfyUI FLUX vs this pack, same weights, same process.

    python bench.py --res 1024                      # FLUX.1-dev architecture, random weights, H200
    python bench.py --model flux1-dev.safetensors   # real weights
    python bench.py --config tiny --device cpu      # smoke test of the harness itself (slow on CPU)
    python bench.py --config tiny --device cpu --res 64 --txt 8 --reps 1 --warmup 1   # quick smoke test

Variants (all on one set of weights; ComfyUI's own ``Flux`` module when a ComfyUI tree is
importable -- COMFYUI_PATH or .carry/ComfyUI -- else the pack's standalone model):
  stock         ComfyUI's forward, untouched (absent without ComfyUI)
  pack-torch    the pack's block functions, stock op order, every op forced to torch
  exact         fused op order, ops on 'auto' (Numba where it is measured faster), attention 'auto' as
                the node runs it: SDPA in torch's backend order or cuDNN-first, measured per shape
  exact-sdpa    as exact, attention SDPA in torch's order (FLASH first; the exact profile before 12-01)
  bf16-attn     as exact, bf16 Numba flash attention forced (wgmma kernel on Hopper)
  attn8         as exact, 8-bit Numba attention (called "fast" before 12-01)
  fast          the node's fast profile: exact's fusion with the block GEMMs in fp8 e4m3 (row-wise
                scales, activations quantised by the kernels that write them; flux_core/fast.py),
                bf16 weights quantised again every step (no second copy)
  fast-cached   as fast, bf16 weights quantised once and kept (the fast-cached profile: +11.9 GB)
  fast-cached-attn8  as fast-cached, 8-bit Numba attention forced (fed by qk_norm_rope's int8 pack)
  ...+graph     the same forward captured once as a CUDA graph and replayed (no launch gaps)
A variant that cannot run here (``stock`` without ComfyUI, ``+graph`` off a CUDA device or with
offloaded weights) is skipped with a printed note and ``{"skipped": reason}`` in the JSON.
Timing: CUDA events around one forward (= one sampling step), warm-up, median of repeats;
"b2b ms": the same steps queued back to back (one pair of events), as a sampler that does not
sync between steps runs them; SM clock / power / share of samples at the power cap from
nvidia-smi during the timed steps (the H200 runs FLUX at its power cap).
Diagnostics: --profile (GPU kernel time by category, idle gaps on the timeline), --memory
(allocations live at the step's peak).
Accuracy: relative error of one forward against an fp32 reference on the same (bf16-rounded)
weights with TF32 off; optional N-step Euler trajectory PSNR against the fp32 trajectory.
Prints a table last and writes JSON (strict: no NaN/Infinity, a non-finite number is null).
On a CPU no Numba kernel runs (the harness smoke test): its times are not a speed measurement.
"""
import gc
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.abspath(__file__))
# bench.py's parts (bench/e2e), gpu_vae for --vae (bench/ops) and the shared timing helper (bench/)
sys.path[:0] = [os.path.join(ROOT, "bench", "e2e"), os.path.join(ROOT, "bench", "ops"), os.path.join(ROOT, "bench")]
from _bench_setup import _avail_ram, _has_kitchen, _wait_for_kernel_build, find_comfy, parse  # noqa: E402
from _bench_diag import ClockLog, host_profile, memory_at_peak, profile_forward  # noqa: E402


def main():
    p, a = parse(__doc__)
    sys.path.insert(0, ROOT)
    try:
        import _pack
        _pack.load()
        import torch
        from flux_numba_pack.cuda_kernels import registry, runtime
        from flux_numba_pack.flux_core import (BlockContext, CheckpointError, FluxModel, FLUX1_DEV, NotFluxError, TINY,
                                               double_block, single_block, euler_sample, flux_schedule,
                                               inspect_checkpoint, load_state_dict)
        from flux_numba_pack.flux_core.harness import step_times, med, pick_device, psnr, rel_err
    except ModuleNotFoundError as e:
        p.fail(f"{e.name or e} is not installed ({e}): run `python3 install.py --standalone` first")

    if a.device.startswith("cuda"):
        if not torch.cuda.is_available():
            p.fail(f"argument --device: {a.device} asked for, but torch sees no CUDA GPU")
        if ":" in a.device and int(a.device[5:]) >= torch.cuda.device_count():
            p.fail(f"argument --device: {a.device}, but torch sees {torch.cuda.device_count()} CUDA GPU(s)")
    dev = pick_device(a.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if a.model:
        try:
            cfg = inspect_checkpoint(a.model)
        except NotFluxError as e:
            p.fail(f"argument --model: {a.model}: {e}")
        except CheckpointError as e:
            p.fail(f"argument --model: {e}")
        except OSError as e:
            p.fail(f"argument --model: cannot read {a.model} ({e.strerror or e})")
    else:
        cfg = FLUX1_DEV if a.config == "flux1-dev" else TINY
    if dev.type == "cpu":  # fp32 on the CPU: the weights (and the fp32 reference's copy) must fit
        need = cfg.n_params() * 4 * (1 if a.no_ref else 2)
        avail = _avail_ram()
        what = a.model or f"--config {a.config}"
        if cfg.n_params() > 2e9 or (avail and need > avail):
            p.fail(f"{what} on the CPU: {cfg.n_params() / 1e9:.1f} B params, {need / 1e9:.0f} GB in fp32"
                   + (f" ({avail / 1e9:.0f} GB free)" if avail else "")
                   + "; the benchmark needs a CUDA GPU for that, its CPU smoke test is --config tiny "
                     "(README: python bench.py --config tiny --device cpu --res 64 --txt 8 --reps 1 --warmup 1)")
    comfy_root = None if a.no_comfy else find_comfy()
    info = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
            "res": a.res, "txt": a.txt, "batch": a.batch, "dtype": str(dtype), "model": a.model or f"random {a.config}",
            "numba": runtime.numba_status() or "ok", "comfyui": comfy_root or "not found"}
    print("bench:", json.dumps(info))

    # ---------------------------------------------------------------- model (one set of weights)
    t0 = time.time()
    if comfy_root:
        sys.path.insert(0, comfy_root)
        if dev.type == "cpu":
            import comfy.cli_args
            comfy.cli_args.args.cpu = True  # as `main.py --cpu`
        import comfy.ops
        from comfy.ldm.flux.model import Flux
        ops, store = comfy.ops.disable_weight_init, dtype
        if a.weight_dtype == "fp8_e4m3fn":  # UNETLoader weight_dtype fp8_e4m3fn: fp8 storage, manual_cast ops
            ops, store = comfy.ops.manual_cast, torch.float8_e4m3fn
        with torch.device(dev):
            model = Flux(dtype=store, device=dev, operations=ops, **cfg.comfy_kwargs())
        info["comfy_kitchen"] = _has_kitchen()
        import comfy.ldm.flux.math
        from flux_numba_pack.cuda_kernels import qk_norm_rope
        qk_norm_rope.set_stock_rope(comfy.ldm.flux.math.apply_rope)  # torch path = stock's RoPE
    else:
        with torch.device("meta"):
            model = FluxModel(cfg)
        model = model.to_empty(device=dev).to(dtype)
    model.eval().requires_grad_(False)
    with torch.no_grad():
        if a.model:
            sd = load_state_dict(a.model)
            weights = {}
            for k, v in sd.items():  # fp8 "scaled" files: weight * its per-tensor scale
                if k.endswith(".scale_weight") or k.endswith("scaled_fp8"):
                    continue
                s = sd.get(k[: -len("weight")] + "scale_weight") if k.endswith(".weight") else None
                weights[k] = v.to(dtype) if s is None else (v.float() * s.float()).to(dtype)
            res = model.load_state_dict(weights, strict=False)
            if res.missing_keys or res.unexpected_keys:
                p.fail(f"argument --model: {a.model} does not fit the FLUX model it describes: missing "
                       f"{res.missing_keys[:3]}, unexpected {res.unexpected_keys[:3]}")
            del sd, weights
        else:
            g = torch.Generator(device=dev).manual_seed(0)
            for n, w in model.named_parameters():  # the weights of ../shared probe/stock_flux.py
                v = torch.empty(w.shape, device=dev, dtype=dtype) if w.dtype != dtype else w
                if w.ndim == 1:
                    v.fill_(1.0) if "scale" in n else v.normal_(0, 0.01, generator=g)
                else:
                    v.normal_(0, 0.02, generator=g)
                if v is not w:
                    w.copy_(v)  # fp8 storage: rounded from the same bf16 draws
        if a.outliers:
            n_out, f_out = a.outliers
            for emb in (model.img_in, model.txt_in):
                emb.weight[:n_out] *= f_out
                if emb.bias is not None:
                    emb.bias[:n_out] *= f_out
            info["outliers"] = {"channels": n_out, "factor": f_out}
    info["weight_dtype"] = a.weight_dtype
    info["weights_gb"] = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9
    print(f"model ready in {time.time() - t0:.1f}s ({sum(p.numel() for p in model.parameters()) / 1e9:.2f} B params)")

    lat = a.res // 8
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(a.batch, cfg.in_channels, lat, lat, generator=g).to(dev, dtype)
    ctx_t = torch.randn(a.batch, a.txt, cfg.context_in_dim, generator=g).to(dev, dtype)
    y = torch.randn(a.batch, cfg.vec_in_dim, generator=g).to(dev, dtype)
    t = torch.full((a.batch,), 0.5, device=dev)
    gd = torch.full((a.batch,), 3.5, device=dev)

    # ---------------------------------------------------------------- forward functions
    def blocks_replace(bctx):
        dm = model
        rep = {}
        for i in range(len(dm.double_blocks)):
            def fd(args, extra, blk=dm.double_blocks[i]):
                img, txt = double_block(blk, args["img"], args["txt"], args["vec"], args["pe"], args.get("attn_mask"), bctx)
                return {"img": img, "txt": txt}
            rep[("double_block", i)] = fd
        for i in range(len(dm.single_blocks)):
            def fs(args, extra, blk=dm.single_blocks[i]):
                return {"img": single_block(blk, args["img"], args["vec"], args["pe"], args.get("attn_mask"), bctx)}
            rep[("single_block", i)] = fs
        return {"dit": rep}

    fp8_weights = {}  # fast-cached's fp8 weight cache, made once (one per process, like the node's per model)

    def forward_fn(variant):
        m = model
        if variant.endswith("+graph"):
            from flux_numba_pack.flux_core.graphs import GraphedForward, graph_blockers
            why = graph_blockers(model, dev)
            if why:
                raise RuntimeError("cannot capture: " + "; ".join(why))
            eager = forward_fn(variant[: -len("+graph")])
            gf = GraphedForward(lambda xin, tin: eager(xin, tin), module=model)

            def graphed(xin=None, tin=None):
                return gf(x if xin is None else xin, t if tin is None else tin)
            graphed.graphed = gf  # its replay count says whether the timed calls replayed a graph
            return graphed
        policy = {"stock": None, "pack-torch": {"*": "torch"}, "exact": {"*": "auto", "attention": "auto"},
                  "exact-sdpa": {"*": "auto", "attention": "torch"}, "attn8": {"*": "auto", "attention": "numba-8bit"},
                  "fast": {"*": "auto", "attention": "auto"}, "fast-cached": {"*": "auto", "attention": "auto"},
                  "fast-cached-attn8": {"*": "auto", "attention": "numba-8bit"},
                  "bf16-attn": {"*": "auto", "attention": "numba"}}[variant]
        fused = variant not in ("stock", "pack-torch")
        bctx = BlockContext(fused=fused, gemm_epilogue=fused,
                            quant8=bool(policy) and policy.get("attention") == "numba-8bit")
        if comfy_root:  # ComfyUI's modules (its ops classes, per-call casts of fp8 storage):
            from flux_numba_pack.nodes.host import ComfyWeights  # their weights the way the node gets them
            bctx.host = ComfyWeights()
        if variant in ("fast", "fast-cached", "fast-cached-attn8"):
            from flux_numba_pack.flux_core import fast as fast_mod
            why = fast_mod.support(dev)
            if why:
                raise RuntimeError("fast profile: " + why)
            bctx.fp8 = (fast_mod.Fp8Weights(keep=False) if variant == "fast"
                        else fp8_weights.setdefault("w", fast_mod.Fp8Weights(keep=True)))

        def fn(xin=None, tin=None):
            xin = x if xin is None else xin
            tin = t if tin is None else tin
            with torch.no_grad():
                if comfy_root and m is model:
                    topt = {} if policy is None else {"patches_replace": blocks_replace(bctx)}
                    if policy is None:
                        return m(xin, tin, ctx_t, y=y, guidance=gd, transformer_options=topt)
                    with registry.force(**policy):
                        return m(xin, tin, ctx_t, y=y, guidance=gd, transformer_options=topt)
                with registry.force(**(policy or {"*": "torch"})):
                    return m(xin, tin, ctx_t, y, gd, bctx if policy else BlockContext(fused=False), dtype=xin.dtype)
        return fn

    variants = [v for v in a.variants.split(",") if v]
    results = {}
    for v in variants:  # what cannot run here is skipped, with a note, before any time is spent
        why = None
        if v.split("+")[0] == "stock" and not comfy_root:
            why = "needs ComfyUI's Flux module (COMFYUI_PATH or .carry/ComfyUI; --no-comfy was given)" if a.no_comfy \
                else "needs ComfyUI's Flux module (set COMFYUI_PATH or put a tree in .carry/ComfyUI)"
        elif v.endswith("+graph"):
            from flux_numba_pack.flux_core.graphs import graph_blockers
            blockers = graph_blockers(model, dev)
            if blockers:
                why = "cannot capture a CUDA graph: " + "; ".join(blockers)
        if why:
            print(f"skipping variant {v}: {why}")
            results[v] = {"skipped": why}
    variants = [v for v in variants if v not in results]

    # ---------------------------------------------------------------- fp32 reference
    ref_out, ref_traj = None, None
    steps = flux_schedule(a.trajectory, lat * lat // 4) if a.trajectory else None
    if not a.no_ref:
        t0 = time.time()
        sd32 = {k: v.float() for k, v in model.state_dict().items()}
        ref = FluxModel.from_state_dict(sd32, device=dev, cfg=cfg)
        del sd32
        rf = lambda xin=None, tin=None: _ref_call(ref, x if xin is None else xin, t if tin is None else tin, ctx_t, y, gd, registry, BlockContext)
        from flux_numba_pack.cuda_kernels import qk_norm_rope
        host_rope, qk_norm_rope._stock_rope = qk_norm_rope._stock_rope, None  # the reference: plain fp32 torch
        with torch.no_grad():
            ref_out = rf(x.float()).float()
            if a.trajectory:
                ref_traj = euler_sample(lambda xx, tt: rf(xx, tt), x.float(), steps)
        qk_norm_rope.set_stock_rope(host_rope)
        del ref
        gc.collect()
        torch.cuda.empty_cache() if dev.type == "cuda" else None
        print(f"fp32 reference in {time.time() - t0:.1f}s")

    # ---------------------------------------------------------------- time each variant
    _wait_for_kernel_build(dev)
    registry.autotune = a.autotune
    finals = {"fp32-reference": ref_traj.float().cpu()} if ref_traj is not None else {}
    for v in variants:
        fn = forward_fn(v)
        try:
            if dev.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.time()
            out = fn()
            first = time.time() - t0
            del out
            registry.take_usage()
            if dev.type == "cuda":  # steady state: JIT, autotune trial copies and capture are behind us
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            gf = getattr(fn, "graphed", None)
            replays0 = gf.replays if gf is not None else 0
            with ClockLog(dev) as clk:
                times = step_times(fn, dev, warmup=a.warmup, reps=a.reps)
            replayed = None if gf is None else gf.replays - replays0
            import timing  # bench/timing.py (bench/ is on sys.path)
            host = timing.wall_ms(fn, a.reps, dev) if dev.type == "cuda" else None  # host-bound when above the event time
            out = fn()
            used = registry.take_usage()
            r = {"ms": med(times), "times": times, "first_call_s": first, "gpu_clocks": clk.summary(),
                 "host_ms": host,
                 "ms_back_to_back": timing.back_to_back_ms(fn, a.reps) if dev.type == "cuda" else None,
                 "peak_gb": torch.cuda.max_memory_allocated() / 1e9 if dev.type == "cuda" else None,
                 "backends": {op: sorted(b) for op, b in used.items()}}
            if gf is not None:  # a +graph row is a graph time only if its timed calls replayed the graph
                r["graph_replays"] = replayed
                if not replayed:
                    r["not_graphed"] = ("no CUDA graph replayed during the timed calls (they ran eagerly: "
                                        + (gf.deferred or ("kernels still building" if not registry.settled()
                                                           else "no capture")) + ")")
            if ref_out is not None:
                r["rel_err"] = rel_err(ref_out, out.float())
            if ref_traj is not None:
                traj = euler_sample(fn, x, steps)
                r["traj_psnr_db"] = psnr(ref_traj, traj.float())  # inf (JSON null) when identical:
                r["traj_identical"] = bool(torch.equal(ref_traj.float(), traj.float()))
                finals[v] = traj.float().cpu()
            results[v] = r
            label = v + (" [NOT GRAPHED: eager]" if r.get("not_graphed") else "")
            print(f"{label}: {r['ms']:.2f} ms  " + json.dumps({k: r[k] for k in r if k not in ('times',)}))
        except Exception as e:  # report and go on
            import traceback
            traceback.print_exc()
            results[v] = {"error": f"{type(e).__name__}: {e}"}
        del fn
        gc.collect()

    json_failed = []

    def write_json():
        """The results as they stand (after the timing, again at the end): nothing is lost to a
        later failure.  False (and one line on stderr) when the file cannot be written."""
        info["speed_measurement"] = dev.type == "cuda" and not runtime.SIMULATOR
        doc = _strict_json({"info": info, "results": results})
        try:
            os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
            with open(a.json + ".tmp", "w") as f:
                json.dump(doc, f, indent=1, allow_nan=False)
            os.replace(a.json + ".tmp", a.json)
        except OSError as e:
            if not json_failed:  # said once, not again at the second write
                print(f"bench.py: error: cannot write {a.json} ({e.strerror or e}); the results are only in this "
                      "output", file=sys.stderr)
            json_failed.append(e)
            return False
        return True

    write_json()

    for v in [v for v in a.profile.split(",") if v]:
        try:
            results.setdefault(v, {})["profile"] = profile_forward(forward_fn(v), v)
        except Exception as e:
            print(f"profile {v} failed: {type(e).__name__}: {e}")

    for v in [v for v in a.host_profile.split(",") if v]:
        try:
            results.setdefault(v, {})["host_profile"] = host_profile(forward_fn(v), v, dev)
        except Exception as e:
            print(f"host profile {v} failed: {type(e).__name__}: {e}")

    for v in [v for v in a.memory.split(",") if v]:
        try:
            results.setdefault(v, {})["memory_at_peak"] = memory_at_peak(forward_fn(v), v)
        except Exception as e:
            print(f"memory {v} failed: {type(e).__name__}: {e}")

    if a.vae:
        try:
            import gpu_vae  # bench/ops/gpu_vae.py (bench/ops is on sys.path)
            gpu_vae.run_decoder()
            results["vae-decode"] = gpu_vae.results.get("decoder 1024^2 bf16 nhwc", {})
        except Exception as e:
            results["vae-decode"] = {"error": f"{type(e).__name__}: {e}"}

    if a.save_latents and finals:
        os.makedirs(os.path.dirname(os.path.abspath(a.save_latents)), exist_ok=True)
        torch.save({"info": json.loads(json.dumps(info, default=str)), "latents": finals}, a.save_latents)
        print(f"final latents of {sorted(finals)} -> {a.save_latents}")

    written = write_json()
    # the "vs stock" column: against ComfyUI's forward, else the pack's torch path; none off a GPU
    base = ((results.get("stock") or {}).get("ms") or (results.get("pack-torch") or {}).get("ms")
            if info["speed_measurement"] else None)
    print(f"\nFLUX {a.config if not a.model else a.model} {a.res}x{a.res} txt {a.txt} batch {a.batch} on {info['device']}")
    print(f"{'variant':<12} {'ms/step':>9} {'vs stock':>9} {'b2b ms':>7} {'host ms':>7} {'peak GB':>8} {'rel err':>8} {'traj dB':>8} {'SM MHz':>7} {'W':>5} {'capped':>6}")
    for v, r in results.items():
        if v == "vae-decode":
            continue
        if "skipped" in r:
            print(f"{v:<12} skipped: {r['skipped'][:90]}")
            continue
        if "ms" not in r and "error" not in r:
            continue
        if "error" in r:
            print(f"{v:<12} ERROR {r['error'][:80]}")
            continue
        ratio = f"{base / r['ms']:.3f}x" if base else "-"
        pk = f"{r['peak_gb']:.1f}" if r.get("peak_gb") else "-"
        re_ = f"{100 * r['rel_err']:.2f}%" if "rel_err" in r else "-"
        tr = f"{r['traj_psnr_db']:.1f}" if "traj_psnr_db" in r else "-"
        ck = r.get("gpu_clocks") or {}
        cl = (f"{ck['sm_mhz_median']:>7.0f} {ck['power_w_median']:>5.0f} {ck['power_capped_share']:>6.0%}"
              if ck else f"{'-':>7} {'-':>5} {'-':>6}")
        b2b = f"{r['ms_back_to_back']:.2f}" if r.get("ms_back_to_back") else "-"
        hm = f"{r['host_ms']:.1f}" if r.get("host_ms") else "-"
        print(f"{v:<12} {r['ms']:>9.2f} {ratio:>9} {b2b:>7} {hm:>7} {pk:>8} {re_:>8} {tr:>8} {cl}")
        if r.get("not_graphed"):
            print(f"{'':<12} ^ {v} is NOT a graph time: {r['not_graphed']}")
    if not info["speed_measurement"]:
        print("(not on a CUDA GPU: no Numba kernel ran; a smoke test of the harness, not a speed measurement)")
    vd = results.get("vae-decode")
    if vd:
        if "stock_ms" in vd:
            print(f"VAE decode 1024^2: stock {vd['stock_ms']} ms, patched (nhwc) {vd['ms']} ms ({vd['speedup']}x; "
                  f"nchw {vd['nchw_ms']} ms), PSNR vs stock {vd['psnr_vs_stock']} dB, vs fp32 {vd['psnr_vs_fp32']} "
                  f"(stock {vd['psnr_stock_vs_fp32']})")
        else:
            print(f"VAE decode: {vd}")
    if written:
        print(f"results: {a.json}")
    else:
        sys.exit(1)


def _strict_json(x):
    """``x`` with every non-finite float replaced by None (for json.dump(allow_nan=False))."""
    import math
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _strict_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_strict_json(v) for v in x]
    return x




def _ref_call(ref, x, t, ctx, y, g, registry, BlockContext):
    import torch
    with registry.force("torch"):
        return ref(x.float(), t, ctx.float(), y.float(), g, BlockContext(fused=False), dtype=torch.float32)



if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("\nbench.py: interrupted (results written so far, if any, are in --json)", file=sys.stderr)
        sys.exit(130)
