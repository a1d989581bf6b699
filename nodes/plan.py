"""FluxNumbaPatch's settings as one typed value: ``PatchPlan`` is built once from the node's widget
values (the only place their strings are read and checked) and answers every question the runner,
the kernel warm-up and the report ask of them; ``BlockFacts`` is what the runner learns once about
each block module.
"""
from __future__ import annotations

import weakref
from dataclasses import asdict, dataclass
from typing import Dict, NamedTuple, Optional, Set, Tuple

NODE_ID = "FluxNumbaPatch"
PROFILES = ["exact", "stock-order", "fast", "fast-cached"]
FAST_PROFILES = ("fast", "fast-cached")
ATTENTIONS = ["auto", "sdpa", "numba-bf16", "numba-8bit"]
BACKENDS = ["auto", "torch", "numba"]
CUDA_GRAPHS = ["auto", "off"]

ATTENTION_OP = "attention"
# attention widget -> the registry backend it forces
ATTENTION_BACKEND = {"numba-bf16": "numba", "numba-8bit": "numba-8bit"}


@dataclass(frozen=True)
class PatchPlan:
    """The checked widget values of one FluxNumbaPatch (hashable: a re-executed node with the same
    plan and model reuses its runner)."""
    profile: str = "exact"
    route_norms: bool = True
    attention: str = "auto"
    backend: str = "auto"
    cuda_graph: str = "auto"

    def __post_init__(self):
        rn = self.route_norms
        if isinstance(rn, str):
            rn = rn.lower() in ("on", "true", "1", "yes")
        object.__setattr__(self, "route_norms", bool(rn))
        for val, allowed, name in ((self.profile, PROFILES, "profile"), (self.attention, ATTENTIONS, "attention"),
                                   (self.backend, BACKENDS, "backend"), (self.cuda_graph, CUDA_GRAPHS, "cuda_graph")):
            if val not in allowed:
                raise ValueError(f"{NODE_ID}: {name} must be one of {allowed}, got {val!r}")

    @classmethod
    def of(cls, value) -> "PatchPlan":
        """A plan from a plan or a dict of widget values."""
        return value if isinstance(value, cls) else cls(**dict(value))

    def as_dict(self) -> Dict[str, object]:
        return asdict(self)

    # --- what the settings mean
    @property
    def fused(self) -> bool:
        """The fused op sequence runs (every profile but stock-order)."""
        return self.profile in ("exact",) + FAST_PROFILES

    @property
    def fast(self) -> bool:
        """Block GEMMs in fp8 (fast, fast-cached)."""
        return self.profile in FAST_PROFILES

    @property
    def keeps_fp8(self) -> bool:
        """fast-cached: the fp8 weight copies are kept between steps."""
        return self.profile == "fast-cached"

    @property
    def graphs(self) -> bool:
        return self.cuda_graph == "auto"

    @property
    def gemm_epilogue(self) -> bool:
        """Linear+GELU as one op where the weights allow (auto backend, norms routed)."""
        return self.fused and self.backend == "auto" and self.route_norms

    def op_policy(self, op_names) -> Tuple[dict, str]:
        """(registry policy: op -> forced backend, attention route: "registry" | "comfy" | "auto")."""
        pol = {}
        if self.backend in ("torch", "numba"):
            pol["*"] = self.backend
        if not self.route_norms:
            for name in op_names:
                if name != ATTENTION_OP:
                    pol[name] = "torch"
        a = self.attention
        if a in ATTENTION_BACKEND:
            pol[ATTENTION_OP] = ATTENTION_BACKEND[a]
            route = "registry"
        elif a == "sdpa" or self.backend == "torch":
            route = "comfy"
        elif self.backend == "numba":
            pol[ATTENTION_OP] = ATTENTION_BACKEND["numba-bf16"]
            route = "registry"
        else:  # auto/auto: the registry picks; its torch reference is replaced by ComfyUI's attention
            pol[ATTENTION_OP] = "auto"
            route = "auto"
        return pol, route

    def attention_kernels(self) -> Set[str]:
        """The pack's own attention backends this plan may run (warmed with the patch)."""
        forced = {"numba-bf16": {"numba"}, "numba-8bit": {"numba-8bit"}}.get(self.attention)
        if forced is not None:
            return forced
        return {"numba"} if self.backend == "numba" and self.attention != "sdpa" else set()


class BlockFacts(NamedTuple):
    """What the runner learns once per block module (re-learnt when ComfyUI swaps the module)."""
    ref: weakref.ref          # the block module
    problem: Optional[str]    # why the fused path cannot run it (None: it can)
    dynamic: bool             # its weights are DynamicVRAM (comfy-aimdo vbar) weights
    fp8_stored: bool          # the fast profile finds every block GEMM weight stored in fp8
    serial: int               # this module's number in the per-block graph table
