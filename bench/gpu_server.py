#!/usr/bin/env python3
"""Real ComfyUI servers on a GPU: stock vs FluxNumbaPatch, as a user runs them.

For each ComfyUI tree and flag set: start ``main.py`` with ComfyUI's default flags plus that set,
queue API prompts built like a user's graph -- UNETLoader (random full-size FLUX.1-dev) ->
[FluxNumbaPatch] -> [EasyCache | LazyCache] -> KSampler (euler, simple, cfg 1) -> VAEDecode
([FluxNumbaVAEPatch]) -> SaveImage -- and record per prompt kind: seconds per image (the server's
own execution_start -> execution_success timestamps), peak GPU memory (nvidia-smi, sampled),
the log's fallback / CUDA-graph / turn-off lines, and whether the server survived.  Each kind
runs ``--repeat`` times; the last run is the one reported (the first patched one includes JIT).

No real weights are needed: a random FLUX.1-dev checkpoint (ComfyUI layout, bf16, std 0.02) is
written once to ``--weights`` (default /dev/shm), a random FLUX VAE next to it, and a small custom
node stands in for the text encoders (T5-XXL is 4.7 B parameters).

    python bench/gpu_server.py --comfy .carry/ComfyUI-0.8.0 --flags= --flags="--reserve-vram 118" \
        --cases stock,patched,easycache,lazycache --steps 28 --res 1024 --json $OUT/server.json

Prints one table row per (tree, flags, case) at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

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

NODE_CLASS_MAPPINGS = {"FluxNumbaBenchConditioning": FluxNumbaBenchConditioning,
                       "FluxNumbaBenchLatent": FluxNumbaBenchLatent, "FluxNumbaBenchSink": FluxNumbaBenchSink,
                       "FluxNumbaBenchSDPA": FluxNumbaBenchSDPA}
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

LOG_COUNTS = ("capture failed", "INTERNAL ASSERT", "freeAsync", "capture stopped", "Traceback", "per-block CUDA graph not captured")
KEYS = ("fallback", "kernel build", "building", "per-block", "profile fast", "FluxNumbaVAEPatch", "DynamicVRAM", "running ComfyUI's original block", "CUDA graph", "captured a CUDA graph", "is off for this model",
        "FluxNumbaPatch", "Traceback", "Error", "error", "terminate called", "freeAsync", "skipped", "capture",
        "INTERNAL ASSERT")


def write_weights(path, seed=0):
    """Random full-size FLUX.1-dev in ComfyUI's layout (bf16), generated on the GPU."""
    if os.path.exists(path):
        return
    import torch
    from safetensors.torch import save_file
    sys.path.insert(0, ROOT)
    import _pack
    _pack.load()
    from flux_numba_pack.flux_core.checkpoint import FLUX1_DEV, expected_shapes
    g = torch.Generator(device="cuda").manual_seed(seed)
    sd = {}
    for k, shape in expected_shapes(FLUX1_DEV).items():
        if "norm" in k and (k.endswith(".scale") or k.endswith(".weight")) and len(shape) == 1:
            t = torch.ones(shape, dtype=torch.bfloat16)
        else:
            t = (torch.randn(shape, generator=g, device="cuda", dtype=torch.float32) * 0.02).to(torch.bfloat16).cpu()
        sd[k] = t
    save_file(sd, path + ".tmp")
    os.replace(path + ".tmp", path)


LORA_RANK = 16
LORA_FILE = "flux_lora_random.safetensors"


LORA_SUFFIX = re.compile(r"_lora(b?)([0-9.]+)?$")  # _lora: after the patch, _lorab: before it; [strength]


def split_lora(case):
    """(the case without its LoRA suffix, the suffix, LoRA before the patch?, strength), or
    (case, "", None, None) for a case without a LoRA."""
    m = LORA_SUFFIX.search(case)
    if m is None:
        return case, "", None, None
    return case[: m.start()], m.group(0), m.group(1) == "b", float(m.group(2) or 1.0)


