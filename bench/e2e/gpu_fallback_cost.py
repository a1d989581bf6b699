#!/usr/bin/env python3
"""What a patched model costs when the pack's path has turned itself off (GPU, one process).

Loads FLUX.1-dev through ComfyUI's own loader (random full-size weights, e.g. the file
bench/e2e/gpu_server.py writes), then times one diffusion-model forward at 1024^2 (CUDA events,
warm-up, median): stock; FluxNumbaPatch (exact) working; and FluxNumbaPatch after a failure in the
pack's block code turned it off for that input (the block functions are replaced by one that
raises, as a kernel error would).  Bar (issue: host compatibility): off <= 1.02x stock.

    python bench/e2e/gpu_fallback_cost.py --comfy /tmp/trees/ComfyUI-0.8.0 --weights /dev/shm/flux1_dev_random.safetensors
"""
import argparse
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--comfy", required=True, help="ComfyUI tree")
    p.add_argument("--weights", default="/dev/shm/flux1_dev_random.safetensors")
    p.add_argument("--res", type=int, default=1024)
    p.add_argument("--reps", type=int, default=10)
    a = p.parse_args()
    if not os.path.isfile(os.path.join(a.comfy, "main.py")) or not os.path.isdir(os.path.join(a.comfy, "comfy")):
        p.exit(2, f"gpu_fallback_cost.py: error: argument --comfy: no ComfyUI tree at {a.comfy!r} (no main.py / comfy/)\n")
    try:
        import torch
        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    if not cuda:
        p.exit(2, "gpu_fallback_cost.py: error: no CUDA GPU (torch sees none): it times forwards on the GPU\n")
    if not os.path.isfile(a.weights):
        p.exit(2, f"gpu_fallback_cost.py: error: argument --weights: no file {a.weights!r} "
                  "(bench/e2e/gpu_server.py writes random FLUX.1-dev weights there)\n")
    sys.argv = [sys.argv[0]]
    sys.path.insert(0, a.comfy)
    os.chdir(a.comfy)
    import comfy.options
    comfy.options.enable_args_parsing(False)
    import torch
    import comfy.model_management as mm
    import comfy.sd
    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import _pack
    import timing  # bench/timing.py
    _pack.load()
    from flux_numba_pack.nodes.patch import apply as patch_apply, stats
    from flux_numba_pack.flux_core import blocks

    model = comfy.sd.load_diffusion_model(a.weights)
    mm.load_models_gpu([model], force_full_load=True)
    dev = mm.get_torch_device()
    h = a.res // 8
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(1, 16, h, h, generator=g).to(dev, torch.bfloat16)
    ctx = torch.randn(1, 256, 4096, generator=g).to(dev, torch.bfloat16)
    y = torch.randn(1, 768, generator=g).to(dev, torch.bfloat16)
    t = torch.tensor([0.5], device=dev)
    gd = torch.tensor([3.5], device=dev)

    def timed(mp, label):
        dm = mp.model.diffusion_model
        to = dict(mp.model_options["transformer_options"])
        with torch.inference_mode():  # 3 warm-up forwards timed and dropped, then a.reps
            ev = timing.event_times(lambda: dm(x, t, ctx, y=y, guidance=gd, transformer_options=dict(to)),
                                    reps=3 + a.reps, warm=0, sync_each=True)[3:]
        med = timing.median(ev)
        print(f"[cost] {label:10} {med:8.2f} ms/forward (median of {a.reps}, spread {min(ev):.2f}-{max(ev):.2f})", flush=True)
        return med

    res = {"stock": timed(model, "stock")}
    pm, = patch_apply(model, profile="exact", cuda_graph="off")
    res["patched"] = timed(pm, "patched")
    off, = patch_apply(model, profile="exact", cuda_graph="off")

    def broken(*args, **kw):
        raise RuntimeError("bench: injected failure in the pack's block code")
    blocks.double_block = blocks.single_block = broken
    res["off"] = timed(off, "off")
    st = stats(off.model_options["transformer_options"]["flux_numba"]["id"])
    res["stock_again"] = timed(model, "stock")
    base = statistics.mean([res["stock"], res["stock_again"]])
    print(f"\nComfyUI at {a.comfy}: stock {base:.2f} ms, patched {res['patched']:.2f} ({base / res['patched']:.3f}x), "
          f"off after a failure {res['off']:.2f} ({res['off'] / base:.4f}x stock; bar <= 1.02); "
          f"off-path stats: calls {st['calls']}, fallbacks {st['fallbacks']}, stock {st.get('stock')}")


if __name__ == "__main__":
    main()
