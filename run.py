#!/usr/bin/env python3
"""Main job: sample FLUX stock and patched, per-step timing, agreement, saved latents.

    python run.py                      # embedded tiny FLUX (generated from a seed), 4 steps
    python run.py --model flux1-dev.safetensors --width 1024 --height 1024 --steps 28

Without a CUDA GPU it says so and runs what it can: the stock path and the pack's path with
torch backends (the Numba kernels need a GPU; ``--simulator`` runs them in Numba's CUDA
simulator instead -- very slow, tiny models only).  Timings are a speed measurement only when
Numba kernels ran on a GPU; run.json says which (``speed_measurement``).  Text encoders and the
VAE are out of scope: the prompt embedding is random from ``--seed`` (the same for both paths),
as the timing does not depend on it, and the saved picture is of the latent, not decoded.

Output (``--out``): latents.safetensors (stock and patched latents), latent_preview.png (the
patched latent's first three channels as RGB, x8: a picture of the latent, not a decoded image),
and run.json (strict JSON: no NaN/Infinity; identical outputs give ``psnr_db: null, identical: true``).
A bad option or file ends the job with one line naming it and a non-zero exit code.
"""
import argparse
import json
import math
import os
import sys

ROOT = os.path.dirname(os.path.abspath(__file__))
ATTENTIONS = ["auto", "torch", "numba", "numba-8bit"]  # registry backends of the attention op
PREVIEW = "latent_preview.png"


class Parser(argparse.ArgumentParser):
    """argparse, but an error is one line (no usage block) and exits 2."""

    def error(self, message):  # argparse's own errors (a bad option value, an unknown option)
        self.fail(f"{message} (--help lists the options)")

    def fail(self, message):
        """One line on stderr, exit status 2: a bad option or file found after parsing."""
        self.exit(2, f"{self.prog}: error: {message}\n")


def positive_int(s):
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {s!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {v}")
    return v


def multiple_of_16(s):
    try:
        v = int(s)
    except ValueError:
        v = None
    if v is None or v <= 0 or v % 16:
        raise argparse.ArgumentTypeError(f"must be a positive multiple of 16 (pixels), got {s!r}")
    return v


def finite_float(s):
    try:
        v = float(s)
    except ValueError:
        v = math.nan
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {s!r}")
    return v


def seed_int(s):
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {s!r}") from None
    if not -2 ** 63 <= v < 2 ** 64:  # what torch.Generator.manual_seed takes
        raise argparse.ArgumentTypeError(f"must be in [-2**63, 2**64), got {v}")
    return v


def device_name(s):
    if s in ("auto", "cpu", "cuda") or (s.startswith("cuda:") and s[5:].isdigit()):
        return s
    raise argparse.ArgumentTypeError(f"invalid choice: {s!r} (choose from 'auto', 'cuda', 'cuda:N', 'cpu')")


def parser():
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", metavar="PATH",
                   help="FLUX.1 diffusion-model .safetensors (default: embedded tiny model)")
    p.add_argument("--steps", type=positive_int, default=4, help="sampling steps, >= 1 (default 4)")
    p.add_argument("--width", type=multiple_of_16, default=256, help="image width in pixels, a multiple of 16 (default 256)")
    p.add_argument("--height", type=multiple_of_16, default=256, help="image height in pixels, a multiple of 16 (default 256)")
    p.add_argument("--batch", type=positive_int, default=1, help="images per batch, >= 1 (default 1)")
    p.add_argument("--txt-len", type=positive_int, default=256,
                   help="text tokens, >= 1 (default 256: ComfyUI pads T5 to >= 256)")
    p.add_argument("--guidance", type=finite_float, default=3.5, help="FLUX guidance value (default 3.5)")
    p.add_argument("--seed", type=seed_int, default=0, help="seed of the noise and the random prompt embedding (default 0)")
    p.add_argument("--device", type=device_name, default="auto",
                   help="auto (CUDA when torch sees a GPU, else CPU) | cuda | cuda:N | cpu")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32"],
                   help="compute dtype (auto: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--attention", default="auto", choices=ATTENTIONS,
                   help="attention backend of the patched path: auto (the registry picks) | torch | "
                        "numba (bf16 flash attention) | numba-8bit; a Numba one falls back to torch where it "
                        "cannot run, with a log line")
    p.add_argument("--simulator", action="store_true", help="run Numba kernels in the CUDA simulator (CPU)")
    p.add_argument("--progress-every", type=finite_float, default=10.0, metavar="SECONDS",
                   help="a progress line at most this often on long runs (default 10)")
    p.add_argument("--out", metavar="DIR", default=os.path.join(ROOT, "out"),
                   help="folder for latents.safetensors, latent_preview.png and run.json (default: out/ next to run.py)")
    p.add_argument("--write-model", metavar="PATH",
                   help="write the embedded tiny model as a ComfyUI-layout .safetensors and exit")
    p.add_argument("--comfy-min", action="store_true",
                   help="with --write-model: the smallest checkpoint ComfyUI detects as FLUX "
                        "(hidden 3072, 1 double + 1 single block, ~531 M params, ~1.06 GB bf16)")
    return p


