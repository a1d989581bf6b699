"""End-to-end: the step-timer chart in a real ComfyUI page (headless Chromium), on CPU.

Runs only when all of these are available, else skips with the reason:
  * a ComfyUI tree (marked ``comfyui``: runs per tree from test_comfyui_matrix, or at COMFYUI_PATH);
    COMFYUI_PYTHON (default: this interpreter) can run it;
  * Debian's chromium (/usr/bin/chromium, or CHROMIUM_PATH);
  * playwright-core from npm (PLAYWRIGHT_CORE_DIR = its folder, or found in /work/browser-tools,
    <repo>/.browser-tools (ignored) or the global npm root).  No browser is downloaded.

What is real and what is a stand-in
-----------------------------------
test_chart_in_browser (chart details: live growth, export, reload) does not need FLUX: the step timer is
model-agnostic (it wraps ComfyUI's APPLY_MODEL, which every model type calls), so it uses:
  * a tiny SD1.5-layout UNet (model_channels 320, one level, 26 M params, random weights) written as a
    safetensors file and loaded by ComfyUI's own UNETLoader (real model detection and ModelPatcher);
  * a 5-line test-only node in the temp custom_nodes dir that outputs a zero CONDITIONING [1,77,768]
    (stands in for CLIPTextEncode);
  * the stock KSampler (euler, N steps, cfg 1 -> one diffusion-model call per step) on a 64x64 latent.
So the server sends real flux_numba.step messages from a real sampler, and the page draws them.

Flow: start ComfyUI (--cpu) with the pack symlinked into a temp custom_nodes dir -> open the page ->
load the workflow (UI format) -> queue it -> wait for  [data-flux-numba-chart][data-bars="N"]  -> check
the report node's text -> screenshot -> reload the page and check the series persisted
(node.properties).  Screenshots: artifacts/browser_timer_chart_<tree>_fe<frontend>.png (+ _node, _reload).

test_example_workflow_runs_in_browser (issue 6 bar) runs the SHIPPED example
example_workflows/flux1_dev_stock_vs_numba.json in the page, with FLUX for real at toy size:
  * the file is opened as a user opens it (Workflow > Open: the frontend's file input -> app.handleFile);
  * then, through the frontend's graph API, only what a user without FLUX.1-dev / T5 would change:
    FluxNumbaLoader.unet_name -> the smallest checkpoint ComfyUI detects as FLUX (run.py --write-model
    --comfy-min), VAELoader -> a random-weight FLUX VAE (test_comfyui_server.MAKE_VAE), DualCLIPLoader +
    CLIPTextEncode -> the test-only FluxNumbaTestFluxConditioning node (context [1,16,64], pooled [1,32];
    it feeds the example's own FluxGuidance and ConditioningZeroOut), latent 64x64, steps 3 on both
    samplers, FluxNumbaPatch backend "torch" (CPU: with "auto" the patch passes through);
  * queued with the Run button; then the page is checked against the server's own records: each timer
    chart has exactly 3 bars whose ms are those of the server's flux_numba.step websocket frames, and
    mean/min/max/total match the report node's table in /history; the compare node shows the PSNR/SSIM
    text of its /history output; stock, patched and the report chart PNGs are in the output folder.
  Screenshots: artifacts/browser_example_{all,stock,patched,compare,report}_<tree>_fe<frontend>.png.

test_chart_states_in_browser (issue #39): pass-through, torch-backend with profile_split, and failed runs
(see STATES_SCRIPT); every test here also fails on a console warning / error from flux_numba*.js.
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

pytestmark = pytest.mark.comfyui

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ART = os.path.join(ROOT, "artifacts")
EXAMPLE = os.path.join(ROOT, "example_workflows", "flux1_dev_stock_vs_numba.json")
N_STEPS = 4
PACK_LINK = "ComfyUI-FluxNumba-Pack"  # must not end in "numba" (numba-cuda redirector trap)
FLUX_UNET = "flux_min_test.safetensors"  # smallest checkpoint ComfyUI detects as FLUX (run.py --comfy-min)
FLUX_VAE = "ae_random_test.safetensors"  # random-weight FLUX VAE (test_comfyui_server.MAKE_VAE)
EX_STEPS = 3


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


# ------------------------------------------------------------------------------------------ test fixtures
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


def ui_workflow(unet_name, steps=N_STEPS):
    """The test graph in the frontend's saved (UI) format."""
    def node(id_, type_, pos, size, widgets, inputs=(), outputs=(), order=0):
        return {"id": id_, "type": type_, "pos": list(pos), "size": list(size), "flags": {}, "order": order,
                "mode": 0, "inputs": [dict(i) for i in inputs], "outputs": [dict(o) for o in outputs],
                "properties": {"Node name for S&R": type_}, "widgets_values": list(widgets)}
    links = [
        [1, 1, 0, 2, 0, "MODEL"],        # loader -> timer.model
        [2, 2, 0, 4, 0, "MODEL"],        # timer -> ksampler.model
        [3, 3, 0, 4, 1, "CONDITIONING"],  # cond -> positive
        [4, 3, 0, 4, 2, "CONDITIONING"],  # cond -> negative
        [5, 5, 0, 4, 3, "LATENT"],       # empty latent -> latent_image
        [6, 4, 0, 6, 0, "LATENT"],       # ksampler -> report.samples
    ]
    nodes = [
        node(1, "UNETLoader", (20, 40), (320, 82), [unet_name, "default"],
             outputs=[{"name": "MODEL", "type": "MODEL", "links": [1], "slot_index": 0}], order=0),
        node(2, "FluxNumbaStepTimer", (370, 40), (420, 360), ["stock", False],
             inputs=[{"name": "model", "type": "MODEL", "link": 1}],
             outputs=[{"name": "model", "type": "MODEL", "links": [2], "slot_index": 0}], order=3),
        node(3, "FluxNumbaTestConditioning", (20, 170), (320, 46), [],
             outputs=[{"name": "CONDITIONING", "type": "CONDITIONING", "links": [3, 4], "slot_index": 0}], order=1),
        node(5, "EmptyLatentImage", (20, 260), (320, 106), [64, 64, 1],
             outputs=[{"name": "LATENT", "type": "LATENT", "links": [5], "slot_index": 0}], order=2),
        node(4, "KSampler", (820, 40), (300, 262), [1234, "fixed", steps, 1.0, "euler", "normal", 1.0],
             inputs=[{"name": "model", "type": "MODEL", "link": 2},
                     {"name": "positive", "type": "CONDITIONING", "link": 3},
                     {"name": "negative", "type": "CONDITIONING", "link": 4},
                     {"name": "latent_image", "type": "LATENT", "link": 5}],
             outputs=[{"name": "LATENT", "type": "LATENT", "links": [6], "slot_index": 0}], order=4),
        node(6, "FluxNumbaTimingReport", (820, 340), (520, 300), ["last", 512, 256],
             inputs=[{"name": "samples", "type": "LATENT", "link": 6},
                     {"name": "samples_2", "type": "LATENT", "link": None}],
             outputs=[{"name": "chart", "type": "IMAGE", "links": None},
                      {"name": "table", "type": "STRING", "links": None},
                      {"name": "samples", "type": "LATENT", "links": None}], order=5),
    ]
    return {"last_node_id": 6, "last_link_id": 6, "nodes": nodes, "links": links, "groups": [],
            "config": {}, "extra": {"ds": {"scale": 1.0, "offset": [70, 80]}}, "version": 0.4}


