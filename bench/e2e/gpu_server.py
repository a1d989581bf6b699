#!/usr/bin/env python3
"""Real ComfyUI servers on a GPU: stock vs FluxNumbaPatch, as a user runs them.

For each ComfyUI tree and flag set: start ``main.py`` with ComfyUI's default flags plus that set,
queue API prompts built like a user's graph -- UNETLoader (random full-size FLUX.1-dev) ->
[FluxNumbaPatch] -> [EasyCache | LazyCache] -> KSampler (euler, simple, cfg 1) -> VAEDecode
([FluxNumbaVAEPatch]) -> SaveImage -- and record per prompt kind: seconds per image (the server's
own execution_start -> execution_success timestamps), peak GPU memory (nvidia-smi, sampled),
the log's fallback / CUDA-graph / turn-off lines, and whether the server survived.  Each kind
runs ``--repeat`` times; the last run is the one reported (the first patched one includes JIT).

No real weights are needed: a random FLUX.1-dev checkpoint (ComfyUI layout, bf16, std 0.02) is
written once to ``--weights`` (default /dev/shm), a random FLUX VAE next to it, and a small custom
node stands in for the text encoders (T5-XXL is 4.7 B parameters).  The FLUX.1 family runs as case
suffixes (graph()): ``_schnell`` / ``_fill`` load their own random checkpoint and ``_cn`` a random
ControlNet, each made from --weights' tensors once, next to it; ``_kontext`` (a reference latent) and
``_redux`` (Redux's 985-token context) change the conditioning.  Each pack case's PSNR is taken
against the stock case of the same family members (stock_schnell for patched_schnell).  Quantised
checkpoints of --weights (bench/e2e/_server_quant.py, written next to it once): ``_fp8s`` an fp8-scaled
safetensors (UNETLoader), ``_gguf`` a Q8_0 GGUF loaded by ComfyUI-GGUF's UnetLoaderGGUF (the node
pack from --gguf-pack, installed into the server's custom_nodes; needs the gguf package).

    python bench/e2e/gpu_server.py --comfy .carry/ComfyUI-0.8.0 --flags= --flags="--reserve-vram 118" \
        --cases stock,patched,easycache,lazycache --steps 28 --res 1024 --json $OUT/server.json
    python bench/e2e/gpu_server.py --comfy .carry/ComfyUI-0.33.0 --flags= --interleave \
        --cases stock_schnell,patched_schnell,stock_kontext,patched_kontext,stock_cn,patched_cn

CPU smoke (a ComfyUI tree's Python; the smallest checkpoint ComfyUI detects as FLUX, its own text widths):

    python run.py --write-model /tmp/fs/flux_min.safetensors --comfy-min
    python bench/e2e/gpu_server.py --comfy .carry/ComfyUI-0.33.0 --flags=--cpu --weights /tmp/fs/flux_min.safetensors \
        --cond-dims 64,32 --res 64 --steps 2 --repeat 1 --cases stock_fill,patched_fill

Prints one table row per (tree, flags, case) at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

# gpu_server.py's parts, next to it (found also when this file is loaded by path, as the tests do):
# _server_nodes (the custom nodes' sources), _server_weights (the random weight files), _server_graph
# (case names -> API prompts), _server_http (a server: start, queue, wait).  The names the tests read
# (SCHNELL_STEPS, FILL_IN, family_plan ...) are reachable here as before.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _server_graph import SCHNELL_STEPS, VAE_CASES, graph, parse_case, run_order, stock_partner  # noqa: E402
from _server_http import GpuMem, comfy_version, run_prompt, serve, split_flags  # noqa: E402
from _server_nodes import AV_STUB, COND_NODE, PHASES_NODE, PROFILE_NODE  # noqa: E402
from _server_quant import gguf_file, planned_bytes, scaled_fp8_file, write_fp8_scaled, write_gguf_q8_0  # noqa: E402
from _server_weights import (FAMILY_FILES, FILL_IN, LORA_FILE, _dev_header, _family_file_ok,  # noqa: E402
                             _st_header, family_file, family_plan, plan_bytes, write_family, write_lora,
                             write_vae, write_weights)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
GGUF_PACK = os.environ.get("COMFYUI_GGUF_PATH") or os.path.join(ROOT, ".gpu", "ComfyUI-GGUF")

LOG_COUNTS = ("capture failed", "INTERNAL ASSERT", "freeAsync", "capture stopped", "Traceback", "per-block CUDA graph not captured")
KEYS = ("fallback", "kernel build", "building", "per-block", "profile fast", "FluxNumbaVAEPatch", "DynamicVRAM", "running ComfyUI's original block", "CUDA graph", "captured a CUDA graph", "is off for this model",
        "FluxNumbaPatch", "Traceback", "Error", "error", "terminate called", "freeAsync", "skipped", "capture",
        "INTERNAL ASSERT")


def image_psnr(out_dir, cases, interleaved):
    """PSNR (dB, 8-bit PNGs) of each case's images against the stock case's image of the same run
    index (the same seed): {case: [dB per run]}.  The stock case is ``stock_partner``'s: ``stock`` for
    bf16 cases, ``stock_fp8`` for ``*_fp8`` ones, ``stock_schnell`` for ``patched_schnell`` (the same
    family members, fp8-ness and LoRA); cases without a stock partner in the run are left out."""
    try:
        import numpy as np
        from PIL import Image
    except ImportError:
        return {}

    def files(case):
        return sorted(f for f in os.listdir(out_dir) if f.startswith(case + "_") and f.endswith(".png")
                      and re.fullmatch(re.escape(case) + r"_\d{5}_\.png", f))
    if not os.path.isdir(out_dir):
        return {}
    res = {}
    for case in cases:
        ref = stock_partner(case, cases)
        if ref is None:
            continue
        out = []
        for fa, fb in zip(files(case), files(ref)):
            a = np.asarray(Image.open(os.path.join(out_dir, fa)).convert("RGB"), dtype=np.float64)
            b = np.asarray(Image.open(os.path.join(out_dir, fb)).convert("RGB"), dtype=np.float64)
            mse = float(((a - b) ** 2).mean()) if a.shape == b.shape else float("nan")
            out.append(round(10 * np.log10(255.0 ** 2 / mse), 2) if mse > 0 else float("inf"))
        if out:
            res[case] = out
    return res


def phase_medians(path, cases):
    """{case: {phase: median seconds over the case's runs 2..N}} from the phases node's lines (in run
    order; profile prompts, prefixed ``prof_``, are left out)."""
    try:
        lines = [json.loads(ln) for ln in open(path) if ln.strip()]
    except OSError:
        return {}
    out = {}
    for case in cases:
        runs = [r for r in lines if r.get("case") == case][1:]
        if not runs:
            continue
        med = {}
        for k in sorted({k for r in runs for k, v in r.items() if k != "case" and isinstance(v, (int, float))}):
            v = sorted(r[k] for r in runs if k in r)
            med[k] = round(v[len(v) // 2], 3)
        out[case] = med
    return out


def family_files_needed(cases):
    """The family members with weights of their own (FAMILY_FILES order) that ``cases`` use."""
    fams = {f for c in cases for f in parse_case(c)["families"]}
    return [f for f in FAMILY_FILES if f in fams]


def weights_room(weights, cases):
    """Where family members' files are needed: why the weight files still to be written (--weights,
    the members' files next to it) do not fit in --weights' folder (one line), or None.  A full-size
    schnell or fill file is as large as FLUX.1-dev (~24 GB; the ControlNet ~1.5 GB)."""
    fams = family_files_needed(cases)
    quants = sorted({parse_case(c)["quant"] for c in cases if c not in VAE_CASES} - {None})
    if not fams and not quants:
        return None
    todo = not os.path.exists(weights)
    try:
        header = _st_header(weights)[0] if os.path.exists(weights) else _dev_header()
    except Exception:  # no torch here, or --weights is no safetensors file: the writers say why, later
        return None
    need, what = 0, []
    if todo:
        need += max((v["data_offsets"][1] for v in header.values()), default=0)
        what.append(os.path.basename(weights))
    for f in fams:
        path = family_file(weights, f)
        try:
            plan = family_plan(header, f)
        except ValueError:
            continue
        if not (os.path.exists(path) and _family_file_ok(path, plan)):
            need += plan_bytes(plan)
            what.append(os.path.basename(path))
    for q in quants:
        path = (scaled_fp8_file if q == "fp8s" else gguf_file)(weights)
        if not os.path.exists(path):
            need += planned_bytes(header, q)
            what.append(os.path.basename(path))
    folder = os.path.dirname(os.path.abspath(weights))
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return None
    if need and need > free:
        return (f"argument --weights: {need / 1e9:.1f} GB of random weights to write into {folder} "
                f"({', '.join(what)}), {free / 1e9:.1f} GB free there: --weights in a larger folder, fewer of "
                f"_schnell / _fill / _fp8s / _gguf in one call, or --drop-family-files in the call before")
    return None


def check_args(p, a, flag_sets, cases):
    """One line and exit 2, before anything is written or started: a --comfy that is not a ComfyUI
    tree, a case graph() does not know (``parse_case``), weight files that do not fit in --weights'
    folder (``weights_room``), or no CUDA GPU where one is needed (the random weights are generated on the GPU; a server
    runs on it unless its flag set has --cpu, as in a CPU smoke test with --weights of an existing file)."""
    def fail(msg):
        p.exit(2, f"gpu_server.py: error: {msg}\n")
    for comfy in a.comfy:
        if not os.path.isfile(os.path.join(comfy, "main.py")):
            fail(f"argument --comfy: no ComfyUI tree at {comfy!r}: no main.py there")
    sys.path.insert(0, ROOT)
    from _pack import file_out_problem, folder_out_problem
    if a.json:
        why = file_out_problem(a.json, "server.json")
        if why:
            fail(f"argument --json: {why}")
    for flag, folder in (("--logs", a.logs), ("--profile", a.profile)):
        why = folder and folder_out_problem(folder)
        if why:
            fail(f"argument {flag}: {why}")
    if not cases:
        fail("argument --cases: no case")
    for case in cases:
        try:
            parse_case(case)
        except ValueError as e:
            fail(f"argument --cases: {e}")
    need = []
    if not all(c in VAE_CASES for c in cases) and not os.path.exists(a.weights):
        need.append(f"the random FLUX.1-dev weights ({a.weights}) are generated on it")
    for flags in flag_sets:
        try:
            argv = split_flags(flags, {})[0]
        except ValueError as e:
            fail(f"argument --flags: {flags!r}: {e}")
        if "--cpu" not in argv:
            need.append(f"the servers run on it (--flags={flags!r} has no --cpu)")
    if need:
        try:
            import torch
        except ImportError as e:
            fail(f"torch does not import here ({e}): {need[0]}")
        if not torch.cuda.is_available():
            fail(f"no CUDA GPU (torch sees none): {need[0]}")
    room = weights_room(a.weights, cases)
    if room:
        fail(room)
    if any(c not in VAE_CASES and parse_case(c)["quant"] == "gguf" for c in cases):
        if not os.path.isfile(os.path.join(a.gguf_pack, "nodes.py")):
            fail(f"argument --gguf-pack: no ComfyUI-GGUF at {a.gguf_pack!r} (its nodes.py), needed by the _gguf cases")
        import importlib.util
        if importlib.util.find_spec("gguf") is None:
            fail("the _gguf cases need the gguf package (ComfyUI-GGUF's requirement) in this Python")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--comfy", action="append", required=True, help="ComfyUI tree (repeatable)")
    p.add_argument("--flags", action="append", default=None,
                   help='extra main.py flags for one server, e.g. "--highvram" (repeatable; "" = defaults)')
    p.add_argument("--cases", default="stock,patched", help="comma list: stock, patched, easycache, lazycache, "
                   "stock_easycache, stock_lazycache, ... (graph()); FLUX.1 family members as suffixes: _schnell, "
                   "_kontext, _fill, _redux, _cn (stock_schnell,patched_schnell,stock_fill,patched_fill ...)")
    p.add_argument("--steps", type=int, default=28)
    p.add_argument("--res", type=int, default=1024)
    p.add_argument("--repeat", type=int, default=2, help="runs per case; the last one is reported")
    p.add_argument("--interleave", action=argparse.BooleanOptionalAction, default=False,
                   help="alternate the cases run by run (drift hits all alike; cases of one checkpoint -- dev, "
                   "_schnell, _fill -- together: run_order); the table then also gives each case's median over "
                   "runs 2..N (--no-interleave: each case's runs in a row -- a later run of a case then shows its "
                   "speed without a switch of weights or LoRA before it)")
    p.add_argument("--weights", default="/dev/shm/flux1_dev_random.safetensors")
    p.add_argument("--gguf-pack", default=GGUF_PACK, help="ComfyUI-GGUF's folder (an export of city96/ComfyUI-GGUF) "
                   "for _gguf cases (default: $COMFYUI_GGUF_PATH or .gpu/ComfyUI-GGUF)")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--json", help="write all results here")
    p.add_argument("--logs", help="folder to copy each server's log into")
    p.add_argument("--prompt-timeout", type=float, default=300)
    p.add_argument("--profile", help="folder: after the timed runs, one prompt per case (--profile-steps steps) "
                   "under cProfile (host time by function) and one under torch.profiler (GPU kernel time vs wall)")
    p.add_argument("--profile-steps", type=int, default=8)
    p.add_argument("--profile-kinds", default="cprofile,torch", help="comma list of cprofile (host time by "
                   "function), torch (GPU busy share, idle gaps), trace (host + GPU timeline, chrome trace .json.gz)")
    p.add_argument("--stock-vae", action="store_true", help="patched cases decode with ComfyUI's own VAE (no "
                   "FluxNumbaVAEPatch): the images' PSNR vs stock then measures the FLUX model's path alone")
    p.add_argument("--drop-family-files", action="store_true", help="at the end remove the family members' "
                   "weight files this call used (_schnell / _fill / _cn / _fp8s / _gguf next to --weights): room in /dev/shm for "
                   "the next call's")
    p.add_argument("--cond-dims", default="4096,768", help="text context / pooled widths (a CPU smoke test with "
                   "run.py --write-model --comfy-min weights uses that model's)")
    a = p.parse_args()
    flag_sets = a.flags if a.flags else [""]
    cases = [c for c in a.cases.split(",") if c]
    check_args(p, a, flag_sets, cases)

    stub = tempfile.mkdtemp(prefix="flux_stub_")
    os.makedirs(os.path.join(stub, "av"))
    with open(os.path.join(stub, "av", "__init__.py"), "w") as f:
        f.write(AV_STUB)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([x for x in (env.get("PYTHONPATH"), stub) if x])

    t = time.time()
    if not all(c in VAE_CASES for c in cases):   # decode-only runs need no FLUX weights
        write_weights(a.weights)
    vae_path = os.path.join(os.path.dirname(a.weights), "flux_vae_random.safetensors")
    lora_path = os.path.join(os.path.dirname(a.weights), LORA_FILE)
    if any("_lora" in c for c in cases):
        write_lora(lora_path)
    fam_paths = {}
    for fam in family_files_needed(cases):
        t1 = time.time()
        fam_paths[fam] = family_file(a.weights, fam)
        wrote = write_family(a.weights, fam)
        print(f"[bench] {fam}: {'wrote' if wrote else 'kept'} {fam_paths[fam]} "
              f"({os.path.getsize(fam_paths[fam]) / 1e9:.2f} GB, {time.time() - t1:.1f} s)", flush=True)
    quant_paths = {}
    for q, writer in (("fp8s", write_fp8_scaled), ("gguf", write_gguf_q8_0)):
        if any(c not in VAE_CASES and parse_case(c)["quant"] == q for c in cases):
            t1 = time.time()
            quant_paths[q] = writer(a.weights)
            print(f"[bench] {q}: {quant_paths[q]} ({os.path.getsize(quant_paths[q]) / 1e9:.2f} GB, "
                  f"{time.time() - t1:.1f} s)", flush=True)
    write_vae(vae_path, a.python, a.comfy[0], env)
    print(f"[bench] weights ready ({time.time() - t:.1f} s)", flush=True)

    rows, results = [], []
    for comfy in a.comfy:
        ver = comfy_version(comfy)
        for flags in flag_sets:
            base = tempfile.mkdtemp(prefix="flux_server_")
            cn = os.path.join(base, "custom_nodes")
            os.makedirs(cn)
            os.symlink(ROOT, os.path.join(cn, "comfyui-flux-numba-kernels"))
            if "gguf" in quant_paths:
                os.symlink(os.path.abspath(a.gguf_pack), os.path.join(cn, "ComfyUI-GGUF"))
            with open(os.path.join(cn, "flux_numba_bench_cond.py"), "w") as f:
                f.write(COND_NODE)
            phases = os.path.join(base, "phases.jsonl")
            with open(os.path.join(cn, "flux_numba_bench_phases.py"), "w") as f:
                f.write(PHASES_NODE)
            prof_dir = None
            if a.profile:
                prof_dir = os.path.join(os.path.abspath(a.profile),
                                        f"{comfy_version(comfy)}_{re.sub(r'[^A-Za-z0-9=_.]', '', flags) or 'default'}")
                os.makedirs(prof_dir, exist_ok=True)
                with open(os.path.join(cn, "flux_numba_bench_profile.py"), "w") as f:
                    f.write(PROFILE_NODE)
            for sub, src in (("diffusion_models", a.weights), ("vae", vae_path), ("loras", lora_path),
                             ("diffusion_models", fam_paths.get("schnell", "")),
                             ("diffusion_models", fam_paths.get("fill", "")),
                             ("controlnet", fam_paths.get("cn", "")),
                             ("diffusion_models", quant_paths.get("fp8s", "")),
                             ("diffusion_models", quant_paths.get("gguf", ""))):
                os.makedirs(os.path.join(base, "models", sub), exist_ok=True)
                if src and os.path.exists(src):
                    os.symlink(src, os.path.join(base, "models", sub, os.path.basename(src)))
            rec = {"comfyui": ver, "tree": comfy, "flags": flags, "cases": {}}
            results.append(rec)
            t0 = time.time()
            try:
                senv = dict(env, FLUX_BENCH_PHASES=phases)
                if prof_dir:
                    senv["FLUX_BENCH_PROFILE"] = prof_dir
                proc, url, logp, logf = serve(a.python, comfy, base, flags, senv)
            except Exception as e:
                rec["start_error"] = str(e)[-2000:]
                rows.append((ver, flags or "(default)", "-", "server did not start", "", "", ""))
                continue
            rec["start_s"] = round(time.time() - t0, 1)
            alive = True
            order = run_order(cases, a.repeat, a.interleave)
            all_runs = {c: [] for c in cases}
            for case, i in order:
                runs = all_runs[case]
                if proc.poll() is not None:
                    alive = False
                    break
                with GpuMem() as mem:
                    try:
                        r = run_prompt(url, graph(case, a.steps, a.res, 7 + i, os.path.basename(a.weights),
                                                  os.path.basename(vae_path),
                                                  tuple(int(v) for v in a.cond_dims.split(",")), stock_vae=a.stock_vae),
                                       a.prompt_timeout)
                    except Exception as e:
                        r = {"ok": False, "error": f"{type(e).__name__}: {e}"}
                r["peak_mib"] = mem.peak
                runs.append(r)
                print(f"[bench] {ver} {flags or '(default)'} {case} run {i + 1}: {r}", flush=True)
                if "Connection refused" in str(r.get("error", "")):
                    alive = False  # the server is gone (it may still be writing its crash dump)
                    break
            if prof_dir and alive and proc.poll() is None:
                for ci, case in enumerate(cases):
                    for ki, kind in enumerate(a.profile_kinds.split(",")):
                        with open(os.path.join(prof_dir, "mode"), "w") as f:
                            f.write(f"{kind}:{case}")
                        try:
                            # a new seed per prompt: ComfyUI would answer an identical prompt from its cache
                            r = run_prompt(url, graph(case, a.profile_steps, a.res, 99 + 5 * ci + ki, os.path.basename(a.weights),
                                                      os.path.basename(vae_path),
                                                      tuple(int(v) for v in a.cond_dims.split(",")), prefix="prof_",
                                                      stock_vae=a.stock_vae), a.prompt_timeout)
                        except Exception as e:
                            r = {"ok": False, "error": f"{type(e).__name__}: {e}"}
                        print(f"[bench] profile {kind} {case}: {r}", flush=True)
                        gj = os.path.join(prof_dir, f"gpu_{case}.json")
                        if kind == "torch" and os.path.exists(gj):
                            g = json.load(open(gj))
                            rec.setdefault("profile", {})[case] = {k: g.get(k) for k in ("wall_s", "gpu_kernel_s", "gpu_span_s", "kernels",
                                                                                        "idle_ms", "idle_ms_by_gap", "gaps_by_size", "copies_n_ms")}
                with open(os.path.join(prof_dir, "mode"), "w") as f:
                    f.write("")
            for case in cases:
                runs = all_runs[case]
                rec["cases"][case] = runs
                last = runs[-1] if runs else {"ok": False, "error": "server died before this case"}
                warm = sorted(r["s"] for r in runs[1:] if r.get("ok") and "s" in r)
                if warm:
                    rec.setdefault("median_warm_s", {})[case] = warm[len(warm) // 2]
                rows.append((ver, flags or "(default)", case, f"{last.get('s', float('nan')):.2f}" if last.get("ok") else
                             "FAIL", f"{runs[0].get('s', float('nan')):.2f}" if runs and runs[0].get("ok") else "-",
                             f"{last.get('peak_mib', 0) / 1024:.1f}", "" if last.get("ok") else last.get("error", "")[:60]))
            ph = phase_medians(phases, cases)
            if ph:
                rec["phases_median_s"] = ph
                rec["phases"] = [json.loads(ln) for ln in open(phases) if ln.strip()]
            psnr = image_psnr(os.path.join(base, "output"), cases, a.interleave)
            if psnr:
                rec["psnr_vs_stock_db"] = psnr
            alive = alive and proc.poll() is None
            rec["server_alive"] = alive
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
            logf.close()
            log = open(logp, errors="replace").read()
            rec["log_lines"] = [ln for ln in log.splitlines() if any(k in ln for k in KEYS)][:80]
            rec["log_counts"] = {k: log.count(k) for k in LOG_COUNTS}
            rec["log_tail"] = log[-3000:]
            if a.logs:
                os.makedirs(a.logs, exist_ok=True)
                tag = f"{ver}_{re.sub(r'[^A-Za-z0-9=_.]', '', flags) or 'default'}"
                with open(os.path.join(a.logs, f"server_{tag}.log"), "w") as f:
                    f.write(log[-400000:])
            if not alive:
                rows.append((ver, flags or "(default)", "-", "SERVER DIED", "", "", ""))
    if a.drop_family_files:
        for path in list(fam_paths.values()) + list(quant_paths.values()):
            try:
                os.remove(path)
            except OSError:
                pass
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    for rec in results:
        for ln in rec.get("log_lines", [])[:25]:
            print(f"[log {rec['comfyui']} {rec['flags'] or 'default'}] {ln[:220]}")
    cw = max([16] + [len(r[2]) for r in rows])  # the case column: as wide as the longest name
    print(f"\n{'ComfyUI':8} {'flags':22} {'case':{cw}} {'s/image':>8} {'first':>7} {'peakGB':>7}  note")
    for r in rows:
        print(f"{r[0]:8} {r[1]:22} {r[2]:{cw}} {r[3]:>8} {r[4]:>7} {r[5]:>7}  {r[6]}")
    for rec in results:
        for case, pr in rec.get("profile", {}).items():
            print(f"profile {rec['comfyui']} {rec['flags'] or '(default)'} {case}: wall {pr['wall_s']:.2f} s, "
                  f"GPU kernels {pr['gpu_kernel_s']:.2f} s ({100 * pr['gpu_kernel_s'] / pr['wall_s']:.0f}% busy), "
                  f"{pr['kernels']} kernels; first-to-last GPU event {pr['gpu_span_s'] or 0:.2f} s "
                  f"({100 * pr['gpu_kernel_s'] / (pr['gpu_span_s'] or 1e9):.0f}% busy over the steps)")
            if pr.get("idle_ms") is not None:
                print(f"   idle {pr['idle_ms']:.1f} ms in gaps: " + ", ".join(
                    f"{k} {v:.1f} ms ({pr['gaps_by_size'][k]})" for k, v in pr["idle_ms_by_gap"].items()))
            for name, (n, ms) in sorted((pr.get("copies_n_ms") or {}).items(), key=lambda kv: -kv[1][1]):
                print(f"   {name}: {n} x, {ms:.1f} ms")
    for rec in results:
        for case, dbs in rec.get("psnr_vs_stock_db", {}).items():
            print(f"PSNR vs stock (same seed, 8-bit PNG), {rec['comfyui']} {rec['flags'] or '(default)'} {case}: "
                  + ", ".join(f"{d:.1f}" for d in dbs) + " dB")
    for rec in results:
        if "log_counts" in rec:
            print(f"log counts, {rec['comfyui']} {rec['flags'] or '(default)'}: "
                  + ", ".join(f"'{k}' {v}" for k, v in rec["log_counts"].items()))
    for rec in results:
        if rec.get("median_warm_s"):
            print(f"median of runs 2..N, {rec['comfyui']} {rec['flags'] or '(default)'}: "
                  + ", ".join(f"{c} {v:.2f}" for c, v in rec["median_warm_s"].items()))
        for case, ph in rec.get("phases_median_s", {}).items():
            tot = rec.get("median_warm_s", {}).get(case)
            rest = (f", rest {tot - sum(v for k, v in ph.items() if not k.startswith('node:')):.3f}"
                    if tot is not None else "")
            print(f"phases (median s, runs 2..N), {rec['comfyui']} {rec['flags'] or '(default)'} {case}: "
                  + ", ".join(f"{k} {v:.3f}" for k, v in ph.items()) + rest)
        for case in rec.get("phases_median_s", {}):
            gc = [r.get("graph_counts") for r in rec.get("phases", []) if r.get("case") == case]
            if any(gc):
                print(f"pack graph counters per prompt (calls, whole-step replays / eager, blocks), {rec['comfyui']} "
                      f"{rec['flags'] or '(default)'} {case}: " + "; ".join(
                          ", ".join(f"{k} {v}" for k, v in sorted((g or {}).items())) or "-" for g in gc))


if __name__ == "__main__":
    main()
