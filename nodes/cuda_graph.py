"""Replay the whole patched FLUX forward as a CUDA graph inside ComfyUI (DIFFUSION_MODEL wrapper).

Captured per input signature (latent/context shapes, dtypes) after a warm-up; replayed every
step.  Only when it is safe -- otherwise the step runs eagerly and the reason is logged once:
  * under either allocator, PyTorch's native one or cudaMallocAsync (ComfyUI's default on
    NVIDIA).  Under cudaMallocAsync an invalidated capture is fatal (the frees that follow it raise
    inside a destructor and terminate the process), so ``GraphedForward`` proves first that the
    forward never syncs the host and captures with syncs turned into Python errors and
    ``capture_error_mode="thread_local"`` (flux_core/graphs.py); tensors from before the capture
    released inside it (the previous step's cached SiLU(vec)) are deferred frees, benign there;
  * the graph covers the model's own forward only: wrappers added after the patch (EasyCache,
    LazyCache ... -- they read tensors on the host with ``.item()`` and decide per step whether to
    run the model at all) would otherwise run inside this one and be recorded into the graph (a host
    sync inside a capture invalidates it; their decisions would be frozen).  So they run first and
    this wrapper's work runs innermost (``host.run_innermost``): every step they let through
    replays the graph.  Wrappers added before the patch run outside it anyway;
  * every weight on the GPU (no low-VRAM offload), no DynamicVRAM staging and no weight functions
    (on-the-fly LoRA) -- plain per-call casts of resident weights (fp8 storage) are device work at
    fixed addresses and are captured -- and no other node's block replacements;
  * no ControlNet, no reference latents (Kontext), no other per-step model patches,
  * not already capturing.
Weights patched in place (LoRA) keep their addresses, so replays see them; if weights move
(model unloaded and reloaded) the graph is re-captured.  Where the whole forward runs eagerly, the
blocks inside may replay per-block graphs (``flux_core.block_graphs.allowed``).
"""
from __future__ import annotations

import logging

from ..flux_core.graphs import GraphGuard, Guarded

log = logging.getLogger("flux_numba")

KEY = "flux_numba_cuda_graph"


class GraphWrapper(Guarded):
    """The DIFFUSION_MODEL wrapper: the whole forward through a CUDA graph where that is safe (module
    docstring), under ``flux_core.graphs.GraphGuard``'s policy."""

    def __init__(self, max_graphs: int = 2, stats: dict = None):
        self.stats = stats if stats is not None else {}  # whole_replays / whole_eager / whole_why (the step timer)
        self.guard = GraphGuard("whole-forward CUDA graph off for this call (per-block graphs where the weights "
                                "are resident)", warmup=2, max_graphs=max_graphs)

    def _eager(self, why, executor, *args, **kwargs):
        """The forward without the whole-forward graph, the reason logged once (``GraphGuard.eager``)."""
        return self.guard.eager(why, lambda: self._run_eager(why, executor, args, kwargs))

    def _run_eager(self, why, executor, args, kwargs):
        """The forward without the whole-forward graph: its blocks may replay per-block graphs
        (``flux_core.block_graphs``) where their weights are resident."""
        from ..flux_core import block_graphs
        self.stats["whole_eager"] = self.stats.get("whole_eager", 0) + 1
        self.stats["whole_why"] = "whole-step graph off: " + why
        with block_graphs.allowed():
            return executor(*args, **kwargs)

    def __call__(self, executor, *args, **kwargs):
        from .host import inner_wrappers, run_innermost
        if inner_wrappers(executor):  # wrappers added after ours: they run first, the graph innermost
            self.stats["innermost"] = self.stats.get("innermost", 0) + 1
            return run_innermost(executor, self._graphed, *args, **kwargs)
        return self._graphed(executor, *args, **kwargs)

    def _graphed(self, executor, x, timestep, context, y=None, guidance=None, ref_latents=None, control=None,
                 transformer_options={}, **kwargs):
        """The forward through the graph where safe; ``executor`` calls the model itself (or wrappers
        we cannot see inside: then eager, with the reason)."""
        from .host import graph_state, wrapped_object
        args = (x, timestep, context, y, guidance, ref_latents, control, transformer_options)
        dm = wrapped_object(executor)
        if not x.is_cuda:
            return self._eager("not a CUDA device", executor, *args, **kwargs)
        if control is not None or ref_latents is not None:
            return self._eager("ControlNet / reference latents change per step", executor, *args, **kwargs)
        if kwargs.get("attention_mask") is not None:
            return self._eager("attention mask", executor, *args, **kwargs)
        extra = {k for k, v in transformer_options.get("patches", {}).items() if v}
        if extra:
            return self._eager(f"other model patches present ({sorted(extra)})", executor, *args, **kwargs)
        why = self.guard.failed or capture_problem(executor, transformer_options)
        if why:
            return self._eager(why, executor, *args, **kwargs)
        why, wkey = graph_state(dm, x.device)   # (one pass; also the weights' addresses for the graph)
        if why:
            return self._eager("; ".join(why), executor, *args, **kwargs)
        has_y, has_g = y is not None, guidance is not None  # FLUX schnell has no guidance input

        def fn(xx, tt, cc, *rest):
            rest = list(rest)
            yy = rest.pop(0) if has_y else None
            gg = rest.pop(0) if has_g else None
            return executor(xx, tt, cc, yy, gg, None, None, transformer_options, **kwargs)
        # the executor and transformer_options of *this* call are what a capture records
        out = self.guard.run(fn, (x, timestep, context, *[v for v in (y, guidance) if v is not None]), wkey,
                             lambda: self._run_eager(self.guard.failed or "", executor, args, kwargs))
        if self.guard.last_mode == "graph":
            self.stats["whole_replays"] = self.stats.get("whole_replays", 0) + 1
        elif self.guard.last_mode == "warm-up":
            self.stats["whole_why"] = "whole-step graph warming up (eager steps before its capture)"
        return out


def capture_problem(executor, transformer_options):
    """Why capturing the rest of this call is unsafe (see the module docstring), or None."""
    from .host import compiler_recording, inner_wrappers
    rec = compiler_recording()
    if rec:
        return rec
    inner = inner_wrappers(executor)
    if inner is None:
        return "cannot see the diffusion-model wrapper chain"
    if inner:
        names = sorted({getattr(w, "__name__", type(w).__name__) for w in inner})
        return f"other diffusion-model wrappers run inside this one ({names}): they would be captured"
    replaced = transformer_options.get("patches_replace", {})
    others = [k for group in replaced.values() for k, fn in group.items()
              if not (getattr(fn, "_flux_numba", False) and getattr(fn, "_flux_numba_previous", None) is None)]
    if others:
        return f"other nodes' block replacements ({len(others)}, e.g. {others[0]})"
    return None


def install(model_patcher, wrapper: GraphWrapper = None):
    """Add the graph wrapper to a (cloned) ModelPatcher."""
    from .host import install_diffusion_wrapper
    return install_diffusion_wrapper(model_patcher, KEY, wrapper or GraphWrapper())
