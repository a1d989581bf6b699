"""FluxNumbaStepTimer: MODEL -> MODEL clone that times every sampling step (``timing.StepTimer``:
CUDA events on a GPU, wall time on a CPU, which backend ran each op, CUDA-graph state, host-bound
flag) and streams it to the node's chart (``web/``) and the report node."""
from __future__ import annotations

from .timing import WRAPPER_KEY, StepTimer, jsonable


class FluxNumbaStepTimer:
    """MODEL -> MODEL clone that records every diffusion-model call (see module docstring)."""

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": ("MODEL", {"tooltip": "Model to time. It is cloned; the input is never modified."}),
                "label": ("STRING", {"default": "patched", "multiline": False,
                                     "tooltip": "Name of this series, e.g. 'stock' or 'patched'. Runs with "
                                                "different labels get different colours and the report "
                                                "node selects runs by label."}),
            },
            "optional": {
                "profile_split": ("BOOLEAN", {"default": False,
                                              "tooltip": "Profile ONE step (the 2nd) with torch.profiler and "
                                                         "split its time into attention / GEMM / our fused "
                                                         "kernels / other. Costs time: that step runs "
                                                         "synchronised under the profiler (much slower) and is "
                                                         "left out of the mean/it/s."}),
            },
            "hidden": {"unique_id": "UNIQUE_ID"},
        }

    RETURN_TYPES = ("MODEL",)
    RETURN_NAMES = ("model",)
    OUTPUT_TOOLTIPS = ("A clone of the input model that times each sampling step (wall time, it/s, "
                       "backend of each op) and streams it to this node's chart.",)
    FUNCTION = "apply"
    CATEGORY = "FluxNumba"
    DESCRIPTION = ("Times every diffusion-model call of the sampler that uses this model: CUDA events on GPU, "
                   "perf_counter on CPU; records which backend (numba / torch) ran each op and the patch "
                   "description left by FluxNumbaPatch. Results: live chart on this node, "
                   "FluxNumbaTimingReport node.")

    @staticmethod
    def check_label(label):
        """The label as the report can select it; ValueError naming the node and input otherwise."""
        if not isinstance(label, str):
            raise ValueError(f"FluxNumbaStepTimer: label must be text, got {type(label).__name__} {label!r}")
        key = label.strip().lower()
        why = ("is empty" if not key else
               "contains ',' (the report splits selections at commas)" if "," in key else
               f"is a report keyword ('{key}' selects runs of every label)" if key in ("last", "all") else
               "starts with 'run:' or 'node:' (report selection syntax)" if key.startswith(("run:", "node:")) else None)
        if why:
            raise ValueError(f"FluxNumbaStepTimer: label {label!r} {why}; use a plain name such as 'stock' or "
                             f"'patched' so that FluxNumbaTimingReport can select it")
        return label

    def apply(self, model, label="patched", profile_split=False, unique_id=None):
        self.check_label(label)
        from .host import install_sampling_wrappers

        m = model.clone()
        patch = m.model_options.get("transformer_options", {}).get("flux_numba")
        timer = StepTimer(unique_id, str(label), bool(profile_split), patch=jsonable(patch))
        # replace (not stack) a timer already on this clone, e.g. two timers in a row
        install_sampling_wrappers(m, WRAPPER_KEY, timer.outer_sample_wrapper, timer.apply_model_wrapper)
        return (m,)


NODE_CLASS_MAPPINGS = {"FluxNumbaStepTimer": FluxNumbaStepTimer}
NODE_DISPLAY_NAME_MAPPINGS = {"FluxNumbaStepTimer": "FluxNumba Step Timer"}
