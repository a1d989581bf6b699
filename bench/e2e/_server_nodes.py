"""gpu_server.py's Python sources written into each server's tree: the custom nodes that stand in for
the text encoders and make seeded images / masks / latents (COND_NODE), a PyAV stand-in (AV_STUB), the
profiling node (PROFILE_NODE: cProfile / torch.profiler per prompt), the phases node (PHASES_NODE:
seconds per phase of a prompt, the pack's graph counters) and the script that writes the random VAE
inside a ComfyUI tree (MAKE_VAE)."""

COND_NODE = '''
import torch

class FluxNumbaBenchConditioning:
    """BENCH ONLY: seeded random FLUX.1 conditioning (T5 context [1, 256, 4096], CLIP pooled
    [1, 768], guidance 3.5), standing in for the text encoders."""
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"seed": ("INT", {"default": 0}), "tokens": ("INT", {"default": 256}),
                             "context_dim": ("INT", {"default": 4096}), "pooled_dim": ("INT", {"default": 768})}}
    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "make"
    CATEGORY = "FluxNumba/bench"
    def make(self, seed, tokens, context_dim, pooled_dim):
        g = torch.Generator().manual_seed(seed)
        return ([[torch.randn(1, tokens, context_dim, generator=g) * 0.5,
                  {"pooled_output": torch.randn(1, pooled_dim, generator=g), "guidance": 3.5}]],)

class FluxNumbaBenchLatent:
    """BENCH ONLY: a seeded random FLUX latent [1, 16, res/8, res/8] (decode-only prompts; a new seed
    per prompt, or ComfyUI would answer from its cache)."""
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"seed": ("INT", {"default": 0}), "res": ("INT", {"default": 1024})}}
    RETURN_TYPES = ("LATENT",)
    FUNCTION = "make"
    CATEGORY = "FluxNumba/bench"
    def make(self, seed, res):
        g = torch.Generator().manual_seed(seed)
        return ({"samples": torch.randn(1, 16, res // 8, res // 8, generator=g)},)

class FluxNumbaBenchSink:
    """BENCH ONLY: an output node that takes the decoded image and keeps nothing (no PNG encoding in
    a decode-only prompt's time)."""
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"images": ("IMAGE",)}}
    RETURN_TYPES = ()
    FUNCTION = "sink"
    OUTPUT_NODE = True
    CATEGORY = "FluxNumba/bench"
    def sink(self, images):
        return {}

class FluxNumbaBenchSDPA:
    """BENCH ONLY (a control for image agreement): the model with ComfyUI's attention replaced, on this
    clone only, by torch SDPA with one backend first (cudnn / flash) -- stock's math otherwise."""
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "backend": (["cudnn", "flash"],)}}
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "patch"
    CATEGORY = "FluxNumba/bench"
    def patch(self, model, backend):
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend as B, sdpa_kernel
        order = [B.CUDNN_ATTENTION, B.FLASH_ATTENTION] if backend == "cudnn" else [B.FLASH_ATTENTION, B.CUDNN_ATTENTION]
        order += [B.EFFICIENT_ATTENTION, B.MATH]
        def attn(func, q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                 skip_output_reshape=False, **kw):
            if skip_reshape:
                b, _, _, dh = q.shape
            else:
                b, _, dim = q.shape
                dh = dim // heads
                q, k, v = (t.view(b, -1, heads, dh).transpose(1, 2) for t in (q, k, v))
            with sdpa_kernel(order, set_priority=True):
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            return out if skip_output_reshape else out.transpose(1, 2).reshape(b, -1, heads * dh)
        m = model.clone()
        m.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = attn
        return (m,)

class FluxNumbaBenchImage:
    """BENCH ONLY: a seeded random image [1, height, width, 3] in [0, 1] (a Kontext reference, a Fill
    picture, a ControlNet hint)."""
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"seed": ("INT", {"default": 0}), "width": ("INT", {"default": 1024}),
                             "height": ("INT", {"default": 1024})}}
    RETURN_TYPES = ("IMAGE",)
    FUNCTION = "make"
    CATEGORY = "FluxNumba/bench"
    def make(self, seed, width, height):
        g = torch.Generator().manual_seed(seed)
        return (torch.rand(1, height, width, 3, generator=g),)

class FluxNumbaBenchMask:
    """BENCH ONLY: a mask [1, height, width], 1 on the lower half (what a Fill prompt repaints), 0 above."""
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"width": ("INT", {"default": 1024}), "height": ("INT", {"default": 1024})}}
    RETURN_TYPES = ("MASK",)
    FUNCTION = "make"
    CATEGORY = "FluxNumba/bench"
    def make(self, width, height):
        m = torch.zeros(1, height, width)
        m[:, height // 2:, :] = 1.0
        return (m,)

NODE_CLASS_MAPPINGS = {"FluxNumbaBenchConditioning": FluxNumbaBenchConditioning,
                       "FluxNumbaBenchLatent": FluxNumbaBenchLatent, "FluxNumbaBenchSink": FluxNumbaBenchSink,
                       "FluxNumbaBenchSDPA": FluxNumbaBenchSDPA, "FluxNumbaBenchImage": FluxNumbaBenchImage,
                       "FluxNumbaBenchMask": FluxNumbaBenchMask}
'''

