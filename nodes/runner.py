"""The work behind FluxNumbaPatch (``patch.py``): MODEL -> MODEL, every FLUX.1 block through
``flux_core.blocks``.

Only ComfyUI's per-model mechanisms are used: the node clones the ModelPatcher (the input model
is never touched) and installs ``set_model_patch_replace(fn, "dit", "double_block"|"single_block", i)``
entries in the clone's ``model_options``.  Nothing global is patched, so unpatching is ComfyUI's
own business: the original ModelPatcher (and every clone made before this node) runs stock.

Per block call ``fn(args, extra)``:
  * the block module is the one ComfyUI is running right now (``host.resolve_block``); every fact
    about ComfyUI's modules -- block types, how the q/k norm scales and the up-projection weights
    are obtained (through ComfyUI's ops: DynamicVRAM staging, low-VRAM offload, fp8 storage, LoRA
    weight functions), which host features the fused path cannot run -- comes from the host package (``nodes/host/``);
  * the op policy (backend / attention / route_norms) is applied with ``registry.force(...)`` only
    while this model's block runs, so two differently patched models in one graph don't interfere;
  * attention: which callable a block call's attention runs (``attention_route.AttentionRoute``);
  * a block or call the fused path does not cover (a non-FLUX.1 block, unexpected shapes/dtypes,
    ``attn1_patch`` / ``attn1_output_patch``, Kontext ``modulation_dims``) runs ComfyUI's original
    block, logged once per reason;
  * an exception inside our path: logged once, the block reruns stock, and the pack's path turns
    itself off for this model at that forward signature (batch, tokens, dtype, device, mask):
    later calls go straight to the original block (one dict lookup -- no checks, no copies, no
    retries).  Only the first call of each block signature keeps a copy of img/txt, so a failure
    after an in-place update is undone; OOM is re-raised so ComfyUI's own OOM handling sees it.

CUDA graphs (``cuda_graph`` auto): the whole forward through ``cuda_graph.GraphWrapper`` where it
can be captured; where it cannot (DynamicVRAM, ControlNet, masks ...) each
block call goes through ``flux_core.block_graphs.BlockGraphs`` with the host's residency key
(``host.block_residency``): replayed while its weights stay put, eager otherwise.  A re-executed
patch node with the same model and options reuses its runner (``_REUSE``), graphs included.

Sampling: the patched model moves its processed conditioning to the GPU once per sampling run
(``host.install_conds_on_device``): ComfyUI copies it from the CPU every step, and a copy from
pageable memory waits for the GPU, which then idles through the next step's host work.

Pass-through: with no usable CUDA GPU / numba the node logs why and returns the clone unpatched,
unless backend is "torch" (the A/B baseline) or ``SIMULATOR_OK`` is set (CPU tests: the kernels in Numba's
simulator).
``model_options["transformer_options"]["flux_numba"]`` describes what was done (for the step timer).
"""
from __future__ import annotations

import itertools
import logging
import weakref
from collections import OrderedDict
from typing import Optional

import torch

from .host import (ComfyWeights, block_problem, block_residency, call_problem, capture_headroom, compiler_recording,
                   dynamic_block, flux_types, fp8_stored_block, release_pins, resolve_block, staged_block,
                   streamed_weights, weight_epoch)
from .plan import (ATTENTION_BACKEND, ATTENTION_OP, ATTENTIONS, BACKENDS, CUDA_GRAPHS, FAST_PROFILES,  # noqa: F401
                   PROFILES, BlockFacts, PatchPlan)
from .warm import warm_kernels, _use_stock_rope
from .checks import input_problem
from .attention_route import AttentionRoute, SDPA_BACKENDS
from .fp8_copies import FP8_KEEP_FREE_SHARE, Fp8Copies  # noqa: F401

log = logging.getLogger("flux_numba")


INFO_KEY = "flux_numba"

# per-block graph capture function (None: CUDA graphs, flux_core.block_graphs.CudaCapture); tests set a stand-in
BLOCK_CAPTURE = None