BROWSER_SCRIPT = r'''
const { chromium } = require(process.env.PW_CORE);
const fs = require("fs");
const cfg = JSON.parse(fs.readFileSync(process.argv[2], "utf8"));
const log = (...a) => console.error("[browser]", ...a);
(async () => {
  const res = { console: [] };
  // fresh profile dir: playwright passes it as --user-data-dir
  const browser = await chromium.launchPersistentContext(cfg.userDataDir, {
    executablePath: cfg.chromium, headless: true, viewport: { width: 1400, height: 900 },
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
    await page.goto(cfg.url, { waitUntil: "domcontentloaded" });
    await page.waitForFunction(() => window.app && window.app.graph && window.fluxNumba, null, { timeout: 120000 });
    log("app ready");
    await page.keyboard.press("Escape");
    await page.evaluate(async (wf) => { await window.app.loadGraphData(wf); }, cfg.workflow);
    await page.waitForSelector('[data-flux-numba-chart][data-node-id="2"]', { state: "attached", timeout: 30000 });
    res.bars_before = await page.evaluate(() => window.fluxNumba.bars(2));
    log("workflow loaded; bars before", res.bars_before);
    // record every bar count the chart shows, to check it grows live (step by step), not only at the end
    await page.evaluate(() => {
      const el = document.querySelector('[data-flux-numba-chart][data-node-id="2"]');
      window.__fnBarsSeen = [];
      new MutationObserver(() => window.__fnBarsSeen.push(Number(el.dataset.bars)))
        .observe(el, { attributes: true, attributeFilter: ["data-bars"] });
    });
    await page.evaluate(async () => { await window.app.queuePrompt(0, 1); });
    await page.waitForSelector(`[data-flux-numba-chart][data-node-id="2"][data-bars="${cfg.steps}"]`, { state: "attached", timeout: cfg.timeoutMs });
    res.bars = await page.evaluate(() => window.fluxNumba.bars(2));
    res.rects = await page.locator('[data-flux-numba-chart][data-node-id="2"] rect.flux-numba-bar').count();
    res.labels = await page.evaluate(() => document.querySelector('[data-flux-numba-chart][data-node-id="2"]').dataset.labels);
    res.stats = await page.locator('[data-flux-numba-chart][data-node-id="2"] .flux-numba-stats').innerText();
    await page.waitForFunction(() => (document.querySelector('[data-flux-numba-text][data-node-id="6"]')?.textContent || "").includes("mean ms"), null, { timeout: cfg.timeoutMs });
    res.report_text = await page.evaluate(() => document.querySelector('[data-flux-numba-text][data-node-id="6"]').textContent);
    res.series = await page.evaluate(() => window.fluxNumba.series(2));
    res.bars_seen = await page.evaluate(() => window.__fnBarsSeen);
    try {
      const [dl] = await Promise.all([
        page.waitForEvent("download", { timeout: 15000 }),
        page.click('[data-flux-numba-chart][data-node-id="2"] [data-flux-numba-export]'),
      ]);
      res.export_name = dl.suggestedFilename();
      res.export = JSON.parse(fs.readFileSync(await dl.path(), "utf8"));
    } catch (e) {
      res.export_error = String(e);
    }
    res.chart_visible = await page.locator('[data-flux-numba-chart][data-node-id="2"]').isVisible();
    await page.waitForTimeout(500);
    await page.screenshot({ path: cfg.shot });
    if (res.chart_visible) await page.locator('[data-flux-numba-chart][data-node-id="2"]').screenshot({ path: cfg.shotNode });
    // persistence: reload, the frontend restores the workflow with node.properties
    await page.waitForTimeout(1500);
    await page.reload({ waitUntil: "domcontentloaded" });
    await page.waitForFunction(() => window.app && window.app.graph && window.fluxNumba && window.app.graph.getNodeById(2), null, { timeout: 120000 });
    await page.waitForTimeout(1000);
    res.bars_after_reload = await page.evaluate(() => window.fluxNumba.bars(2));
    await page.screenshot({ path: cfg.shotReload });
    // the shipped example workflow: every node type known to this server, converts to an API prompt
    await page.keyboard.press("Escape");
    await page.evaluate(async (wf) => { await window.app.loadGraphData(wf); }, cfg.example);
    await page.waitForTimeout(1000);
    res.example_unknown = await page.evaluate(() => window.app.graph._nodes
      .filter((n) => !n.constructor?.nodeData || n.constructor.nodeData.name !== n.type).map((n) => n.type));
    res.example_prompt = (await page.evaluate(async () => await window.app.graphToPrompt())).output;
    await page.keyboard.press("Escape");
    await page.screenshot({ path: cfg.shotExample });
  } catch (e) {
    res.error = String(e && e.stack || e);
  } finally {
    await browser.close();
  }
  process.stdout.write(JSON.stringify(res));
})();
'''


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read().decode())


@pytest.fixture(scope="module")
def comfy_server():
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


def run_browser_script(server, name, source, cfg, timeout):
    """Run a playwright-core script (node) with its JSON config; return its JSON result, failing
    with the script's error, the page console and the server log's tail."""
    cfg_path = os.path.join(server["base"], name + "_cfg.json")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    script = os.path.join(server["base"], name + ".cjs")
    with open(script, "w") as f:
        f.write(source)
    r = subprocess.run([server["node"], script, cfg_path], capture_output=True, text=True, timeout=timeout,
                       env=dict(os.environ, PW_CORE=server["pw"]))
    assert r.stdout.strip(), f"browser script failed: {r.stderr[-3000:]}"
    res = json.loads(r.stdout)
    tail = open(server["log"]).read()[-4000:]
    assert not res.get("error"), f"{res.get('error')}\nconsole: {res.get('console')}\nserver: {tail}"
    return res


