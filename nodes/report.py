"""FluxNumbaTimingReport: the step-timer chart as an IMAGE plus a text table, after sampling.

It takes the sampler's LATENT as a passthrough input only so that ComfyUI runs it after the sampler
(and passes the latent on unchanged); the numbers come from ``timing``'s run store, the drawing
from ``timing_report``.
"""
from __future__ import annotations

from . import timing
from .timing_report import chart_array, table_text


NODE_ID = "FluxNumbaTimingReport"


def _int_input(name, value, lo, hi):
    """A whole-number widget value in [lo, hi]; ValueError naming the node and the input otherwise."""
    try:
        v = int(value)
        ok = v == value if isinstance(value, float) else not isinstance(value, bool)
    except (TypeError, ValueError):
        ok = False
    if not ok or not lo <= v <= hi:
        raise ValueError(f"{NODE_ID}: {name} must be a whole number of pixels in {lo}..{hi}, got {value!r}")
    return v


class FluxNumbaTimingReport:
    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "samples": ("LATENT", {"tooltip": "The sampler's output. Only orders this node after sampling; "
                                                  "passed through unchanged."}),
                "selection": ("STRING", {"default": "last", "multiline": False,
                                         "tooltip": "Which runs: 'last' = newest run of every label; a label "
                                                    "(e.g. 'patched'); several comma-separated ('stock,patched'); "
                                                    "'all'; 'run:<id>'; 'node:<timer node id>'."}),
            },
            "optional": {
                "samples_2": ("LATENT", {"tooltip": "Optional: a second sampler's output (e.g. the stock branch), "
                                                    "only so this node runs after BOTH samplers. Not passed on."}),
                "width": ("INT", {"default": 1024, "min": 256, "max": 4096, "step": 8,
                                  "tooltip": "Chart image width in pixels."}),
                "height": ("INT", {"default": 512, "min": 128, "max": 4096, "step": 8,
                                   "tooltip": "Chart image height in pixels."}),
            },
            "hidden": {"unique_id": "UNIQUE_ID"},
        }

    RETURN_TYPES = ("IMAGE", "STRING", "LATENT")
    RETURN_NAMES = ("chart", "table", "samples")
    OUTPUT_TOOLTIPS = ("Bar chart of the step times (one bar per step, colour per label).",
                       "Text table: mean/min/max/total ms, it/s, backends per run.",
                       "The input latent, unchanged.")
    FUNCTION = "report"
    CATEGORY = "FluxNumba"
    OUTPUT_NODE = True
    DESCRIPTION = "Chart + table of FluxNumbaStepTimer runs; connect after the sampler(s)."

    @classmethod
    def IS_CHANGED(cls, **kwargs):
        return float("nan")  # reads the timer's run store: always re-run

    def report(self, samples, selection="last", samples_2=None, width=1024, height=512, unique_id=None):
        import torch
        width = _int_input("width", width, 256, 4096)
        height = _int_input("height", height, 128, 4096)
        try:
            runs = timing.select_runs(selection)
        except timing.SelectionError as e:
            raise ValueError(f"{NODE_ID}: selection {e} (use {timing.SELECTION_HELP})") from None
        text = table_text(runs)
        img = torch.from_numpy(chart_array(runs, width, height)).unsqueeze(0)
        return {"ui": {"text": [text]}, "result": (img, text, samples)}


NODE_CLASS_MAPPINGS = {"FluxNumbaTimingReport": FluxNumbaTimingReport}
NODE_DISPLAY_NAME_MAPPINGS = {"FluxNumbaTimingReport": "FluxNumba Timing Report"}
