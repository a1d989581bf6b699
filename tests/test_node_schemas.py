"""The pack's nodes as ComfyUI sees them (V3 schema, ``comfy_api``; per ComfyUI tree): every node
defines, ``comfy_entrypoint`` lists them, each node's V1 view (what saved workflows and the frontend
read: required / optional inputs in the saved widget order, tooltips, outputs, category) is what it
was, and the example workflows' widget values fit those inputs."""
import asyncio
import json
import os

import pytest
import torch

from test_comfyui import comfy, pytestmark  # noqa: F401  (ComfyUI in-process; skipped without a tree)
from test_workflows import CONTROL, MAIN, WORKFLOWS, combo_options, ui_to_api, widget_names

# node id -> (required inputs in order, optional inputs in order, hidden unique_id, outputs, output node)
NODES = {
    "FluxNumbaLoader": (["unet_name", "weight_dtype"], [], False, ("MODEL",), False),
    "FluxNumbaPatch": (["model", "profile", "route_norms", "attention", "backend", "cuda_graph"], [], True,
                       ("MODEL",), False),
    "FluxNumbaStepTimer": (["model", "label"], ["profile_split"], True, ("MODEL",), False),
    "FluxNumbaTimingReport": (["samples", "selection"], ["samples_2", "width", "height"], True,
                              ("IMAGE", "STRING", "LATENT"), True),
    "FluxNumbaQualityCompare": (["image_a", "image_b"], [], True, ("FLOAT", "FLOAT"), True),
    "FluxNumbaVAEPatch": (["vae", "enabled", "backend"], ["layout", "cuda_graph"], False, ("VAE",), False),
}
NO_TOOLTIP = {("FluxNumbaVAEPatch", "vae"), ("FluxNumbaVAEPatch", "enabled")}


def _classes():
    from flux_numba_pack.nodes import LOAD_ERRORS, node_classes
    classes = node_classes()
    assert not LOAD_ERRORS, LOAD_ERRORS
    return classes


def test_every_node_defines_and_the_entrypoint_lists_them(comfy):
    from flux_numba_pack.nodes import NODE_DISPLAY_NAME_MAPPINGS, comfy_entrypoint
    classes = _classes()
    assert set(classes) == set(NODES) == set(NODE_DISPLAY_NAME_MAPPINGS)
    listed = asyncio.run(comfy_entrypoint().get_node_list())
    assert {c.GET_SCHEMA().node_id for c in listed} == set(NODES)
    for node_id, cls in classes.items():
        schema = cls.GET_SCHEMA()
        assert schema.node_id == node_id and schema.display_name == NODE_DISPLAY_NAME_MAPPINGS[node_id]


@pytest.mark.parametrize("node_id", list(NODES))
def test_v1_view_is_unchanged(comfy, node_id):
    req, opt, hidden, outputs, output_node = NODES[node_id]
    cls = _classes()[node_id]
    it = cls.INPUT_TYPES()
    assert list(it["required"]) == req and list(it.get("optional", {})) == opt
    assert ("unique_id" in it.get("hidden", {})) == hidden
    for name, spec in {**it["required"], **it.get("optional", {})}.items():
        if (node_id, name) not in NO_TOOLTIP:
            assert len(spec) > 1 and spec[1].get("tooltip"), f"{node_id}.{name} needs a tooltip"
    assert tuple(cls.RETURN_TYPES) == outputs and len(cls.RETURN_NAMES) == len(outputs)
    assert cls.CATEGORY == "FluxNumba" and cls.DESCRIPTION and bool(cls.OUTPUT_NODE) == output_node


def test_patch_choices_keep_their_order(comfy):
    """Saved workflows store combo values by name; new choices are appended, never reordered."""
    it = _classes()["FluxNumbaPatch"].INPUT_TYPES()
    assert combo_options(it, "profile") == ["exact", "stock-order", "fast", "fast-cached"]
    assert combo_options(it, "attention") == ["auto", "sdpa", "numba-bf16", "numba-8bit"]
    assert combo_options(it, "backend") == ["auto", "torch", "numba"]
    assert combo_options(it, "cuda_graph") == ["auto", "off"]
    vae = _classes()["FluxNumbaVAEPatch"].INPUT_TYPES()
    assert combo_options(vae, "backend") == ["auto", "numba", "torch"]
    assert combo_options(vae, "layout") == ["nhwc", "nchw"] and combo_options(vae, "cuda_graph") == ["auto", "off"]


def test_execute_returns_the_outputs_and_the_ui(comfy):
    """``execute`` as ComfyUI calls it (``EXECUTE_NORMALIZED``): outputs and the text shown on the node."""
    a = torch.rand(1, 16, 16, 3)
    out = _classes()["FluxNumbaQualityCompare"].EXECUTE_NORMALIZED(image_a=a, image_b=a.clone())
    psnr, ssim = out.result
    assert psnr == float("inf") and ssim == pytest.approx(1.0) and "PSNR" in out.ui["text"][0]
    out = _classes()["FluxNumbaTimingReport"].EXECUTE_NORMALIZED(samples={"samples": torch.zeros(1)}, width=256,
                                                                 height=128)
    img, text, lat = out.result
    assert tuple(img.shape) == (1, 128, 256, 3) and out.ui == {"text": [text]} and lat == {"samples": torch.zeros(1)}
    with pytest.raises(ValueError, match="^FluxNumbaPatch: profile must be one of"):
        _classes()["FluxNumbaPatch"].EXECUTE_NORMALIZED(model=None, profile="turbo")


@pytest.mark.parametrize("path", WORKFLOWS, ids=[os.path.basename(p) for p in WORKFLOWS])
def test_pack_node_widgets(comfy, path):
    """The pack's own nodes in every example workflow: widget values match the node's inputs (count,
    order and combo choices)."""
    pack = _classes()
    with open(path) as f:
        wf = json.load(f)
    seen = 0
    for n in wf["nodes"]:
        cls = pack.get(n["type"])
        if cls is None:
            continue
        seen += 1
        it = cls.INPUT_TYPES()
        names = widget_names(it)
        vals = n["widgets_values"]
        required = [nm for nm in widget_names({"required": it.get("required", {})})]
        assert len(required) <= len(vals) <= len(names), (n["type"], names, vals)
        for name, val in zip(names, vals):
            if name is CONTROL:
                continue
            opts = combo_options(it, name)
            if opts and n["type"] != "FluxNumbaLoader":  # the loader's file list is this machine's
                assert val in opts, (n["type"], name, val, opts)
        api = ui_to_api({"nodes": [n], "links": wf["links"]}, lambda t: it)
        assert set(api[str(n["id"])]["inputs"]) >= {nm for nm in required if nm is not CONTROL}
    if os.path.abspath(path) == MAIN:
        assert seen >= 3
