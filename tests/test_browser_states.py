"""End-to-end: what each run's chart says in a real ComfyUI page (headless Chromium), issue #39, on
this tree's frontend, FLUX for real at toy size on the CPU.

Needs a ComfyUI tree, chromium and playwright-core (tests/_browser_testing.py); skips with the reason
otherwise.

test_chart_states_in_browser:
  run A (one prompt, two timers): FluxNumbaPatch backend "auto" -> passes the model through on the CPU
    (timer "passthru"); backend "torch" -> patched (timer "patched", profile_split on); the report node
    and a preview of its chart image;
  run B: the patched branch fed an SD-shaped conditioning -> the model's first call fails (timer "failed").
Checked: each series' state in words (NOT PATCHED with its reason / PATCHED / FAILED with its error), no
CUDA-graph strip or caption anywhere (CPU), "3/3 steps" over 3 bars with the profiled step explained,
the step slots fixed from the first step, the SVG drawn in its own pixels (no preserveAspectRatio
"none"), a failed run's error in the plot (no placeholder, no "mean - ms" / "total 0.0 ms"), the
report node's table not clipped, and no console warning / error from flux_numba*.js (nor a call the
frontend reports as deprecated).  Screenshots: artifacts/browser_states_*_<tree>_fe<frontend>.png.
"""
import os
import tempfile

import pytest

from _browser_testing import FLUX_UNET, _shot, check_console, run_browser_script

pytestmark = pytest.mark.comfyui

STATE_STEPS = 3


# the page steps of test_chart_states_in_browser (run after JS_PRELUDE): run A, run B
STATES_SCRIPT = r'''
runPage({ frames: [] }, async (page, res) => {
  page.on("websocket", (ws) => ws.on("framereceived", (f) => {
    try { const m = JSON.parse(f.payload); if (["execution_success", "execution_error", "execution_interrupted"].includes(m.type)) res.frames.push(m); } catch (e) {}
  }));
  await openApp(page);
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
  await nodeShot(page, cfg.idsA[0], cfg.shots.passthru);
  await nodeShot(page, cfg.idsA[1], cfg.shots.patched);
  await nodeShot(page, cfg.reportId, cfg.shots.report);
  await nodeShot(page, cfg.previewId, cfg.shots.preview);
  // run B
  res.endB = await runPrompt(cfg.wfB, cfg.idsB);
  log("run B:", res.endB.type);
  await page.waitForFunction((id) => document.querySelector(`[data-flux-numba-chart][data-node-id="${id}"] .flux-numba-stats-row[data-status="FAILED"]`),
    cfg.idsB[0], { timeout: 30000 }).catch(() => {});
  res.chartsB = await chartInfo(cfg.idsB);
  res.seenB = await page.evaluate(() => window.__fnSeen);
  await page.keyboard.press("Escape");
  for (const sel of [".p-dialog-close-button", "[aria-label=Close]"]) await page.locator(sel).first().click({ timeout: 1000 }).catch(() => {});
  await nodeShot(page, cfg.idsB[0], cfg.shots.failed);
});
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
