"""Example workflows (UI format, as the ComfyUI frontend saves them): structure checks without ComfyUI.

``ui_to_api`` converts a UI workflow to the API prompt format the way the frontend does (widget
values mapped to the widget inputs of INPUT_TYPES, links to ``[node_id, slot]``); tests/test_comfyui.py
uses it to have ComfyUI's own ``validate_prompt`` accept the converted graph.
"""
import glob
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKFLOWS = sorted(glob.glob(os.path.join(ROOT, "example_workflows", "*.json")))
MAIN = os.path.join(ROOT, "example_workflows", "flux1_dev_numba.json")

WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}
FRONTEND_ONLY = {"Note", "MarkdownNote", "PrimitiveNode", "Reroute"}
CONTROL = object()  # the frontend's extra "control after generate" widget value


def _spec(spec):
    typ = spec[0]
    opts = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
    return typ, opts


def widget_names(input_types: dict):
    """Names of the widget inputs in widgets_values order (CONTROL marks the seed control value)."""
    names = []
    for section in ("required", "optional"):
        for name, spec in (input_types.get(section) or {}).items():
            typ, opts = _spec(spec)
            if not (isinstance(typ, (list, tuple)) or typ in WIDGET_TYPES) or opts.get("forceInput"):
                continue
            names.append(name)
            if typ == "INT" and (opts.get("control_after_generate") or name in ("seed", "noise_seed")):
                names.append(CONTROL)
    return names


def combo_options(input_types: dict, name: str):
    for section in ("required", "optional"):
        spec = (input_types.get(section) or {}).get(name)
        if spec is not None:
            typ, opts = _spec(spec)
            if isinstance(typ, (list, tuple)):
                return list(typ)
            if typ == "COMBO":
                return list(opts.get("options", []))
    return None


def ui_to_api(wf: dict, input_types_of) -> dict:
    """API prompt {id: {"class_type", "inputs"}} from a UI workflow; ``input_types_of(type)`` gives
    the node's INPUT_TYPES dict."""
    links = {lk[0]: lk for lk in wf["links"]}
    prompt = {}
    for n in wf["nodes"]:
        if n["type"] in FRONTEND_ONLY or n.get("mode", 0) in (2, 4):  # notes; muted / bypassed nodes
            continue
        inputs = {}
        names = widget_names(input_types_of(n["type"]))
        for name, val in zip(names, n.get("widgets_values") or []):
            if name is not CONTROL:
                inputs[name] = val
        for inp in n.get("inputs", []):
            if inp.get("link") is not None:
                lk = links[inp["link"]]
                inputs[inp["name"]] = [str(lk[1]), lk[2]]
        prompt[str(n["id"])] = {"class_type": n["type"], "inputs": inputs}
    return prompt


def check_structure(wf: dict):
    """Every link joins existing slots consistently; ids are unique; returns {id: node}."""
    assert wf.get("version") == 0.4
    for key in ("nodes", "links", "last_node_id", "last_link_id"):
        assert key in wf, key
    nodes = {}
    for n in wf["nodes"]:
        assert n["id"] not in nodes, f"duplicate node id {n['id']}"
        for key in ("type", "pos", "size", "inputs", "outputs", "widgets_values", "mode"):
            assert key in n, (n["id"], key)
        assert len(n["pos"]) == 2 and len(n["size"]) == 2
        nodes[n["id"]] = n
    assert wf["last_node_id"] >= max(nodes)
    link_ids = set()
    for lk in wf["links"]:
        assert len(lk) == 6, lk
        lid, src, sslot, dst, dslot, typ = lk
        assert lid not in link_ids, f"duplicate link id {lid}"
        link_ids.add(lid)
        assert src in nodes and dst in nodes, f"link {lid} joins missing nodes {src}->{dst}"
        outs, ins = nodes[src]["outputs"], nodes[dst]["inputs"]
        assert 0 <= sslot < len(outs), f"link {lid}: node {src} has no output slot {sslot}"
        assert 0 <= dslot < len(ins), f"link {lid}: node {dst} has no input slot {dslot}"
        assert lid in (outs[sslot].get("links") or []), f"link {lid} missing from node {src} output {sslot}"
        assert ins[dslot].get("link") == lid, f"link {lid} missing from node {dst} input {dslot}"
        assert outs[sslot]["type"] == typ and ins[dslot]["type"] in (typ, "*"), f"link {lid} type mismatch"
    assert wf["last_link_id"] >= max(link_ids, default=0)
    for n in nodes.values():  # the other direction: slots only name links that exist
        for i in n["inputs"]:
            assert i.get("link") is None or i["link"] in link_ids, (n["id"], i)
        for o in n["outputs"]:
            for lid in o.get("links") or []:
                assert lid in link_ids, (n["id"], o)
    return nodes