def write_lora(path, seed=1):
    """A random rank-16 LoRA over every block Linear of FLUX.1-dev (ComfyUI's generic
    ``<key>.lora_up.weight`` / ``.lora_down.weight`` / ``.alpha`` format, bf16, ~110 MB): up / down
    ~N(0, 0.01), so a full-strength LoRA moves each weight by ~8% of its spread."""
    if os.path.exists(path):
        return
    import torch
    from safetensors.torch import save_file
    sys.path.insert(0, ROOT)
    import _pack
    _pack.load()
    from flux_numba_pack.flux_core.checkpoint import FLUX1_DEV, expected_shapes
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for k, shape in expected_shapes(FLUX1_DEV).items():
        if not (k.endswith(".weight") and len(shape) == 2 and ("_blocks." in k)):
            continue
        base = "diffusion_model." + k[: -len(".weight")]
        out, inp = shape
        sd[base + ".lora_up.weight"] = (torch.randn(out, LORA_RANK, generator=g) * 0.01).to(torch.bfloat16)
        sd[base + ".lora_down.weight"] = (torch.randn(LORA_RANK, inp, generator=g) * 0.01).to(torch.bfloat16)
        sd[base + ".alpha"] = torch.tensor(float(LORA_RANK))
    save_file(sd, path + ".tmp")
    os.replace(path + ".tmp", path)


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


def write_vae(path, py, comfy, env):
    """A random FLUX VAE (built from ComfyUI's own decoder definition, so run inside a tree)."""
    if os.path.exists(path):
        return
    r = subprocess.run([py, "-c", MAKE_VAE, ROOT, path], cwd=comfy, capture_output=True, text=True, env=env)
    if r.returncode:
        raise RuntimeError("writing the random VAE failed:\n" + r.stderr[-3000:])


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url, timeout=30):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read().decode())


def _post(url, data):
    req = urllib.request.Request(url, data=json.dumps(data).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read().decode())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"HTTP {e.code}: {e.read().decode(errors='replace')[:800]}") from None


class GpuMem:
    """Peak of nvidia-smi's memory.used while running (MiB)."""

    def __init__(self, period=0.1):
        self.period, self.peak, self._stop = period, 0, threading.Event()
        self.t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=5).stdout
                self.peak = max(self.peak, int(out.split()[0]))
            except Exception:
                pass
            self._stop.wait(self.period)

    def __enter__(self):
        self.t.start()
        return self

    def __exit__(self, *a):
        self._stop.set()
        self.t.join()


VAE_CASES = {"vae_stock": None, "vae_patched": "auto", "vae_patched_eager": "off"}


def decode_graph(case, res, seed, vae):
    """Decode-only API prompt (``vae_*`` cases): a random latent -> VAEDecode (through FluxNumbaVAEPatch
    for vae_patched: low-res CUDA graph auto; vae_patched_eager: graph off) -> a sink output node."""
    g = {"lat": {"class_type": "FluxNumbaBenchLatent", "inputs": {"seed": seed, "res": res}},
         "vae": {"class_type": "VAELoader", "inputs": {"vae_name": vae}}}
    vae_ref = ["vae", 0]
    if VAE_CASES[case] is not None:
        g["vpatch"] = {"class_type": "FluxNumbaVAEPatch", "inputs": {"vae": vae_ref, "enabled": True, "backend": "auto",
                                                                     "layout": "nhwc", "cuda_graph": VAE_CASES[case]}}
        vae_ref = ["vpatch", 0]
    g["dec"] = {"class_type": "VAEDecode", "inputs": {"samples": ["lat", 0], "vae": vae_ref}}
    g["sink"] = {"class_type": "FluxNumbaBenchSink", "inputs": {"images": ["dec", 0]}}
    return g