def test_pack_loaded(comfy_server):
    info = _get(comfy_server["url"] + "/object_info/FluxNumbaStepTimer")
    assert "FluxNumbaStepTimer" in info, open(comfy_server["log"]).read()[-4000:]
    exts = _get(comfy_server["url"] + "/extensions")
    assert any(e.endswith("/flux_numba.js") for e in exts), exts


def test_chart_in_browser(comfy_server):
    os.makedirs(ART, exist_ok=True)
    cfg = {
        "url": comfy_server["url"], "chromium": comfy_server["chromium"], "steps": N_STEPS, "timeoutMs": 180000,
        "userDataDir": tempfile.mkdtemp(prefix="chromium_", dir=comfy_server["base"]),
        "workflow": ui_workflow(comfy_server["unet"]),
        "shot": _shot(comfy_server, "browser_timer_chart"),
        "shotNode": _shot(comfy_server, "browser_timer_chart_node"),
        "shotReload": _shot(comfy_server, "browser_timer_chart_reload"),
        "shotExample": _shot(comfy_server, "browser_example_workflow"),
        "example": json.load(open(EXAMPLE)),
    }
    res = run_browser_script(comfy_server, "browser_test", BROWSER_SCRIPT, cfg, timeout=600)
    assert res["bars_before"] == 0
    assert res["bars"] == N_STEPS and res["rects"] == N_STEPS, res
    assert res["labels"] == "stock"
    assert "it/s" in res["stats"] and "mean" in res["stats"], res["stats"]
    s = res["series"]["series"]["stock"]
    assert len(s["steps"]) == N_STEPS and s["done"] and s["summary"]["steps"] == N_STEPS
    assert all(p["ms"] > 0 for p in s["steps"])
    assert "mean ms" in res["report_text"] and "stock" in res["report_text"]
    # every redraw (a step, the run's start / end, a resize) sets data-bars, also to the same number:
    # the distinct counts in order must be 1, 2, ..., N (one bar per step, none skipped)
    seen = [b for i, b in enumerate(res["bars_seen"]) if b > 0 and (i == 0 or b != res["bars_seen"][i - 1])]
    assert seen[:N_STEPS] == list(range(1, N_STEPS + 1)), f"chart did not grow step by step: {res['bars_seen']}"
    assert not res.get("export_error"), res.get("export_error")
    assert res["export_name"].endswith(".json") and len(res["export"]["series"]["stock"]["steps"]) == N_STEPS
    assert res["chart_visible"], "chart element is hidden"
    assert res["bars_after_reload"] == N_STEPS, "series did not survive a page reload (node.properties)"
    assert os.path.getsize(cfg["shot"]) > 10000
    check_example_prompt(res)
    check_console(res)


def check_example_prompt(res):
    """The example workflow, as the frontend converts it to an API prompt."""
    assert res["example_unknown"] == [], f"node types unknown to the server: {res['example_unknown']}"
    check_example_structure(res["example_prompt"], backend="auto")


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