AV_STUB = '''"""Stand-in for PyAV (absent on the GPU image): ComfyUI imports it (and av.* submodules)
for its video types only; any attribute is a placeholder class that refuses to be used."""
import importlib.machinery
import sys
import types


class _Meta(type):
    def __getattr__(cls, name):  # ColorTrc.ARIB_STD_B67 and the like: more placeholders
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder


class _Placeholder(metaclass=_Meta):
    def __init__(self, *a, **k):
        raise RuntimeError("PyAV is not installed (bench stand-in)")


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Placeholder


class _Loader:
    def create_module(self, spec):
        m = types.ModuleType(spec.name)
        m.__getattr__ = __getattr__
        m.__path__ = []
        return m

    def exec_module(self, m):
        pass


class _Finder:
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith("av."):
            return importlib.machinery.ModuleSpec(fullname, _Loader(), is_package=True)
        return None


sys.meta_path.insert(0, _Finder())
'''

PROFILE_NODE = r'''
"""BENCH ONLY (gpu_server.py --profile): profiles the sampler call (and VAE.decode) of a prompt when the control
file says so -- cProfile of the host thread, or torch.profiler's GPU kernel time against wall
time (how busy the GPU is: a step that is host-bound leaves it idle)."""
import cProfile, io, json, os, pstats, time
import torch
import comfy.sample

CTRL = os.environ["FLUX_BENCH_PROFILE"]
_orig = comfy.sample.sample


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _mode():
    try:
        return open(os.path.join(CTRL, "mode")).read().strip()
    except OSError:
        return ""


def sample(*a, **k):
    return _profiled(_orig, a, k)


def _gaps(ev):
    """Where the GPU idles between its first and last event: the union of the events' intervals,
    the idle gaps between them by size, and the largest gaps with the events on either side (which
    step phase leaves the GPU waiting for the host)."""
    iv = sorted((e.time_range.start, e.time_range.end, e.name) for e in ev)
    if not iv:
        return {}
    t_first = iv[0][0]
    end, prev = iv[0][1], iv[0][2]
    gaps = []
    for s, e, n in iv[1:]:
        if s > end:
            gaps.append((s - end, prev, n, s - t_first))
        if e >= end:
            end, prev = e, n
    bins = {"<20us": 0.0, "20-100us": 0.0, "100us-1ms": 0.0, ">1ms": 0.0}
    count = dict.fromkeys(bins, 0)
    for g, *_ in gaps:
        b = "<20us" if g < 20 else "20-100us" if g < 100 else "100us-1ms" if g < 1000 else ">1ms"
        bins[b] += g / 1e3
        count[b] += 1
    big = sorted(gaps, key=lambda x: -x[0])[:30]
    return {"idle_ms": sum(g for g, *_ in gaps) / 1e3, "idle_ms_by_gap": bins, "gaps_by_size": count,
            "largest_gaps": [{"ms": round(g / 1e3, 3), "at_ms": round(at / 1e3, 2), "after": a[:90], "before": b[:90]}
                             for g, a, b, at in sorted(big, key=lambda x: x[3])]}


def _profiled(orig, a, k, suffix=""):
    mode = _mode()
    if not mode:
        return orig(*a, **k)
    kind, tag = mode.split(":", 1)
    if suffix and tag.startswith("vae_"):
        suffix = ""  # a decode-only prompt: the decode is the profile
    tag += suffix
    _sync()
    t0 = time.perf_counter()
    if kind == "cprofile":
        pr = cProfile.Profile()
        pr.enable()
        try:
            out = orig(*a, **k)
            _sync()
        finally:
            pr.disable()
        wall = time.perf_counter() - t0
        s = io.StringIO()
        st = pstats.Stats(pr, stream=s)
        s.write(f"wall {wall:.3f} s (under cProfile)\n")
        st.sort_stats("tottime").print_stats(45)
        st.sort_stats("cumulative").print_stats(60)
        open(os.path.join(CTRL, f"cprofile_{tag}.txt"), "w").write(s.getvalue())
        return out
    from torch.profiler import profile, ProfilerActivity
    acts = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if kind == "trace" else [])
    with profile(activities=acts) as prof:
        out = orig(*a, **k)
        _sync()
    wall = time.perf_counter() - t0
    if kind == "trace":  # the host and GPU timeline (host ops slowed by the profiler: structure, not speed)
        path = os.path.join(CTRL, f"trace_{tag}.json")
        prof.export_chrome_trace(path)
        import gzip, shutil
        with open(path, "rb") as fi, gzip.open(path + ".gz", "wb") as fo:
            shutil.copyfileobj(fi, fo)
        os.remove(path)
        return out
    ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.device_time for e in ev) / 1e6  # us -> s (kernels and copies; overlaps counted twice)
    top = {}
    for e in ev:
        top[e.name] = top.get(e.name, 0.0) + e.device_time / 1e3
    # the span from the first to the last GPU event: the steps themselves, without the host-only prologue
    # (model load, sampler set-up) that wall time also holds
    span = (max(e.time_range.end for e in ev) - min(e.time_range.start for e in ev)) / 1e6 if ev else 0.0
    rec = {"wall_s": wall, "gpu_kernel_s": busy, "gpu_span_s": span, "kernels": len(ev),
           "top_ms": sorted(top.items(), key=lambda kv: -kv[1])[:25]}
    rec.update(_gaps(ev))
    copies = {}  # weight streaming shows here: "Memcpy HtoD (Pageable -> Device)" vs "(Pinned -> Device)"
    for e in ev:
        if e.name.startswith("Memcpy") or e.name.startswith("Memset"):
            c = copies.setdefault(e.name, [0, 0.0])
            c[0] += 1
            c[1] += e.device_time / 1e3
    rec["copies_n_ms"] = copies
    json.dump(rec, open(os.path.join(CTRL, f"gpu_{tag}.json"), "w"), indent=1)
    return out


comfy.sample.sample = sample

import comfy.sd
_orig_decode = comfy.sd.VAE.decode


def vae_decode(self, *a, **k):  # decode-only prompts (gpu_server's vae_* cases): profile the decode
    # (in a sampling prompt the decode's profile goes beside the sampler's, not over it)
    return _profiled(lambda *a_, **k_: _orig_decode(self, *a_, **k_), a, k, suffix="_decode")


comfy.sd.VAE.decode = vae_decode
NODE_CLASS_MAPPINGS = {}
'''

