#!/usr/bin/env python3
"""Decode the final latents that ``bench.py --trajectory N --save-latents F`` saved and compare the
images: SSIM / PSNR (scikit-image, as FluxNumbaQualityCompare computes them) of every variant
against a reference variant (default ``exact``) and against the fp32 reference trajectory.

The decoder is ComfyUI's FLUX VAE Decoder in fp32 (COMFYUI_PATH or .carry/ComfyUI), with the
weights of ``--vae`` (a FLUX ae.safetensors) or, without one, random weights seeded as
bench/ops/gpu_vae.py draws them; latents go through FLUX's latent format (x / 0.3611 + 0.1159) as
ComfyUI's VAE.decode does.  Runs on the CPU by default (no GPU time; ~1 min per 1024² image).

    python bench/e2e/decode_ssim.py out/latents.pt [--ref exact] [--vae ae.safetensors] [--json out/ssim.json]
"""
import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
SCALE, SHIFT = 0.3611, 0.1159  # comfy.latent_formats.Flux


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("latents")
    p.add_argument("--ref", default="exact")
    p.add_argument("--vae", default=None, help="FLUX VAE .safetensors (default: random weights)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    sys.path.insert(0, ROOT)
    import _pack
    _pack.load()
    import torch
    sys.path[:0] = [os.path.join(ROOT, "bench", "ops"), os.path.join(ROOT, "bench")]  # gpu_vae, timing
    import gpu_vae
    from flux_numba_pack.nodes.quality import compare

    if a.device == "cpu":  # as `main.py --cpu`, before ComfyUI's model management looks for a GPU
        tree = os.environ.get("COMFYUI_PATH", os.path.join(ROOT, ".carry", "ComfyUI"))
        sys.path.insert(0, os.path.abspath(tree))
        try:
            import comfy.cli_args
            comfy.cli_args.args.cpu = True
        except Exception:
            pass
    M, why = gpu_vae.comfy_decoder()
    if M is None:
        raise SystemExit(why)
    doc = torch.load(a.latents, map_location="cpu")
    lat = doc["latents"]
    if a.ref not in lat:
        raise SystemExit(f"reference variant {a.ref!r} not in {sorted(lat)}")
    cfg = dict(ch=128, out_ch=3, ch_mult=[1, 2, 4, 4], num_res_blocks=2, attn_resolutions=[], in_channels=3,
               resolution=256, z_channels=16)
    dev = torch.device(a.device)
    with torch.device(dev):
        dec = M.Decoder(**cfg)
    if a.vae:
        from safetensors.torch import load_file
        sd = {k[len("decoder."):]: v.float() for k, v in load_file(a.vae).items() if k.startswith("decoder.")}
        dec.load_state_dict(sd)
        weights = a.vae
    else:
        gpu_vae.init_(dec, device=dev)
        weights = "random (bench/ops/gpu_vae.py init_, seed 0)"
    dec = dec.eval().float()

    images = {}
    for name, z in lat.items():
        t0 = time.time()
        with torch.no_grad():
            img = dec(z.to(dev).float() / SCALE + SHIFT)
        images[name] = ((img.clamp(-1, 1) + 1) / 2).permute(0, 2, 3, 1).cpu()  # ComfyUI IMAGE [B,H,W,C]
        print(f"decoded {name} {tuple(z.shape)} -> {tuple(images[name].shape)} in {time.time() - t0:.1f}s", flush=True)

    rows = {}
    for name, img in images.items():
        r = {}
        for ref in (a.ref, "fp32-reference"):
            if ref in images and ref != name:
                ps, ss, _ = compare(images[ref], img)
                r[f"vs_{ref}"] = {"psnr_db": ps, "ssim": ss}
        rows[name] = r
    out = {"latents": a.latents, "vae": weights, "bench_info": doc.get("info"), "results": rows}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    print(f"\ndecoded images, VAE {weights}")
    print(f"{'variant':<16} {'SSIM vs ' + a.ref:>16} {'PSNR dB':>8} {'SSIM vs fp32':>13} {'PSNR dB':>8}")
    for name, r in rows.items():
        x, f = r.get(f"vs_{a.ref}"), r.get("vs_fp32-reference")
        c1 = f"{x['ssim']:>16.4f} {x['psnr_db']:>8.2f}" if x else f"{'-':>16} {'-':>8}"
        c2 = f"{f['ssim']:>13.4f} {f['psnr_db']:>8.2f}" if f else f"{'-':>13} {'-':>8}"
        print(f"{name:<16} {c1} {c2}")


if __name__ == "__main__":
    main()
