"""Step timer: its wrappers, the per-step records it keeps and sends, and what a run's record says
(stock / patched / not patched, failed, CUDA-graph state per step) -- no ComfyUI needed.

The ComfyUI pieces the timer touches are faked in tests/_timer_testing.py; tests/test_timing_report.py
checks what the report, quality and progress nodes show; tests/test_browser_*.py run the real thing
inside ComfyUI.
"""
import numpy as np
import pytest
import torch

from flux_numba_pack.cuda_kernels.registry import registry
from flux_numba_pack.nodes import timer, timing, timing_report
# fake_comfy, sent, test_op: fixtures, used by name
from _timer_testing import FakePatcher, run_sampler, _patched_model, _op_step
from _timer_testing import fake_comfy, sent, test_op  # noqa: F401


# ------------------------------------------------------------------------------------------ timer
def test_timer_node_clones_and_adds_wrappers(fake_comfy):
    m = FakePatcher({"transformer_options": {"flux_numba": {"profile": "fast", "attention": "numba"}}})
    (out,) = timer.apply(m, label="patched", unique_id="7")
    assert out is not m and m.wrappers == {}, "input model must not be mutated"
    assert set(out.wrappers) == {"outer_sample", "apply_model"}
    # applying twice to the same clone replaces, not stacks
    (out2,) = timer.apply(out, label="again", unique_id="8")
    assert len(out2.wrappers["apply_model"]["flux_numba_step_timer"]) == 1
    assert len(out.wrappers["apply_model"]["flux_numba_step_timer"]) == 1


def test_records_sent_for_n_steps(fake_comfy, sent, test_op):
    n = 5
    m = FakePatcher({"transformer_options": {"flux_numba": {"profile": "fast", "weights": torch.zeros(3)}}})
    (tm,) = timer.apply(m, label="patched", unique_id="12")

    calls = {"i": 0}

    def per_step(x):  # step i calls the op i+1 times (numba: batch 2) and once with batch 1 (torch)
        calls["i"] += 1
        with registry.force("numba"):
            for _ in range(calls["i"]):
                registry.call(test_op, x)
            registry.call(test_op, x[:1])
    run_sampler(tm, n, per_step=per_step)

    events = [e for e, _ in sent]
    assert events[0] == timing.EVENT_RUN and sent[0][1]["phase"] == "start"
    assert events[-1] == timing.EVENT_RUN and sent[-1][1]["phase"] == "end"
    steps = [d for e, d in sent if e == timing.EVENT_STEP]
    assert len(steps) == n
    for i, d in enumerate(steps):
        assert d["node"] == "12" and d["label"] == "patched" and d["step"] == i and d["index"] == i
        assert d["ms"] > 0 and d["total_steps"] == n
        assert d["backends"][test_op] == {"numba": i + 1, "torch": 1}, d["backends"]
        assert d["summary"]["steps"] == i + 1
        assert d["sigma"] == pytest.approx(1.0 - i / n, abs=1e-6)
        assert d["batch"] == 2
    assert sent[0][1]["patch"]["profile"] == "fast"
    assert isinstance(sent[0][1]["patch"]["weights"], str)  # made JSON-safe

    # python API
    run = timing.last_run(node_id="12")
    assert run is not None and run["done"] and len(run["steps"]) == n
    assert timing.last_run(label="patched")["run"] == run["run"]
    assert timing.get_run(run["run"])["label"] == "patched"
    ms = [s["ms"] for s in run["steps"]]
    s = run["summary"]
    assert s["mean_ms"] == pytest.approx(sum(ms) / n) and s["total_ms"] == pytest.approx(sum(ms))
    assert s["min_ms"] == min(ms) and s["max_ms"] == max(ms)
    assert s["its"] == pytest.approx(1000.0 / s["mean_ms"])
    assert run["backends"][test_op] == {"numba": sum(range(1, n + 1)), "torch": n}
    import json
    json.dumps(sent)  # everything sent must be JSON-serialisable
    json.dumps(timing.get_runs())


def test_stock_run_has_no_backends_and_rerun_gives_new_run(fake_comfy, sent):
    (tm,) = timer.apply(FakePatcher(), label="stock", unique_id="3")
    run_sampler(tm, 3)
    run_sampler(tm, 4)
    runs = timing.get_runs()
    assert [len(r["steps"]) for r in runs] == [3, 4]
    assert runs[0]["run"] != runs[1]["run"]
    assert all(st["backends"] == {} for r in runs for st in r["steps"])
    assert runs[0]["patch"] is None