# ------------------------------------------------------------------------------------------ the example, run
# The shipped stock-vs-patched example, opened and edited in the page as a user without the big weights
# would do it, queued with the Run button; the page and the server's own records are compared.
EXAMPLE_SCRIPT = r'''
const { chromium } = require(process.env.PW_CORE);
const fs = require("fs");
const cfg = JSON.parse(fs.readFileSync(process.argv[2], "utf8"));
const log = (...a) => console.error("[browser]", ...a);
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
(async () => {
  const res = { console: [], frames: [], queued: [] };
  const browser = await chromium.launchPersistentContext(cfg.userDataDir, {
    executablePath: cfg.chromium, headless: true, viewport: { width: 2400, height: 1350 },
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
    // what the server sends (raw websocket frames, not the frontend's copy) and what the page queues
    page.on("websocket", (ws) => ws.on("framereceived", (f) => {
      try {
        const m = JSON.parse(typeof f.payload === "string" ? f.payload : f.payload.toString());
        if (m.type && m.type !== "crystools.monitor" && m.type !== "progress_state") res.frames.push(m);
      } catch (e) { /* binary preview frames */ }
    }));
    page.on("request", (r) => { if (r.method() === "POST" && new URL(r.url()).pathname.endsWith("/prompt")) res.queued.push(r.postDataJSON()); });
    await page.goto(cfg.url, { waitUntil: "domcontentloaded" });
    await page.waitForFunction(() => window.app && window.app.graph && window.fluxNumba, null, { timeout: 120000 });
    await page.keyboard.press("Escape");
    // 1. open the example file the way a user does (Workflow > Open = the frontend's file input -> app.handleFile)
    if (await page.locator("#comfy-file-input").count()) {
      await page.setInputFiles("#comfy-file-input", cfg.examplePath);
      res.opened_with = "file input";
    } else {
      await page.evaluate(async (wf) => { await window.app.loadGraphData(wf); }, cfg.example);
      res.opened_with = "app.loadGraphData";
    }
    await page.waitForFunction(() => window.app.graph._nodes.some((n) => n.type === "FluxNumbaPatch") &&
      document.querySelectorAll("[data-flux-numba-chart]").length === 2, null, { timeout: 30000 });
    await page.keyboard.press("Escape");
    res.graph_before = await page.evaluate(() => ({
      nodes: window.app.graph._nodes.map((n) => [n.id, n.type]),
      links: Object.values(window.app.graph.serialize().links).map((l) => l.slice(0, 5)),
    }));
    // 2. the substitutions of a user without FLUX.1-dev / T5, through the graph API (widgets, add/remove, connect)
    res.edits = await page.evaluate((cfg) => {
      const g = window.app.graph, edits = [];
      const byType = (t) => g._nodes.filter((n) => n.type === t);
      const one = (t) => { const a = byType(t); if (a.length !== 1) throw new Error(`${t}: ${a.length} nodes`); return a[0]; };
      const setW = (node, name, value) => {
        const w = (node.widgets || []).find((w) => w.name === name);
        if (!w) throw new Error(`${node.type} #${node.id} has no widget ${name}`);
        const vals = w.options?.values;
        if (Array.isArray(vals) && !vals.includes(value)) throw new Error(`${node.type}.${name}: ${value} is not offered: ${vals}`);
        const old = w.value;
        w.value = value;
        w.callback?.(value, window.app.canvas, node);
        edits.push(`${node.type} #${node.id} ${name}: ${old} -> ${w.value}`);
      };
      setW(one("FluxNumbaLoader"), "unet_name", cfg.unet);
      setW(one("VAELoader"), "vae_name", cfg.vae);
      const lat = one("EmptySD3LatentImage");
      setW(lat, "width", 64);
      setW(lat, "height", 64);
      for (const ks of byType("KSampler")) setW(ks, "steps", cfg.steps);
      setW(one("FluxNumbaPatch"), "backend", "torch");
      // text encoders -> the test-only conditioning node, wired where CLIPTextEncode's output went
      const clip = one("DualCLIPLoader"), enc = one("CLIPTextEncode");
      const link = (id) => (g.links.get ? g.links.get(id) : g.links[id]);
      const targets = (enc.outputs[0].links || []).map(link).map((l) => [l.target_id, l.target_slot]);
      const cond = window.LiteGraph.createNode("FluxNumbaTestFluxConditioning");
      cond.title = "TEST: FLUX conditioning (stands in for CLIP-L + T5)";
      cond.pos = [enc.pos[0], enc.pos[1]];
      g.add(cond);
      g.remove(enc);
      g.remove(clip);
      for (const [tid, slot] of targets) cond.connect(0, g.getNodeById(tid), slot);
      edits.push(`DualCLIPLoader #${clip.id} + CLIPTextEncode #${enc.id} -> FluxNumbaTestFluxConditioning #${cond.id} -> ` +
                 targets.map(([t, s]) => `${g.getNodeById(t).type} #${t}.${s}`).join(", "));
      g.setDirtyCanvas(true, true);
      return edits;
    }, cfg);
    log(res.edits.join("\n"));
    res.graph_after = await page.evaluate(() => ({
      nodes: window.app.graph._nodes.map((n) => [n.id, n.type]),
      links: Object.values(window.app.graph.serialize().links).map((l) => l.slice(0, 5)),
    }));
    res.timers = await page.evaluate(() => window.app.graph._nodes.filter((n) => n.type === "FluxNumbaStepTimer")
      .map((n) => [n.id, n.widgets.find((w) => w.name === "label").value]));
    res.bars_before = await page.evaluate((ids) => ids.map((id) => window.fluxNumba.bars(id)), res.timers.map((t) => t[0]));
    // 3. queue it with the Run button
    const run = page.getByTestId("queue-button").locator("button").first();
    if (await run.isVisible().catch(() => false)) {
      await run.click();
      res.queued_with = "Run button";
    } else {
      await page.evaluate(async () => { await window.app.queuePrompt(0, 1); });
      res.queued_with = "app.queuePrompt";
    }
    const t0 = Date.now();
    let end = null;
    while (!end) {
      end = res.frames.find((m) => m.type === "execution_success" || m.type === "execution_error" || m.type === "execution_interrupted");
      if (Date.now() - t0 > cfg.timeoutMs) throw new Error("prompt did not finish; frames: " + res.frames.map((m) => m.type).join(","));
      if (!end) await sleep(500);
    }
    res.end = end;
    res.prompt_id = end.data?.prompt_id;
    log("finished:", end.type, (Date.now() - t0) / 1000, "s");
    // 4. what the page shows
    const ids = res.timers.map((t) => t[0]);
    for (const id of ids)
      await page.waitForSelector(`[data-flux-numba-chart][data-node-id="${id}"][data-bars="${cfg.steps}"]`, { state: "attached", timeout: 30000 }).catch(() => {});
    await page.waitForFunction(() => ["FluxNumbaQualityCompare", "FluxNumbaTimingReport"].every((t) => {
      const n = window.app.graph._nodes.find((x) => x.type === t);
      return n && (document.querySelector(`[data-flux-numba-text][data-node-id="${n.id}"]`)?.textContent || "").length > 0;
    }), null, { timeout: 30000 }).catch(() => {});
    res.charts = await page.evaluate((ids) => Object.fromEntries(ids.map((id) => {
      const el = document.querySelector(`[data-flux-numba-chart][data-node-id="${id}"]`);
      return [id, { bars: Number(el?.dataset.bars), labels: el?.dataset.labels,
        rects: [...(el?.querySelectorAll("rect.flux-numba-bar") || [])].map((r) => ({ label: r.dataset.label, step: Number(r.dataset.step), ms: Number(r.dataset.ms), h: Number(r.getAttribute("height")) })),
        stats: el?.querySelector(".flux-numba-stats")?.innerText, visible: !!el && el.getBoundingClientRect().width > 0 }];
    })), ids);
    res.texts = await page.evaluate(() => Object.fromEntries(["FluxNumbaQualityCompare", "FluxNumbaTimingReport"].map((t) => {
      const n = window.app.graph._nodes.find((x) => x.type === t);
      return [t, { id: n.id, text: document.querySelector(`[data-flux-numba-text][data-node-id="${n.id}"]`)?.textContent ?? null }];
    })));
    // 5. screenshots: the whole graph, then each node of interest at zoom 1
    await page.keyboard.press("Escape");
    await page.evaluate(() => { const c = window.app.canvas; c.deselectAll?.(); });
    await page.locator("#graph-canvas").click({ position: { x: 5, y: 500 } }).catch(() => {});
    await page.keyboard.press(".");  // fit view
    await page.waitForTimeout(800);
    await page.screenshot({ path: cfg.shotAll });
    const nodeShot = async (id, path) => {
      const clip = await page.evaluate((id) => {
        const c = window.app.canvas, n = window.app.graph.getNodeById(id), r = c.canvas.getBoundingClientRect();
        // zoom 1, the node's top-left at (160, 160) of the canvas: clear of the side bar and the top menus
        c.ds.scale = 1;
        c.ds.offset = [-n.pos[0] + 160, -n.pos[1] + 160];
        c.setDirty(true, true);
        return { x: r.x + 145, y: r.y + 115, width: Math.min(n.size[0] + 30, r.width - 145), height: Math.min(n.size[1] + 60, r.height - 115) };
      }, id);
      await page.waitForTimeout(600);
      await page.screenshot({ path, clip });
    };
    const [stockId, patchedId] = ["stock", "patched"].map((l) => res.timers.find((t) => t[1] === l)[0]);
    await nodeShot(stockId, cfg.shotStock);
    await nodeShot(patchedId, cfg.shotPatched);
    await nodeShot(res.texts.FluxNumbaQualityCompare.id, cfg.shotCompare);
    const saveTiming = await page.evaluate(() => window.app.graph._nodes.find((n) => n.type === "SaveImage" &&
      n.widgets.find((w) => w.name === "filename_prefix").value.includes("timing")).id);
    await nodeShot(saveTiming, cfg.shotReport);
  } catch (e) {
    res.error = String(e && e.stack || e);
  } finally {
    await browser.close();
  }
  process.stdout.write(JSON.stringify(res));
})();
'''


