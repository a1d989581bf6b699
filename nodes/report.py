"""FluxNumbaTimingReport: the step-timer chart as an IMAGE plus a text table, after sampling (V3 schema).

It takes the sampler's LATENT as a passthrough input only so that ComfyUI runs it after the sampler
(and passes the latent on unchanged); the numbers come from ``timing``'s run store, the drawing
from ``timing_report``.
"""
from __future__ import annotations

import functools

from . import timing
from .host import api
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


DISPLAY_NAME = "FluxNumba Timing Report"


def report(samples, selection="last", samples_2=None, width=1024, height=512):
    """What the node does: (chart image [1, H, W, 3], table text, samples)."""
    import torch
    width = _int_input("width", width, 256, 4096)
    height = _int_input("height", height, 128, 4096)
    try:
        runs = timing.select_runs(selection)
    except timing.SelectionError as e:
        raise ValueError(f"{NODE_ID}: selection {e} (use {timing.SELECTION_HELP})") from None
    text = table_text(runs)
    img = torch.from_numpy(chart_array(runs, width, height)).unsqueeze(0)
    return img, text, samples


@functools.lru_cache(maxsize=None)
def node_class():
    """The V3 node class, defined on first use (it needs ComfyUI's ``comfy_api``)."""
    io = api.io()

    class FluxNumbaTimingReport(io.ComfyNode):
        @classmethod
        def define_schema(cls):
            return io.Schema(
                node_id=NODE_ID, display_name=DISPLAY_NAME, category="FluxNumba", is_output_node=True,
                description="Chart + table of FluxNumbaStepTimer runs; connect after the sampler(s).",
                inputs=[io.Latent.Input("samples", tooltip="The sampler's output. Only orders this node after "
                                                           "sampling; passed through unchanged."),
                        io.String.Input("selection", default="last", multiline=False,
                                        tooltip="Which runs: 'last' = newest run of every label; a label (e.g. "
                                                "'patched'); several comma-separated ('stock,patched'); 'all'; "
                                                "'run:<id>'; 'node:<timer node id>'."),
                        io.Latent.Input("samples_2", optional=True,
                                        tooltip="Optional: a second sampler's output (e.g. the stock branch), only so "
                                                "this node runs after BOTH samplers. Not passed on."),
                        io.Int.Input("width", default=1024, min=256, max=4096, step=8, optional=True,
                                     tooltip="Chart image width in pixels."),
                        io.Int.Input("height", default=512, min=128, max=4096, step=8, optional=True,
                                     tooltip="Chart image height in pixels.")],
                outputs=[io.Image.Output(display_name="chart",
                                         tooltip="Bar chart of the step times (one bar per step, colour per label)."),
                         io.String.Output(display_name="table",
                                          tooltip="Text table: mean/min/max/total ms, it/s, backends per run."),
                         io.Latent.Output(display_name="samples", tooltip="The input latent, unchanged.")],
                hidden=[io.Hidden.unique_id])

        @classmethod
        def fingerprint_inputs(cls, **kwargs):
            return float("nan")  # reads the timer's run store: always re-run

        @classmethod
        def execute(cls, samples, selection="last", samples_2=None, width=1024, height=512):
            img, text, samples = report(samples, selection, samples_2, width, height)
            return io.NodeOutput(img, text, samples, ui={"text": [text]})

    return FluxNumbaTimingReport