def graph(case, steps, res, seed, unet, vae, cond_dims=(4096, 768), prefix="", stock_vae=False):
    """API prompt for one case: stock | patched | patched_fast (profile fast) | patched_fast_cached
    (profile fast-cached) | easycache | lazycache | stock_easycache | stock_lazycache; a case ending in
    ``_fp8`` loads the weights with UNETLoader's weight_dtype fp8_e4m3fn (stock_fp8, patched_fast_fp8);
    a patched case ending in ``_eager`` runs with cuda_graph off (patched_eager: the eager host path);
    ``patched_sdpa``: exact with attention "sdpa" (ComfyUI's own attention call, stock's backend order);
    ``stock_cudnn`` / ``stock_flash``: stock with SDPA's cuDNN / FLASH backend first (controls for image
    agreement: what a change of attention backend alone does); ``vae_*``: decode-only (``decode_graph``);
    a cache case ending in ``_t<x>`` (``easycache_t1.0``) sets the cache node's reuse_threshold to x
    (default 0.2, the node's own)."""
    if case in VAE_CASES:
        return decode_graph(case, res, seed, vae)
    name = prefix + case  # the SaveImage prefix: the case's full name (image_psnr pairs files by it)
    case, lora, lora_before, lora_strength = split_lora(case)
    fp8 = case.endswith("_fp8")
    case = case[: -len("_fp8")] if fp8 else case
    eager = case.endswith("_eager")  # cuda_graph off: every block eager (the host path's own cost)
    case = case[: -len("_eager")] if eager else case
    sdpa = case.endswith("_sdpa")  # the pack with ComfyUI's own attention call
    case = case[: -len("_sdpa")] if sdpa else case
    thr = re.fullmatch(r"(.*cache)_t([0-9.]+)", case)  # easycache_t1.0: EasyCache with reuse_threshold 1.0
    threshold = float(thr.group(2)) if thr else 0.2
    case = thr.group(1) if thr else case
    control = {"stock_cudnn": "cudnn", "stock_flash": "flash"}.get(case)
    patched = case in ("patched", "patched_fast", "patched_fast_cached", "easycache", "lazycache")
    profile = {"patched_fast": "fast", "patched_fast_cached": "fast-cached"}.get(case, "exact")
    g = {
        "unet": {"class_type": "UNETLoader", "inputs": {"unet_name": unet,
                                                        "weight_dtype": "fp8_e4m3fn" if fp8 else "default"}},
        "cond": {"class_type": "FluxNumbaBenchConditioning", "inputs": {"seed": 3, "tokens": 256,
                                                                        "context_dim": cond_dims[0], "pooled_dim": cond_dims[1]}},
        "lat": {"class_type": "EmptySD3LatentImage", "inputs": {"width": res, "height": res, "batch_size": 1}},
        "vae": {"class_type": "VAELoader", "inputs": {"vae_name": vae}},
    }
    model = ["unet", 0]
    vae_ref = ["vae", 0]
    if control:
        g["sdpa"] = {"class_type": "FluxNumbaBenchSDPA", "inputs": {"model": model, "backend": control}}
        model = ["sdpa", 0]

    def with_lora(model):
        g["lora"] = {"class_type": "LoraLoaderModelOnly", "inputs": {"model": model, "lora_name": LORA_FILE,
                                                                     "strength_model": lora_strength}}
        return ["lora", 0]
    if lora and (lora_before or not patched):
        model = with_lora(model)
    if patched:
        g["patch"] = {"class_type": "FluxNumbaPatch", "inputs": {
            "model": model, "profile": profile, "route_norms": True, "attention": "sdpa" if sdpa else "auto",
            "backend": "auto",
            "cuda_graph": "off" if eager else "auto"}}
        model = ["patch", 0]
        if not stock_vae:
            g["vpatch"] = {"class_type": "FluxNumbaVAEPatch", "inputs": {"vae": vae_ref, "enabled": True, "backend": "auto"}}
            vae_ref = ["vpatch", 0]
    if lora and patched and not lora_before:  # LoRA after the patch: a clone of the patched model
        model = with_lora(model)
    cache = {"easycache": "EasyCache", "stock_easycache": "EasyCache",
             "lazycache": "LazyCache", "stock_lazycache": "LazyCache"}.get(case)
    if cache:
        g["cache"] = {"class_type": cache, "inputs": {"model": model, "reuse_threshold": threshold, "start_percent": 0.15,
                                                      "end_percent": 0.95, "verbose": False}}
        model = ["cache", 0]
    g["ks"] = {"class_type": "KSampler", "inputs": {
        "model": model, "seed": seed, "steps": steps, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple",
        "positive": ["cond", 0], "negative": ["cond", 0], "latent_image": ["lat", 0], "denoise": 1.0}}
    g["dec"] = {"class_type": "VAEDecode", "inputs": {"samples": ["ks", 0], "vae": vae_ref}}
    g["save"] = {"class_type": "SaveImage", "inputs": {"images": ["dec", 0], "filename_prefix": name}}
    return g