def _report_rows(text):
    """FluxNumbaTimingReport's table rows: label -> dict(run, steps, mean, min, max, total) as printed."""
    rows = {}
    for line in text.splitlines():
        p = line.split()
        # run label steps mean min max total it/s, then model state (one or two words), graphs, host-bound
        if len(p) >= 8 and p[0].isdigit() and p[2].isdigit():
            rows[p[1]] = dict(run=int(p[0]), steps=int(p[2]), mean=p[3], min=p[4], max=p[5], total=p[6])
    return rows


def test_example_workflow_runs_in_browser(comfy_server):
    """Issue 6 bar: the example runs in the page, both timers show one bar per step with the server's
    numbers, the compare node shows PSNR/SSIM, the report chart is saved."""
    from PIL import Image
    os.makedirs(ART, exist_ok=True)
    shots = {k: _shot(comfy_server, f"browser_example_{k}") for k in ("all", "stock", "patched", "compare", "report")}
    cfg = {
        "url": comfy_server["url"], "chromium": comfy_server["chromium"], "steps": EX_STEPS, "timeoutMs": 300000,
        "userDataDir": tempfile.mkdtemp(prefix="chromium_ex_", dir=comfy_server["base"]),
        "examplePath": EXAMPLE, "example": json.load(open(EXAMPLE)), "unet": FLUX_UNET, "vae": FLUX_VAE,
        **{"shot" + k.capitalize(): v for k, v in shots.items()},
    }
    res = run_browser_script(comfy_server, "browser_example", EXAMPLE_SCRIPT, cfg, timeout=560)
    print(f"\nopened with {res['opened_with']}, queued with {res['queued_with']}; edits:\n  " + "\n  ".join(res["edits"]))

    # only the user's substitutions: every other node and link of the example is still there
    removed = {tuple(n) for n in res["graph_before"]["nodes"]} - {tuple(n) for n in res["graph_after"]["nodes"]}
    added = {tuple(n) for n in res["graph_after"]["nodes"]} - {tuple(n) for n in res["graph_before"]["nodes"]}
    assert sorted(t for _, t in removed) == ["CLIPTextEncode", "DualCLIPLoader"], removed
    assert [t for _, t in added] == ["FluxNumbaTestFluxConditioning"], added
    gone = {str(i) for i, _ in removed}  # frontend 1.49: node ids are strings, link ends numbers
    kept = [l for l in res["graph_before"]["links"] if str(l[1]) not in gone and str(l[3]) not in gone]
    after = [l[1:] for l in res["graph_after"]["links"]]
    lost = [l for l in kept if l[1:] not in after]
    assert not lost, f"links of the example lost: {lost}\nbefore: {res['graph_before']}\nafter: {res['graph_after']}"

    # what was queued: the example's structure with the substituted values
    assert len(res["queued"]) == 1, res["queued"]
    p = res["queued"][0]["prompt"]
    by_type = _prompt_by_type(p)
    check_example_structure(p, backend="torch")
    assert "DualCLIPLoader" not in by_type and "CLIPTextEncode" not in by_type
    (cond_id, _), = by_type["FluxNumbaTestFluxConditioning"]
    (_, fg), = by_type["FluxGuidance"]
    (_, zo), = by_type["ConditioningZeroOut"]
    assert fg["conditioning"] == [cond_id, 0] and zo["conditioning"] == [cond_id, 0]
    assert by_type["FluxNumbaLoader"][0][1]["unet_name"] == FLUX_UNET
    assert by_type["VAELoader"][0][1]["vae_name"] == FLUX_VAE
    lat = by_type["EmptySD3LatentImage"][0][1]
    assert (lat["width"], lat["height"]) == (64, 64)
    assert all(inp["steps"] == EX_STEPS for _, inp in by_type["KSampler"])

    # the run finished
    assert res["end"]["type"] == "execution_success", f"{res['end']}\nserver: {open(comfy_server['log']).read()[-4000:]}"
    h = _get(comfy_server["url"] + f"/history/{res['prompt_id']}")[res["prompt_id"]]
    assert h["status"]["status_str"] == "success", h["status"]
    outs = h["outputs"]

    # timers: exactly one bar per step, each bar = the ms the server measured and sent
    assert res["bars_before"] == [0, 0]
    timers = {label: str(nid) for nid, label in res["timers"]}
    assert set(timers) == {"stock", "patched"}
    steps_sent = [m["data"] for m in res["frames"] if m["type"] == "flux_numba.step"]
    ends_sent = {m["data"]["node"]: m["data"] for m in res["frames"]
                 if m["type"] == "flux_numba.run" and m["data"].get("phase") == "end"}
    rows = _report_rows(" ".join(outs[str(by_type["FluxNumbaTimingReport"][0][0])]["text"]))
    assert set(rows) == {"stock", "patched"}, rows
    for label, nid in timers.items():
        ch = res["charts"][nid]
        sent = [d for d in steps_sent if d["node"] == nid]
        assert ch["visible"], f"{label} chart is hidden"
        assert ch["bars"] == EX_STEPS and len(ch["rects"]) == EX_STEPS, (label, ch)
        assert ch["labels"] == label
        assert len(sent) == EX_STEPS and [d["step"] for d in sent] == list(range(EX_STEPS)), sent
        assert [(b["label"], b["step"], b["ms"]) for b in ch["rects"]] == [(label, d["step"], d["ms"]) for d in sent]
        assert all(b["ms"] > 0 and b["h"] >= 1 for b in ch["rects"])
        ms = [b["ms"] for b in ch["rects"]]
        tot = float(sum(ms))
        summ = ends_sent[nid]["summary"]
        assert summ["steps"] == EX_STEPS and abs(summ["total_ms"] - tot) < 1e-6, summ
        row = rows[label]  # the report node's table (server side, from the timer's run store)
        assert row["run"] == sent[0]["run"], (row, sent[0]["run"])  # this run, not an older one
        assert row["steps"] == EX_STEPS
        assert (row["mean"], row["min"], row["max"], row["total"]) == \
            (f"{tot / len(ms):.2f}", f"{min(ms):.2f}", f"{max(ms):.2f}", f"{tot:.1f}"), (label, row, ms)
        assert f"{EX_STEPS}/{EX_STEPS} steps, mean {tot / len(ms):.2f} ms" in ch["stats"], ch["stats"]
        assert f"total {tot:.1f} ms" in ch["stats"], ch["stats"]
    assert ends_sent[timers["stock"]]["patch"] is None
    patch = ends_sent[timers["patched"]]["patch"]
    assert patch and "torch" in json.dumps(patch), patch  # the patched series carries FluxNumbaPatch's description

    # compare node: PSNR and SSIM on the node, the same text the server returned
    cmp = res["texts"]["FluxNumbaQualityCompare"]
    shown = cmp["text"] or ""
    assert "PSNR" in shown and "SSIM" in shown, shown
    assert shown == "\n".join(outs[str(cmp["id"])]["text"]), (shown, outs[str(cmp["id"])])
    assert "inf" in shown or float(shown.split("PSNR")[1].split("dB")[0]) >= 40, shown  # backend torch == stock
    rep_node = res["texts"]["FluxNumbaTimingReport"]
    assert "mean ms" in (rep_node["text"] or "")
    assert rep_node["text"] == "\n".join(outs[str(rep_node["id"])]["text"])

    # images: both branches and the report chart saved to the output folder and listed in /history
    saved = {}
    for nid, inp in by_type["SaveImage"]:
        (im,) = outs[nid]["images"]
        path = os.path.join(comfy_server["base"], "output", im.get("subfolder", ""), im["filename"])
        assert os.path.isfile(path), path
        saved[inp["filename_prefix"]] = Image.open(path).size
    rep = by_type["FluxNumbaTimingReport"][0][1]
    assert saved == {"flux_numba/stock": (64, 64), "flux_numba/patched": (64, 64),
                     "flux_numba/timing": (rep["width"], rep["height"])}, saved
    server_log = open(comfy_server["log"]).read()
    assert "FluxNumbaPatch: 1 double + 1 single blocks" in server_log
    fb = [ln for ln in server_log.splitlines() if "running ComfyUI's original block instead" in ln]
    assert not fb, fb  # the pack's blocks ran: a fallback would make the PSNR check vacuous
    check_console(res)
    for k, v in shots.items():
        assert os.path.getsize(v) > 2000, k