def test_profile_split(fake_comfy, sent):
    (tm,) = timer.apply(FakePatcher(), label="patched", profile_split=True, unique_id="4")
    run_sampler(tm, 3, x=torch.randn(2, 4, 64, 64))
    run = timing.last_run(node_id="4")
    prof = [st for st in run["steps"] if st.get("profiled")]
    assert len(prof) == 1 and prof[0]["step"] == 1
    split = run["profile"]
    assert set(split["ms"]) == set(timing.CATEGORIES)
    assert split["ms"]["gemm"] > 0  # the fake model is a matmul
    assert run["summary"]["steps"] == 2  # profiled step left out of the mean
    assert timing.classify("_ZN6cudapy8flux_numba_pack11ln_modulate") == "fused"
    assert timing.classify("aten::_scaled_dot_product_flash_attention") == "attention"
    assert timing.classify("sm90_xmma_gemm_bf16bf16_bf16f32") == "gemm"
    assert timing.classify("aten::add_") == "other"
    assert timing.classify("_ZN6cudapy15flux_numba_pack12cuda_kernels9attention7_kernel") == "attention"
    # newer numba-cuda demangles the module path: the pack's kernels whatever its folder is called
    assert timing.classify("_2fhome_2fx_2fcustom_nodes_2fmy_2dpack::cuda_kernels::gelu_tanh::make_gelu_kernel::"
                          "_3clocals_3e::gelu_kernel(Array<long long, 3, A, mutable, aligned>)") == "fused"
    assert timing.classify("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7") == "attention"
    assert timing.classify("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_gelubias_TNT") == "gemm"
    assert timing.classify("fmha_cutlassF_bf16_aligned_64x128_rf_sm80") == "attention"


def test_select_runs(fake_comfy, sent):
    (a,) = timer.apply(FakePatcher(), label="stock", unique_id="1")
    (b,) = timer.apply(FakePatcher(), label="patched", unique_id="2")
    run_sampler(a, 2)
    run_sampler(b, 2)
    run_sampler(b, 3)
    assert [(r["label"], len(r["steps"])) for r in timing.select_runs("last")] == [("stock", 2), ("patched", 3)]
    assert [r["label"] for r in timing.select_runs("stock")] == ["stock"]
    assert len(timing.select_runs("all")) == 3
    assert [len(r["steps"]) for r in timing.select_runs("node:2")] == [3]
    assert timing.select_runs("nope") == []


def test_empty_label_is_the_node_id(fake_comfy, sent):
    for label in ("", "   "):
        (m,) = timer.apply(FakePatcher(), label=label, unique_id="12")
        run_sampler(m, 2)
        r = timing.last_run(node_id="12")
        assert r["label"] == "12" and [d["label"] for d in timing.select_runs("12")] == ["12"]
    (m,) = timer.apply(FakePatcher(), label="", unique_id=None)  # no node id: the widget default
    run_sampler(m, 1)
    assert timing.last_run()["label"] == "patched"


def test_node_selection_without_id_is_last(fake_comfy, sent):
    (a,) = timer.apply(FakePatcher(), label="stock", unique_id="1")
    (b,) = timer.apply(FakePatcher(), label="patched", unique_id="2")
    run_sampler(a, 2)
    run_sampler(b, 3)
    last = [r["run"] for r in timing.select_runs("last")]
    assert len(last) == 2
    for sel in ("node:", "NODE:  ", " node: ", "node:,node:"):
        assert [r["run"] for r in timing.select_runs(sel)] == last, sel
    assert [r["label"] for r in timing.select_runs("stock, node:")] == ["stock", "patched"]
    with pytest.raises(timing.SelectionError, match="run:<id> takes a run number"):
        timing.select_runs("node:, run:x")


# ------------------------------------------------------------------------------------------ what a run's record says
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA event path needs a GPU")
def test_cuda_event_timing(fake_comfy, sent):
    (tm,) = timer.apply(FakePatcher(), label="gpu", profile_split=True, unique_id="9")
    run_sampler(tm, 5, x=torch.randn(2, 4, 256, 256, device="cuda"))
    run = timing.last_run(node_id="9")
    assert [s["step"] for s in run["steps"]] == list(range(5)) and all(s["ms"] > 0 for s in run["steps"])
    steps = [d for e, d in sent if e == timing.EVENT_STEP]
    assert [d["index"] for d in steps] == list(range(5))
    assert run["profile"]["source"] == "cuda kernels" and run["profile"]["ms"]["gemm"] > 0, run["profile"]


