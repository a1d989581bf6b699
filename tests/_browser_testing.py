"""Shared by the browser tests (tests/test_browser_*.py): what they need, the ComfyUI server they
drive, the JavaScript every page script starts with, and the checks more than one of them makes.

They run only when all of these are available, else skip with the reason:
  * a ComfyUI tree (marked ``comfyui``: runs per tree from test_comfyui_matrix, or at COMFYUI_PATH);
    COMFYUI_PYTHON (default: this interpreter) can run it;
  * Debian's chromium (/usr/bin/chromium, or CHROMIUM_PATH);
  * playwright-core from npm (PLAYWRIGHT_CORE_DIR = its folder, or found in /work/browser-tools,
    <repo>/.browser-tools (ignored) or the global npm root).  No browser is downloaded.
  tests/browser_tools.sh installs the last two where the package registries allow it.

Design
------
* ``comfy_server`` (the fixture, in tests/conftest.py around ``browser_server`` here): ONE ComfyUI for
  all the browser test files (session-scoped: started by the first browser test, stopped when the
  session ends; writing the models and starting the server take about a minute): --cpu, loopback,
  a free port, with the pack symlinked into a temp custom_nodes dir, next to two test-only nodes
  (HELPER_NODE: a zero SD CONDITIONING [1,77,768]; test_comfyui_server.COND_NODE: a FLUX one) and three
  test models written in parallel: a tiny SD1.5-layout UNet (MAKE_UNET, random weights), the smallest
  checkpoint ComfyUI detects as FLUX (run.py --write-model --comfy-min) and a random-weight FLUX VAE
  (test_comfyui_server.MAKE_VAE).  The step timer is model-agnostic (it wraps ComfyUI's APPLY_MODEL,
  which every model type calls), so the chart test uses the SD UNet; the example and states tests run
  FLUX for real at toy size.
* ``run_browser_script(server, name, body, cfg, timeout)``: node runs JS_PRELUDE + ``body`` with ``cfg``
  as a JSON file and returns the JSON the script prints (failing with its error, the page console and
  the server log's tail).  JS_PRELUDE gives every script ``cfg``, ``log``, ``sleep``, ``runPage`` (a
  fresh headless Chromium, the page console kept, the result printed), ``openApp`` and ``nodeShot``; a
  test file's script is only its page steps.
* Screenshots: artifacts/<name>_<ComfyUI version>_fe<frontend version>.png (``_shot``), each tree's
  side by side.
* ``check_console`` (no warning / error from flux_numba*.js) and ``check_example_structure`` (the
  shipped example's stock vs patched branches in an API prompt) are used by more than one test file.
"""
import contextlib
import json
import re
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest

from _comfy_trees import comfyui_path, frontend_args, required_frontend, version_label

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ART = os.path.join(ROOT, "artifacts")
EXAMPLE = os.path.join(ROOT, "example_workflows", "flux1_dev_stock_vs_numba.json")
PACK_LINK = "ComfyUI-FluxNumba-Pack"  # must not end in "numba" (numba-cuda redirector trap)
FLUX_UNET = "flux_min_test.safetensors"  # smallest checkpoint ComfyUI detects as FLUX (run.py --comfy-min)
FLUX_VAE = "ae_random_test.safetensors"  # random-weight FLUX VAE (test_comfyui_server.MAKE_VAE)


# ------------------------------------------------------------------------------------------ discovery
def _shot(server, name):
    """artifacts/<name>_<ComfyUI version>_fe<frontend version>.png: the screenshots of each tree kept
    side by side (a run on the other tree does not overwrite them)."""
    os.makedirs(ART, exist_ok=True)
    fe = required_frontend(server["comfy"]) or "installed"
    return os.path.join(ART, f"{name}_{version_label(server['comfy'])}_fe{fe}.png")


def _comfy_path():
    return comfyui_path()  # tests/_comfy_trees.py: per tree from test_comfyui_matrix, or COMFYUI_PATH


def _comfy_python(comfy):
    py = os.environ.get("COMFYUI_PYTHON", sys.executable)
    try:
        r = subprocess.run([py, "-c", "import torch, torchvision, aiohttp, safetensors"], cwd=comfy,
                           capture_output=True, text=True, timeout=120)
    except Exception as e:
        return None, f"cannot run {py}: {e}"
    if r.returncode != 0:
        return None, f"{py} cannot run ComfyUI (set COMFYUI_PYTHON): {r.stderr.strip().splitlines()[-1:]}"
    return py, None