# ------------------------------------------------------------------------------------------ what each run says (#39)
# Issue #39's chart points in the page, on this tree's frontend, FLUX for real at toy size on the CPU:
#   run A (one prompt, two timers): FluxNumbaPatch backend "auto" -> passes the model through on the CPU
#     (timer "passthru"); backend "torch" -> patched (timer "patched", profile_split on); the report node
#     and a preview of its chart image;
#   run B: the patched branch fed an SD-shaped conditioning -> the model's first call fails (timer "failed").
# Checked: each series' state in words (NOT PATCHED with its reason / PATCHED / FAILED with its error), no
# CUDA-graph strip or caption anywhere (CPU), "3/3 steps" over 3 bars with the profiled step explained,
# the step slots fixed from the first step, the SVG drawn in its own pixels (no preserveAspectRatio
# "none"), a failed run's error in the plot (no placeholder, no "mean - ms" / "total 0.0 ms"), the
# report node's table not clipped, and no console warning / error from flux_numba*.js (nor a call the
# frontend reports as deprecated).  Screenshots: artifacts/browser_states_*_<tree>_fe<frontend>.png.
STATES_SCRIPT = r'''
const { chromium } = require(process.env.PW_CORE);
const fs = require("fs");
const cfg = JSON.parse(fs.readFileSync(process.argv[2], "utf8"));
const log = (...a) => console.error("[browser]", ...a);
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
(async () => {
  const res = { console: [], frames: [] };
  const browser = await chromium.launchPersistentContext(cfg.userDataDir, {
    executablePath: cfg.chromium, headless: true, viewport: { width: 1400, height: 900 },
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
    page.on("websocket", (ws) => ws.on("framereceived", (f) => {
      try { const m = JSON.parse(f.payload); if (["execution_success", "execution_error", "execution_interrupted"].includes(m.type)) res.frames.push(m); } catch (e) {}
    }));
    await page.goto(cfg.url, { waitUntil: "domcontentloaded" });
    await page.waitForFunction(() => window.app && window.app.graph && window.fluxNumba, null, { timeout: 120000 });
    await page.keyboard.press("Escape");
    const chartInfo = (ids) => page.evaluate((ids) => Object.fromEntries(ids.map((id) => {
      const el = document.querySelector(`[data-flux-numba-chart][data-node-id="${id}"]`);
      const svg = el.querySelector("svg");
      const rows = [...el.querySelectorAll(".flux-numba-stats-row")].map((r) => ({
        label: r.dataset.label, model: r.dataset.model, status: r.dataset.status, text: r.innerText,
        state: r.querySelector(".flux-numba-state")?.textContent, line: r.querySelector(".flux-numba-line")?.textContent }));
      return [id, { bars: Number(el.dataset.bars), slots: Number(el.dataset.slots), rows,
        rects: [...el.querySelectorAll("rect.flux-numba-bar")].map((r) => ({ fill: r.getAttribute("fill"), profiled: r.dataset.profiled, graphs: r.dataset.graphs })),
        graphStrips: el.querySelectorAll(".flux-numba-graph").length,
        caption: el.querySelector(".flux-numba-caption")?.textContent ?? null,
        empty: el.querySelector(".flux-numba-empty")?.textContent ?? null,
        text: el.innerText + " " + [...svg.querySelectorAll("text")].map((t) => t.textContent).join(" "),
        par: svg.getAttribute("preserveAspectRatio"), viewBox: svg.getAttribute("viewBox"),
        box: [Math.round(svg.clientWidth), Math.round(svg.clientHeight)] }];
    })), ids);
    const watch = (ids) => page.evaluate((ids) => {
      window.__fnSeen = {};
      for (const id of ids) {
        const el = document.querySelector(`[data-flux-numba-chart][data-node-id="${id}"]`);
        window.__fnSeen[id] = [];
        new MutationObserver(() => window.__fnSeen[id].push([Number(el.dataset.bars), Number(el.dataset.slots)]))
          .observe(el, { attributes: true, attributeFilter: ["data-bars", "data-slots"] });
      }
    }, ids);
    const runPrompt = async (wf, ids) => {
      res.frames.length = 0;
      await page.evaluate(async (wf) => { await window.app.loadGraphData(wf); }, wf);
      for (const id of ids) await page.waitForSelector(`[data-flux-numba-chart][data-node-id="${id}"]`, { state: "attached", timeout: 30000 });
      await page.keyboard.press("Escape");
      await watch(ids);
      await page.evaluate(async () => { await window.app.queuePrompt(0, 1); });
      const t0 = Date.now();
      while (!res.frames.length) {
        if (Date.now() - t0 > cfg.timeoutMs) throw new Error("prompt did not finish");
        await sleep(500);
      }
      await sleep(1500);  // the last flux_numba.run frame and the report's onExecuted
      return res.frames[0];
    };
    const nodeShot = async (id, path) => {
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
    };
    // run A
    res.endA = await runPrompt(cfg.wfA, cfg.idsA);
    log("run A:", res.endA.type);
    res.chartsA = await chartInfo(cfg.idsA);
    res.seenA = await page.evaluate(() => window.__fnSeen);
    res.report = await page.evaluate((id) => {
      const pre = document.querySelector(`[data-flux-numba-text][data-node-id="${id}"]`);
      const n = window.app.graph.getNodeById(id);
      return { text: pre?.textContent ?? null, scrollW: pre?.scrollWidth, clientW: pre?.clientWidth,
               tableW: Number(pre?.dataset.tableWidth), size: [...n.size] };
    }, cfg.reportId);
    await nodeShot(cfg.idsA[0], cfg.shots.passthru);
    await nodeShot(cfg.idsA[1], cfg.shots.patched);
    await nodeShot(cfg.reportId, cfg.shots.report);
    await nodeShot(cfg.previewId, cfg.shots.preview);
    // run B
    res.endB = await runPrompt(cfg.wfB, cfg.idsB);
    log("run B:", res.endB.type);
    await page.waitForFunction((id) => document.querySelector(`[data-flux-numba-chart][data-node-id="${id}"] .flux-numba-stats-row[data-status="FAILED"]`),
      cfg.idsB[0], { timeout: 30000 }).catch(() => {});
    res.chartsB = await chartInfo(cfg.idsB);
    res.seenB = await page.evaluate(() => window.__fnSeen);
    await page.keyboard.press("Escape");
    for (const sel of [".p-dialog-close-button", "[aria-label=Close]"]) await page.locator(sel).first().click({ timeout: 1000 }).catch(() => {});
    await nodeShot(cfg.idsB[0], cfg.shots.failed);
  } catch (e) {
    res.error = String(e && e.stack || e);
  } finally {
    await browser.close();
  }
  process.stdout.write(JSON.stringify(res));
})();
'''


