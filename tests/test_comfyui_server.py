"""A real ComfyUI server on CPU runs the pack's FLUX graph as a user would queue it.

One API prompt, two branches from the same FluxNumbaLoader: stock (loader -> timer -> KSampler ->
VAEDecode -> SaveImage) and patched (loader -> FluxNumbaPatch -> timer -> KSampler -> VAEDecode ->
SaveImage), plus FluxNumbaTimingReport.  The model is the smallest checkpoint ComfyUI itself
detects as FLUX (hidden 3072, 1 double + 1 single block, written by ``run.py --write-model
--comfy-min``), the VAE a random-weight FLUX VAE; a test-only node stands in for the text
encoders (T5-XXL is 4.7 B parameters).  On CPU the patch runs with backend "torch" (the pack's
block functions and fused op order on torch ops); the images must match the stock branch.

Marked ``comfyui``: runs once per ComfyUI tree from test_comfyui_matrix (or at COMFYUI_PATH) when
COMFYUI_PYTHON (or the running python) can run it; skips with the reason otherwise.
"""
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid

import pytest

from _browser_testing import _comfy_path, _comfy_python, _get, running_comfyui

pytestmark = pytest.mark.comfyui

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 3

COND_NODE = '''
import torch

class FluxNumbaTestFluxConditioning:
    """TEST ONLY: seeded random FLUX conditioning (context [1, 16, 64], pooled [1, 32], guidance 3.5)
    for the tiny FLUX checkpoint, standing in for CLIP-L + T5-XXL."""
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"seed": ("INT", {"default": 0})}}
    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "make"
    CATEGORY = "FluxNumba/test"
    def make(self, seed):
        g = torch.Generator().manual_seed(seed)
        return ([[torch.randn(1, 16, 64, generator=g), {"pooled_output": torch.randn(1, 32, generator=g),
                                                         "guidance": 3.5}]],)

NODE_CLASS_MAPPINGS = {"FluxNumbaTestFluxConditioning": FluxNumbaTestFluxConditioning}
'''

MAKE_VAE = f"ROOT = {ROOT!r}\n" + r'''
import sys
OUT = sys.argv[1]
sys.argv = [sys.argv[0], "--cpu"]
import comfy.options; comfy.options.enable_args_parsing()
import safetensors.torch
sys.path.insert(0, ROOT)
import _pack; _pack.load()
from flux_numba_pack.nodes.host.vae import random_vae_state_dict
safetensors.torch.save_file(random_vae_state_dict(1), OUT)
'''


def _post(url, data):
    req = urllib.request.Request(url, data=json.dumps(data).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read().decode())