def _source(nodes, wf, node_id, input_name):
    n = nodes[node_id]
    inp = next(i for i in n["inputs"] if i["name"] == input_name)
    lk = next(lk for lk in wf["links"] if lk[0] == inp["link"])
    return nodes[lk[1]]


@pytest.mark.parametrize("path", WORKFLOWS, ids=[os.path.basename(p) for p in WORKFLOWS])
def test_structure(path):
    with open(path) as f:
        check_structure(json.load(f))


def test_flux1_dev_graph():
    with open(MAIN) as f:
        wf = json.load(f)
    nodes = check_structure(wf)
    by_type = {}
    for n in nodes.values():
        by_type.setdefault(n["type"], []).append(n)
    for t in ("FluxNumbaLoader", "FluxNumbaPatch", "FluxNumbaStepTimer", "KSampler", "DualCLIPLoader",
              "CLIPTextEncode", "FluxGuidance", "EmptySD3LatentImage", "VAELoader", "VAEDecode", "SaveImage"):
        assert t in by_type, f"workflow lacks {t}"
    assert by_type["FluxNumbaLoader"][0]["widgets_values"][0] == "flux1-dev.safetensors"
    clip = by_type["DualCLIPLoader"][0]["widgets_values"]
    assert "clip_l.safetensors" in clip and any("t5xxl" in str(v) for v in clip) and "flux" in clip
    assert by_type["EmptySD3LatentImage"][0]["widgets_values"][:2] == [1024, 1024]
    assert by_type["VAELoader"][0]["widgets_values"] == ["ae.safetensors"]
    ks = by_type["KSampler"][0]
    # model chain: loader -> patch -> timer -> sampler
    timer = _source(nodes, wf, ks["id"], "model")
    assert timer["type"] == "FluxNumbaStepTimer"
    patch = _source(nodes, wf, timer["id"], "model")
    assert patch["type"] == "FluxNumbaPatch"
    assert _source(nodes, wf, patch["id"], "model")["type"] == "FluxNumbaLoader"
    pos = _source(nodes, wf, ks["id"], "positive")
    assert pos["type"] == "FluxGuidance" and _source(nodes, wf, pos["id"], "conditioning")["type"] == "CLIPTextEncode"
    assert ks["widgets_values"][3] == 1.0, "FLUX.1-dev is guidance-distilled: cfg 1.0"
    dec = _source(nodes, wf, by_type["SaveImage"][0]["id"], "images")
    assert dec["type"] == "VAEDecode" and _source(nodes, wf, dec["id"], "samples")["id"] == ks["id"]
    vpatch = _source(nodes, wf, dec["id"], "vae")   # the decode goes through the NHWC VAE patch
    assert vpatch["type"] == "FluxNumbaVAEPatch" and vpatch["widgets_values"] == [True, "auto", "nhwc", "auto"]
    assert _source(nodes, wf, vpatch["id"], "vae")["type"] == "VAELoader"


def test_every_template_has_a_thumbnail():
    """ComfyUI's template browser asks for <name>.jpg beside each example workflow
    (tests/workflow_thumbnails.py draws them from the workflow's own graph)."""
    import glob
    from PIL import Image
    folder = os.path.join(ROOT, "example_workflows")
    jsons = sorted(glob.glob(os.path.join(folder, "*.json")))
    assert jsons
    for path in jsons:
        thumb = path[:-5] + ".jpg"
        assert os.path.exists(thumb), f"{os.path.basename(thumb)} missing: run python tests/workflow_thumbnails.py"
        with Image.open(thumb) as im:
            assert im.format == "JPEG" and im.size[0] >= 256 and im.size[1] >= 192, (thumb, im.format, im.size)
