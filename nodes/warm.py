"""Kernel warm-up for a FluxNumbaPatch: the kernels a plan may use compiled (or loaded from numba's
on-disk cache) with progress on the node, or left to the background build; and the RoPE its torch
path uses.  Failures are reported, never raised: the ops then run on torch."""
from __future__ import annotations

import logging

from .plan import PatchPlan

log = logging.getLogger("flux_numba")


def _use_stock_rope():
    """The torch reference of qk_norm_rope uses ComfyUI's own RoPE (comfy-kitchen's kernel), so the
    pack's torch path costs what stock costs (a plain fp32 torch RoPE is ~13 ms/step slower)."""
    from ..cuda_kernels import qk_norm_rope
    from .host import stock_rope
    rope = stock_rope()
    if rope is None:
        log.info("[flux_numba] stock RoPE not found; torch path uses the plain torch RoPE")
    else:
        qk_norm_rope.set_stock_rope(rope)


# (op, backend) pairs warmed without error in this process: a re-executed patch node (a workflow that
# alternates re-runs it every prompt) skips them -- warming them again cost ~0.1 s per prompt (test
# tensors, a run and a device sync per op, two scans of numba's cache directory per op)
_WARMED = set()


def warm_kernels(unique_id, plan) -> dict:
    """Compile (or load from the on-disk cache) the kernels this patch may use, with progress on the
    node; failures are reported (the ops then run on torch), never raised.  Once per (op, backend)
    and process (``_WARMED``)."""
    from ..cuda_kernels import prebuild, warmup
    from .progress import compile_progress
    plan = PatchPlan.of(plan)
    want_attn = plan.attention_kernels()
    fp8 = False
    if plan.fast:
        from ..flux_core import fast
        fp8 = fast.support("cuda") is None  # elsewhere the fast profile runs exact (logged at the first step)
    want = {(op, b) for op, b in warmup.WARM_NAMES
            if (op in warmup.FP8_OPS and fp8) or (op == "attention" and b in want_attn)
            or (op not in warmup.FP8_OPS + warmup.VAE_OPS and op != "attention" and plan.route_norms)}
    # by name only: warm_all builds the test tensors (~20-50 ms of host work) for what is left
    calls = [n for n in warmup.WARM_NAMES if n in want and n not in _WARMED]
    if not calls:
        return {"warm": "all kernels of this patch were warmed earlier in this process"}
    out = {}
    build = prebuild.current()
    if build is not None and not build.done.is_set():
        # the kernels are being built in the background (first start after an install or update):
        # no wait here -- each op runs ComfyUI's torch math until its kernels are stored; what the
        # build does not cover (the pack's own attention kernels, when asked for) is warmed below
        done, total = build.progress()
        from .progress import _send_text
        msg = (f"FluxNumba kernels: being built in the background ({done}/{total or '?'}); the first steps "
               f"run ComfyUI's own math and switch to the kernels as they are ready")
        log.info("[flux_numba] %s", msg)
        _send_text(msg, unique_id)
        out["background_build"] = {"done": done, "total": total, "state": build.state}
        calls = [c for c in calls if not build.covers(c[0])]
        if not calls:
            return out
    with compile_progress(unique_id, total=len(calls)) as prog:
        res = warmup.warm_all("cuda", backends=set(calls), on_begin=prog.begin,
                              on_step=lambda name, cached, dt, err: prog.step(name + (f" FAILED ({err})" if err else ""),
                                                                              cached=cached))
    out.update({k: {"s": round(v["seconds"], 2), "cached": v["cached"], "error": v["error"]} for k, v in res.items()})
    for op, backend in calls:
        r = res.get(warmup.warm_name(op, backend))
        if r is not None and r["error"] is None:
            _WARMED.add((op, backend))
    return out
