"""End-to-end: the step-timer chart in a real ComfyUI page (headless Chromium), on CPU.

Needs a ComfyUI tree, chromium and playwright-core (tests/_browser_testing.py: what is found where,
the server, the page scripts' shared JavaScript); skips with the reason otherwise.

test_chart_in_browser (chart details: live growth, export, reload) does not need FLUX: the step timer is
model-agnostic (it wraps ComfyUI's APPLY_MODEL, which every model type calls), so it uses:
  * a tiny SD1.5-layout UNet (model_channels 320, one level, 26 M params, random weights) written as a
    safetensors file and loaded by ComfyUI's own UNETLoader (real model detection and ModelPatcher);
  * a 5-line test-only node in the temp custom_nodes dir that outputs a zero CONDITIONING [1,77,768]
    (stands in for CLIPTextEncode);
  * the stock KSampler (euler, N steps, cfg 1 -> one diffusion-model call per step) on a 64x64 latent.
So the server sends real flux_numba.step messages from a real sampler, and the page draws them.

Flow: open the page -> load the workflow (UI format) -> queue it -> wait for
[data-flux-numba-chart][data-bars="N"] -> check the report node's text -> export the series -> screenshot
-> reload the page and check the series persisted (node.properties) -> load the shipped example and
check every node type is known and it converts to an API prompt.  It also fails on a console
warning / error from flux_numba*.js.  Screenshots: artifacts/browser_timer_chart_<tree>_fe<frontend>.png
(+ _node, _reload) and artifacts/browser_example_workflow_<tree>_fe<frontend>.png.
test_pack_loaded: the server lists the pack's nodes and its web extension.
"""
import json
import os
import tempfile

import pytest

from _browser_testing import (ART, EXAMPLE, _get, _shot, check_console, check_example_structure,
                              run_browser_script)

pytestmark = pytest.mark.comfyui

N_STEPS = 4


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


# the page steps of test_chart_in_browser (run after JS_PRELUDE)
CHART_SCRIPT = r'''
runPage({}, async (page, res) => {
  await openApp(page);
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
  res.yticks = await page.evaluate(() => [...document.querySelectorAll('[data-flux-numba-chart][data-node-id="2"] text.flux-numba-tick[data-axis="y"]')].map((t) => t.textContent));
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
});
'''


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
    res = run_browser_script(comfy_server, "browser_test", CHART_SCRIPT, cfg, timeout=600)
    assert res["bars_before"] == 0
    assert res["bars"] == N_STEPS and res["rects"] == N_STEPS, res
    assert res["labels"] == "stock"
    assert "it/s" in res["stats"] and "mean" in res["stats"], res["stats"]
    # the three y-axis tick labels share one format (no decimals from 100 ms up, one below)
    decimals = {len(t.partition(".")[2]) for t in res["yticks"]}
    assert len(res["yticks"]) == 3 and len(decimals) == 1 and decimals <= {0, 1}, res["yticks"]
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