def image_psnr(out_dir, cases, interleaved):
    """PSNR (dB, 8-bit PNGs) of each case's images against the stock case's image of the same run
    index (the same seed): {case: [dB per run]}.  Stock is ``stock`` for bf16 cases and ``stock_fp8``
    for ``*_fp8`` ones; cases without a stock partner in the run are left out."""
    try:
        import numpy as np
        from PIL import Image
    except ImportError:
        return {}

    def files(case):
        return sorted(f for f in os.listdir(out_dir) if f.startswith(case + "_") and f.endswith(".png")
                      and re.fullmatch(re.escape(case) + r"_\d{5}_\.png", f))
    if not os.path.isdir(out_dir):
        return {}
    res = {}
    for case in cases:
        base, lora = split_lora(case)[:2]
        ref = ("stock_fp8" if base.endswith("_fp8") else "stock") + lora.replace("_lorab", "_lora")
        if case == ref or ref not in cases or case in VAE_CASES:
            continue
        out = []
        for fa, fb in zip(files(case), files(ref)):
            a = np.asarray(Image.open(os.path.join(out_dir, fa)).convert("RGB"), dtype=np.float64)
            b = np.asarray(Image.open(os.path.join(out_dir, fb)).convert("RGB"), dtype=np.float64)
            mse = float(((a - b) ** 2).mean()) if a.shape == b.shape else float("nan")
            out.append(round(10 * np.log10(255.0 ** 2 / mse), 2) if mse > 0 else float("inf"))
        if out:
            res[case] = out
    return res