def test_run_not_patched_says_so_and_gets_no_speed_up(fake_comfy, sent, test_op):
    """A patch that passed the model through (no GPU, not FLUX ...) is reported as such: no speed-up
    line, grey hatched bars and NOT PATCHED in the legend, whatever its label says."""
    (a,) = timer.apply(FakePatcher(), label="stock", unique_id="1")
    (b,) = timer.apply(_patched_model(False, "no CUDA GPU visible to torch"), label="patched",
                                            unique_id="2")
    (c,) = timer.apply(_patched_model(), label="nothing ran", unique_id="3")
    run_sampler(a, 3)
    run_sampler(b, 3)
    run_sampler(c, 3)
    runs = timing.select_runs("last")
    states = {r["label"]: r["model"]["state"] for r in runs}
    assert states == {"stock": "stock", "patched": "not patched", "nothing ran": "partly patched"}, states
    text = timing_report.table_text(runs)
    assert " vs stock:" not in text
    assert "no speed-up for patched" in text and "not patched: no CUDA GPU visible to torch" in text
    assert "no op of the pack ran" in text
    img = timing_report.chart_array(runs, 640, 320)
    px = (img * 255).round().astype(int)
    orange = np.array([int(timing_report.label_colour("patched")[i:i + 2], 16) for i in (1, 3, 5)])
    assert (np.abs(px - orange).sum(-1) <= 6).sum() == 0, "a run that was not patched must not be drawn as patched"
    end = [d for e, d in sent if e == timing.EVENT_RUN and d["phase"] == "end"]
    assert [d["model"]["state"] for d in end] == ["stock", "not patched", "partly patched"]


def test_failed_run_is_marked(fake_comfy, sent):
    (a,) = timer.apply(FakePatcher(), label="stock", unique_id="1")

    def boom(x):
        if boom.n == 2:
            raise RuntimeError("CUDA out of memory (test)")
        boom.n += 1
    boom.n = 0
    with pytest.raises(RuntimeError):
        run_sampler(a, 4, per_step=boom)
    run = timing.last_run(node_id="1")
    assert run["done"] and "out of memory" in run["error"] and len(run["steps"]) == 2
    assert sent[-1][1]["phase"] == "end" and "out of memory" in sent[-1][1]["error"]
    assert "FAILED after 2 steps" in timing_report.table_text([run])


def test_graph_state_per_step_from_the_packs_counters(monkeypatch):
    """Each step's CUDA-graph state comes from the pack's counters around the step."""
    from collections import Counter
    st = {"block_graphs": Counter(), "block_graph_misses": {}, "fallbacks": 0}
    g0 = timing._graph_snapshot(st)
    st["block_graphs"].update(replay=50, capture=7)
    assert timing.graph_step(g0, timing._graph_snapshot(st), st) == {"state": "all", "mode": "blocks", "blocks": [57, 57],
                                                                 "why": None}
    g1 = timing._graph_snapshot(st)
    st["block_graphs"].update(replay=40, eager_not_resident=17)
    st["block_graph_misses"]["weights not resident (DynamicVRAM streams them)"] = 17
    g = timing.graph_step(g1, timing._graph_snapshot(st), st)
    assert g["state"] == "some" and g["blocks"] == [40, 57] and "not resident" in g["why"]
    g2 = timing._graph_snapshot(st)
    st["whole_replays"] = 1
    assert timing.graph_step(g2, timing._graph_snapshot(st), st)["mode"] == "whole step"
    g3 = timing._graph_snapshot(st)
    st["whole_why"] = "whole-step graph off: attention mask"
    g = timing.graph_step(g3, timing._graph_snapshot(st), st)
    assert g["state"] == "none" and "attention mask" in g["why"]
    assert timing.graphs_summary([{"graphs": {"state": "all"}}, {"graphs": {"state": "some"}, "host_bound": True}]) == \
        {"all": 1, "some": 1, "none": 0, "host_bound": 1}


def test_cpu_steps_have_no_graph_state(fake_comfy, sent, test_op, monkeypatch):
    """CUDA graphs exist only on CUDA: a patched run on the CPU records no graph state per step (the
    chart draws no red 'none' strip, the table's graphs column says '-')."""
    from collections import Counter
    st = {"block_graphs": Counter(), "block_graph_misses": {}, "fallbacks": 0, "whole_why": "no CUDA"}
    monkeypatch.setattr(timing, "_pack_stats", lambda patch: st)
    (b,) = timer.apply(_patched_model(patch_id=5), label="patched", unique_id="2")
    run_sampler(b, 3, per_step=_op_step(test_op))
    run = timing.last_run(node_id="2")
    assert run["model"]["state"] == "patched" and run["device"] == "cpu"
    assert [s["graphs"] for s in run["steps"]] == [None] * 3
    assert [d["graphs"] for e, d in sent if e == timing.EVENT_STEP] == [None] * 3
    assert timing_report.graphs_text(run) == "-"
    text = timing_report.table_text([run])
    assert "CUDA graphs" not in text and "none" not in text.split("\n")[2]
    # a run that claims graph states but ran on the CPU still gets no graph column
    assert timing_report.graphs_text(dict(run, graphs={"all": 0, "some": 0, "none": 3})) == "-"
    assert timing_report.graphs_text(dict(run, device="cuda:0", graphs={"all": 2, "some": 1, "none": 0})) == \
        "all 2/3, some 1"