def _chromium():
    for p in (os.environ.get("CHROMIUM_PATH"), "/usr/bin/chromium", "/usr/bin/chromium-browser"):
        if p and os.path.isfile(p) and os.access(p, os.X_OK):
            return p, None
    return None, "Debian chromium not found (apt-get install -y chromium, or set CHROMIUM_PATH)"


def _playwright_core():
    node = shutil.which("node")
    if not node:
        return None, None, "node (Node.js) not found"
    cands = [os.environ.get("PLAYWRIGHT_CORE_DIR"),
             "/work/browser-tools/node_modules/playwright-core",
             os.path.join(ROOT, ".browser-tools", "node_modules", "playwright-core")]
    try:
        g = subprocess.run(["npm", "root", "-g"], capture_output=True, text=True, timeout=30).stdout.strip()
        if g:
            cands.append(os.path.join(g, "playwright-core"))
    except Exception:
        pass
    for c in cands:
        if c and os.path.isfile(os.path.join(c, "package.json")):
            return node, c, None
    return None, None, "playwright-core not found (npm install playwright-core in /work/browser-tools, or set PLAYWRIGHT_CORE_DIR)"


def _requirements():
    comfy, why = _comfy_path()
    if why:
        return None, why
    py, why = _comfy_python(comfy)
    if why:
        return None, why
    chromium, why = _chromium()
    if why:
        return None, why
    node, pw, why = _playwright_core()
    if why:
        return None, why
    pack = os.environ.get("FLUX_NUMBA_PACK_DIR", ROOT)
    if not os.path.isfile(os.path.join(pack, "__init__.py")):
        return None, f"pack root {pack} has no __init__.py (ComfyUI entry point)"
    return dict(comfy=comfy, py=py, chromium=chromium, node=node, pw=pw, pack=pack), None


# ------------------------------------------------------------------------------------------ the server: test nodes, test models, ComfyUI
HELPER_NODE = '''
import torch

class FluxNumbaTestConditioning:
    """TEST ONLY: zero CONDITIONING [1,77,768] standing in for a text encoder."""
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {}}
    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "make"
    CATEGORY = "FluxNumba/test"
    def make(self):
        return ([[torch.zeros(1, 77, 768), {}]],)

NODE_CLASS_MAPPINGS = {"FluxNumbaTestConditioning": FluxNumbaTestConditioning}
'''

MAKE_UNET = r'''
import sys, torch
OUT = sys.argv[1]
sys.argv = [sys.argv[0], "--cpu"]
import comfy.options; comfy.options.enable_args_parsing()
import comfy.ops, safetensors.torch
from comfy.ldm.modules.diffusionmodules.openaimodel import UNetModel
torch.manual_seed(0)
m = UNetModel(image_size=32, in_channels=4, out_channels=4, model_channels=320, num_res_blocks=[1], channel_mult=(1,),
              use_spatial_transformer=True, transformer_depth=[1], transformer_depth_output=[1, 1],
              transformer_depth_middle=1, context_dim=768, num_heads=8, num_head_channels=-1,
              use_linear_in_transformer=False, dtype=torch.float32, operations=comfy.ops.disable_weight_init)
sd = {k: (torch.randn_like(v) * 0.02).half().contiguous() for k, v in m.state_dict().items()}
safetensors.torch.save_file(sd, OUT)
'''


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read().decode())