def phase_medians(path, cases):
    """{case: {phase: median seconds over the case's runs 2..N}} from the phases node's lines (in run
    order; profile prompts, prefixed ``prof_``, are left out)."""
    try:
        lines = [json.loads(ln) for ln in open(path) if ln.strip()]
    except OSError:
        return {}
    out = {}
    for case in cases:
        runs = [r for r in lines if r.get("case") == case][1:]
        if not runs:
            continue
        med = {}
        for k in sorted({k for r in runs for k, v in r.items() if k != "case" and isinstance(v, (int, float))}):
            v = sorted(r[k] for r in runs if k in r)
            med[k] = round(v[len(v) // 2], 3)
        out[case] = med
    return out


def run_prompt(url, prompt, timeout):
    cid = uuid.uuid4().hex
    pid = _post(url + "/prompt", {"prompt": prompt, "client_id": cid})["prompt_id"]
    t0 = time.time()
    while True:
        h = _get(f"{url}/history/{pid}")
        if pid in h and h[pid].get("status", {}).get("completed") is not None:
            st = h[pid]["status"]
            if st.get("status_str") in ("success", "error") or st.get("completed"):
                break
        if time.time() - t0 > timeout:
            return {"ok": False, "error": "timeout"}
        time.sleep(0.2)
    msgs = {m[0]: m[1] for m in st.get("messages", [])}
    ok = st.get("status_str") == "success"
    out = {"ok": ok}
    if "execution_start" in msgs and ("execution_success" in msgs or "execution_error" in msgs):
        end = msgs.get("execution_success") or msgs.get("execution_error")
        out["s"] = round((end["timestamp"] - msgs["execution_start"]["timestamp"]) / 1000.0, 3)
    if not ok:
        err = msgs.get("execution_error", {})
        out["error"] = f"{err.get('exception_type')}: {err.get('exception_message')}"[:500]
    return out


def split_flags(flags, env):
    """A flag set's leading NAME=value tokens go into the server's environment (A/B runs of one
    setting, e.g. "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"); the rest are main.py arguments."""
    argv, env = shlex.split(flags), dict(env)
    while argv and re.match(r"^[A-Z_][A-Z0-9_]*=", argv[0]):
        k, v = argv.pop(0).split("=", 1)
        env[k] = v
    return argv, env


def serve(py, comfy, base, flags, env, start_timeout=600):
    port = _free_port()
    logp = os.path.join(base, f"comfyui_{port}.log")
    logf = open(logp, "w")
    fe = os.path.join(base, "frontend")
    os.makedirs(fe, exist_ok=True)
    with open(os.path.join(fe, "index.html"), "w") as f:
        f.write("<html><body>bench</body></html>")
    argv, env = split_flags(flags, env)
    cmd = [py, "main.py", "--listen", "127.0.0.1", "--port", str(port), "--base-directory", base,
           "--database-url", "sqlite:///:memory:", "--disable-auto-launch", "--front-end-root", fe, *argv]
    proc = subprocess.Popen(cmd, cwd=comfy, stdout=logf, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    t0 = time.time()
    while True:
        if proc.poll() is not None:
            raise RuntimeError("ComfyUI exited at start:\n" + open(logp).read()[-3000:])
        try:
            _get(url + "/system_stats", timeout=5)
            break
        except Exception:
            if time.time() - t0 > start_timeout:
                proc.kill()
                raise RuntimeError("ComfyUI did not start:\n" + open(logp).read()[-3000:])
            time.sleep(0.5)
    return proc, url, logp, logf


def comfy_version(comfy):
    ns = {}
    try:
        exec(open(os.path.join(comfy, "comfyui_version.py")).read(), ns)
    except Exception:
        pass
    return ns.get("__version__", "?")


def check_args(p, a, flag_sets, cases):
    """One line and exit 2, before anything is written or started: a --comfy that is not a ComfyUI
    tree, or no CUDA GPU where one is needed (the random weights are generated on the GPU; a server
    runs on it unless its flag set has --cpu, as in a CPU smoke test with --weights of an existing file)."""
    def fail(msg):
        p.exit(2, f"gpu_server.py: error: {msg}\n")
    for comfy in a.comfy:
        if not os.path.isfile(os.path.join(comfy, "main.py")):
            fail(f"argument --comfy: no ComfyUI tree at {comfy!r}: no main.py there")
    need = []
    if not all(c in VAE_CASES for c in cases) and not os.path.exists(a.weights):
        need.append(f"the random FLUX.1-dev weights ({a.weights}) are generated on it")
    for flags in flag_sets:
        try:
            argv = split_flags(flags, {})[0]
        except ValueError as e:
            fail(f"argument --flags: {flags!r}: {e}")
        if "--cpu" not in argv:
            need.append(f"the servers run on it (--flags={flags!r} has no --cpu)")
    if need:
        try:
            import torch
        except ImportError as e:
            fail(f"torch does not import here ({e}): {need[0]}")
        if not torch.cuda.is_available():
            fail(f"no CUDA GPU (torch sees none): {need[0]}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--comfy", action="append", required=True, help="ComfyUI tree (repeatable)")
    p.add_argument("--flags", action="append", default=None,
                   help='extra main.py flags for one server, e.g. "--highvram" (repeatable; "" = defaults)')
    p.add_argument("--cases", default="stock,patched", help="comma list: stock, patched, easycache, lazycache, "
                   "stock_easycache, stock_lazycache")
    p.add_argument("--steps", type=int, default=28)
    p.add_argument("--res", type=int, default=1024)
    p.add_argument("--repeat", type=int, default=2, help="runs per case; the last one is reported")
    p.add_argument("--interleave", action=argparse.BooleanOptionalAction, default=False,
                   help="alternate the cases run by run (drift hits all alike); the table then also gives each "
                   "case's median over runs 2..N (--no-interleave: each case's runs in a row -- a later run of a "
                   "case then shows its speed without a switch of weights or LoRA before it)")
    p.add_argument("--weights", default="/dev/shm/flux1_dev_random.safetensors")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--json", help="write all results here")
    p.add_argument("--logs", help="folder to copy each server's log into")
    p.add_argument("--prompt-timeout", type=float, default=300)
    p.add_argument("--profile", help="folder: after the timed runs, one prompt per case (--profile-steps steps) "
                   "under cProfile (host time by function) and one under torch.profiler (GPU kernel time vs wall)")
    p.add_argument("--profile-steps", type=int, default=8)
    p.add_argument("--profile-kinds", default="cprofile,torch", help="comma list of cprofile (host time by "
                   "function), torch (GPU busy share, idle gaps), trace (host + GPU timeline, chrome trace .json.gz)")
    p.add_argument("--stock-vae", action="store_true", help="patched cases decode with ComfyUI's own VAE (no "
                   "FluxNumbaVAEPatch): the images' PSNR vs stock then measures the FLUX model's path alone")
    p.add_argument("--cond-dims", default="4096,768", help="text context / pooled widths (a CPU smoke test with "
                   "run.py --write-model --comfy-min weights uses that model's)")
    a = p.parse_args()
    flag_sets = a.flags if a.flags else [""]
    cases = [c for c in a.cases.split(",") if c]
    check_args(p, a, flag_sets, cases)

    stub = tempfile.mkdtemp(prefix="flux_stub_")
    os.makedirs(os.path.join(stub, "av"))
    with open(os.path.join(stub, "av", "__init__.py"), "w") as f:
        f.write(AV_STUB)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([x for x in (env.get("PYTHONPATH"), stub) if x])

    t = time.time()
    if not all(c in VAE_CASES for c in cases):   # decode-only runs need no FLUX weights
        write_weights(a.weights)
    vae_path = os.path.join(os.path.dirname(a.weights), "flux_vae_random.safetensors")
    lora_path = os.path.join(os.path.dirname(a.weights), LORA_FILE)
    if any("_lora" in c for c in cases):
        write_lora(lora_path)
    write_vae(vae_path, a.python, a.comfy[0], env)
    print(f"[bench] weights ready ({time.time() - t:.1f} s)", flush=True)

    rows, results = [], []
    for comfy in a.comfy:
        ver = comfy_version(comfy)
        for flags in flag_sets:
            base = tempfile.mkdtemp(prefix="flux_server_")
            cn = os.path.join(base, "custom_nodes")
            os.makedirs(cn)
            os.symlink(ROOT, os.path.join(cn, "comfyui-flux-numba-kernels"))
            with open(os.path.join(cn, "flux_numba_bench_cond.py"), "w") as f:
                f.write(COND_NODE)
            phases = os.path.join(base, "phases.jsonl")
            with open(os.path.join(cn, "flux_numba_bench_phases.py"), "w") as f:
                f.write(PHASES_NODE)
            prof_dir = None
            if a.profile:
                prof_dir = os.path.join(os.path.abspath(a.profile),
                                        f"{comfy_version(comfy)}_{re.sub(r'[^A-Za-z0-9=_.]', '', flags) or 'default'}")
                os.makedirs(prof_dir, exist_ok=True)
                with open(os.path.join(cn, "flux_numba_bench_profile.py"), "w") as f:
                    f.write(PROFILE_NODE)
            for sub, src in (("diffusion_models", a.weights), ("vae", vae_path), ("loras", lora_path)):
                os.makedirs(os.path.join(base, "models", sub))
                if os.path.exists(src):
                    os.symlink(src, os.path.join(base, "models", sub, os.path.basename(src)))
            rec = {"comfyui": ver, "tree": comfy, "flags": flags, "cases": {}}
            results.append(rec)
            t0 = time.time()
            try:
                senv = dict(env, FLUX_BENCH_PHASES=phases)
                if prof_dir:
                    senv["FLUX_BENCH_PROFILE"] = prof_dir
                proc, url, logp, logf = serve(a.python, comfy, base, flags, senv)
            except Exception as e:
                rec["start_error"] = str(e)[-2000:]
                rows.append((ver, flags or "(default)", "-", "server did not start", "", "", ""))
                continue
            rec["start_s"] = round(time.time() - t0, 1)
            alive = True
            order = ([(c, i) for i in range(a.repeat) for c in cases] if a.interleave
                     else [(c, i) for c in cases for i in range(a.repeat)])
            all_runs = {c: [] for c in cases}
            for case, i in order:
                runs = all_runs[case]
                if proc.poll() is not None:
                    alive = False
                    break
                with GpuMem() as mem:
                    try:
                        r = run_prompt(url, graph(case, a.steps, a.res, 7 + i, os.path.basename(a.weights),
                                                  os.path.basename(vae_path),
                                                  tuple(int(v) for v in a.cond_dims.split(",")), stock_vae=a.stock_vae),
                                       a.prompt_timeout)
                    except Exception as e:
                        r = {"ok": False, "error": f"{type(e).__name__}: {e}"}
                r["peak_mib"] = mem.peak
                runs.append(r)
                print(f"[bench] {ver} {flags or '(default)'} {case} run {i + 1}: {r}", flush=True)
                if "Connection refused" in str(r.get("error", "")):
                    alive = False  # the server is gone (it may still be writing its crash dump)
                    break
            if prof_dir and alive and proc.poll() is None:
                for ci, case in enumerate(cases):
                    for ki, kind in enumerate(a.profile_kinds.split(",")):
                        with open(os.path.join(prof_dir, "mode"), "w") as f:
                            f.write(f"{kind}:{case}")
                        try:
                            # a new seed per prompt: ComfyUI would answer an identical prompt from its cache
                            r = run_prompt(url, graph(case, a.profile_steps, a.res, 99 + 5 * ci + ki, os.path.basename(a.weights),
                                                      os.path.basename(vae_path),
                                                      tuple(int(v) for v in a.cond_dims.split(",")), prefix="prof_",
                                                      stock_vae=a.stock_vae), a.prompt_timeout)
                        except Exception as e:
                            r = {"ok": False, "error": f"{type(e).__name__}: {e}"}
                        print(f"[bench] profile {kind} {case}: {r}", flush=True)
                        gj = os.path.join(prof_dir, f"gpu_{case}.json")
                        if kind == "torch" and os.path.exists(gj):
                            g = json.load(open(gj))
                            rec.setdefault("profile", {})[case] = {k: g.get(k) for k in ("wall_s", "gpu_kernel_s", "gpu_span_s", "kernels",
                                                                                        "idle_ms", "idle_ms_by_gap", "gaps_by_size", "copies_n_ms")}
                with open(os.path.join(prof_dir, "mode"), "w") as f:
                    f.write("")
            for case in cases:
                runs = all_runs[case]
                rec["cases"][case] = runs
                last = runs[-1] if runs else {"ok": False, "error": "server died before this case"}
                warm = sorted(r["s"] for r in runs[1:] if r.get("ok") and "s" in r)
                if warm:
                    rec.setdefault("median_warm_s", {})[case] = warm[len(warm) // 2]
                rows.append((ver, flags or "(default)", case, f"{last.get('s', float('nan')):.2f}" if last.get("ok") else
                             "FAIL", f"{runs[0].get('s', float('nan')):.2f}" if runs and runs[0].get("ok") else "-",
                             f"{last.get('peak_mib', 0) / 1024:.1f}", "" if last.get("ok") else last.get("error", "")[:60]))
            ph = phase_medians(phases, cases)
            if ph:
                rec["phases_median_s"] = ph
                rec["phases"] = [json.loads(ln) for ln in open(phases) if ln.strip()]
            psnr = image_psnr(os.path.join(base, "output"), cases, a.interleave)
            if psnr:
                rec["psnr_vs_stock_db"] = psnr
            alive = alive and proc.poll() is None
            rec["server_alive"] = alive
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
            logf.close()
            log = open(logp, errors="replace").read()
            rec["log_lines"] = [ln for ln in log.splitlines() if any(k in ln for k in KEYS)][:80]
            rec["log_counts"] = {k: log.count(k) for k in LOG_COUNTS}
            rec["log_tail"] = log[-3000:]
            if a.logs:
                os.makedirs(a.logs, exist_ok=True)
                tag = f"{ver}_{re.sub(r'[^A-Za-z0-9=_.]', '', flags) or 'default'}"
                with open(os.path.join(a.logs, f"server_{tag}.log"), "w") as f:
                    f.write(log[-400000:])
            if not alive:
                rows.append((ver, flags or "(default)", "-", "SERVER DIED", "", "", ""))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    for rec in results:
        for ln in rec.get("log_lines", [])[:25]:
            print(f"[log {rec['comfyui']} {rec['flags'] or 'default'}] {ln[:220]}")
    print(f"\n{'ComfyUI':8} {'flags':22} {'case':16} {'s/image':>8} {'first':>7} {'peakGB':>7}  note")
    for r in rows:
        print(f"{r[0]:8} {r[1]:22} {r[2]:16} {r[3]:>8} {r[4]:>7} {r[5]:>7}  {r[6]}")
    for rec in results:
        for case, pr in rec.get("profile", {}).items():
            print(f"profile {rec['comfyui']} {rec['flags'] or '(default)'} {case}: wall {pr['wall_s']:.2f} s, "
                  f"GPU kernels {pr['gpu_kernel_s']:.2f} s ({100 * pr['gpu_kernel_s'] / pr['wall_s']:.0f}% busy), "
                  f"{pr['kernels']} kernels; first-to-last GPU event {pr['gpu_span_s'] or 0:.2f} s "
                  f"({100 * pr['gpu_kernel_s'] / (pr['gpu_span_s'] or 1e9):.0f}% busy over the steps)")
            if pr.get("idle_ms") is not None:
                print(f"   idle {pr['idle_ms']:.1f} ms in gaps: " + ", ".join(
                    f"{k} {v:.1f} ms ({pr['gaps_by_size'][k]})" for k, v in pr["idle_ms_by_gap"].items()))
            for name, (n, ms) in sorted((pr.get("copies_n_ms") or {}).items(), key=lambda kv: -kv[1][1]):
                print(f"   {name}: {n} x, {ms:.1f} ms")
    for rec in results:
        for case, dbs in rec.get("psnr_vs_stock_db", {}).items():
            print(f"PSNR vs stock (same seed, 8-bit PNG), {rec['comfyui']} {rec['flags'] or '(default)'} {case}: "
                  + ", ".join(f"{d:.1f}" for d in dbs) + " dB")
    for rec in results:
        if "log_counts" in rec:
            print(f"log counts, {rec['comfyui']} {rec['flags'] or '(default)'}: "
                  + ", ".join(f"'{k}' {v}" for k, v in rec["log_counts"].items()))
    for rec in results:
        if rec.get("median_warm_s"):
            print(f"median of runs 2..N, {rec['comfyui']} {rec['flags'] or '(default)'}: "
                  + ", ".join(f"{c} {v:.2f}" for c, v in rec["median_warm_s"].items()))
        for case, ph in rec.get("phases_median_s", {}).items():
            tot = rec.get("median_warm_s", {}).get(case)
            rest = (f", rest {tot - sum(v for k, v in ph.items() if not k.startswith('node:')):.3f}"
                    if tot is not None else "")
            print(f"phases (median s, runs 2..N), {rec['comfyui']} {rec['flags'] or '(default)'} {case}: "
                  + ", ".join(f"{k} {v:.3f}" for k, v in ph.items()) + rest)
        for case in rec.get("phases_median_s", {}):
            gc = [r.get("graph_counts") for r in rec.get("phases", []) if r.get("case") == case]
            if any(gc):
                print(f"pack graph counters per prompt (calls, whole-step replays / eager, blocks), {rec['comfyui']} "
                      f"{rec['flags'] or '(default)'} {case}: " + "; ".join(
                          ", ".join(f"{k} {v}" for k, v in sorted((g or {}).items())) or "-" for g in gc))


if __name__ == "__main__":
    main()