# patch id -> live counters (calls, fallbacks, reasons); the step timer may read ``stats(id)``
_STATS = {}
_ids = itertools.count(1)


_RUNNERS = weakref.WeakValueDictionary()  # patch id -> its _Runner (while a patched model holds it)
# The last REUSE_MAX patches (model, options) keep their runner: re-executing FluxNumbaPatch with the same
# inputs (workflows that alternate re-run the node) reuses its CUDA graphs, attention choices and fp8
# copies instead of warming up and capturing again.  An unload frees their graphs and fp8 copies.
_REUSE = OrderedDict()
REUSE_MAX = 3


def stats(patch_id: int) -> dict:
    return _STATS.get(patch_id, {})


def _reuse_key(model, plan):
    return id(model), PatchPlan.of(plan)


def _reused_runner(model, plan):
    key = _reuse_key(model, plan)
    r = _REUSE.get(key)
    if r is None or r.model_ref() is not model:
        _REUSE.pop(key, None)
        return None
    _REUSE.move_to_end(key)
    return r


def _release_fp8_copies(model, current):
    """The kept fp8 weight copies (fast-cached: ~12 GB for FLUX.1-dev) of the model's other kept
    runners, when another patch of that model runs: freed where their GPU is short of memory (less
    than ``FP8_KEEP_FREE_SHARE`` of it free), so at most one copy per model stays there; kept where
    there is room, so a workflow switching between profiles does not re-quantise the copy and
    re-capture its graphs on every switch (H200, v0.33 interleaved: 3.43 s vs 3.09-3.19 per image)."""
    for key, r in list(_REUSE.items()):
        if r is not current and key[0] == id(model) and not r.fp8_room():
            r.drop_fp8_copies()


def runner_of(model_patcher):
    """The _Runner of a patched ModelPatcher (tests, benches), or None."""
    info = model_patcher.model_options.get("transformer_options", {}).get(INFO_KEY) or {}
    return _RUNNERS.get(info.get("id"))


SIMULATOR_OK = False  # tests: run the pack's path with the kernels in Numba's CUDA simulator (no GPU)
# DynamicVRAM: stage each fused block's weights at once through ComfyUI's block prefetch (False: A/B runs)
STAGE_BLOCKS = True


def _simulator_ok() -> bool:
    return bool(SIMULATOR_OK)


def _pack():
    """The pack's flux_core.blocks / cuda_kernels modules (relative imports, lazily)."""
    from ..flux_core import blocks
    from ..cuda_kernels import registry, runtime  # ``registry`` is the OpRegistry instance
    return blocks, registry, runtime


def _graph_probe() -> bool:
    """Inside the CUDA-graph wrapper's sync-checked warm-up or its capture (flux_core/graphs.py):
    an error there is the graph wrapper's to handle (it runs the step eagerly and stops capturing)
    -- not a reason to turn the fused path off for the model."""
    try:
        from ..flux_core.capture import in_probe
        return in_probe() or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
    except Exception:
        return False


def _is_oom(e: BaseException) -> bool:
    """torch's out-of-memory (``flux_core.graphs.is_oom``) or ComfyUI's own OOM exception types."""
    from ..flux_core.graphs import is_oom
    from .host import ui
    oom = ui.oom_exceptions()
    return bool(oom and isinstance(e, oom)) or is_oom(e)


# ----------------------------------------------------------------------------- checks
def unavailable_reason(model_patcher, backend: str) -> Optional[str]:
    """None when the numba path may run for this model; else why the node passes through."""
    if backend == "torch" or _simulator_ok():
        return None
    try:
        _, _, runtime = _pack()
    except Exception as e:
        return f"the pack's kernels failed to import ({type(e).__name__}: {e})"
    why = runtime.numba_status()
    if why:
        return f"numba-cuda unusable: {why}"
    if not torch.cuda.is_available():
        return "no CUDA GPU visible to torch"
    dev = getattr(model_patcher, "load_device", None)
    if dev is None or getattr(dev, "type", str(dev)) != "cuda":
        return f"the model runs on {dev}, the numba kernels need a CUDA device"
    return None


