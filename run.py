#!/usr/bin/env python3
"""Main job: sample FLUX stock and patched, per-step timing, agreement, saved result.

    python run.py                      # embedded tiny FLUX (generated from a seed), 4 steps
    python run.py --model flux1-dev.safetensors --width 1024 --height 1024 --steps 28

Without a CUDA GPU it says so and runs what it can: the stock path and the pack's path with
torch backends (the Numba kernels need a GPU; ``--simulator`` runs them in Numba's CUDA
simulator instead -- very slow, tiny models only).  Text encoders are out of scope: the prompt
embedding is random from ``--seed`` (the same for both paths), as the timing does not depend on it.
"""
import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.abspath(__file__))


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="FLUX.1 diffusion-model .safetensors (default: embedded tiny model)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--height", type=int, default=256)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--txt-len", type=int, default=256, help="text tokens (ComfyUI pads T5 to >= 256)")
    p.add_argument("--guidance", type=float, default=3.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="auto | cuda | cpu")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32"])
    p.add_argument("--attention", default="auto", help="auto | torch | numba | numba-8bit")
    p.add_argument("--simulator", action="store_true", help="run Numba kernels in the CUDA simulator (CPU)")
    p.add_argument("--out", default=os.path.join(ROOT, "out"), help="folder for the result")
    p.add_argument("--write-model", metavar="PATH",
                   help="write the embedded tiny model as a ComfyUI-layout .safetensors and exit")
    p.add_argument("--comfy-min", action="store_true",
                   help="with --write-model: the smallest checkpoint ComfyUI detects as FLUX "
                        "(hidden 3072, 1 double + 1 single block, ~531 M params, ~1.06 GB bf16)")
    return p.parse_args()


