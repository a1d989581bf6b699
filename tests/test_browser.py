"""End-to-end: the step-timer chart in a real ComfyUI page (headless Chromium), on CPU.

Runs only when all of these are available, else skips with the reason:
  * COMFYUI_PATH -> a ComfyUI tree (main.py); COMFYUI_PYTHON (default: this interpreter) can run it;
  * Debian's chromium (/usr/bin/chromium, or CHROMIUM_PATH);
  * playwright-core from npm (PLAYWRIGHT_CORE_DIR = its folder, or found in /work/browser-tools,
    <repo>/.browser-tools (ignored) or the global npm root).  No browser is downloaded.

What is real and what is a stand-in
-----------------------------------
FLUX itself cannot run here: ComfyUI only accepts a FLUX checkpoint with hidden size 3072 (~1 GB even
with one block), and real text encoders are gigabytes.  The step timer is model-agnostic (it wraps
ComfyUI's APPLY_MODEL, which every model type calls), so the test uses:
  * a tiny SD1.5-layout UNet (model_channels 320, one level, 26 M params, random weights) written as a
    safetensors file and loaded by ComfyUI's own UNETLoader (real model detection and ModelPatcher);
  * a 5-line test-only node in the temp custom_nodes dir that outputs a zero CONDITIONING [1,77,768]
    (stands in for CLIPTextEncode);
  * the stock KSampler (euler, N steps, cfg 1 -> one diffusion-model call per step) on a 64x64 latent.
So the server sends real flux_numba.step messages from a real sampler, and the page draws them.

Flow: start ComfyUI (--cpu) with the pack symlinked into a temp custom_nodes dir -> open the page ->
load the workflow (UI format) -> queue it -> wait for  [data-flux-numba-chart][data-bars="N"]  -> check
the report node's text -> screenshot -> reload the page and check the series persisted
(node.properties).  Screenshots: artifacts/browser_timer_chart.png (+ _node.png, _reload.png).
"""
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ART = os.path.join(ROOT, "artifacts")
EXAMPLE = os.path.join(ROOT, "example_workflows", "flux1_dev_stock_vs_numba.json")
N_STEPS = 4
PACK_LINK = "ComfyUI-FluxNumba-Pack"  # must not end in "numba" (numba-cuda redirector trap)


# ------------------------------------------------------------------------------------------ discovery
def _comfy_path():
    p = os.environ.get("COMFYUI_PATH")
    if not p:
        return None, "COMFYUI_PATH is not set (point it at a ComfyUI tree to run the browser test)"
    if not os.path.isfile(os.path.join(p, "main.py")):
        return None, f"COMFYUI_PATH={p} has no main.py"
    return os.path.abspath(p), None


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
    page.on("console", (m) => { if (m.type() === "error" || m.text().includes("FluxNumba")) res.console.push(m.type() + ": " + m.text()); });
    page.on("pageerror", (e) => res.console.push("pageerror: " + e.message));
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
    dm = os.path.join(base, "models", "diffusion_models")
    os.makedirs(dm)
    unet = "tiny_sd15_unet_test.safetensors"
    r = subprocess.run([req["py"], "-c", MAKE_UNET, os.path.join(dm, unet)], cwd=req["comfy"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    udir = os.path.join(base, "user", "default")
    os.makedirs(udir)
    with open(os.path.join(udir, "comfy.settings.json"), "w") as f:
        json.dump({"Comfy.TutorialCompleted": True}, f)
    port = _free_port()
    logf = open(os.path.join(base, "comfyui.log"), "w")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([req["py"], "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(port),
                             "--base-directory", base, "--database-url", "sqlite:///:memory:",
                             "--disable-auto-launch"], cwd=req["comfy"], stdout=logf, stderr=subprocess.STDOUT,
                            env=env)
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
                if time.time() - t0 > 240:
                    pytest.fail("ComfyUI did not start in 240 s: " + open(logf.name).read()[-4000:])
                time.sleep(1)
        yield dict(req, base=base, url=url, unet=unet, log=logf.name, proc=proc)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        logf.close()
        shutil.rmtree(base, ignore_errors=True)


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
        "shot": os.path.join(ART, "browser_timer_chart.png"),
        "shotNode": os.path.join(ART, "browser_timer_chart_node.png"),
        "shotReload": os.path.join(ART, "browser_timer_chart_reload.png"),
        "shotExample": os.path.join(ART, "browser_example_workflow.png"),
        "example": json.load(open(EXAMPLE)),
    }
    cfg_path = os.path.join(comfy_server["base"], "browser_cfg.json")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    script = os.path.join(comfy_server["base"], "browser_test.cjs")
    with open(script, "w") as f:
        f.write(BROWSER_SCRIPT)
    r = subprocess.run([comfy_server["node"], script, cfg_path], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PW_CORE=comfy_server["pw"]))
    assert r.stdout.strip(), f"browser script failed: {r.stderr[-3000:]}"
    res = json.loads(r.stdout)
    tail = open(comfy_server["log"]).read()[-3000:]
    assert not res.get("error"), f"{res.get('error')}\nconsole: {res.get('console')}\nserver: {tail}"
    assert res["bars_before"] == 0
    assert res["bars"] == N_STEPS and res["rects"] == N_STEPS, res
    assert res["labels"] == "stock"
    assert "it/s" in res["stats"] and "mean" in res["stats"], res["stats"]
    s = res["series"]["series"]["stock"]
    assert len(s["steps"]) == N_STEPS and s["done"] and s["summary"]["steps"] == N_STEPS
    assert all(p["ms"] > 0 for p in s["steps"])
    assert "mean ms" in res["report_text"] and "stock" in res["report_text"]
    seen = [b for b in res["bars_seen"] if b > 0]
    assert seen[:N_STEPS] == list(range(1, N_STEPS + 1)), f"chart did not grow step by step: {res['bars_seen']}"
    assert not res.get("export_error"), res.get("export_error")
    assert res["export_name"].endswith(".json") and len(res["export"]["series"]["stock"]["steps"]) == N_STEPS
    assert res["chart_visible"], "chart element is hidden"
    assert res["bars_after_reload"] == N_STEPS, "series did not survive a page reload (node.properties)"
    assert os.path.getsize(cfg["shot"]) > 10000
    check_example_prompt(res)


def check_example_prompt(res):
    """The example workflow, as the frontend converts it to an API prompt."""
    assert res["example_unknown"] == [], f"node types unknown to the server: {res['example_unknown']}"
    p = res["example_prompt"]
    by_type = {}
    for nid, n in p.items():
        by_type.setdefault(n["class_type"], []).append((nid, n["inputs"]))
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
        {"profile": "exact", "route_norms": True, "attention": "auto", "backend": "auto"}
    ks = {inp["model"][0]: inp for _, inp in by_type["KSampler"]}
    assert set(ks) == {timers["stock"][0], timers["patched"][0]}
    a, b = ks.values()
    assert a["seed"] == b["seed"] and a["steps"] == b["steps"] and a["positive"] == b["positive"]
    rep = by_type["FluxNumbaTimingReport"][0][1]
    ks_ids = {nid for nid, _ in by_type["KSampler"]}
    assert {rep["samples"][0], rep["samples_2"][0]} == ks_ids
    q = by_type["FluxNumbaQualityCompare"][0][1]
    assert {q["image_a"][0], q["image_b"][0]} == {nid for nid, _ in by_type["VAEDecode"]}