def ui_graph(nodes, links):
    """A UI-format workflow from (id, type, pos, size, widgets) nodes and (src, slot, dst, slot, type)
    links; inputs / outputs are named by the frontend from the server's node definitions."""
    out_links, nlist = [], []
    ins, outs = {}, {}
    for i, (src, ss, dst, ds, typ) in enumerate(links, 1):
        out_links.append([i, src, ss, dst, ds, typ])
        outs.setdefault(src, {}).setdefault(ss, (typ, []))[1].append(i)
        ins.setdefault(dst, {})[ds] = (typ, i)
    for order, (nid, typ, pos, size, widgets, in_names) in enumerate(nodes):
        nlist.append({"id": nid, "type": typ, "pos": list(pos), "size": list(size), "flags": {}, "order": order,
                      "mode": 0, "properties": {"Node name for S&R": typ}, "widgets_values": list(widgets),
                      "inputs": [{"name": name, "type": ins.get(nid, {}).get(k, ("*", None))[0],
                                  "link": ins.get(nid, {}).get(k, (None, None))[1]} for k, name in enumerate(in_names)],
                      "outputs": [{"name": t, "type": t, "links": l, "slot_index": k}
                                  for k, (t, l) in sorted(outs.get(nid, {}).items())]})
    return {"last_node_id": max(n["id"] for n in nlist), "last_link_id": len(out_links), "nodes": nlist,
            "links": out_links, "groups": [], "config": {}, "extra": {"ds": {"scale": 0.6, "offset": [40, 40]}},
            "version": 0.4}


STATE_STEPS = 3


def _states_workflows():
    ks = ["model", "positive", "negative", "latent_image"]
    kw = [7, "fixed", STATE_STEPS, 1.0, "euler", "simple", 1.0]
    patch = ["exact", True, "auto"]
    a_nodes = [
        (1, "UNETLoader", (20, 40), (320, 82), [FLUX_UNET, "default"], []),
        (2, "FluxNumbaTestFluxConditioning", (20, 160), (320, 60), [0], []),
        (3, "EmptySD3LatentImage", (20, 260), (320, 106), [64, 64, 1], []),
        (4, "FluxNumbaPatch", (20, 420), (320, 154), patch + ["auto", "auto"], ["model"]),
        (5, "FluxNumbaStepTimer", (380, 40), (420, 360), ["passthru", False], ["model"]),
        (6, "KSampler", (840, 40), (300, 262), kw, ks),
        (7, "FluxNumbaPatch", (20, 620), (320, 154), patch + ["torch", "auto"], ["model"]),
        (8, "FluxNumbaStepTimer", (380, 440), (420, 360), ["patched", True], ["model"]),
        (9, "KSampler", (840, 440), (300, 262), kw, ks),
        (10, "FluxNumbaTimingReport", (380, 860), (520, 300), ["last", 1024, 512], ["samples", "samples_2"]),
        (11, "PreviewImage", (1260, 860), (560, 340), [], ["images"]),
    ]
    a_links = [(1, 0, 4, 0, "MODEL"), (4, 0, 5, 0, "MODEL"), (5, 0, 6, 0, "MODEL"), (2, 0, 6, 1, "CONDITIONING"),
               (2, 0, 6, 2, "CONDITIONING"), (3, 0, 6, 3, "LATENT"), (1, 0, 7, 0, "MODEL"), (7, 0, 8, 0, "MODEL"),
               (8, 0, 9, 0, "MODEL"), (2, 0, 9, 1, "CONDITIONING"), (2, 0, 9, 2, "CONDITIONING"),
               (3, 0, 9, 3, "LATENT"), (9, 0, 10, 0, "LATENT"), (6, 0, 10, 1, "LATENT"), (10, 0, 11, 0, "IMAGE")]
    # the SD-shaped conditioning ([1, 77, 768]) into the FLUX model: its first call fails
    b_nodes = [
        (1, "UNETLoader", (20, 40), (320, 82), [FLUX_UNET, "default"], []),
        (2, "FluxNumbaTestConditioning", (20, 160), (320, 46), [], []),
        (3, "EmptySD3LatentImage", (20, 260), (320, 106), [64, 64, 1], []),
        (7, "FluxNumbaPatch", (20, 420), (320, 154), patch + ["torch", "auto"], ["model"]),
        (8, "FluxNumbaStepTimer", (380, 40), (420, 360), ["failed", False], ["model"]),
        (9, "KSampler", (840, 40), (300, 262), kw, ks),
        (10, "FluxNumbaTimingReport", (840, 360), (520, 300), ["last", 1024, 512], ["samples", "samples_2"]),
    ]
    b_links = [(1, 0, 7, 0, "MODEL"), (7, 0, 8, 0, "MODEL"), (8, 0, 9, 0, "MODEL"), (2, 0, 9, 1, "CONDITIONING"),
               (2, 0, 9, 2, "CONDITIONING"), (3, 0, 9, 3, "LATENT"), (9, 0, 10, 0, "LATENT")]
    return ui_graph(a_nodes, a_links), ui_graph(b_nodes, b_links)