def main():
    a = parse()
    if a.simulator:
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    if a.width % 16 or a.height % 16 or a.width <= 0 or a.height <= 0:
        raise SystemExit(f"--width/--height must be positive multiples of 16, got {a.width}x{a.height}")
    sys.path.insert(0, ROOT)
    import _pack
    _pack.load()
    import torch
    from flux_numba_pack.cuda_kernels import registry, runtime
    from flux_numba_pack.flux_core import (BlockContext, FluxModel, euler_sample, flux_schedule,
                                           inspect_checkpoint, load_state_dict, tiny_state_dict)
    from flux_numba_pack.flux_core.harness import StepTimer, pick_device, pick_dtype, psnr, med

    if a.write_model:
        from flux_numba_pack.flux_core import comfy_min_state_dict, save_state_dict
        sd = comfy_min_state_dict(seed=0) if a.comfy_min else tiny_state_dict(seed=0, dtype=torch.bfloat16)
        save_state_dict(sd, a.write_model, prefix="model.diffusion_model.")
        print(f"wrote {a.write_model}: {sum(v.numel() for v in sd.values()) / 1e6:.1f} M params, bf16")
        return
    dev = pick_device(a.device)
    dtype = pick_dtype(a.dtype, dev)
    if a.simulator:
        dev = torch.device("cpu")
        if a.dtype == "auto":
            dtype = torch.bfloat16  # the kernels' dtype
    why = runtime.numba_status() or (None if (dev.type == "cuda" or runtime.SIMULATOR) else "no CUDA GPU")
    print(f"device {dev} ({torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'CPU'}), dtype {dtype}")
    if why:
        print(f"Numba kernels unavailable: {why}. The patched path runs the pack's fused op order with torch backends.")
    elif runtime.SIMULATOR:
        print("Numba kernels run in the CUDA simulator (slow; correctness only, timings meaningless).")

    if a.model:
        cfg = inspect_checkpoint(a.model)
        print(f"model {a.model}: hidden {cfg.hidden_size}, {cfg.depth}+{cfg.depth_single_blocks} blocks, "
              f"{cfg.n_params() / 1e9:.2f} B params")
        sd = load_state_dict(a.model)
    else:
        sd = tiny_state_dict(seed=0)
        print("model: embedded tiny FLUX (hidden 128, 2+2 blocks, generated from seed 0)")
    model = FluxModel.from_state_dict(sd, device=dev, dtype=None if next(iter(sd.values())).dtype in
                                      (torch.float8_e4m3fn, torch.float8_e5m2) else dtype)
    del sd
    cfg = model.cfg
    g = torch.Generator(device="cpu").manual_seed(a.seed)
    lat_h, lat_w = a.height // 8, a.width // 8
    noise = torch.randn(a.batch, cfg.in_channels, lat_h, lat_w, generator=g).to(dev)
    context = torch.randn(a.batch, a.txt_len, cfg.context_in_dim, generator=g).to(dev, dtype)
    y = torch.randn(a.batch, cfg.vec_in_dim, generator=g).to(dev, dtype)
    guidance = torch.full((a.batch,), a.guidance, device=dev)
    ts = flux_schedule(a.steps, (lat_h // 2) * (lat_w // 2))

    def sample(label, fused, policy):
        times, backends = [], []

        def fn(x, t):
            with StepTimer(dev) as tm, torch.no_grad(), registry.force(**policy):
                v = model(x, t, context, y, guidance,
                          BlockContext(fused=fused, quant8=policy.get("attention") == "numba-8bit"), dtype=dtype)
            times.append(tm.ms)
            backends.append(registry.take_usage())
            return v
        registry.take_usage()
        out = euler_sample(fn, noise, ts)
        return out, times, backends

    stock, t_stock, _ = sample("stock", False, {"*": "torch"})
    pol = {"*": "auto"}
    if a.attention != "auto":
        pol["attention"] = a.attention
    patched, t_ours, used = sample("patched", True, pol)

    print(f"\n{'step':>4} {'t':>6} {'stock ms':>10} {'patched ms':>11}")
    for i, (t0, t1) in enumerate(zip(t_stock, t_ours)):
        print(f"{i:>4} {ts[i]:>6.3f} {t0:>10.2f} {t1:>11.2f}")
    ms_s, ms_o = med(t_stock[1:] or t_stock), med(t_ours[1:] or t_ours)
    print(f"{'med':>4} {'':>6} {ms_s:>10.2f} {ms_o:>11.2f}   (first step excluded: warm-up / JIT)")
    ran = {}
    for u in used:
        for op, bk in u.items():
            for b in bk:
                ran.setdefault(op, set()).add(b)
    print("backends (patched): " + ", ".join(f"{op}={'/'.join(sorted(b))}" for op, b in sorted(ran.items())))
    p = psnr(stock.float(), patched.float())
    mad = (stock.float() - patched.float()).abs().max().item()
    print(f"agreement stock vs patched: PSNR {p:.1f} dB, max abs diff {mad:.3g}")

    os.makedirs(a.out, exist_ok=True)
    from safetensors.torch import save_file
    save_file({"stock": stock.float().cpu().contiguous(), "patched": patched.float().cpu().contiguous()},
              os.path.join(a.out, "latents.safetensors"))
    preview(patched[0].float().cpu(), os.path.join(a.out, "patched_preview.png"))
    rec = {"device": str(dev), "dtype": str(dtype), "model": a.model or "embedded-tiny", "steps": a.steps,
           "size": [a.width, a.height], "stock_ms": t_stock, "patched_ms": t_ours, "psnr_db": p,
           "max_abs_diff": mad, "backends": {k: sorted(v) for k, v in ran.items()}}
    with open(os.path.join(a.out, "run.json"), "w") as f:
        json.dump(rec, f, indent=1)
    print(f"saved {a.out}/latents.safetensors, patched_preview.png, run.json")


def preview(lat, path):
    """Latent preview: first three channels, each stretched to 0..255, nearest-upscaled x8."""
    import numpy as np
    from PIL import Image
    x = lat[:3]
    lo, hi = x.amin(dim=(1, 2), keepdim=True), x.amax(dim=(1, 2), keepdim=True)
    img = ((x - lo) / (hi - lo + 1e-8) * 255).clamp(0, 255).byte().permute(1, 2, 0).numpy()
    Image.fromarray(np.ascontiguousarray(img)).resize((img.shape[1] * 8, img.shape[0] * 8), Image.NEAREST).save(path)


if __name__ == "__main__":
    main()
