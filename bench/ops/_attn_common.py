"""Pieces shared by the attention GPU scripts (gpu_attention.py, gpu_attn8.py, gpu_attn_kernels.py,
gpu_attn_ab.py): the start-up (dry run or GPU, the repo root on sys.path), the dry-run shims (CPU
simulator smoke test of a script's flow), notes, the fp32 reference, event timing."""
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # bench/: timing.py
ROOT = os.path.dirname(BENCH)  # the repo root
sys.path.insert(0, BENCH)
import timing  # noqa: E402  (bench/timing.py, the shared timing helper)

DRY = False
T0 = time.time()
results = {}  # JSON of the run


def script_env(var="FLUX_ATTN_DRYRUN"):
    """A script's first step, before numba loads: DRY = the environment variable ``var`` is "1" (the
    CPU simulator) else the real GPU path; the repo root first on sys.path (for ``_pack``)."""
    dry = os.environ.get(var) == "1"
    if dry:
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    else:
        os.environ.setdefault("FLUX_NUMBA_REAL_GPU", "1")
    sys.path.insert(0, ROOT)
    return dry


class _Ev:
    """Wall-clock stand-in for torch.cuda.Event in a dry run."""

    def __init__(self, **kw):
        self.t = 0.0

    def record(self):
        self.t = time.perf_counter()

    def elapsed_time(self, other):
        return (other.t - self.t) * 1e3


def init(dry: bool):
    """Set the mode (dry: CPU simulator, tiny shapes, wall-clock 'events'); TF32 off."""
    global DRY
    DRY = dry
    if dry:
        torch.cuda.Event = _Ev
        torch.cuda.synchronize = lambda: None
        torch.cuda.empty_cache = lambda: None
        torch.cuda.get_device_name = lambda: "simulator (dry run)"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def note(name, **kw):
    results[name] = kw
    print(f"[{time.time() - T0:6.1f}s] {name}: " + ", ".join(f"{k}={v}" for k, v in kw.items()), flush=True)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def ref32(q, k, v, mask=None):
    """fp32 attention (math backend, heads in chunks of 4: it materialises [B, h, L, L]) ->
    [B, L, H*D]; mask already in [Bm, Hm, L, L] form (attention.normalize_mask)."""
    from torch.nn.attention import sdpa_kernel, SDPBackend
    B, H, L, D = q.shape
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.float()
    outs = []
    with sdpa_kernel(SDPBackend.MATH):
        for h0 in range(0, H, 4):
            mh = None if mask is None else (mask if mask.shape[1] == 1 else mask[:, h0:h0 + 4])
            outs.append(F.scaled_dot_product_attention(q[:, h0:h0 + 4].float(), k[:, h0:h0 + 4].float(),
                                                       v[:, h0:h0 + 4].float(), attn_mask=mh))
    return torch.cat(outs, 1).transpose(1, 2).reshape(B, L, H * D)


def time_ms(fn, reps=25, warm=3):
    """Median ms of one call between two events (dry: one wall-clock call; timing.median_ms)."""
    if DRY:
        reps, warm = 1, 0
    return timing.median_ms(fn, reps, warm)


def graph_ms(fn, n=10):
    """Device time of one call: n calls captured in one CUDA graph, median replay / n (dry: time_ms)."""
    if DRY:
        return time_ms(fn)
    return timing.graph_ms(fn, n, reps=20)


def finish(json_name, obj, title, rows):
    """The attention scripts' last lines: JSON of the run to $OUT/json_name when OUT is set, then
    the title and the rows as a left-aligned table."""
    out = os.environ.get("OUT")
    if out:
        try:
            with open(os.path.join(out, json_name), "w") as f:
                json.dump(obj, f, indent=1, default=str)
        except Exception as ex:
            print("JSON write failed:", ex)
    print(title)
    n = max((len(r) for r in rows), default=0)
    w = [max(len(str(r[i])) for r in rows) for i in range(n)]
    for r in rows:
        print("  ".join(str(c).ljust(w[i]) for i, c in enumerate(r)))
