"""bench.py's set-up: its command line (one-line errors, exit 2), the checks that need no model,
where a ComfyUI tree is, the memory available, and the wait for the pack's background kernel build."""
import argparse
import os
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root (bench.py's folder)


def _int_at_least(lo, multiple=1):
    def check(s):
        try:
            v = int(s)
        except ValueError:
            v = None
        if v is None or v < lo or v % multiple:
            raise argparse.ArgumentTypeError(f"must be a whole number >= {lo}"
                                             + (f" and a multiple of {multiple}" if multiple > 1 else "") + f", got {s!r}")
        return v
    return check


def _outliers(s):
    """"N,F" -> (N channels, factor F)."""
    try:
        n, f = s.split(",")
        n, f = int(n), float(f)
        if n >= 1 and f > 0:
            return n, f
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"expected N,F (channels >= 1, factor > 0), got {s!r}")


BASE_VARIANTS = ("stock", "pack-torch", "exact", "exact-sdpa", "bf16-attn", "attn8", "fast", "fast-cached",
                 "fast-cached-attn8")


class Parser(argparse.ArgumentParser):
    """argparse, but an error is one line (no usage block) and exits 2."""

    def error(self, message):
        self.fail(f"{message} (--help lists the options)")

    def fail(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _device(s):
    if s in ("auto", "cpu", "cuda") or (s.startswith("cuda:") and s[5:].isdigit()):
        return s
    raise argparse.ArgumentTypeError(f"invalid choice: {s!r} (choose from 'auto', 'cuda', 'cuda:N', 'cpu')")


def _variant_list(allow_empty):
    def check(s):
        vs = [v.strip() for v in s.split(",") if v.strip()]
        bad = [v for v in vs if (v[: -len("+graph")] if v.endswith("+graph") else v) not in BASE_VARIANTS]
        if bad:
            raise argparse.ArgumentTypeError(
                f"unknown variant(s) {', '.join(map(repr, bad))} (known: {', '.join(BASE_VARIANTS)}, each also as NAME+graph)")
        if not vs and not allow_empty:
            raise argparse.ArgumentTypeError("no variant given")
        return ",".join(vs)
    return check


def parse(doc):
    """bench.py's arguments (``doc``: its help text), checked (``check_args``): (parser, args)."""
    p = Parser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--res", type=_int_at_least(16, 16), default=1024, help="image side in pixels (multiple of 16)")
    p.add_argument("--txt", type=_int_at_least(1), default=512, help="text tokens")
    p.add_argument("--batch", type=_int_at_least(1), default=1)
    p.add_argument("--model", help="FLUX.1 .safetensors (default: random weights of --config)")
    p.add_argument("--config", default="flux1-dev", choices=["flux1-dev", "tiny"])
    p.add_argument("--device", default="auto", type=_device, help="auto | cuda | cuda:N | cpu")
    p.add_argument("--variants", type=_variant_list(False),
                   default="stock,pack-torch,exact,exact+graph,exact-sdpa,attn8,attn8+graph,fast,fast+graph,fast-cached,fast-cached+graph",
                   help="comma list (see above)")
    p.add_argument("--warmup", type=_int_at_least(0), default=2)
    p.add_argument("--reps", type=_int_at_least(1), default=5)
    p.add_argument("--weight-dtype", default="default", choices=["default", "fp8_e4m3fn"],
                   help="fp8_e4m3fn: the diffusion model stored in fp8 e4m3 as UNETLoader's weight_dtype of that "
                        "name stores it (ComfyUI's manual_cast ops; needs ComfyUI): stock casts each weight per call, "
                        "the fast profile takes the stored fp8 weights as its GEMM operands")
    p.add_argument("--outliers", default=None, metavar="N,F", type=_outliers,
                   help="stress case: N hidden channels F times larger (img_in / txt_in output rows scaled; the "
                        "residual stream keeps them), as real DiTs have a few massive activation channels")
    p.add_argument("--no-ref", action="store_true", help="skip the fp32 reference (saves memory/time)")
    p.add_argument("--trajectory", type=_int_at_least(0), default=0, help="also run an N-step Euler trajectory (PSNR vs fp32)")
    p.add_argument("--save-latents", default=None, metavar="PATH",
                   help="with --trajectory: torch.save the final latent of each variant and of the fp32 reference "
                        "(bench/e2e/decode_ssim.py decodes them and compares the images)")
    p.add_argument("--no-comfy", action="store_true", help="use the standalone model even if ComfyUI is importable")
    p.add_argument("--no-autotune", dest="autotune", action="store_false",
                   help="auto picks by priority instead of timing each candidate once per shape")
    p.add_argument("--json", default=os.path.join(ROOT, "out", "bench.json"), metavar="PATH",
                   help="where the results go (default out/bench.json next to bench.py)")
    p.add_argument("--vae", action="store_true", help="also time the FLUX VAE decode of a 1024^2 image, "
                   "stock ComfyUI decoder vs FluxNumbaVAEPatch's (bench/ops/gpu_vae.py run_decoder)")
    p.add_argument("--memory", default="", type=_variant_list(True),
                   help="comma list of variants: allocations live at the peak of one forward")
    p.add_argument("--host-profile", default="", type=_variant_list(True), help="comma list of variants: one forward "
                   "under cProfile (top Python functions by own time: where the eager step's host time goes)")
    p.add_argument("--profile", default="", type=_variant_list(True),
                   help="comma list of variants to profile (one forward): top GPU kernels")
    a = p.parse_args()
    check_args(p, a)
    return p, a


def check_file_out(p, opt, path):
    """Fail at once when ``path`` (a file to write later) cannot be written; creates nothing."""
    from _pack import file_out_problem
    why = file_out_problem(path, "bench.json")
    if why:
        p.fail(f"argument {opt}: {why}")


def check_args(p, a):
    """Every check that needs no model: before anything is built or timed."""
    check_file_out(p, "--json", a.json)
    if a.save_latents is not None:
        check_file_out(p, "--save-latents", a.save_latents)
    cp = os.environ.get("COMFYUI_PATH")
    if cp and not a.no_comfy and not os.path.isfile(os.path.join(cp, "comfy", "ldm", "flux", "model.py")):
        p.fail(f"COMFYUI_PATH={cp} is not a ComfyUI tree (no comfy/ldm/flux/model.py); unset it or pass --no-comfy "
               "for the pack's standalone model")
    if a.model is not None:
        if not a.model:
            p.fail("argument --model: empty path (leave --model out for random weights of --config)")
        if not os.path.isfile(a.model):
            p.fail(f"argument --model: {'is a folder, not a file' if os.path.isdir(a.model) else 'no such file'}: {a.model}")


def find_comfy():
    for c in (os.environ.get("COMFYUI_PATH"), os.path.join(ROOT, ".carry", "gpu", "ComfyUI"), os.path.join(ROOT, ".carry", "ComfyUI")):
        if c and os.path.isfile(os.path.join(c, "comfy", "ldm", "flux", "model.py")):
            return c
    return None


def _avail_ram():
    """Bytes of memory available for new allocations (Linux: MemAvailable), or None."""
    try:
        with open("/proc/meminfo") as f:
            for ln in f:
                if ln.startswith("MemAvailable:"):
                    return int(ln.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _wait_for_kernel_build(dev):
    """Timing starts once the pack's background kernel build (started when its nodes are imported) is
    done: until then the ops run their torch references and no graph is captured, so a row would not
    time what its label says."""
    if dev.type != "cuda":
        return
    from flux_numba_pack.cuda_kernels import prebuild
    b = prebuild.current() or prebuild.start(dev)  # (started here when nothing imported the nodes yet)
    if b is None or b.done.is_set():
        return
    t0 = time.time()
    print("waiting for the background kernel build (first run after an install or update) ...", flush=True)
    b.wait()
    print(f"kernel build done in {time.time() - t0:.1f}s ({b.state})", flush=True)



def _has_kitchen():
    try:
        import comfy.quant_ops  # noqa: F401
        return bool(getattr(comfy.quant_ops, "ck", None))
    except Exception:
        return False
