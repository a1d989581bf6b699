"""End-to-end: the SHIPPED example workflow example_workflows/flux1_dev_stock_vs_numba.json runs in a
real ComfyUI page (headless Chromium), with FLUX for real at toy size on the CPU (issue 6 bar).

Needs a ComfyUI tree, chromium and playwright-core (tests/_browser_testing.py); skips with the reason
otherwise.

test_example_workflow_runs_in_browser:
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
"""
import json
import os
import tempfile

import pytest

from _browser_testing import (ART, EXAMPLE, FLUX_UNET, FLUX_VAE, _get, _prompt_by_type, _shot, check_console,
                              check_example_structure, run_browser_script)

pytestmark = pytest.mark.comfyui

EX_STEPS = 3


# The shipped stock-vs-patched example, opened and edited in the page as a user without the big weights
# would do it, queued with the Run button; the page and the server's own records are compared.
EXAMPLE_SCRIPT = r'''
runPage({ frames: [], queued: [] }, async (page, res) => {
  // what the server sends (raw websocket frames, not the frontend's copy) and what the page queues
  page.on("websocket", (ws) => ws.on("framereceived", (f) => {
    try {
      const m = JSON.parse(typeof f.payload === "string" ? f.payload : f.payload.toString());
      if (m.type && m.type !== "crystools.monitor" && m.type !== "progress_state") res.frames.push(m);
    } catch (e) { /* binary preview frames */ }
  }));
  page.on("request", (r) => { if (r.method() === "POST" && new URL(r.url()).pathname.endsWith("/prompt")) res.queued.push(r.postDataJSON()); });
  await openApp(page);
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
  const [stockId, patchedId] = ["stock", "patched"].map((l) => res.timers.find((t) => t[1] === l)[0]);
  await nodeShot(page, stockId, cfg.shotStock);
  await nodeShot(page, patchedId, cfg.shotPatched);
  await nodeShot(page, res.texts.FluxNumbaQualityCompare.id, cfg.shotCompare);
  const saveTiming = await page.evaluate(() => window.app.graph._nodes.find((n) => n.type === "SaveImage" &&
    n.widgets.find((w) => w.name === "filename_prefix").value.includes("timing")).id);
  await nodeShot(page, saveTiming, cfg.shotReport);
}, { width: 2400, height: 1350 });
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