def check_console(res):
    """No warning / error from the pack's scripts, and no deprecation the frontend reports about a
    call made from them."""
    ours = [m for m in res["console"] if re.search(r"flux_numba(_view)?\.js", m.get("url", "") + " " + m["text"])
            or "FluxNumba" in m["text"] or "checkState" in m["text"]]
    assert not ours, ours


def check_chart_common(ch, steps):
    """What no chart on a CPU server may show."""
    assert ch["par"] in (None, "xMidYMid meet"), ch["par"]  # no preserveAspectRatio="none": text never squeezed
    assert ch["viewBox"] == f"0 0 {ch['box'][0]} {ch['box'][1]}", (ch["viewBox"], ch["box"])  # its own pixels
    assert ch["graphStrips"] == 0 and all(r["graphs"] == "" for r in ch["rects"]), ch  # no CUDA, no graph strip
    assert "graph" not in ch["text"].lower(), ch["text"]  # nor any word about graphs ("CUDA graphs: all 0/3")
    assert ch["slots"] == steps, ch


def _fixed_slots(seen, steps):
    """From the first bar on, the chart has the run's step slots (it never grows one slot per step)."""
    with_bars = [s for b, s in seen if b > 0]
    assert with_bars and all(s == steps for s in with_bars), seen


def test_chart_states_in_browser(comfy_server):
    """Issue #39 part 1 on this tree's frontend: pass-through, torch-backend (profile split) and failed
    runs, two timers in one prompt."""
    wf_a, wf_b = _states_workflows()
    shots = {k: _shot(comfy_server, f"browser_states_{k}") for k in ("passthru", "patched", "report", "preview", "failed")}
    cfg = {"url": comfy_server["url"], "chromium": comfy_server["chromium"], "timeoutMs": 300000,
           "userDataDir": tempfile.mkdtemp(prefix="chromium_st_", dir=comfy_server["base"]),
           "wfA": wf_a, "idsA": [5, 8], "reportId": 10, "previewId": 11, "wfB": wf_b, "idsB": [8], "shots": shots}
    res = run_browser_script(comfy_server, "browser_states", STATES_SCRIPT, cfg, timeout=560)
    log = open(comfy_server["log"]).read()[-4000:]
    assert res["endA"]["type"] == "execution_success", (res["endA"], log)
    passthru, patched = res["chartsA"]["5"], res["chartsA"]["8"]
    for ch in (passthru, patched):
        check_chart_common(ch, STATE_STEPS)
        assert ch["bars"] == STATE_STEPS and len(ch["rows"]) == 1, ch
    for nid in ("5", "8"):
        _fixed_slots(res["seenA"][nid], STATE_STEPS)
    (row,) = passthru["rows"]
    assert row["model"] == "not patched" and row["status"] == "done", row
    assert row["state"].startswith("NOT PATCHED: ") and len(row["state"]) > len("NOT PATCHED: ") + 5, row
    assert all(r["fill"].startswith("url(#flux-numba-hatch") for r in passthru["rects"]), passthru["rects"]
    assert row["line"].startswith(f"{STATE_STEPS}/{STATE_STEPS} steps, mean "), row
    (row,) = patched["rows"]
    assert row["model"] == "patched" and row["state"] == "PATCHED" and row["status"] == "done", row
    # profile_split: 3 bars, the header says 3/3 steps and why the mean is over 2
    assert sum(r["profiled"] == "1" for r in patched["rects"]) == 1, patched["rects"]
    assert row["line"].startswith(f"{STATE_STEPS}/{STATE_STEPS} steps, mean "), row
    assert "profiled (dimmed, left out of mean / it/s: mean of 2)" in row["line"], row
    rep = res["report"]
    assert "mean ms" in (rep["text"] or "") and "passthru" in rep["text"] and "patched" in rep["text"], rep
    assert rep["tableW"] <= rep["clientW"], rep  # the report node's table is not clipped
    assert rep["size"][0] >= rep["tableW"], rep
    # run B: failed in its first step
    assert res["endB"]["type"] == "execution_error", res["endB"]
    failed = res["chartsB"]["8"]
    (row,) = failed["rows"]
    assert row["status"] == "FAILED" and failed["bars"] == 0, failed
    assert row["model"] == "patched" and row["state"] == "PATCHED", row  # not "PARTLY PATCHED: no op ran"
    assert (failed["empty"] or "").startswith("failed FAILED: ") and len(failed["empty"]) > 25, failed  # the error, in the plot
    assert "appear here" not in failed["text"] and "waiting" not in failed["text"], failed["text"]
    assert row["line"] == f"no step finished (0/{STATE_STEPS} steps)", row
    assert "mean -" not in failed["text"] and "total 0.0" not in failed["text"], failed["text"]
    assert failed["slots"] == STATE_STEPS and failed["graphStrips"] == 0
    check_console(res)
    for k, v in shots.items():
        assert os.path.getsize(v) > 2000, k