# ----------------------------------------------------------------------------- runner
class _Runner(AttentionRoute, Fp8Copies):
    """Shared by all block functions of one patch (and every later clone of the patched model)."""

    def __init__(self, plan, model_ref, patch_id: int):
        blocks, registry, runtime = _pack()
        self.blocks = blocks
        self.registry = registry
        self.plan = plan = PatchPlan.of(plan)
        self.model_ref = model_ref
        self.fused = plan.fused
        self.fast = plan.fast
        self._fp8 = {}  # device -> flux_core.fast.Fp8Weights, or None where fp8 cannot run (logged)
        self.policy, self.attn_route = plan.op_policy(registry.ops)
        self.block_ok = {}  # id(block) -> BlockFacts
        self.proven = set()  # input signatures that ran through our path once
        self.attn_choice = {}  # attention "auto": input signature -> backend the registry chose
        self._sdpa_direct = None  # see sdpa_direct()
        self.logged = set()
        self.off = {}  # forward signature -> why the fused path is off for it (turn_off)
        self.silu_cache = {}  # shared by every block call: SiLU(vec) once per step (BlockContext.silu)
        self.version = runtime.tensor_version
        self.patch_id = patch_id
        self.whole = None  # the whole-forward GraphWrapper (cuda_graph auto)
        self.graphs = None  # flux_core.block_graphs.BlockGraphs when cuda_graph is auto (enable_block_graphs)
        self.graph_why = {}  # why a block call could not replay (not resident, weight functions ...) -> calls
        from ..flux_core import block_graphs
        self._graphs_mod = block_graphs
        while len(_STATS) >= 256:  # keep the counters of recent patches only
            _STATS.pop(next(iter(_STATS)))
        self.stats = _STATS.setdefault(patch_id, {"calls": 0, "fallbacks": 0, "reasons": {}})

    def unloaded(self):
        """ComfyUI unloaded the model: free the CUDA graphs and the kept fp8 weight copies."""
        if self.graphs is not None:
            self.graphs.drop("the model was unloaded")
        if self.whole is not None:
            self.whole.drop()
        self.drop_fp8_copies(graphs_dropped=True)  # (the graphs over the copies are gone already)

    def enable_block_graphs(self, capture_fn=None):
        self.graphs = self._graphs_mod.BlockGraphs(capture_fn)
        self.stats["block_graphs"] = self.graphs.counts  # replay / capture / eager / eager_not_resident / failed
        self.stats["block_graph_misses"] = self.graph_why
        return self.graphs

    def note(self, key, level, msg, *a):
        if key not in self.logged:
            self.logged.add(key)
            log.log(level, "[flux_numba] " + msg, *a)

    def fallback(self, kind, index, why, args, extra, level=logging.WARNING):
        """Count, log once per (block kind, reason) -- not per block or step -- and run stock."""
        reason = f"{kind} block {index}: {why}"
        self.stats["fallbacks"] += 1
        self.stats["reasons"][reason] = self.stats["reasons"].get(reason, 0) + 1
        self.note(("fallback", kind, why), level, "%s; running ComfyUI's original block instead "
                  "(logged once)", reason)
        return extra["original_block"](args)

    @staticmethod
    def forward_sig(kind, args):
        """One forward's input signature, the same for its double and single blocks: (batch, tokens,
        dtype, device, mask shape)."""
        img, txt, mask = args.get("img"), args.get("txt"), args.get("attn_mask")
        if not isinstance(img, torch.Tensor):
            return ("?", type(img).__name__)
        L = img.shape[1] + (txt.shape[1] if kind == "double" and isinstance(txt, torch.Tensor) else 0)
        return (img.shape[0], L, img.dtype, img.device, None if mask is None else tuple(mask.shape))

    def turn_off(self, fsig, kind, index, why):
        """The fused path failed for this model and input signature: from now on every block of it
        runs stock with no checks and no copies (one log line)."""
        self.off[fsig] = f"{kind} block {index}: {why}"
        self.stats["off"] = dict(self.off)
        log.warning("[flux_numba] %s block %d %s; the pack's path is off for this model at input %s "
                    "(it runs stock from here on)", kind, index, why, fsig)

    def __call__(self, kind, index, args, extra, wrapped=False):
        fsig = self.forward_sig(kind, args)
        if fsig in self.off:  # failed before at this signature: stock at the cost of a dict lookup
            self.stats["stock"] = self.stats.get("stock", 0) + 1
            return extra["original_block"](args)
        blk = resolve_block(kind, index, extra, self.model_ref)
        if blk is None:
            return self.fallback(kind, index, "block module not found", args, extra)
        facts = self.block_ok.get(id(blk))
        if facts is None or facts.ref() is not blk:
            facts = self.block_ok[id(blk)] = BlockFacts(weakref.ref(blk), block_problem(kind, blk), dynamic_block(blk),
                                                        self.fast and fp8_stored_block(kind, blk), next(_ids))
        bad = facts.problem or call_problem(args, extra)
        if bad is None:
            bad = input_problem(kind, blk, args)
        if bad is not None:
            return self.fallback(kind, index, bad, args, extra)

        img, txt = args["img"], args.get("txt")
        vec, pe, mask = args["vec"], args.get("pe"), args.get("attn_mask")
        topts = args.get("transformer_options") or {}
        sig = (kind, tuple(img.shape), img.dtype, img.device, None if txt is None else tuple(txt.shape),
               None if mask is None else tuple(mask.shape))
        # per-block CUDA graphs: the whole-forward graph is not running this call (block_graphs.allowed),
        # and no other node's block replacement wraps ours (it may keep our outputs across calls)
        use_graph = self.graphs is not None and not wrapped and self._graphs_mod.is_allowed() and not _graph_probe()
        if use_graph:
            rec = compiler_recording()
            if rec:  # ComfyUI's own compiler records this forward's allocations: the pack's graphs stand down
                self.note(("compiler",), logging.INFO, "per-block CUDA graphs stand down: %s", rec)
                use_graph = False
        epoch = weight_epoch(self.model_ref() if self.model_ref is not None else None)
        attention = self._attention(topts, sig, blk)
        fp8 = None
        if self.fast:
            fp8 = self.fp8_cache(img.device)
            if fp8 is not None and not fp8.keep and facts.dynamic and not facts.fp8_stored and not use_graph:
                # DynamicVRAM + bf16 weights + per-step quantisation, eager: slower than stock there;
                # inside per-block graphs the quantisation is device work only
                self.note(("fast-dynamic", kind), logging.WARNING,
                          "profile fast: %s blocks have bf16 DynamicVRAM weights and per-block CUDA graphs are off "
                          "(cuda_graph off, or another node wraps the blocks): quantising them again every step "
                          "eagerly is slower than stock, so these blocks run the exact profile", kind)
                fp8 = None
        policy = self.policy
        choice = self.attn_choice.get(sig)
        if self.attn_route == "auto" and choice is not None and (choice not in SDPA_BACKENDS or self.sdpa_direct()):
            policy = dict(policy, **{ATTENTION_OP: choice})  # the registry op writes straight into `out`

        skip, kept, plain = frozenset(), (), frozenset()
        if fp8 is not None and fp8.keep:  # Linears served by kept copies: neither staged nor faulted
            skip, kept, plain = fp8.block_state(kind, blk, epoch, streamed_weights)

        def run(silu_cache, host, img, txt, vec, pe, mask):
            ctx = self.blocks.BlockContext(fused=self.fused, attention=attention, silu_cache=silu_cache,
                                           gemm_epilogue=self.plan.gemm_epilogue,
                                           host=host, quant8=self.policy.get(ATTENTION_OP) == "numba-8bit",
                                           fp8=fp8, fp8_epoch=epoch, keep_plain=plain)
            with self.registry.force(**policy):
                if kind == "double":
                    o_img, o_txt = self.blocks.double_block(blk, img, txt, vec, pe, mask, ctx)
                    return {"img": o_img, "txt": o_txt}
                return {"img": self.blocks.single_block(blk, img, vec, pe, mask, ctx)}

        def eager():
            return self._eager(kind, index, fsig, sig, blk, facts, args, extra, run, skip)

        self.stats["calls"] += 1
        if not use_graph:
            return eager()

        def core(img, txt=None, vec=None, pe=None, mask=None):
            w = ComfyWeights()
            try:
                return run({}, w, img, txt, vec, pe, mask)  # a fresh SiLU(vec) per graph: no tensor shared between graphs
            finally:
                w.release()

        wkey, why, pins = block_residency(blk, img.device, epoch, skip=skip, extra=kept)
        try:
            inputs = {"img": img, "txt": txt, "vec": vec, "pe": pe, "mask": mask} if kind == "double" else \
                {"img": img, "vec": vec, "pe": pe, "mask": mask}
            out = self.graphs.call((facts.serial, sig), kind, wkey, inputs, core, eager,
                                   outputs=("img", "txt") if kind == "double" else ("img",),
                                   prepare=lambda: staged_block(blk, img.device, facts.dynamic and STAGE_BLOCKS,
                                                                dtype=img.dtype, skip=skip),
                                   can_capture=lambda: capture_headroom(pins, img.device, partial=bool(skip)))
        finally:
            release_pins(pins)
        if why is not None:
            self.graph_why[why] = self.graph_why.get(why, 0) + 1
        return out

    def _eager(self, kind, index, fsig, sig, blk, facts, args, extra, run, skip=frozenset()):
        """The block on the caller's tensors, with the first-call backup and the fallback policy."""
        img, txt = args["img"], args.get("txt")
        vec, pe, mask = args["vec"], args.get("pe"), args.get("attn_mask")
        backup = None
        if sig not in self.proven:  # the first call of a signature only: undo an in-place update on failure
            backup = (img.clone(), None if txt is None else txt.clone())
        versions = (self.version(img), None if txt is None else self.version(txt))
        weights = ComfyWeights()
        with staged_block(blk, img.device, facts.dynamic and STAGE_BLOCKS, skip=skip):
            try:
                out = run(self.silu_cache, weights, img, txt, vec, pe, mask)
            except Exception as e:
                if _is_oom(e) or _graph_probe():
                    raise  # a CUDA-graph warm-up or capture: the graph wrapper runs the step eagerly
                why = f"raised {type(e).__name__}: {e}"
                if backup is not None:
                    img.copy_(backup[0])
                    if txt is not None:
                        txt.copy_(backup[1])
                else:
                    now = (self.version(img), None if txt is None else self.version(txt))
                    if versions[0] is None or now != versions:  # unknown (inference mode) or updated
                        log.error("[flux_numba] %s block %d %s after updating its input in place; cannot fall "
                                  "back", kind, index, why)
                        raise
                self.turn_off(fsig, kind, index, why)
                return self.fallback(kind, index, why, args, extra)
            finally:
                weights.release()
            self.proven.add(sig)
            return out


