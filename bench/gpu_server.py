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
node stands in for the text encoders (T5-XXL is 4.7 B parameters).  The FLUX.1 family runs as case
suffixes (graph()): ``_schnell`` / ``_fill`` load their own random checkpoint and ``_cn`` a random
ControlNet, each made from --weights' tensors once, next to it; ``_kontext`` (a reference latent) and
``_redux`` (Redux's 985-token context) change the conditioning.  Each pack case's PSNR is taken
against the stock case of the same family members (stock_schnell for patched_schnell).  Quantised
checkpoints of --weights (bench/server_quant.py, written next to it once): ``_fp8s`` an fp8-scaled
safetensors (UNETLoader), ``_gguf`` a Q8_0 GGUF loaded by ComfyUI-GGUF's UnetLoaderGGUF (the node
pack from --gguf-pack, installed into the server's custom_nodes; needs the gguf package).

    python bench/gpu_server.py --comfy .carry/ComfyUI-0.8.0 --flags= --flags="--reserve-vram 118" \
        --cases stock,patched,easycache,lazycache --steps 28 --res 1024 --json $OUT/server.json
    python bench/gpu_server.py --comfy .carry/ComfyUI-0.33.0 --flags= --interleave \
        --cases stock_schnell,patched_schnell,stock_kontext,patched_kontext,stock_cn,patched_cn

CPU smoke (a ComfyUI tree's Python; the smallest checkpoint ComfyUI detects as FLUX, its own text widths):

    python run.py --write-model /tmp/fs/flux_min.safetensors --comfy-min
    python bench/gpu_server.py --comfy .carry/ComfyUI-0.33.0 --flags=--cpu --weights /tmp/fs/flux_min.safetensors \
        --cond-dims 64,32 --res 64 --steps 2 --repeat 1 --cases stock_fill,patched_fill

Prints one table row per (tree, flags, case) at the end.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from server_quant import gguf_file, planned_bytes, scaled_fp8_file, write_fp8_scaled, write_gguf_q8_0  # noqa: E402
GGUF_PACK = os.environ.get("COMFYUI_GGUF_PATH") or os.path.join(ROOT, ".gpu", "ComfyUI-GGUF")

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


# ---------------------------------------------------------------- the FLUX.1 family (case suffixes)
FAMILIES = ("schnell", "kontext", "fill", "redux", "cn")
QUANTS = ("fp8s", "gguf")  # quantised checkpoints of --weights (bench/server_quant.py): fp8 scaled, GGUF Q8_0
QUANT_RE = re.compile(r"_(fp8s|gguf)(?=_|$)")
FAMILY_RE = re.compile(r"_(schnell|kontext|fill|redux|cn)(?=_|$)")
FAMILY_FILES = ("schnell", "fill", "cn")  # the members with weights of their own, written next to --weights
SCHNELL_STEPS = 4        # FLUX.1-schnell is a 4-step model: its cases override --steps
REDUX_TOKENS = 729       # Redux's StyleModelApply appends 27 x 27 SigLIP image tokens to the text context
FILL_IN = 384            # FLUX.1 Fill's img_in features: (16 latent + 16 masked-image latent + 64 mask) x 2x2
CN_DEPTH = 2             # double blocks of the random ControlNet (XLabs layout)
CN_STRENGTH = 0.7
_ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "F8_E4M3": 1, "F8_E5M2": 1, "U8": 1, "I8": 1, "BOOL": 1,
             "I16": 2, "I32": 4, "I64": 8}


def family_file(weights, fam):
    """Where a family member's weights go: named after --weights and next to it (a tiny and a full-size
    --weights in one folder each get their own), ``<stem>_schnell`` / ``_fill`` / ``_cn.safetensors``.
    With a bare file name (graph()'s ``unet``) the bare name of the member's file."""
    d, b = os.path.split(weights)
    stem = b[: -len(".safetensors")] if b.endswith(".safetensors") else b
    return os.path.join(d, f"{stem}_{fam}.safetensors")


def _st_header(path):
    """A safetensors file's header {name: {dtype, shape, data_offsets}} and the offset its data starts at."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if not 0 < n <= min(os.path.getsize(path) - 8, 100 << 20):
            raise ValueError(f"{path}: not a safetensors file")
        h = json.loads(f.read(n))
    if not isinstance(h, dict):
        raise ValueError(f"{path}: not a safetensors file")
    h.pop("__metadata__", None)
    return h, 8 + n


def _dev_header():
    """The header write_weights gives --weights (FLUX.1-dev, bf16): sizes for a file not written yet."""
    sys.path.insert(0, ROOT)
    import _pack
    _pack.load()
    from flux_numba_pack.flux_core.checkpoint import FLUX1_DEV, expected_shapes
    h, pos = {}, 0
    for k, shape in expected_shapes(FLUX1_DEV).items():
        n = 2 * math.prod(shape)
        h[k] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [pos, pos + n]}
        pos += n
    return h


def _prefix(header):
    for p in ("model.diffusion_model.", "diffusion_model.", "model."):
        if p + "img_in.weight" in header:
            return p
    return ""


def family_plan(header, fam):
    """The tensors of a family member's file, made from --weights' own tensors (its header ``header``):
    [(name, dtype, shape, how)], ``how`` a --weights tensor name (copied byte for byte) or a new tensor
    -- ("randn", std), ("randn_ref", name, scale): std that of --weights' tensor ``name`` times
    ``scale``, ("fill_img_in", name): --weights' img_in widened to FILL_IN features (the new ones random
    at img_in's std).  So a full-size and a tiny (run.py --write-model --comfy-min) --weights both work.

    schnell: every tensor but ``guidance_in.*`` (ComfyUI's model_detection then picks FluxSchnell);
    fill: ``img_in.weight`` [hidden, 384] (in_channels 96: FluxInpaint); cn: an XLabs-layout FLUX
    ControlNet (ComfyUI's ``load_controlnet_flux_xlabs_mistoline``: FLUX's own key names, no prefix) --
    the embedders and CN_DEPTH double blocks of --weights, controlnet_blocks, pos_embed_input and the
    hint encoder (input_hint_block: 8 3x3 convolutions, 3 of stride 2, image -> 16 x res/8)."""
    pre = _prefix(header)
    if pre + "img_in.weight" not in header:
        raise ValueError("no img_in.weight: not a FLUX.1 checkpoint")
    hidden, pin = header[pre + "img_in.weight"]["shape"]
    dt = header[pre + "img_in.weight"]["dtype"]
    if fam == "schnell":
        return [(k, v["dtype"], v["shape"], k) for k, v in header.items() if not k.startswith(pre + "guidance_in.")]
    if fam == "fill":
        return [(k, v["dtype"], [hidden, FILL_IN], ("fill_img_in", k)) if k == pre + "img_in.weight" else
                (k, v["dtype"], v["shape"], k) for k, v in header.items()]
    if fam != "cn":
        raise ValueError(f"no weight file of its own for {fam!r}")
    out = [(k[len(pre):], v["dtype"], v["shape"], k) for k, v in header.items() if k.startswith(pre) and
           k[len(pre):].split(".")[0] in ("img_in", "time_in", "vector_in", "guidance_in", "txt_in")]
    blocks = [re.match(re.escape(pre) + r"double_blocks\.(\d+)\.", k) for k in header]
    depth = 1 + max(int(m.group(1)) for m in blocks if m)
    ref = pre + "double_blocks.0.img_attn.proj.weight"
    for i in range(CN_DEPTH):
        src = f"{pre}double_blocks.{i % depth}."
        out += [(f"double_blocks.{i}." + k[len(src):], v["dtype"], v["shape"], k) for k, v in header.items()
                if k.startswith(src)]
        out.append((f"controlnet_blocks.{i}.weight", dt, [hidden, hidden], ("randn_ref", ref, 0.1)))
        out.append((f"controlnet_blocks.{i}.bias", dt, [hidden], ("randn", 0.0)))
    out.append(("pos_embed_input.weight", dt, [hidden, pin], ("randn_ref", pre + "img_in.weight", 1.0)))
    out.append(("pos_embed_input.bias", dt, [hidden], ("randn", 0.0)))
    for j in range(8):
        cin = 3 if j == 0 else 16
        out.append((f"input_hint_block.{2 * j}.weight", dt, [16, cin, 3, 3], ("randn", (9 * cin) ** -0.5)))
        out.append((f"input_hint_block.{2 * j}.bias", dt, [16], ("randn", 0.01)))
    return out


def plan_bytes(plan):
    return sum(_ITEMSIZE[dt] * math.prod(shape) for _, dt, shape, _ in plan)


def _family_file_ok(path, plan):
    """An existing member file with exactly the plan's tensors (names, dtypes, shapes) is kept."""
    try:
        h = _st_header(path)[0]
    except (OSError, ValueError, struct.error):
        return False
    return {k: (v["dtype"], list(v["shape"])) for k, v in h.items()} == {n: (dt, list(s)) for n, dt, s, _ in plan}


def _copy_range(fi, fo, start, n):
    """n bytes of fi from ``start`` appended to fo (in-kernel copy_file_range where the file system
    has it, else 64 MiB reads)."""
    fo.flush()
    if hasattr(os, "copy_file_range"):
        try:
            done = 0
            while done < n:
                k = os.copy_file_range(fi.fileno(), fo.fileno(), n - done, start + done)
                if k <= 0:
                    break
                done += k
            fo.seek(0, os.SEEK_END)
            if done == n:
                return
            start, n = start + done, n - done
        except OSError:
            fo.seek(0, os.SEEK_END)
    fi.seek(start)
    while n:
        b = fi.read(min(n, 1 << 26))
        if not b:
            raise OSError("source file ended early")
        fo.write(b)
        n -= len(b)


def write_family(weights, fam, seed=2):
    """A family member's weights (``family_plan``) written next to ``weights`` unless a file with the same
    tensors is there: --weights' tensors copied byte for byte, the new ones generated on the GPU (CPU
    without one), one tensor at a time (no whole model in host memory).  The path, or None if kept."""
    import torch
    path = family_file(weights, fam)
    header, data0 = _st_header(weights)
    plan = family_plan(header, fam)
    if os.path.exists(path) and _family_file_ok(path, plan):
        return None
    dtypes = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
              "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(seed + FAMILIES.index(fam))

    def stored(fi, name):
        v = header[name]
        a, b = v["data_offsets"]
        fi.seek(data0 + a)
        return torch.frombuffer(bytearray(fi.read(b - a)), dtype=dtypes[v["dtype"]]).reshape(v["shape"])

    def randn(shape, std):
        return torch.randn(shape, generator=g, device=dev, dtype=torch.float32) * std

    hdr, pos = {}, 0
    for name, dt, shape, _ in plan:
        n = _ITEMSIZE[dt] * math.prod(shape)
        hdr[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [pos, pos + n]}
        pos += n
    hb = json.dumps(hdr, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    with open(weights, "rb") as fi, open(path + ".tmp", "wb") as fo:
        fo.write(struct.pack("<Q", len(hb)) + hb)
        for name, dt, shape, how in plan:
            if isinstance(how, str):
                a, b = header[how]["data_offsets"]
                _copy_range(fi, fo, data0 + a, b - a)
                continue
            if how[0] == "fill_img_in":
                old = stored(fi, how[1]).float()
                t = torch.cat([old.to(dev), randn([shape[0], shape[1] - old.shape[1]], old.std().item())], dim=1)
            elif how[0] == "randn_ref":
                t = randn(shape, stored(fi, how[1]).float().std().item() * how[2])
            else:
                t = randn(shape, how[1])
            t = t.to(dtypes[dt]).cpu().contiguous()
            fo.write(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    os.replace(path + ".tmp", path)
    return path


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


BASES = ("stock", "patched", "patched_fast", "patched_fast_cached", "easycache", "lazycache", "stock_easycache",
         "stock_lazycache", "stock_cudnn", "stock_flash")
PATCHED_BASES = ("patched", "patched_fast", "patched_fast_cached", "easycache", "lazycache")
CASE_GRAMMAR = ("one of " + ", ".join(BASES) + " (or " + ", ".join(VAE_CASES) + ") with optional suffixes _t<x> "
                "(cache cases), _sdpa, _eager, _fp8, _lora[b][<strength>] in that order, and family members "
                + ", ".join("_" + f for f in FAMILIES) + " anywhere after the base (not _schnell with _fill), "
                "one quantised checkpoint _fp8s / _gguf anywhere after the base (not with _fp8, _schnell, _fill)")


def parse_case(case):
    """A case name read into its parts, or ValueError (one line: why) for a name graph() does not know:
    {base, families (FAMILIES order), lora (the suffix), lora_before, lora_strength, fp8, eager, sdpa,
    threshold}.  Family suffixes may stand anywhere after the base (stock_schnell_fp8 =
    stock_fp8_schnell); the other suffixes in the order base[_t<x>][_sdpa][_eager][_fp8][_lora...]."""
    if case in VAE_CASES:
        return {"base": case, "families": (), "vae": True}
    found = FAMILY_RE.findall(case)
    if len(found) != len(set(found)):
        raise ValueError(f"case {case!r}: a family suffix twice")
    if "schnell" in found and "fill" in found:
        raise ValueError(f"case {case!r}: _schnell and _fill are two checkpoints; one of them per case")
    quants = QUANT_RE.findall(case)
    if len(quants) > 1:
        raise ValueError(f"case {case!r}: one quantised checkpoint (_fp8s or _gguf) per case")
    if quants and ("schnell" in found or "fill" in found):
        raise ValueError(f"case {case!r}: _{quants[0]} is made from --weights (dev), not from the _schnell / _fill file")
    rest = QUANT_RE.sub("", FAMILY_RE.sub("", case))
    try:
        rest, lora, lora_before, lora_strength = split_lora(rest)
    except ValueError:
        raise ValueError(f"case {case!r}: a LoRA strength that is no number") from None
    out = {"families": tuple(f for f in FAMILIES if f in found), "lora": lora, "lora_before": lora_before,
           "lora_strength": lora_strength, "vae": False, "quant": quants[0] if quants else None}
    for flag in ("fp8", "eager", "sdpa"):
        out[flag] = rest.endswith("_" + flag)
        rest = rest[: -len(flag) - 1] if out[flag] else rest
    thr = re.fullmatch(r"(.*cache)_t([0-9.]+)", rest)  # easycache_t1.0: EasyCache with reuse_threshold 1.0
    try:
        out["threshold"] = float(thr.group(2)) if thr else 0.2
    except ValueError:
        raise ValueError(f"case {case!r}: a cache threshold _t<x> that is no number") from None
    rest = thr.group(1) if thr else rest
    if out["fp8"] and out["quant"]:
        raise ValueError(f"case {case!r}: _fp8 (weight_dtype fp8_e4m3fn) with a quantised checkpoint _{out['quant']}")
    if rest not in BASES:
        raise ValueError(f"unknown case {case!r}: a case is {CASE_GRAMMAR}")
    out["base"] = rest
    return out


def graph(case, steps, res, seed, unet, vae, cond_dims=(4096, 768), prefix="", stock_vae=False):
    """API prompt for one case: stock | patched | patched_fast (profile fast) | patched_fast_cached
    (profile fast-cached) | easycache | lazycache | stock_easycache | stock_lazycache; a case ending in
    ``_fp8`` loads the weights with UNETLoader's weight_dtype fp8_e4m3fn (stock_fp8, patched_fast_fp8);
    a patched case ending in ``_eager`` runs with cuda_graph off (patched_eager: the eager host path);
    ``patched_sdpa``: exact with attention "sdpa" (ComfyUI's own attention call, stock's backend order);
    ``stock_cudnn`` / ``stock_flash``: stock with SDPA's cuDNN / FLASH backend first (controls for image
    agreement: what a change of attention backend alone does); ``vae_*``: decode-only (``decode_graph``);
    a cache case ending in ``_t<x>`` (``easycache_t1.0``) sets the cache node's reuse_threshold to x
    (default 0.2, the node's own); ``_lora[b][<strength>]``: a random LoRA after (``_lorab``: before) the patch.

    FLUX.1 family members, as suffixes anywhere after the base (``parse_case``; stock_schnell,
    patched_schnell, patched_fast_cached_kontext, patched_fill_fp8, stock_kontext_cn ...):

    * ``_schnell``: FLUX.1-schnell -- UNETLoader of ``<unet stem>_schnell.safetensors`` (--weights without
      ``guidance_in``: ComfyUI detects FluxSchnell), SCHNELL_STEPS (4) steps whatever ``steps`` says
      (euler, simple, cfg 1 as every case).
    * ``_kontext``: a FLUX.1 Kontext-style reference image -- a seeded random image (res x res) ->
      VAEEncode -> ReferenceLatent on the positive conditioning (the dev weights: the reference
      latent's tokens join the image tokens, twice the sequence).
    * ``_fill``: FLUX.1 Fill -- UNETLoader of ``<unet stem>_fill.safetensors`` (img_in [hidden, 384]:
      FluxInpaint), InpaintModelConditioning (positive, negative, the VAE, a seeded random image, a mask
      of its lower half, noise_mask) whose latent goes into the KSampler.
    * ``_redux``: FLUX.1 Redux's longer context -- FluxNumbaBenchConditioning with 256 + 729 tokens.  A
      stand-in for the token count StyleModelApply gives (729 SigLIP image tokens appended to the T5
      context), not the style model: no CLIP vision, no Redux weights.
    * ``_cn``: a FLUX ControlNet -- ControlNetLoader of ``<unet stem>_cn.safetensors`` (a random
      XLabs-layout ControlNet, CN_DEPTH double blocks, in models/controlnet), ControlNetApplyAdvanced
      (strength 0.7, 0 -> 1) with a seeded random hint image on both conditionings.

    Conditioning order where several combine: ReferenceLatent, then ControlNet, then
    InpaintModelConditioning.  In patched cases VAEEncode / InpaintModelConditioning take the same VAE
    as VAEDecode (FluxNumbaVAEPatch's clone; its encoder is ComfyUI's).  The reference / picture / hint
    images have fixed seeds (as a user re-running with a new noise seed keeps them); ComfyUI's cache
    re-encodes them only when the VAE input changes (so an interleaved stock / patched pair encodes in
    every prompt, as a decode does)."""
    if case in VAE_CASES:
        return decode_graph(case, res, seed, vae)
    name = prefix + case  # the SaveImage prefix: the case's full name (image_psnr pairs files by it)
    c = parse_case(case)
    fams, base = c["families"], c["base"]
    lora, lora_before, lora_strength = c["lora"], c["lora_before"], c["lora_strength"]
    eager, sdpa = c["eager"], c["sdpa"]  # eager: cuda_graph off, every block eager (the host path's own cost)
    control = {"stock_cudnn": "cudnn", "stock_flash": "flash"}.get(base)
    patched = base in PATCHED_BASES
    profile = {"patched_fast": "fast", "patched_fast_cached": "fast-cached"}.get(base, "exact")
    unet_name = (family_file(unet, "schnell") if "schnell" in fams else
                 family_file(unet, "fill") if "fill" in fams else
                 scaled_fp8_file(unet) if c["quant"] == "fp8s" else gguf_file(unet) if c["quant"] == "gguf" else unet)
    if "schnell" in fams:
        steps = SCHNELL_STEPS
    g = {
        "unet": ({"class_type": "UnetLoaderGGUF", "inputs": {"unet_name": unet_name}} if c["quant"] == "gguf" else
                 {"class_type": "UNETLoader", "inputs": {"unet_name": unet_name,
                                                         "weight_dtype": "fp8_e4m3fn" if c["fp8"] else "default"}}),
        "cond": {"class_type": "FluxNumbaBenchConditioning", "inputs": {
            "seed": 3, "tokens": 256 + (REDUX_TOKENS if "redux" in fams else 0),
            "context_dim": cond_dims[0], "pooled_dim": cond_dims[1]}},
        "vae": {"class_type": "VAELoader", "inputs": {"vae_name": vae}},
    }
    if "fill" not in fams:
        g["lat"] = {"class_type": "EmptySD3LatentImage", "inputs": {"width": res, "height": res, "batch_size": 1}}
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
             "lazycache": "LazyCache", "stock_lazycache": "LazyCache"}.get(base)
    if cache:
        g["cache"] = {"class_type": cache, "inputs": {"model": model, "reuse_threshold": c["threshold"],
                                                      "start_percent": 0.15, "end_percent": 0.95, "verbose": False}}
        model = ["cache", 0]
    pos = neg = ["cond", 0]
    latent = ["lat", 0]
    if "kontext" in fams:
        g["ref_img"] = {"class_type": "FluxNumbaBenchImage", "inputs": {"seed": 5, "width": res, "height": res}}
        g["ref_enc"] = {"class_type": "VAEEncode", "inputs": {"pixels": ["ref_img", 0], "vae": vae_ref}}
        g["ref"] = {"class_type": "ReferenceLatent", "inputs": {"conditioning": pos, "latent": ["ref_enc", 0]}}
        pos = ["ref", 0]
    if "cn" in fams:
        g["cn"] = {"class_type": "ControlNetLoader", "inputs": {"control_net_name": family_file(unet, "cn")}}
        g["cn_img"] = {"class_type": "FluxNumbaBenchImage", "inputs": {"seed": 6, "width": res, "height": res}}
        g["cn_apply"] = {"class_type": "ControlNetApplyAdvanced", "inputs": {
            "positive": pos, "negative": neg, "control_net": ["cn", 0], "image": ["cn_img", 0],
            "strength": CN_STRENGTH, "start_percent": 0.0, "end_percent": 1.0}}
        pos, neg = ["cn_apply", 0], ["cn_apply", 1]
    if "fill" in fams:
        g["fill_img"] = {"class_type": "FluxNumbaBenchImage", "inputs": {"seed": 4, "width": res, "height": res}}
        g["fill_mask"] = {"class_type": "FluxNumbaBenchMask", "inputs": {"width": res, "height": res}}
        g["inpaint"] = {"class_type": "InpaintModelConditioning", "inputs": {
            "positive": pos, "negative": neg, "vae": vae_ref, "pixels": ["fill_img", 0], "mask": ["fill_mask", 0],
            "noise_mask": True}}
        pos, neg, latent = ["inpaint", 0], ["inpaint", 1], ["inpaint", 2]
    g["ks"] = {"class_type": "KSampler", "inputs": {
        "model": model, "seed": seed, "steps": steps, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple",
        "positive": pos, "negative": neg, "latent_image": latent, "denoise": 1.0}}
    g["dec"] = {"class_type": "VAEDecode", "inputs": {"samples": ["ks", 0], "vae": vae_ref}}
    g["save"] = {"class_type": "SaveImage", "inputs": {"images": ["dec", 0], "filename_prefix": name}}
    return g


def stock_partner(case, cases):
    """The case in ``cases`` whose images ``case``'s are compared with: the plain stock case of the same
    family members, fp8-ness and LoRA (``_lorab`` as ``_lora``, same strength) -- stock_fp8 for *_fp8,
    stock_schnell for patched_schnell, stock_lora for patched_lorab; None if there is none (or
    ``case`` is it, or a decode-only case)."""
    def key(c):
        try:
            p = parse_case(c)
        except ValueError:
            return None
        if p["vae"]:
            return None
        return p["fp8"], p["families"], p["quant"], p["lora"].replace("_lorab", "_lora")
    k = key(case)
    if k is None:
        return None
    for c in cases:
        if key(c) == k:
            p = parse_case(c)
            if p["base"] == "stock" and not p["eager"] and not p["sdpa"]:
                return None if c == case else c
    return None


def run_order(cases, repeat, interleave):
    """[(case, run index)] in the order the prompts are queued.  --interleave: run by run, each case
    once per round -- within each checkpoint's group of cases (--weights, its _schnell, its _fill
    file; groups in the order of their first case): ComfyUI holds one of these 24 GB models on the
    GPU at a time, so a round over cases of several checkpoints would put a model load (seconds)
    into the first case after each switch; grouped, only each group's run 1 (left out of the medians
    over runs 2..N) pays it.  Cases of one checkpoint keep the plain interleaved order.  Without
    --interleave: each case's runs in a row."""
    if not interleave:
        return [(c, i) for c in cases for i in range(repeat)]
    groups = {}
    for c in cases:
        pc = {"families": (), "quant": None} if c in VAE_CASES else parse_case(c)
        fams = pc["families"]
        groups.setdefault("schnell" if "schnell" in fams else "fill" if "fill" in fams else pc["quant"] or "",
                          []).append(c)
    return [(c, i) for grp in groups.values() for i in range(repeat) for c in grp]


def image_psnr(out_dir, cases, interleaved):
    """PSNR (dB, 8-bit PNGs) of each case's images against the stock case's image of the same run
    index (the same seed): {case: [dB per run]}.  The stock case is ``stock_partner``'s: ``stock`` for
    bf16 cases, ``stock_fp8`` for ``*_fp8`` ones, ``stock_schnell`` for ``patched_schnell`` (the same
    family members, fp8-ness and LoRA); cases without a stock partner in the run are left out."""
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
        ref = stock_partner(case, cases)
        if ref is None:
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


def family_files_needed(cases):
    """The family members with weights of their own (FAMILY_FILES order) that ``cases`` use."""
    fams = {f for c in cases for f in parse_case(c)["families"]}
    return [f for f in FAMILY_FILES if f in fams]


def weights_room(weights, cases):
    """Where family members' files are needed: why the weight files still to be written (--weights,
    the members' files next to it) do not fit in --weights' folder (one line), or None.  A full-size
    schnell or fill file is as large as FLUX.1-dev (~24 GB; the ControlNet ~1.5 GB)."""
    fams = family_files_needed(cases)
    quants = sorted({parse_case(c)["quant"] for c in cases if c not in VAE_CASES} - {None})
    if not fams and not quants:
        return None
    todo = not os.path.exists(weights)
    try:
        header = _st_header(weights)[0] if os.path.exists(weights) else _dev_header()
    except Exception:  # no torch here, or --weights is no safetensors file: the writers say why, later
        return None
    need, what = 0, []
    if todo:
        need += max((v["data_offsets"][1] for v in header.values()), default=0)
        what.append(os.path.basename(weights))
    for f in fams:
        path = family_file(weights, f)
        try:
            plan = family_plan(header, f)
        except ValueError:
            continue
        if not (os.path.exists(path) and _family_file_ok(path, plan)):
            need += plan_bytes(plan)
            what.append(os.path.basename(path))
    for q in quants:
        path = (scaled_fp8_file if q == "fp8s" else gguf_file)(weights)
        if not os.path.exists(path):
            need += planned_bytes(header, q)
            what.append(os.path.basename(path))
    folder = os.path.dirname(os.path.abspath(weights))
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return None
    if need and need > free:
        return (f"argument --weights: {need / 1e9:.1f} GB of random weights to write into {folder} "
                f"({', '.join(what)}), {free / 1e9:.1f} GB free there: --weights in a larger folder, fewer of "
                f"_schnell / _fill / _fp8s / _gguf in one call, or --drop-family-files in the call before")
    return None


def check_args(p, a, flag_sets, cases):
    """One line and exit 2, before anything is written or started: a --comfy that is not a ComfyUI
    tree, a case graph() does not know (``parse_case``), weight files that do not fit in --weights'
    folder (``weights_room``), or no CUDA GPU where one is needed (the random weights are generated on the GPU; a server
    runs on it unless its flag set has --cpu, as in a CPU smoke test with --weights of an existing file)."""
    def fail(msg):
        p.exit(2, f"gpu_server.py: error: {msg}\n")
    for comfy in a.comfy:
        if not os.path.isfile(os.path.join(comfy, "main.py")):
            fail(f"argument --comfy: no ComfyUI tree at {comfy!r}: no main.py there")
    if not cases:
        fail("argument --cases: no case")
    for case in cases:
        try:
            parse_case(case)
        except ValueError as e:
            fail(f"argument --cases: {e}")
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
    room = weights_room(a.weights, cases)
    if room:
        fail(room)
    if any(c not in VAE_CASES and parse_case(c)["quant"] == "gguf" for c in cases):
        if not os.path.isfile(os.path.join(a.gguf_pack, "nodes.py")):
            fail(f"argument --gguf-pack: no ComfyUI-GGUF at {a.gguf_pack!r} (its nodes.py), needed by the _gguf cases")
        import importlib.util
        if importlib.util.find_spec("gguf") is None:
            fail("the _gguf cases need the gguf package (ComfyUI-GGUF's requirement) in this Python")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--comfy", action="append", required=True, help="ComfyUI tree (repeatable)")
    p.add_argument("--flags", action="append", default=None,
                   help='extra main.py flags for one server, e.g. "--highvram" (repeatable; "" = defaults)')
    p.add_argument("--cases", default="stock,patched", help="comma list: stock, patched, easycache, lazycache, "
                   "stock_easycache, stock_lazycache, ... (graph()); FLUX.1 family members as suffixes: _schnell, "
                   "_kontext, _fill, _redux, _cn (stock_schnell,patched_schnell,stock_fill,patched_fill ...)")
    p.add_argument("--steps", type=int, default=28)
    p.add_argument("--res", type=int, default=1024)
    p.add_argument("--repeat", type=int, default=2, help="runs per case; the last one is reported")
    p.add_argument("--interleave", action=argparse.BooleanOptionalAction, default=False,
                   help="alternate the cases run by run (drift hits all alike; cases of one checkpoint -- dev, "
                   "_schnell, _fill -- together: run_order); the table then also gives each case's median over "
                   "runs 2..N (--no-interleave: each case's runs in a row -- a later run of a case then shows its "
                   "speed without a switch of weights or LoRA before it)")
    p.add_argument("--weights", default="/dev/shm/flux1_dev_random.safetensors")
    p.add_argument("--gguf-pack", default=GGUF_PACK, help="ComfyUI-GGUF's folder (an export of city96/ComfyUI-GGUF) "
                   "for _gguf cases (default: $COMFYUI_GGUF_PATH or .gpu/ComfyUI-GGUF)")
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
    p.add_argument("--drop-family-files", action="store_true", help="at the end remove the family members' "
                   "weight files this call used (_schnell / _fill / _cn / _fp8s / _gguf next to --weights): room in /dev/shm for "
                   "the next call's")
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
    fam_paths = {}
    for fam in family_files_needed(cases):
        t1 = time.time()
        fam_paths[fam] = family_file(a.weights, fam)
        wrote = write_family(a.weights, fam)
        print(f"[bench] {fam}: {'wrote' if wrote else 'kept'} {fam_paths[fam]} "
              f"({os.path.getsize(fam_paths[fam]) / 1e9:.2f} GB, {time.time() - t1:.1f} s)", flush=True)
    quant_paths = {}
    for q, writer in (("fp8s", write_fp8_scaled), ("gguf", write_gguf_q8_0)):
        if any(c not in VAE_CASES and parse_case(c)["quant"] == q for c in cases):
            t1 = time.time()
            quant_paths[q] = writer(a.weights)
            print(f"[bench] {q}: {quant_paths[q]} ({os.path.getsize(quant_paths[q]) / 1e9:.2f} GB, "
                  f"{time.time() - t1:.1f} s)", flush=True)
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
            if "gguf" in quant_paths:
                os.symlink(os.path.abspath(a.gguf_pack), os.path.join(cn, "ComfyUI-GGUF"))
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
            for sub, src in (("diffusion_models", a.weights), ("vae", vae_path), ("loras", lora_path),
                             ("diffusion_models", fam_paths.get("schnell", "")),
                             ("diffusion_models", fam_paths.get("fill", "")),
                             ("controlnet", fam_paths.get("cn", "")),
                             ("diffusion_models", quant_paths.get("fp8s", "")),
                             ("diffusion_models", quant_paths.get("gguf", ""))):
                os.makedirs(os.path.join(base, "models", sub), exist_ok=True)
                if src and os.path.exists(src):
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
            order = run_order(cases, a.repeat, a.interleave)
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
    if a.drop_family_files:
        for path in list(fam_paths.values()) + list(quant_paths.values()):
            try:
                os.remove(path)
            except OSError:
                pass
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    for rec in results:
        for ln in rec.get("log_lines", [])[:25]:
            print(f"[log {rec['comfyui']} {rec['flags'] or 'default'}] {ln[:220]}")
    cw = max([16] + [len(r[2]) for r in rows])  # the case column: as wide as the longest name
    print(f"\n{'ComfyUI':8} {'flags':22} {'case':{cw}} {'s/image':>8} {'first':>7} {'peakGB':>7}  note")
    for r in rows:
        print(f"{r[0]:8} {r[1]:22} {r[2]:{cw}} {r[3]:>8} {r[4]:>7} {r[5]:>7}  {r[6]}")
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
