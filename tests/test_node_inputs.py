"""A bad widget value on any pack node: an error that names the node and the input.  No ComfyUI
needed: each node module's ``apply`` / ``load`` / ``report`` (what the V3 node's ``execute`` calls)
checks its values before it touches ComfyUI.  FluxNumbaPatch has its own tests in
test_pack_import.py (``FluxNumbaPatch: profile must be one of ...``)."""
import sys
import types

import pytest
import torch

from flux_numba_pack.nodes import loader, quality, report, timer, timing, vae_patch


@pytest.mark.parametrize("selection,what", [
    ("run:abc", "run:<id> takes a run number"),
    ("stock, run:", "run:<id> takes a run number"),
    ("run:-1", "run:<id> takes a run number"),
    ("stock, run:x", "run:<id> takes a run number"),
    (12, "must be text"),
])
def test_timing_report_bad_selection(selection, what):
    with pytest.raises(ValueError) as ei:
        report.report({"samples": torch.zeros(1)}, selection=selection)
    msg = str(ei.value)
    assert msg.startswith("FluxNumbaTimingReport: selection ") and what in msg, msg
    assert "'last', 'all', a label" in msg  # says what is accepted


def test_timing_report_good_selections_still_parse():
    for sel in ("last", "all", "", None, "stock,patched", "run:3", "RUN: 7", "node:12", "some label", "node:",
                "NODE:  ", "stock, node:"):
        assert isinstance(timing.select_runs(sel), list)


def test_timing_report_garbage_selection_is_one_line():
    with pytest.raises(ValueError) as ei:
        report.report({"samples": torch.zeros(1)}, selection="run:abc")
    assert "\n" not in str(ei.value)


@pytest.mark.parametrize("name,value", [("width", "abc"), ("width", 100), ("height", 5000), ("height", 300.5),
                                        ("width", None)])
def test_timing_report_bad_size(name, value):
    with pytest.raises(ValueError, match=rf"^FluxNumbaTimingReport: {name} must be a whole number of pixels"):
        report.report({}, **{name: value})


@pytest.mark.parametrize("label", ["a,b", "last", "ALL", "run:3", "node:1", None, 3])
def test_step_timer_bad_label(label):
    with pytest.raises(ValueError, match=r"^FluxNumbaStepTimer: label "):
        timer.apply(model=None, label=label)


def test_step_timer_good_labels():
    for label in ("stock", "patched", "exact 1024", "fp8-fast"):
        assert timer.check_label(label) == label


@pytest.mark.parametrize("label", ["", "   ", "\t"])
def test_step_timer_empty_label_is_the_node_id(label):
    assert timer.check_label(timer.default_label(label, "12")) == "12"
    assert timer.default_label(label, None) == "patched"  # no node id (outside ComfyUI): the widget default
    assert timer.default_label("stock", "12") == "stock"


def test_loader_bad_weight_dtype_and_name(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match=r"^FluxNumbaLoader: weight_dtype must be one of .*'int4'"):
        loader.load("flux1-dev.safetensors", "int4")
    with pytest.raises(ValueError, match=r"^FluxNumbaLoader: unet_name must be a file name"):
        loader.load(None, "default")
    # a name ComfyUI's folder_paths does not find, and a file that is not a checkpoint
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"abcdef")
    fp = types.ModuleType("folder_paths")
    fp.get_full_path = lambda folder, name: str(junk) if name == "junk.safetensors" else None
    fp.get_folder_paths = lambda folder: [str(tmp_path)]
    comfy = types.ModuleType("comfy")
    comfy.sd = types.ModuleType("comfy.sd")
    comfy.sd.load_diffusion_model = lambda *a, **k: pytest.fail("a refused file must not be loaded")
    monkeypatch.setitem(sys.modules, "folder_paths", fp)
    monkeypatch.setitem(sys.modules, "comfy", comfy)
    monkeypatch.setitem(sys.modules, "comfy.sd", comfy.sd)
    with pytest.raises(FileNotFoundError, match=r"^FluxNumbaLoader: unet_name 'nope.safetensors' is not in"):
        loader.load("nope.safetensors", "default")
    with pytest.raises(ValueError, match=r"^FluxNumbaLoader: unet_name junk.safetensors: .*too short"):
        loader.load("junk.safetensors", "default")


@pytest.mark.parametrize("kw,match", [({"backend": "cuda"}, "backend must be one of"),
                                      ({"enabled": "yes"}, "enabled must be a boolean"),
                                      ({"layout": "NCHW"}, "layout must be one of")])
def test_vae_patch_bad_widget(kw, match):
    with pytest.raises(ValueError, match=rf"^FluxNumbaVAEPatch: {match}"):
        vae_patch.apply(vae=None, **kw)


def test_quality_compare_bad_inputs():
    img = torch.rand(1, 8, 8, 3)
    with pytest.raises(ValueError, match=r"^FluxNumbaQualityCompare: image_b is missing"):
        quality.report(img, None)
    with pytest.raises(ValueError, match=r"^FluxNumbaQualityCompare: image_a must be an IMAGE batch"):
        quality.report({"not": "an image"}, img)
    with pytest.raises(ValueError, match=r"^FluxNumbaQualityCompare: the two images must have the same shape"):
        quality.report(img, torch.rand(1, 8, 9, 3))
