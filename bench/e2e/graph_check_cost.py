"""Host cost of the per-call CUDA-graph safety check on FLUX.1-dev's module tree (CPU only).

    COMFYUI_PATH=.carry/ComfyUI-0.8.0 python bench/e2e/graph_check_cost.py

Builds ComfyUI's ``Flux`` with FLUX.1-dev's depth (19 double + 38 single blocks: 581 modules that own
parameters, 780 parameters) at tiny widths -- the walk's cost depends on the tree, not on the tensor
sizes -- and times, median of 21 after 3 warm-ups (``time.perf_counter``):
  * before (the earlier wrapper, each step): ``flux_core.graphs.graph_blockers`` (named_parameters,
    device compare), a ``named_modules`` walk for per-call weight work, and ``GraphedForward``'s
    ``data_ptr`` tuple over ``parameters()``;
  * now: ``nodes.host.graph_state`` (one walk, the addresses included).
The parameters are CPU tensors and the device claimed is cuda:0 (every weight reads as offloaded:
the walk runs to the end either way).
"""
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.abspath(os.environ.get("COMFYUI_PATH", os.path.join(ROOT, ".carry", "ComfyUI"))))

import torch  # noqa: E402

from comfy.cli_args import args  # noqa: E402

args.cpu = True
import comfy.ops  # noqa: E402
from comfy.ldm.flux.model import Flux  # noqa: E402

import _pack  # noqa: E402

_pack.load()
from flux_numba_pack.flux_core.graphs import graph_blockers  # noqa: E402
from flux_numba_pack.nodes import host  # noqa: E402
from flux_numba_pack.nodes.host.residency import _freezes_per_call_work  # noqa: E402

torch.cuda.is_current_stream_capturing = lambda: False   # (CPU-only torch builds raise there)

kw = dict(in_channels=16, out_channels=16, vec_in_dim=32, context_in_dim=64, hidden_size=64, mlp_ratio=4.0,
          num_heads=2, depth=19, depth_single_blocks=38, axes_dim=[8, 12, 12], theta=10000, qkv_bias=True,
          guidance_embed=True, patch_size=2, txt_ids_dims=[])
try:
    m = Flux(**kw, operations=comfy.ops.disable_weight_init, dtype=torch.bfloat16, device="cpu")
except TypeError:   # trees whose FluxParams lack the newer fields
    kw.pop("patch_size"), kw.pop("txt_ids_dims")
    m = Flux(**kw, operations=comfy.ops.disable_weight_init, dtype=torch.bfloat16, device="cpu")
dev = torch.device("cuda", 0)


def before():
    why = graph_blockers(m, dev)
    cast = [n for n, mm in m.named_modules() if _freezes_per_call_work(mm)]
    return why, cast, tuple(p.data_ptr() for p in m.parameters())


def now():
    return host.graph_state(m, dev)


def med_ms(fn, warm=3, rep=21):
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(rep):
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts)


n_mod = sum(1 for mm in m.modules() if mm._parameters)
n_par = sum(1 for _ in m.parameters())
b, a = med_ms(before), med_ms(now)
assert now()[1] == before()[2]   # the same addresses, in the same order
print(f"FLUX.1-dev tree: {n_mod} modules with parameters, {n_par} parameters")
print(f"per-call graph check: before {b:.2f} ms, graph_state {a:.2f} ms ({b / a:.1f}x)")
