"""FluxNumbaStepTimer: MODEL -> MODEL clone that times every sampling step (``timing.StepTimer``:
CUDA events on a GPU, wall time on a CPU, which backend ran each op, CUDA-graph state, host-bound
flag) and streams it to the node's chart (``web/``) and the report node.  V3 schema."""
from __future__ import annotations

import functools

from .host import api
from .timing import WRAPPER_KEY, StepTimer, jsonable

NODE_ID = "FluxNumbaStepTimer"
DISPLAY_NAME = "FluxNumba Step Timer"
DEFAULT_LABEL = "patched"


def default_label(label, unique_id=None):
    """An empty or whitespace-only label -> the node's id (the widget default where there is none);
    any other value unchanged."""
    if isinstance(label, str) and not label.strip():
        return str(unique_id) if unique_id is not None else DEFAULT_LABEL
    return label


def check_label(label):
    """The label as the report can select it; ValueError naming the node and input otherwise."""
    if not isinstance(label, str):
        raise ValueError(f"{NODE_ID}: label must be text, got {type(label).__name__} {label!r}")
    key = label.strip().lower()
    why = ("is empty" if not key else
           "contains ',' (the report splits selections at commas)" if "," in key else
           f"is a report keyword ('{key}' selects runs of every label)" if key in ("last", "all") else
           "starts with 'run:' or 'node:' (report selection syntax)" if key.startswith(("run:", "node:")) else None)
    if why:
        raise ValueError(f"{NODE_ID}: label {label!r} {why}; use a plain name such as 'stock' or "
                         f"'patched' so that FluxNumbaTimingReport can select it")
    return label


def apply(model, label=DEFAULT_LABEL, profile_split=False, unique_id=None):
    """What the node does: ``(clone with the timer's sampling wrappers,)``; an empty label is the
    node's id."""
    label = check_label(default_label(label, unique_id))
    from .host import install_sampling_wrappers
    m = model.clone()
    patch = m.model_options.get("transformer_options", {}).get("flux_numba")
    timer = StepTimer(unique_id, str(label), bool(profile_split), patch=jsonable(patch))
    # replace (not stack) a timer already on this clone, e.g. two timers in a row
    install_sampling_wrappers(m, WRAPPER_KEY, timer.outer_sample_wrapper, timer.apply_model_wrapper)
    return (m,)


@functools.lru_cache(maxsize=None)
def node_class():
    """The V3 node class, defined on first use (it needs ComfyUI's ``comfy_api``)."""
    io = api.io()

    class FluxNumbaStepTimer(io.ComfyNode):
        @classmethod
        def define_schema(cls):
            return io.Schema(
                node_id=NODE_ID, display_name=DISPLAY_NAME, category="FluxNumba",
                description="Times every diffusion-model call of the sampler that uses this model: CUDA events on "
                            "GPU, perf_counter on CPU; records which backend (numba / torch) ran each op and the "
                            "patch description left by FluxNumbaPatch. Results: live chart on this node, "
                            "FluxNumbaTimingReport node.",
                inputs=[io.Model.Input("model", tooltip="Model to time. It is cloned; the input is never modified."),
                        io.String.Input("label", default=DEFAULT_LABEL, multiline=False,
                                        tooltip="Name of this series, e.g. 'stock' or 'patched'. Runs with different "
                                                "labels get different colours and the report node selects runs by "
                                                "label. Empty: this node's id."),
                        io.Boolean.Input("profile_split", default=False, optional=True,
                                         tooltip="Profile ONE step (the 2nd) with torch.profiler and split its time "
                                                 "into attention / GEMM / our fused kernels / other. Costs time: that "
                                                 "step runs synchronised under the profiler (much slower) and is left "
                                                 "out of the mean/it/s.")],
                outputs=[io.Model.Output(display_name="model",
                                         tooltip="A clone of the input model that times each sampling step (wall "
                                                 "time, it/s, backend of each op) and streams it to this node's chart.")],
                hidden=[io.Hidden.unique_id])

        @classmethod
        def execute(cls, model, label=DEFAULT_LABEL, profile_split=False):
            return io.NodeOutput(*apply(model, label, profile_split, api.unique_id(cls)))

    return FluxNumbaStepTimer