PHASES_NODE = r'''
"""BENCH ONLY (gpu_server.py): wall seconds of each prompt's phases -- the sampler call (comfy.sample.sample,
up to its result on the host's side of the GPU: one synchronize at its end), VAE.decode, SaveImage -- one
JSON line per saved image, keyed by the SaveImage prefix (the case's name), so a prompt's time splits
into sampling, decoding, saving and the rest (ComfyUI's executor, model loading, text nodes); and
each node's execution ("node:<class>", as ComfyUI's executor runs it: a node's time holds the phases
inside it; a SaveImage node's own line lands in the next prompt's record, so it is left out)."""
import json, os, time
import torch
import comfy.sample, comfy.sd, nodes
import execution

OUT = os.environ["FLUX_BENCH_PHASES"]
_acc = {}


def _timed(name, fn, sync=False):
    def run(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            if sync and torch.cuda.is_available():
                torch.cuda.synchronize()
            _acc[name] = _acc.get(name, 0.0) + time.perf_counter() - t
    return run


def _pack_counts():
    """The pack's graph counters summed over every patch in this process (nodes.runner._STATS):
    diffusion-model calls, whole-step graph replays / eager steps, per-block replay / capture / eager."""
    import sys
    out = {}
    for name, mod in list(sys.modules.items()):
        st = getattr(mod, "_STATS", None) if name.endswith("nodes.runner") else None
        if not isinstance(st, dict):
            continue
        for s in list(st.values()):
            for k in ("calls", "whole_replays", "whole_eager", "stock"):
                out[k] = out.get(k, 0) + int(s.get(k, 0) or 0)
            for k, v in (s.get("block_graphs") or {}).items():
                if isinstance(v, int):
                    out["block_" + k] = out.get("block_" + k, 0) + v
    return out


_graphs = {}


def _counted_sample(fn):
    def run(*a, **k):
        before = _pack_counts()
        try:
            return fn(*a, **k)
        finally:
            after = _pack_counts()
            for key, v in after.items():
                d = v - before.get(key, 0)
                if d:
                    _graphs[key] = _graphs.get(key, 0) + d
    return run


comfy.sample.sample = _counted_sample(_timed("sample", comfy.sample.sample, sync=True))
comfy.sd.VAE.decode = _timed("decode", comfy.sd.VAE.decode, sync=True)
_save = nodes.SaveImage.save_images


def save_images(self, images, filename_prefix="ComfyUI", *a, **k):
    t = time.perf_counter()
    try:
        return _save(self, images, filename_prefix, *a, **k)
    finally:
        rec = dict(_acc, save=time.perf_counter() - t, case=filename_prefix)
        if _graphs:
            rec["graph_counts"] = dict(_graphs)
        _acc.clear()
        _graphs.clear()
        with open(OUT, "a") as f:
            f.write(json.dumps(rec) + "\n")


nodes.SaveImage.save_images = save_images
_execute = execution.execute


async def execute(server, dynprompt, caches, current_item, *a, **k):
    t = time.perf_counter()
    try:
        return await _execute(server, dynprompt, caches, current_item, *a, **k)
    finally:
        try:
            ct = dynprompt.get_node(current_item)["class_type"]
        except Exception:
            ct = "?"
        if ct != "SaveImage":
            _acc["node:" + ct] = _acc.get("node:" + ct, 0.0) + time.perf_counter() - t


execution.execute = execute
NODE_CLASS_MAPPINGS = {}
'''


MAKE_VAE = r'''
import sys
ROOT, OUT = sys.argv[1], sys.argv[2]
sys.argv = [sys.argv[0], "--cpu"]
import comfy.options; comfy.options.enable_args_parsing()
import safetensors.torch
sys.path.insert(0, ROOT)
import _pack; _pack.load()
from flux_numba_pack.nodes.host.vae import random_vae_state_dict
safetensors.torch.save_file(random_vae_state_dict(1), OUT)
'''