def browser_server():
    """Behind the ``comfy_server`` fixture (tests/conftest.py): skip with the reason when something the
    browser tests need is missing; else write the test nodes and models, start ComfyUI, yield the
    server's dict (the requirements plus base, url, unet, log, proc) and stop it afterwards."""
    req, why = _requirements()
    if why:
        pytest.skip(why)
    base = tempfile.mkdtemp(prefix="flux_numba_browser_")
    cn = os.path.join(base, "custom_nodes")
    os.makedirs(cn)
    os.symlink(req["pack"], os.path.join(cn, PACK_LINK))
    with open(os.path.join(cn, "flux_numba_test_helper.py"), "w") as f:
        f.write(HELPER_NODE)
    from test_comfyui_server import COND_NODE, MAKE_VAE  # the lead's FLUX stand-ins (lazy: that module imports this one)
    with open(os.path.join(cn, "flux_numba_test_cond.py"), "w") as f:
        f.write(COND_NODE)
    dm, vd = os.path.join(base, "models", "diffusion_models"), os.path.join(base, "models", "vae")
    os.makedirs(dm)
    os.makedirs(vd)
    unet = "tiny_sd15_unet_test.safetensors"
    # the three test models are written in parallel (2 cores; each is mostly single-threaded work)
    jobs = {
        "sd15 unet": subprocess.Popen([req["py"], "-c", MAKE_UNET, os.path.join(dm, unet)], cwd=req["comfy"],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
        "flux model": subprocess.Popen([sys.executable, os.path.join(ROOT, "run.py"), "--write-model",
                                        os.path.join(dm, FLUX_UNET), "--comfy-min"],
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
        "flux vae": subprocess.Popen([req["py"], "-c", MAKE_VAE, os.path.join(vd, FLUX_VAE)], cwd=req["comfy"],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
    }
    for name, j in jobs.items():
        _, err = j.communicate(timeout=600)
        assert j.returncode == 0, f"writing the {name} failed: {err[-3000:]}"
    udir = os.path.join(base, "user", "default")
    os.makedirs(udir)
    with open(os.path.join(udir, "comfy.settings.json"), "w") as f:
        json.dump({"Comfy.TutorialCompleted": True, "Comfy.Minimap.Visible": False}, f)
    try:
        with running_comfyui(req["py"], req["comfy"], base) as (url, log, proc):
            yield dict(req, base=base, url=url, unet=unet, log=log, proc=proc)
    finally:
        shutil.rmtree(base, ignore_errors=True)


@contextlib.contextmanager
def running_comfyui(py, comfy, base, timeout=240):
    """Start ComfyUI on CPU (loopback, a free port, ``base`` as its base directory; the frontend the
    tree pins where a copy is at hand: _comfy_trees.frontend_args), wait until it answers, yield
    (url, log path, process); stop it afterwards."""
    port = _free_port()
    logf = open(os.path.join(base, "comfyui.log"), "w")
    proc = subprocess.Popen([py, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(port),
                             "--base-directory", base, "--database-url", "sqlite:///:memory:",
                             "--disable-auto-launch", *frontend_args(comfy, py)], cwd=comfy, stdout=logf, stderr=subprocess.STDOUT,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    url = f"http://127.0.0.1:{port}"
    try:
        t0 = time.time()
        while True:
            if proc.poll() is not None:
                pytest.fail("ComfyUI exited: " + open(logf.name).read()[-4000:])
            try:
                _get(url + "/system_stats")
                break
            except Exception:
                if time.time() - t0 > timeout:
                    pytest.fail(f"ComfyUI did not start in {timeout} s: " + open(logf.name).read()[-4000:])
                time.sleep(1)
        yield url, logf.name, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        logf.close()


# ------------------------------------------------------------------------------------------ the page scripts
def run_browser_script(server, name, body, cfg, timeout):
    """Run JS_PRELUDE + ``body`` (a playwright-core script, in node) with its JSON config; return its
    JSON result, failing with the script's error, the page console and the server log's tail."""
    cfg_path = os.path.join(server["base"], name + "_cfg.json")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    script = os.path.join(server["base"], name + ".cjs")
    with open(script, "w") as f:
        f.write(JS_PRELUDE + body)
    r = subprocess.run([server["node"], script, cfg_path], capture_output=True, text=True, timeout=timeout,
                       env=dict(os.environ, PW_CORE=server["pw"]))
    assert r.stdout.strip(), f"browser script failed: {r.stderr[-3000:]}"
    res = json.loads(r.stdout)
    tail = open(server["log"]).read()[-4000:]
    assert not res.get("error"), f"{res.get('error')}\nconsole: {res.get('console')}\nserver: {tail}"
    return res


JS_PRELUDE = r'''
// JS_PRELUDE (tests/_browser_testing.py): what every page script of the browser tests starts with.
// The script runs in node (playwright-core at $PW_CORE) with its JSON config's path as argv[2].
const { chromium } = require(process.env.PW_CORE);
const fs = require("fs");
const cfg = JSON.parse(fs.readFileSync(process.argv[2], "utf8"));
const log = (...a) => console.error("[browser]", ...a);
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

// runPage(res, body, viewport): body(page, res) in headless Chromium with a fresh profile (cfg.userDataDir:
// playwright passes it as --user-data-dir); the page's warnings, errors and any message about flux_numba
// are kept in res.console, a throw in res.error; then res goes to stdout as JSON (run_browser_script)
async function runPage(res, body, viewport = { width: 1400, height: 900 }) {
  res.console = [];
  const browser = await chromium.launchPersistentContext(cfg.userDataDir, {
    executablePath: cfg.chromium, headless: true, viewport,
    args: ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
           "--disable-component-update", "--disable-sync"],
  });
  try {
    const page = browser.pages()[0] || await browser.newPage();
    page.on("console", (m) => {
      if (["warning", "error"].includes(m.type()) || /flux.?numba/i.test(m.text()))
        res.console.push({ type: m.type(), text: m.text(), url: (m.location() || {}).url || "" });
    });
    page.on("pageerror", (e) => res.console.push({ type: "pageerror", text: e.message, url: String(e.stack || "") }));
    await body(page, res);
  } catch (e) {
    res.error = String(e && e.stack || e);
  } finally {
    await browser.close();
  }
  process.stdout.write(JSON.stringify(res));
}

// openApp(page): the ComfyUI page, once the frontend's app and the pack's window.fluxNumba are there
// (a script that listens to the websocket registers its handler first)
async function openApp(page) {
  await page.goto(cfg.url, { waitUntil: "domcontentloaded" });
  await page.waitForFunction(() => window.app && window.app.graph && window.fluxNumba, null, { timeout: 120000 });
}

// nodeShot(page, id, path): a screenshot of one node at zoom 1, nothing selected, its top-left at
// (160, 160) of the canvas: clear of the side bar and the top menus
async function nodeShot(page, id, path) {
  const clip = await page.evaluate((id) => {
    const c = window.app.canvas, n = window.app.graph.getNodeById(id), r = c.canvas.getBoundingClientRect();
    c.deselectAll?.();
    c.ds.scale = 1;
    c.ds.offset = [-n.pos[0] + 160, -n.pos[1] + 160];
    c.setDirty(true, true);
    return { x: r.x + 145, y: r.y + 115, width: Math.min(n.size[0] + 30, r.width - 145), height: Math.min(n.size[1] + 60, r.height - 115) };
  }, id);
  await page.waitForTimeout(800);
  await page.screenshot({ path, clip });
}
'''


# ------------------------------------------------------------------------------------------ checks more than one test makes
def check_console(res):
    """No warning / error from the pack's scripts, and no deprecation the frontend reports about a
    call made from them."""
    ours = [m for m in res["console"] if re.search(r"flux_numba(_view)?\.js", m.get("url", "") + " " + m["text"])
            or "FluxNumba" in m["text"] or "checkState" in m["text"]]
    assert not ours, ours


def _prompt_by_type(p):
    by_type = {}
    for nid, n in p.items():
        by_type.setdefault(n["class_type"], []).append((nid, n["inputs"]))
    return by_type


def check_example_structure(p, backend):
    """Stock vs patched branches of the example in an API prompt ``p``."""
    by_type = _prompt_by_type(p)
    for t, k in {"FluxNumbaLoader": 1, "FluxNumbaPatch": 1, "FluxNumbaStepTimer": 2, "KSampler": 2, "VAEDecode": 2,
                 "FluxNumbaQualityCompare": 1, "FluxNumbaTimingReport": 1, "SaveImage": 3}.items():
        assert len(by_type.get(t, [])) == k, (t, by_type.get(t))
    timers = {inp["label"]: (nid, inp) for nid, inp in by_type["FluxNumbaStepTimer"]}
    assert set(timers) == {"stock", "patched"}
    patch_id, patch_in = by_type["FluxNumbaPatch"][0]
    loader_id = by_type["FluxNumbaLoader"][0][0]
    assert timers["stock"][1]["model"] == [loader_id, 0] and timers["patched"][1]["model"] == [patch_id, 0]
    assert patch_in["model"] == [loader_id, 0]
    assert {k: patch_in[k] for k in ("profile", "route_norms", "attention", "backend")} == \
        {"profile": "exact", "route_norms": True, "attention": "auto", "backend": backend}
    ks = {inp["model"][0]: inp for _, inp in by_type["KSampler"]}
    assert set(ks) == {timers["stock"][0], timers["patched"][0]}
    a, b = ks.values()
    assert a["seed"] == b["seed"] and a["steps"] == b["steps"] and a["positive"] == b["positive"]
    rep = by_type["FluxNumbaTimingReport"][0][1]
    ks_ids = {nid for nid, _ in by_type["KSampler"]}
    assert {rep["samples"][0], rep["samples_2"][0]} == ks_ids
    q = by_type["FluxNumbaQualityCompare"][0][1]
    assert {q["image_a"][0], q["image_b"][0]} == {nid for nid, _ in by_type["VAEDecode"]}
