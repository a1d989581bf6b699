"""web/flux_numba_view.js -- what the step-timer chart says about a run, in words -- under node (no
browser, no ComfyUI): the pure functions flux_numba.js draws with.  tests/test_browser_states.py checks
the same points in a real page.  Skips (with the reason) where node is not installed."""
import json
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VIEW = os.path.join(ROOT, "web", "flux_numba_view.js")

SCRIPT = r'''
const v = await import(process.argv[1]);
const cases = JSON.parse(process.argv[2]);
const out = {};
for (const [name, s] of Object.entries(cases)) {
  out[name] = { words: v.stateWords(s), status: v.runStatus(s), stats: v.statsText(s), notes: v.notes(s).map((n) => n.text),
    graphs: v.showsGraphs(s), colour: v.seriesColour(s), slots: v.slotCount([s]), empty: v.emptyPlotText([s]),
    caption: v.axisCaption([s], v.slotCount([s])) };
}
process.stdout.write(JSON.stringify(out));
'''


def step(i, ms=10.0, **kw):
    return {**dict(step=i, index=i, ms=ms, profiled=False, graphs=None, host_ms=None, host_bound=False), **kw}


def summary(ms, recorded=None):
    if not ms:
        return dict(steps=0, recorded_steps=recorded or 0, mean_ms=None, min_ms=None, max_ms=None, total_ms=0.0, its=None)
    t = sum(ms)
    return dict(steps=len(ms), recorded_steps=recorded or len(ms), mean_ms=t / len(ms), min_ms=min(ms), max_ms=max(ms),
                total_ms=t, its=1000 * len(ms) / t)


NONE_G = {"state": "none", "mode": "eager", "blocks": [0, 0], "why": "CUDA graphs off (cuda_graph off)"}
ALL_G = {"state": "all", "mode": "whole step", "why": None}


def series(label="patched", state="patched", why=None, device="cpu", steps=(), done=True, error=None, total=3, profile=None):
    steps = list(steps)
    timed = [p["ms"] for p in steps if not p["profiled"]] or [p["ms"] for p in steps]
    return dict(label=label, run=7, total_steps=total, device=device, steps=steps, done=done, error=error,
                summary=summary(timed, len(steps)), model={"state": state, "why": why}, profile=profile)


CASES = {
    # FluxNumbaPatch passed the model through (no CUDA): says so with the reason, hatched grey
    "pass_through": series(state="not patched", why="no CUDA GPU visible to torch",
                           steps=[step(0), step(1), step(2)]),
    # backend torch on the CPU: patched, but no graph strip and no "CUDA graphs: all 0/3" even if steps carry states
    "torch_cpu": series(steps=[step(i, graphs=NONE_G) for i in range(3)]),
    "stock": series(label="stock", state="stock", steps=[step(i) for i in range(3)]),
    # failed before its first step: no placeholder, no "mean - ms ... total 0.0 ms"
    "failed": series(error="RuntimeError: boom (test)", steps=[]),
    # running, first step only: the slots are the run's 28 steps already
    "running": series(done=False, total=28, steps=[step(0)]),
    # profile_split: 3 bars, one profiled: "3/3 steps" and why the mean is over 2
    "profiled": series(steps=[step(0), step(1, ms=90.0, profiled=True), step(2)],
                       profile={"step": 1, "ms": {"attention": 1.0, "gemm": 2.0, "fused": 0.5, "other": 0.2},
                                "gpu_busy_pct": 71.6}),
    # patched on CUDA: the graph replays are stated, and host-bound steps where measured
    "cuda": series(device="cuda:0", steps=[step(0, graphs=NONE_G, host_ms=3.0), step(1, graphs=ALL_G, host_ms=1.0),
                                           step(2, graphs=ALL_G, host_ms=9.5, host_bound=True)]),
    "cuda_not_patched": series(device="cuda:0", state="not patched", why="not a FLUX.1 model",
                               steps=[step(i, graphs=NONE_G) for i in range(3)]),
}


@pytest.fixture(scope="module")
def view():
    node = shutil.which("node")
    if not node:
        pytest.skip("node (Node.js) not found: apt-get install nodejs")
    r = subprocess.run([node, "--input-type=module", "-e", SCRIPT, VIEW, json.dumps(CASES)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_state_in_words(view):
    assert view["pass_through"]["words"] == "NOT PATCHED: no CUDA GPU visible to torch"
    assert view["pass_through"]["colour"] == "#b0b0b0"
    assert view["torch_cpu"]["words"] == "PATCHED" and view["torch_cpu"]["colour"] == "#e8743b"
    assert view["stock"]["words"] == "stock (no FluxNumbaPatch)" and view["stock"]["colour"] == "#8a8f98"
    assert view["cuda_not_patched"]["words"] == "NOT PATCHED: not a FLUX.1 model"
    assert [view[k]["status"] for k in ("stock", "failed", "running")] == ["done", "FAILED", "running"]


def test_graphs_only_for_patched_steps_on_cuda(view):
    for k in ("pass_through", "torch_cpu", "stock", "failed", "running", "profiled", "cuda_not_patched"):
        v = view[k]
        assert not v["graphs"], k
        assert not any("graph" in n.lower() for n in v["notes"]), (k, v["notes"])
        assert "graph" not in v["caption"].lower(), (k, v["caption"])
        assert "0/3" not in " ".join(v["notes"])
    c = view["cuda"]
    assert c["graphs"] and "CUDA graphs replayed: every block in 2 of 3 steps, none in 1" in c["notes"]
    assert "host-bound (the GPU waited for the host) in 1 of 3 steps" in c["notes"]
    assert "CUDA graphs replayed for all / some / no blocks" in c["caption"]


def test_failed_run_says_failed_without_placeholder_or_mixed_stats(view):
    f = view["failed"]
    assert f["notes"][0] == "FAILED: RuntimeError: boom (test)"
    assert f["empty"] == "patched FAILED: RuntimeError: boom (test)"
    assert "appear here" not in f["empty"]
    assert f["stats"] == "no step finished (0/3 steps)"
    assert "mean" not in f["stats"] and "total" not in f["stats"]


def test_profiled_step_explained(view):
    p = view["profiled"]
    assert p["stats"].startswith("3/3 steps, mean 10.00 ms"), p["stats"]
    assert "step 1 profiled (dimmed, left out of mean / it/s: mean of 2)" in p["stats"]
    assert any(n.startswith("profiled step 1 split: attention 1.00 ms") and n.endswith("GPU busy 72%") for n in p["notes"])


def test_fixed_slots_from_the_first_step(view):
    assert view["running"]["slots"] == 28
    assert view["running"]["stats"].startswith("1/28 steps, mean 10.00 ms")
    assert view["failed"]["slots"] == 3