@pytest.fixture(scope="module")
def server():
    comfy, why = _comfy_path()
    if why:
        pytest.skip(why)
    py, why = _comfy_python(comfy)
    if why:
        pytest.skip(why)
    base = tempfile.mkdtemp(prefix="flux_numba_server_")
    cn = os.path.join(base, "custom_nodes")
    os.makedirs(cn)
    os.symlink(ROOT, os.path.join(cn, "comfyui-flux-numba"))  # a folder name numba-cuda's redirector trips on
    with open(os.path.join(cn, "flux_numba_test_cond.py"), "w") as f:
        f.write(COND_NODE)
    dm, vd = os.path.join(base, "models", "diffusion_models"), os.path.join(base, "models", "vae")
    os.makedirs(dm)
    os.makedirs(vd)
    r = subprocess.run([sys.executable, os.path.join(ROOT, "run.py"), "--write-model", os.path.join(dm, "flux_min.safetensors"),
                        "--comfy-min"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    r = subprocess.run([py, "-c", MAKE_VAE, os.path.join(vd, "ae_random.safetensors")], cwd=comfy,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    try:
        with running_comfyui(py, comfy, base) as (url, log, _):
            yield dict(url=url, base=base, log=log)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def prompt():
    sampler = lambda model, seed_node: {"class_type": "KSampler", "inputs": {
        "model": model, "seed": 7, "steps": STEPS, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple",
        "positive": [seed_node, 0], "negative": [seed_node, 0], "latent_image": ["lat", 0], "denoise": 1.0}}
    return {
        "load": {"class_type": "FluxNumbaLoader", "inputs": {"unet_name": "flux_min.safetensors", "weight_dtype": "default"}},
        "cond": {"class_type": "FluxNumbaTestFluxConditioning", "inputs": {"seed": 3}},
        "lat": {"class_type": "EmptySD3LatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
        "vae": {"class_type": "VAELoader", "inputs": {"vae_name": "ae_random.safetensors"}},
        "t_stock": {"class_type": "FluxNumbaStepTimer", "inputs": {"model": ["load", 0], "label": "stock", "profile_split": False}},
        "patch": {"class_type": "FluxNumbaPatch", "inputs": {"model": ["load", 0], "profile": "exact", "route_norms": True,
                                                              "attention": "auto", "backend": "torch", "cuda_graph": "auto"}},
        "t_patched": {"class_type": "FluxNumbaStepTimer", "inputs": {"model": ["patch", 0], "label": "patched", "profile_split": False}},
        "ks_stock": sampler(["t_stock", 0], "cond"),
        "ks_patched": sampler(["t_patched", 0], "cond"),
        "dec_stock": {"class_type": "VAEDecode", "inputs": {"samples": ["ks_stock", 0], "vae": ["vae", 0]}},
        "dec_patched": {"class_type": "VAEDecode", "inputs": {"samples": ["ks_patched", 0], "vae": ["vae", 0]}},
        "save_stock": {"class_type": "SaveImage", "inputs": {"images": ["dec_stock", 0], "filename_prefix": "stock"}},
        "save_patched": {"class_type": "SaveImage", "inputs": {"images": ["dec_patched", 0], "filename_prefix": "patched"}},
        "report": {"class_type": "FluxNumbaTimingReport", "inputs": {"samples": ["ks_patched", 0], "samples_2": ["ks_stock", 0],
                                                                      "selection": "last", "width": 512, "height": 256}},
        "save_report": {"class_type": "SaveImage", "inputs": {"images": ["report", 0], "filename_prefix": "timing"}},
        "compare": {"class_type": "FluxNumbaQualityCompare", "inputs": {"image_a": ["dec_stock", 0], "image_b": ["dec_patched", 0]}},
    }


def test_flux_graph_patched_matches_stock(server):
    import numpy as np
    from PIL import Image
    res = _post(server["url"] + "/prompt", {"prompt": prompt(), "client_id": str(uuid.uuid4())})
    assert not res.get("node_errors"), res
    pid = res["prompt_id"]
    t0 = time.time()
    while True:
        h = _get(server["url"] + f"/history/{pid}")
        if pid in h and h[pid].get("status", {}).get("completed") is not None:
            break
        assert time.time() - t0 < 600, "prompt did not finish: " + open(server["log"]).read()[-4000:]
        time.sleep(2)
    entry = h[pid]
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[:3000] + open(server["log"]).read()[-4000:]
    outs = entry["outputs"]
    imgs = {}
    for node in ("save_stock", "save_patched"):
        (im,) = outs[node]["images"]
        imgs[node] = np.asarray(Image.open(os.path.join(server["base"], "output", im.get("subfolder", ""), im["filename"]))).astype(np.float64)
    a, b = imgs["save_stock"], imgs["save_patched"]
    assert a.shape == b.shape == (64, 64, 3)
    mse = ((a - b) ** 2).mean()
    psnr = math.inf if mse == 0 else 10 * math.log10(255 ** 2 / mse)
    assert psnr >= 45, psnr  # fp32 on CPU: the same function up to float rounding, 8-bit PNG output
    assert a.std() > 1, "a random VAE still makes a non-constant image"
    log = open(server["log"]).read()
    assert "FluxNumbaPatch: 1 double + 1 single blocks" in log, log[-3000:]
    # the pack's blocks ran: a fallback to ComfyUI's block (patch.py logs it) would make the PSNR check vacuous
    fb = [ln for ln in log.splitlines() if "running ComfyUI's original block instead" in ln]
    assert not fb, fb
    text = json.dumps(outs["report"])
    assert "patched" in text and "stock" in text, text[:2000]
    (chart,) = outs["save_report"]["images"]  # the timing chart is saved with the outputs
    assert Image.open(os.path.join(server["base"], "output", chart.get("subfolder", ""), chart["filename"])).size == (512, 256)
    shown = " ".join(outs["compare"]["text"])  # the compare node shows PSNR/SSIM on the node
    assert "PSNR" in shown and "SSIM" in shown, shown
    print(f"stock vs patched PNG PSNR {psnr:.1f} dB; compare node: {shown}")