def check_out(p, out):
    """Fail at once (before any work) when the output folder cannot be made or written; nothing
    is left here (a probe file is made and removed at once): the folder is made when the results
    are written, so a failed run leaves none."""
    if not out:
        p.fail("argument --out: empty path")
    if os.path.exists(out) and not os.path.isdir(out):
        p.fail(f"argument --out: {out} exists and is not a folder")
    from _pack import create_problem, nearest_existing
    base = nearest_existing(out)
    if not os.path.isdir(base):
        p.fail(f"argument --out: cannot create folder {out} ({base} is not a folder)")
    why = create_problem(base)
    if why:
        p.fail(f"argument --out: {'cannot write into folder' if base == os.path.abspath(out) else 'cannot create folder'} "
               f"{out} ({why})")


def check_write_model(p, path):
    """--write-model PATH must name a file that can be written."""
    from _pack import file_out_problem
    why = file_out_problem(path, "tiny.safetensors")
    if why:
        p.fail(f"argument --write-model: {why}")


def strict_json(x):
    """``x`` with every non-finite float replaced by None (json.dump(allow_nan=False) then holds)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: strict_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [strict_json(v) for v in x]
    return x


def main():
    p = parser()
    a = p.parse_args()
    if a.comfy_min and a.write_model is None:
        p.fail("argument --comfy-min: only used with --write-model PATH")
    if a.write_model is not None:
        check_write_model(p, a.write_model)
    elif a.model is not None:
        if not a.model:
            p.fail("argument --model: empty path (leave --model out for the embedded tiny model)")
        if not os.path.isfile(a.model):
            p.fail(f"argument --model: {'is a folder, not a file' if os.path.isdir(a.model) else 'no such file'}: {a.model}")
    if a.write_model is None:
        check_out(p, a.out)
    if a.simulator:
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    sys.path.insert(0, ROOT)
    try:
        import _pack
        _pack.load()
        import torch
        from flux_numba_pack.cuda_kernels import registry, runtime
        from flux_numba_pack.flux_core import (BlockContext, CheckpointError, FluxModel, NotFluxError, euler_sample,
                                               flux_schedule, inspect_checkpoint, load_state_dict, tiny_state_dict)
        from flux_numba_pack.flux_core.harness import StepTimer, pick_device, pick_dtype, psnr, med
    except ModuleNotFoundError as e:
        p.fail(f"{e.name or e} is not installed ({e}): run `python3 install.py --standalone` first "
               "(README: The two commands)")

    if a.write_model is not None:
        from flux_numba_pack.flux_core import comfy_min_state_dict, save_state_dict
        sd = comfy_min_state_dict(seed=0) if a.comfy_min else tiny_state_dict(seed=0, dtype=torch.bfloat16)
        try:
            save_state_dict(sd, a.write_model, prefix="model.diffusion_model.")
        except OSError as e:
            p.fail(f"argument --write-model: cannot write {a.write_model} ({e.strerror or e})")
        except Exception as e:  # safetensors' SafetensorError (not an OSError)
            p.fail(f"argument --write-model: cannot write {a.write_model} ({str(e).splitlines()[0] if str(e) else type(e).__name__})")
        print(f"wrote {a.write_model}: {sum(v.numel() for v in sd.values()) / 1e6:.1f} M params, bf16")
        return
    if a.device.startswith("cuda") and not a.simulator:
        if not torch.cuda.is_available():
            p.fail(f"argument --device: {a.device} asked for, but torch sees no CUDA GPU")
        if ":" in a.device and int(a.device[5:]) >= torch.cuda.device_count():
            p.fail(f"argument --device: {a.device}, but torch sees {torch.cuda.device_count()} CUDA GPU(s)")
    if a.model:  # every check of the file before anything is printed or sampled
        try:
            cfg = inspect_checkpoint(a.model)
            sd = load_state_dict(a.model)
        except NotFluxError as e:  # a readable checkpoint of another model: say which file
            p.fail(f"argument --model: {a.model}: {e}")
        except CheckpointError as e:  # unreadable: the message names the file
            p.fail(f"argument --model: {e}")
        except OSError as e:
            p.fail(f"argument --model: cannot read {a.model} ({e.strerror or e})")
    else:
        sd = tiny_state_dict(seed=0)
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
        print(f"model {a.model}: hidden {cfg.hidden_size}, {cfg.depth}+{cfg.depth_single_blocks} blocks, "
              f"{cfg.n_params() / 1e9:.2f} B params")
    else:
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

    import time
    progress = {"label": None, "step": 0}

    def sample(label, fused, policy):
        times, backends = [], []
        t0 = last = time.monotonic()
        progress.update(label=label, step=0)

        def fn(x, t):
            nonlocal last
            with StepTimer(dev) as tm, torch.no_grad(), registry.force(**policy):
                v = model(x, t, context, y, guidance,
                          BlockContext(fused=fused, quant8=policy.get("attention") == "numba-8bit"), dtype=dtype)
            times.append(tm.ms)
            backends.append(registry.take_usage())
            progress["step"] = len(times)
            now = time.monotonic()
            if now - last >= a.progress_every and len(times) < a.steps:  # a line every --progress-every s
                last = now
                left = (now - t0) / len(times) * (a.steps - len(times))
                print(f"{label} path: step {len(times)}/{a.steps}, {now - t0:.0f} s, ~{_duration(left)} left"
                      + (" (then the patched path)" if label == "stock" else ""), flush=True)
            return v
        registry.take_usage()
        out = euler_sample(fn, noise, ts)
        return out, times, backends

    pol = {"*": "auto"}
    if a.attention != "auto":
        pol["attention"] = a.attention
    try:
        stock, t_stock, _ = sample("stock", False, {"*": "torch"})
        patched, t_ours, used = sample("patched", True, pol)
    except KeyboardInterrupt:
        print(f"\nrun.py: interrupted at {progress['label']} step {progress['step']}/{a.steps}; nothing written",
              file=sys.stderr)
        sys.exit(130)

    ran = {}
    for u in used:
        for op, bk in u.items():
            for b in bk:
                ran.setdefault(op, set()).add(b)
    numba_ran = any(b != "torch" for bs in ran.values() for b in bs)
    if not numba_ran:
        speed_note = ("no Numba kernel ran: both paths ran on torch" + (" on the CPU" if dev.type == "cpu" else "")
                      + "; the times show the job works, not how fast the pack is")
    elif runtime.SIMULATOR or dev.type != "cuda":
        speed_note = "the Numba kernels ran in the CUDA simulator on the CPU; its times say nothing about speed"
    else:
        speed_note = None
    speed = speed_note is None
    s32, p32 = stock.float(), patched.float()
    finite = bool(torch.isfinite(s32).all() and torch.isfinite(p32).all())
    identical = finite and torch.equal(s32, p32)
    p_db = None if identical or not finite else psnr(s32, p32)
    mad = (s32 - p32).abs().max().item() if finite else None
    rec = {"device": str(dev), "dtype": str(dtype), "model": a.model or "embedded-tiny", "steps": a.steps,
           "size": [a.width, a.height], "batch": a.batch, "stock_ms": t_stock, "patched_ms": t_ours,
           "speed_measurement": speed, "speed_note": speed_note,
           "psnr_db": p_db, "identical": identical, "finite": finite, "max_abs_diff": mad,
           "backends": {k: sorted(v) for k, v in ran.items()},
           "latent_preview": {"file": PREVIEW, "what": "patched latent, channels 0-2 as RGB (each stretched to "
                                                      "0..255), nearest x8: a picture of the latent, not a "
                                                      "decoded image"}}
    # the results go to disk before anything else can fail (the table, the preview)
    from flux_numba_pack.flux_core.checkpoint import save_safetensors
    try:
        os.makedirs(a.out, exist_ok=True)
        save_safetensors({"stock": s32.cpu().contiguous(), "patched": p32.cpu().contiguous()},
                         os.path.join(a.out, "latents.safetensors"))
        with open(os.path.join(a.out, "run.json"), "w") as f:
            json.dump(strict_json(rec), f, indent=1, allow_nan=False)
    except Exception as e:  # the folder went away or the disk is full: say so in one line
        p.fail(f"argument --out: cannot write the results to {a.out} ({getattr(e, 'strerror', None) or e})")

    if not speed:
        print(f"\nNOT a speed measurement: {speed_note}.")
    print(f"\n{'step':>4} {'t':>6} {'stock ms':>10} {'patched ms':>11}")
    for i, (t0, t1) in enumerate(zip(t_stock, t_ours)):
        if len(t_stock) > 40 and 10 <= i < len(t_stock) - 10:  # a long run: its first and last ten steps
            if i == 10:
                print(f"{'...':>4} ({len(t_stock) - 20} steps not shown; run.json has every one)")
            continue
        print(f"{i:>4} {ts[i]:>6.3f} {t0:>10.2f} {t1:>11.2f}")
    ms_s, ms_o = med(t_stock[1:] or t_stock), med(t_ours[1:] or t_ours)
    which = "(first step excluded: warm-up / JIT)" if len(t_stock) > 1 else "(one step: it includes warm-up / JIT)"
    print(f"{'med':>4} {'':>6} {ms_s:>10.2f} {ms_o:>11.2f}   {which}"
          + ("" if speed else "   [not a speed measurement]"))
    print("backends (patched): " + ", ".join(f"{op}={'/'.join(sorted(b))}" for op, b in sorted(ran.items())))
    if not finite:
        print("agreement stock vs patched: not measurable, an output has NaN/Inf values")
    elif identical:
        print("agreement stock vs patched: identical outputs (max abs diff 0; PSNR infinite, written as "
              "psnr_db null, identical true)")
    else:
        print(f"agreement stock vs patched: PSNR {p_db:.1f} dB, max abs diff {mad:.3g}")
    try:
        preview(p32[0].cpu(), os.path.join(a.out, PREVIEW))
    except Exception as e:
        print(f"run.py: error: could not write {os.path.join(a.out, PREVIEW)} ({e}); latents.safetensors and "
              "run.json are written", file=sys.stderr)
        sys.exit(1)
    print(f"saved {a.out}/: latents.safetensors (stock and patched latents), run.json, and {PREVIEW}: "
          f"a picture of the latent (its first 3 of {cfg.in_channels} channels as RGB, x8), not a decoded image "
          f"(no VAE in this job)")


def _duration(s):
    return f"{s:.0f} s" if s < 120 else (f"{s / 60:.0f} min" if s < 7200 else f"{s / 3600:.1f} h")


def preview(lat, path):
    """Latent picture: first three channels, each stretched to 0..255, nearest-upscaled x8."""
    import numpy as np
    from PIL import Image
    x = lat[:3]
    lo, hi = x.amin(dim=(1, 2), keepdim=True), x.amax(dim=(1, 2), keepdim=True)
    img = ((x - lo) / (hi - lo + 1e-8) * 255).clamp(0, 255).byte().permute(1, 2, 0).numpy()
    Image.fromarray(np.ascontiguousarray(img)).resize((img.shape[1] * 8, img.shape[0] * 8), Image.NEAREST).save(path)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # outside the sampling loop (imports, JIT, model load): nothing was written
        print("\nrun.py: interrupted; nothing written", file=sys.stderr)
        sys.exit(130)