def _make_fn(runner, kind, index, previous=None):
    """A plain function (ModelPatcher deep-copies model_options: functions are copied by reference)."""
    if previous is None:
        def fn(args, extra):
            return runner(kind, index, args, extra)
    else:  # another node's replacement was there first: it wraps our block as its "original"
        def fn(args, extra):
            inner = dict(extra)
            inner["original_block"] = lambda a: runner(kind, index, a, extra, wrapped=True)
            return previous(args, inner)
    fn._flux_numba = True
    fn._flux_numba_previous = previous
    return fn


# ----------------------------------------------------------------------------- node


def patch_model(model, plan, unique_id=None):
    """FluxNumbaPatch's work: a patched clone of ``model`` (``plan``: the node's checked settings, a
    ``PatchPlan``), or the clone passed through with the reason logged; returns ``(clone,)``."""
    from .host import log_once
    log_once()  # which ComfyUI, and what the host package adapts to (once per process)
    plan = PatchPlan.of(plan)
    m = model.clone()
    info = dict(plan.as_dict(), active=False, reason=None, double_blocks=0, single_blocks=0, id=None)

    why = unavailable_reason(m, plan.backend)
    dm = None
    if why is None:
        try:
            dm = m.get_model_object("diffusion_model")
            dm = getattr(dm, "_orig_mod", dm)  # torch.compile wrapper
        except Exception as e:
            why = f"model has no diffusion_model ({type(e).__name__}: {e})"
    targets = []
    if why is None:
        try:
            Flux = flux_types()[0]
            if not isinstance(dm, Flux):
                why = f"not a FLUX model ({type(dm).__name__})"
            else:
                problems = {}
                for kind in ("double", "single"):
                    for i, blk in enumerate(getattr(dm, f"{kind}_blocks")):
                        p = block_problem(kind, blk)
                        if p is None:
                            targets.append((kind, i))
                        else:
                            problems.setdefault(p, []).append(i)
                for p, idx in problems.items():
                    log.warning("[flux_numba] FluxNumbaPatch leaves blocks %s stock: %s", idx, p)
                if not targets:
                    why = "no FLUX.1 blocks to patch"
        except Exception as e:
            why = f"cannot inspect the model ({type(e).__name__}: {e})"
    if why is None:
        try:
            runner = _reused_runner(m.model, plan)
            if runner is None:
                runner = _Runner(plan, weakref.ref(m.model), next(_ids))
                _RUNNERS[runner.patch_id] = runner
                _REUSE[_reuse_key(m.model, plan)] = runner
                while len(_REUSE) > REUSE_MAX:
                    _REUSE.popitem(last=False)
            _release_fp8_copies(m.model, runner)
            patch_id = runner.patch_id
        except Exception as e:
            why = f"cannot set up the pack's blocks ({type(e).__name__}: {e})"
    if why is not None:
        log.warning("[flux_numba] FluxNumbaPatch passes the model through unpatched: %s", why)
        info["reason"] = why
        m.model_options["transformer_options"][INFO_KEY] = info
        return (m,)

    replaced = m.model_options["transformer_options"].get("patches_replace", {}).get("dit", {})
    for kind, i in targets:
        prev = replaced.get((f"{kind}_block", i))
        if prev is not None and getattr(prev, "_flux_numba", False):
            prev = prev._flux_numba_previous  # our own earlier patch: replace it, keep what it wrapped
        m.set_model_patch_replace(_make_fn(runner, kind, i, prev), "dit", f"{kind}_block", i)
        info[f"{kind}_blocks"] += 1
    _use_stock_rope()
    from .host import install_conds_on_device
    # the conditioning goes to the GPU once per sampling run, not from the CPU every step (a copy from
    # pageable memory waits for the GPU: the next step's host work would run with the GPU idle)
    info["conds_on_device"] = install_conds_on_device(m)
    runtime = _pack()[2]
    if plan.backend != "torch" and not runtime.SIMULATOR:
        info["kernels"] = warm_kernels(unique_id, plan)
    info["cuda_graph"] = "off"
    if plan.graphs:
        from .cuda_graph import install
        from .host import drop_on_unload
        if runner.whole is None:
            from .cuda_graph import GraphWrapper
            runner.whole = install(m, GraphWrapper(stats=runner.stats))
            runner.enable_block_graphs(BLOCK_CAPTURE)
        else:
            install(m, runner.whole)
        drop_on_unload(m, "flux_numba_block_graphs", runner.unloaded)
        info["cuda_graph"] = "auto"
    info.update(active=True, id=patch_id, attention_route=runner.attn_route,
                policy=dict(runner.policy), simulator=bool(getattr(runtime, "SIMULATOR", False)))
    m.model_options["transformer_options"][INFO_KEY] = info
    log.info("[flux_numba] FluxNumbaPatch: %d double + %d single blocks, %s", info["double_blocks"],
             info["single_blocks"], plan.as_dict())
    return (m,)
