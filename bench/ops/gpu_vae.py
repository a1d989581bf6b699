"""GPU check + timing of groupnorm_silu and of ComfyUI's FLUX VAE decoder, stock vs patched.

    FLUX_NUMBA_REAL_GPU=1 COMFYUI_PATH=.carry/ComfyUI python bench/ops/gpu_vae.py [--decoder-only]

1. groupnorm_silu at the decoder's shapes (bf16, plus fp32 / silu off / large-mean cases):
   error vs an fp32 reference (relative Frobenius + max abs, next to stock bf16's own error),
   NaN check with NaN-poisoned output/partials; timing of ours vs stock ``F.group_norm`` +
   ``F.silu``: DEVICE time = 10 back-to-back calls queued behind ``torch.cuda._sleep`` (long
   enough to cover their host launch time) between CUDA events / 10, median of 3; HOST us/call
   = wall time of issuing those calls; plus the run-5 metric (events around ONE call, median
   of 25: host latency + device); GB/s for 3*numel*itemsize bytes (read x twice, write y)
   from device time, against a same-size device copy timed the same way and the 3.7 TB/s
   ceiling; per-kernel device split (stats / normalize) on 128x1024^2; Python cost per call.
2. If ComfyUI imports (COMFYUI_PATH, default .carry/ComfyUI): its FLUX VAE Decoder (ch 128,
   ch_mult [1,2,4,4], 2 res blocks, z 16, random weights, bf16), decode of a [1,16,128,128]
   latent (1024^2 image) stock vs patched (median of 5 after 2 warm-ups), PSNR patched vs
   stock and both vs an fp32 decoder with the same weights; GroupNorm-kernel time from the
   profiler for both.
3. The node itself on a real ``comfy.sd.VAE`` (FLUX keys, random weights): ComfyUI's decode
   stock vs patched (backend auto: the registry's autotune may keep torch on shapes where it
   measured faster; every call of >= 32M elements must run numba; PSNR > 40 dB), and the stock
   VAE restored afterwards.
4. The NHWC decoder's kernels (layout "nhwc"): groupnorm_silu_nhwc at the decoder's shapes vs torch's
   GroupNorm+SiLU on the same channels_last tensor and vs our NCHW kernel on the NCHW copy; the
   nearest-2x upsample ours vs torch NHWC / NCHW (device time as in 1); the decoder in both layouts
   (2.) with a kernel breakdown of each (cuDNN convs, cuDNN layout conversions, ours, attention,
   copies, other).
Never stops at the first failure; table last; JSON to $OUT/gpu_vae.json if OUT is set.
"""
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # gpu_vae's parts, next to it
from _vae_common import T0, rows, results, note, torch  # noqa: E402,F401  (results: bench.py --vae reads it)
from _vae_kernels import CASES, run_case, split_and_overhead, run_nhwc_kernels  # noqa: E402
from _vae_decoder import comfy_decoder, init_, run_decoder, run_node_path  # noqa: E402,F401  (decode_ssim.py)


def section(name, row, fn):
    """Run one part of the bench: a failure is noted (and a table row) and the rest still runs."""
    try:
        fn()
    except Exception as e:
        traceback.print_exc()
        note(name, ok=False, error=f"{type(e).__name__}: {e}")
        rows.append((row, "ERROR", str(e)[:40], "", "", "", "", "", "", ""))
    torch.cuda.empty_cache()


def main():
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    keep = None
    only_dec = "--decoder-only" in sys.argv    # skip 1. and 4.'s kernel tables (e.g. a second ComfyUI tree)
    for c in ([] if only_dec else CASES):
        try:
            r = run_case(*c)
            if c[0] == "128x1024^2":
                keep = r
            del r
        except Exception as e:
            traceback.print_exc()
            note(c[0], ok=False, error=f"{type(e).__name__}: {e}")
            rows.append((c[0], "ERROR", str(e)[:40], "", "", "", "", "", "", ""))
        torch.cuda.empty_cache()
    try:
        if keep is not None:
            split_and_overhead(*keep)
    except Exception as e:
        traceback.print_exc()
        note("split", error=f"{type(e).__name__}: {e}")
    keep = None
    torch.cuda.empty_cache()
    if not only_dec:
        section("nhwc kernels", "nhwc kernels", run_nhwc_kernels)
    section("decoder", "decoder", run_decoder)
    if time.time() - T0 < 240:
        section("node path", "node VAE.decode", run_node_path)
    else:
        note("node path", skipped="time budget")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_vae.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)
    hdr = ("case", "check", "err ours/stock", "stock dev ms", "ours dev ms", "speedup", "GB/s", "% copy",
           "host us ours/stock", "ours 1-call ms")
    w = [max(len(str(r[i])) for r in rows + [hdr]) for i in range(len(hdr))]
    print(f"\n=== groupnorm_silu / FLUX VAE decoder (H200; bytes = 3*numel*itemsize; ceiling 3.7 TB/s), "
          f"{time.time() - T0:.0f}s ===")
    print("dev ms: 10 calls queued behind a GPU sleep / 10 (device only); host us: Python+launch per call "
          "(! = host outran the sleep); 1-call ms: events around one call (host+device, run-5 metric); "
          "% copy: vs a same-size device copy timed the same way")
    for r in [hdr] + rows:
        print("  ".join(str(v).ljust(w[i]) for i, v in enumerate(r)))


if __name__ == "__main__":
    main()
