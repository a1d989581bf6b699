"""bench/e2e/gpu_server.py's FLUX.1 family cases (_schnell, _kontext, _fill, _redux, _cn), without a server:
the API prompts graph() builds (node classes, wiring, steps, file names), the case grammar and its
one-line refusal, the stock partner each case's PSNR is taken against, and the family members'
weight files made from a tiny --weights (names, dtypes, shapes ComfyUI detects them by)."""
import glob
import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UNET, VAE = "flux1_dev_random.safetensors", "flux_vae_random.safetensors"


@pytest.fixture(scope="module")
def gs():
    spec = importlib.util.spec_from_file_location("_bench_gpu_server", os.path.join(ROOT, "bench", "e2e", "gpu_server.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def build(gs, case, steps=28, res=1024, **kw):
    g = gs.graph(case, steps, res, 7, UNET, VAE, **kw)
    for nid, node in g.items():  # every link names a node of the prompt
        for v in node["inputs"].values():
            if isinstance(v, list):
                assert len(v) == 2 and v[0] in g and isinstance(v[1], int), (case, nid, v)
    return g


def classes(g):
    return sorted(n["class_type"] for n in g.values())


def node(g, cls):
    (n,) = [n for n in g.values() if n["class_type"] == cls]
    return n


def test_schnell_own_file_and_four_steps(gs):
    for case in ("stock_schnell", "patched_schnell", "patched_fast_cached_schnell"):
        g = build(gs, case, steps=28)
        assert node(g, "UNETLoader")["inputs"]["unet_name"] == "flux1_dev_random_schnell.safetensors"
        ks = node(g, "KSampler")["inputs"]
        assert gs.SCHNELL_STEPS == 4
        assert (ks["steps"], ks["cfg"], ks["scheduler"], ks["sampler_name"]) == (4, 1.0, "simple", "euler")
        assert node(g, "SaveImage")["inputs"]["filename_prefix"] == case
        assert ("FluxNumbaPatch" in classes(g)) == case.startswith("patched")
    assert node(build(gs, "stock", steps=28), "KSampler")["inputs"]["steps"] == 28
    assert node(build(gs, "patched_schnell_fp8"), "UNETLoader")["inputs"]["weight_dtype"] == "fp8_e4m3fn"


def test_kontext_reference_latent_on_positive(gs):
    g = build(gs, "patched_fast_cached_kontext", res=512)
    assert node(g, "FluxNumbaPatch")["inputs"]["profile"] == "fast-cached"
    img, enc, ref = node(g, "FluxNumbaBenchImage"), node(g, "VAEEncode"), node(g, "ReferenceLatent")
    assert (img["inputs"]["width"], img["inputs"]["height"]) == (512, 512)  # the output's resolution
    assert g[enc["inputs"]["pixels"][0]] is img
    assert enc["inputs"]["vae"] == node(g, "VAEDecode")["inputs"]["vae"] == ["vpatch", 0]
    assert g[ref["inputs"]["latent"][0]] is enc and ref["inputs"]["conditioning"] == ["cond", 0]
    ks = node(g, "KSampler")["inputs"]
    assert g[ks["positive"][0]] is ref and ks["negative"] == ["cond", 0] and ks["latent_image"] == ["lat", 0]
    assert node(g, "UNETLoader")["inputs"]["unet_name"] == UNET
    st = build(gs, "stock_kontext")
    assert node(st, "VAEEncode")["inputs"]["vae"] == ["vae", 0] and "FluxNumbaPatch" not in classes(st)


def test_fill_inpaint_conditioning_and_latent(gs):
    g = build(gs, "patched_fill", res=768)
    assert node(g, "UNETLoader")["inputs"]["unet_name"] == "flux1_dev_random_fill.safetensors"
    assert "EmptySD3LatentImage" not in classes(g)
    ip = node(g, "InpaintModelConditioning")["inputs"]
    assert g[ip["pixels"][0]]["class_type"] == "FluxNumbaBenchImage"
    assert g[ip["mask"][0]]["class_type"] == "FluxNumbaBenchMask"
    assert ip["noise_mask"] is True and ip["vae"] == ["vpatch", 0]
    assert ip["positive"] == ip["negative"] == ["cond", 0]
    ks = node(g, "KSampler")["inputs"]
    assert (ks["positive"], ks["negative"], ks["latent_image"]) == (["inpaint", 0], ["inpaint", 1], ["inpaint", 2])
    assert node(g, "FluxNumbaBenchMask")["inputs"] == {"width": 768, "height": 768}


def test_redux_token_count(gs):
    assert node(build(gs, "stock_redux"), "FluxNumbaBenchConditioning")["inputs"]["tokens"] == 256 + 729
    assert node(build(gs, "patched"), "FluxNumbaBenchConditioning")["inputs"]["tokens"] == 256
    c = node(build(gs, "patched_redux", cond_dims=(64, 32)), "FluxNumbaBenchConditioning")["inputs"]
    assert (c["context_dim"], c["pooled_dim"]) == (64, 32)


def test_controlnet_loader_and_apply(gs):
    g = build(gs, "patched_cn")
    assert node(g, "ControlNetLoader")["inputs"]["control_net_name"] == "flux1_dev_random_cn.safetensors"
    ap = node(g, "ControlNetApplyAdvanced")["inputs"]
    assert ap["strength"] == 0.7 and (ap["start_percent"], ap["end_percent"]) == (0.0, 1.0)
    assert g[ap["image"][0]]["class_type"] == "FluxNumbaBenchImage" and ap["control_net"] == ["cn", 0]
    ks = node(g, "KSampler")["inputs"]
    assert (ks["positive"], ks["negative"]) == (["cn_apply", 0], ["cn_apply", 1])
    assert node(g, "UNETLoader")["inputs"]["unet_name"] == UNET


def test_members_combine(gs):
    g = build(gs, "stock_kontext_redux_cn_fill_lora")
    ks = node(g, "KSampler")["inputs"]
    ip = node(g, "InpaintModelConditioning")["inputs"]
    ap = node(g, "ControlNetApplyAdvanced")["inputs"]
    assert ks["positive"] == ["inpaint", 0] and ip["positive"] == ["cn_apply", 0] and ap["positive"] == ["ref", 0]
    assert node(g, "FluxNumbaBenchConditioning")["inputs"]["tokens"] == 985
    assert node(g, "LoraLoaderModelOnly")["inputs"]["lora_name"] == gs.LORA_FILE
    assert node(g, "UNETLoader")["inputs"]["unet_name"] == "flux1_dev_random_fill.safetensors"
    # the order of suffixes after the base does not matter for the family members
    assert build(gs, "patched_fp8_schnell")["unet"] == build(gs, "patched_schnell_fp8")["unet"]


def test_existing_cases_unchanged(gs):
    g = build(gs, "patched_eager")
    assert node(g, "FluxNumbaPatch")["inputs"]["cuda_graph"] == "off"
    assert classes(build(gs, "stock")) == sorted(["UNETLoader", "FluxNumbaBenchConditioning", "EmptySD3LatentImage",
                                                  "VAELoader", "KSampler", "VAEDecode", "SaveImage"])
    assert node(build(gs, "easycache_t1.0"), "EasyCache")["inputs"]["reuse_threshold"] == 1.0
    assert node(build(gs, "stock_cudnn"), "FluxNumbaBenchSDPA")["inputs"]["backend"] == "cudnn"
    g = build(gs, "patched_lorab0.5")
    assert node(g, "LoraLoaderModelOnly")["inputs"]["strength_model"] == 0.5
    assert node(g, "FluxNumbaPatch")["inputs"]["model"] == ["lora", 0]
    assert "FluxNumbaVAEPatch" not in classes(build(gs, "patched", stock_vae=True))
    assert node(build(gs, "vae_patched"), "FluxNumbaVAEPatch")["inputs"]["cuda_graph"] == "auto"


def test_case_grammar(gs):
    for bad, why in (("patched_foo", "unknown case"), ("stock_schnell_fill", "two checkpoints"),
                     ("stock_cn_cn", "twice"), ("vae_patched_schnell", "unknown case"),
                     ("patched_lora1.2.3", "no number"), ("patched_fp8_eager", "unknown case")):
        with pytest.raises(ValueError, match=why):
            gs.parse_case(bad)
    assert gs.parse_case("patched_fast_cached_kontext")["families"] == ("kontext",)
    assert gs.parse_case("stock_cn_kontext")["families"] == ("kontext", "cn")


def test_unknown_suffix_is_refused_with_one_line(tmp_path):
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "main.py").write_text("")
    w = tmp_path / "w.safetensors"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "e2e", "gpu_server.py"), "--comfy", str(tree),
                        "--weights", str(w), "--cases", "stock_schnell,patched_schnel"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    err = p.stderr.strip()
    assert p.returncode == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, p.stderr
    assert err.startswith("gpu_server.py: error: argument --cases: unknown case 'patched_schnel'"), err
    assert p.stdout == "" and not w.exists() and os.listdir(tree) == ["main.py"]


def test_psnr_pairs_within_a_family(gs):
    cases = ["stock", "patched", "stock_schnell", "patched_schnell", "patched_fast_schnell", "stock_fill_fp8",
             "patched_fp8_fill", "stock_kontext_lora", "patched_kontext_lorab", "patched_cn", "stock_cudnn",
             "easycache_t1.0", "vae_stock", "vae_patched"]
    want = {"patched": "stock", "patched_schnell": "stock_schnell", "patched_fast_schnell": "stock_schnell",
            "patched_fp8_fill": "stock_fill_fp8", "patched_kontext_lorab": "stock_kontext_lora",
            "stock_cudnn": "stock", "easycache_t1.0": "stock"}
    assert {c: gs.stock_partner(c, cases) for c in cases if gs.stock_partner(c, cases)} == want


@pytest.fixture(scope="module")
def tiny_weights(tmp_path_factory):
    import torch
    from flux_numba_pack.flux_core import save_state_dict, tiny_state_dict
    path = str(tmp_path_factory.mktemp("w") / "tiny.safetensors")
    save_state_dict(tiny_state_dict(seed=0, dtype=torch.bfloat16), path, prefix="model.diffusion_model.")
    return path


def test_family_files_from_the_weights_own_tensors(gs, tiny_weights):
    import torch
    from safetensors.torch import load_file
    src = load_file(tiny_weights)
    pre = "model.diffusion_model."
    hidden, pin = src[pre + "img_in.weight"].shape
    for fam in gs.FAMILY_FILES:
        path = gs.write_family(tiny_weights, fam)
        assert path == gs.family_file(tiny_weights, fam) and path.endswith(f"tiny_{fam}.safetensors")
        assert gs.write_family(tiny_weights, fam) is None  # the same tensors already there: kept
        assert os.stat(path).st_mode & 0o044  # readable by others, as the umask gives (not 0600)
        sd = load_file(path)
        if fam == "schnell":
            assert set(sd) == {k for k in src if ".guidance_in." not in k} and any(".guidance_in." in k for k in src)
            assert all(sd[k].equal(src[k]) for k in sd)
        elif fam == "fill":
            assert sd[pre + "img_in.weight"].shape == (hidden, gs.FILL_IN) == (hidden, 384)
            assert sd[pre + "img_in.weight"][:, :pin].equal(src[pre + "img_in.weight"])
            assert all(sd[k].equal(src[k]) for k in sd if k != pre + "img_in.weight")
        else:  # XLabs layout: FLUX's names, no prefix, CN_DEPTH double blocks, no single blocks
            assert not any(k.startswith("model.") for k in sd)
            assert "controlnet_blocks.0.weight" in sd and "double_blocks.0.img_attn.norm.key_norm.scale" in sd
            assert {k.split(".")[1] for k in sd if k.startswith("double_blocks.")} == {"0", "1"}
            assert not any(k.startswith(("single_blocks.", "final_layer.")) for k in sd)
            assert sd["pos_embed_input.weight"].shape == (hidden, pin)
            assert sd["txt_in.weight"].equal(src[pre + "txt_in.weight"])
            assert sd["double_blocks.1.img_mlp.0.weight"].equal(src[pre + "double_blocks.1.img_mlp.0.weight"])
            assert sd["input_hint_block.0.weight"].shape == (16, 3, 3, 3) and "input_hint_block.14.bias" in sd
            assert len(gs.family_plan(gs._st_header(tiny_weights)[0], fam)) == len(sd)
        assert all(v.dtype == torch.bfloat16 for v in sd.values())
        assert os.path.getsize(path) == gs.plan_bytes(gs.family_plan(gs._st_header(tiny_weights)[0], fam)) + \
            gs._st_header(path)[1]


def test_stale_member_file_is_rewritten(gs, tiny_weights):
    path = gs.family_file(tiny_weights, "schnell")
    with open(path, "wb") as f:
        f.write(b"not safetensors")
    assert gs.write_family(tiny_weights, "schnell") == path
    assert gs.write_family(tiny_weights, "schnell") is None


def test_weights_room(gs, tiny_weights, monkeypatch):
    for fam in gs.FAMILY_FILES:
        p = gs.family_file(tiny_weights, fam)
        if os.path.exists(p):
            os.remove(p)
    assert gs.weights_room(tiny_weights, ["stock", "patched"]) is None  # no member file: nothing checked
    assert gs.weights_room(tiny_weights, ["stock_schnell", "patched_fill"]) is None
    monkeypatch.setattr(gs.shutil, "disk_usage", lambda path: type("U", (), {"free": 1000})())
    msg = gs.weights_room(tiny_weights, ["stock_schnell", "patched_fill"])
    assert msg.startswith("argument --weights: ") and "tiny_schnell.safetensors, tiny_fill.safetensors" in msg
    assert "\n" not in msg and "--drop-family-files" in msg
    # full size: FLUX.1-dev's header when --weights is not written yet (~24 GB, and as much again per member)
    big = gs.weights_room(os.path.join(os.path.dirname(tiny_weights), "none.safetensors"), ["stock_schnell"])
    assert "none.safetensors, none_schnell.safetensors" in big and float(big.split(" GB")[0].split()[-1]) > 40


def test_nodes_exist_in_the_trees():
    """The stock nodes the family prompts use are in each ComfyUI tree at hand (.carry/ComfyUI-*)."""
    trees = sorted(glob.glob(os.path.join(ROOT, ".carry", "ComfyUI-*")))
    if not trees:
        pytest.skip("no ComfyUI tree in .carry")
    for tree in trees:
        text = ""
        for f in [os.path.join(tree, "nodes.py")] + glob.glob(os.path.join(tree, "comfy_extras", "*.py")):
            with open(f, errors="replace") as fh:
                text += fh.read()
        for cls in ("ReferenceLatent", "InpaintModelConditioning", "ControlNetLoader", "ControlNetApplyAdvanced",
                    "VAEEncode", "UNETLoader"):
            assert f"class {cls}" in text or f'node_id="{cls}"' in text, (tree, cls)


def test_interleave_groups_cases_by_checkpoint(gs):
    """--interleave alternates cases run by run within each checkpoint's group (a switch of 24 GB model
    loads the new one in the next prompt); cases of one checkpoint keep the plain interleaved order."""
    cases = ["stock", "patched", "stock_schnell", "patched_schnell", "stock_cn", "patched_cn", "patched_fill"]
    assert gs.run_order(cases, 2, True) == [
        ("stock", 0), ("patched", 0), ("stock_cn", 0), ("patched_cn", 0),
        ("stock", 1), ("patched", 1), ("stock_cn", 1), ("patched_cn", 1),
        ("stock_schnell", 0), ("patched_schnell", 0), ("stock_schnell", 1), ("patched_schnell", 1),
        ("patched_fill", 0), ("patched_fill", 1)]
    plain = ["stock", "patched", "stock_fp8", "patched_fast_fp8", "vae_stock"]
    assert gs.run_order(plain, 2, True) == [(c, i) for i in range(2) for c in plain]
    assert gs.run_order(cases, 2, False) == [(c, i) for c in cases for i in range(2)]


def test_quantised_checkpoint_cases(gs):
    """_fp8s / _gguf: the quantised files of --weights (bench/e2e/_server_quant.py) -- UNETLoader of the
    fp8-scaled file (weight_dtype default), ComfyUI-GGUF's UnetLoaderGGUF of the Q8_0 file; their own
    stock partner and checkpoint group; refused with _fp8 or a member with a file of its own."""
    g = build(gs, "patched_fast_cached_fp8s")
    assert node(g, "UNETLoader")["inputs"] == {"unet_name": "flux1_dev_random_fp8_scaled.safetensors",
                                               "weight_dtype": "default"}
    g = build(gs, "patched_gguf_lora")
    assert node(g, "UnetLoaderGGUF")["inputs"] == {"unet_name": "flux1_dev_random_Q8_0.gguf"}
    assert "UNETLoader" not in classes(g) and node(g, "FluxNumbaPatch")["inputs"]["profile"] == "exact"
    assert node(g, "LoraLoaderModelOnly")["inputs"]["model"] == ["patch", 0]
    g = build(gs, "stock_kontext_gguf")
    assert "UnetLoaderGGUF" in classes(g) and "ReferenceLatent" in classes(g)
    assert gs.parse_case("patched_gguf")["quant"] == "gguf" and gs.parse_case("patched")["quant"] is None
    cases = ["stock", "patched", "stock_fp8s", "patched_fp8s", "patched_fast_fp8s", "stock_gguf", "patched_gguf",
             "patched_gguf_lora", "stock_gguf_lora"]
    assert gs.stock_partner("patched_fast_fp8s", cases) == "stock_fp8s"
    assert gs.stock_partner("patched_gguf", cases) == "stock_gguf"
    assert gs.stock_partner("patched_gguf_lora", cases) == "stock_gguf_lora"
    assert gs.stock_partner("patched", cases) == "stock"
    order = [c for c, i in gs.run_order(cases, 2, True)]
    assert order[:4] == ["stock", "patched", "stock", "patched"]   # one checkpoint's cases together
    assert order[4:10] == ["stock_fp8s", "patched_fp8s", "patched_fast_fp8s"] * 2
    for bad, why in (("patched_fp8s_gguf", "one quantised checkpoint"), ("stock_gguf_schnell", "made from --weights"),
                     ("patched_fast_fp8s_fp8", "_fp8 (weight_dtype")):
        with pytest.raises(ValueError, match=why.replace("(", r"\(")):
            gs.parse_case(bad)


def test_gguf_cases_need_the_pack(tmp_path):
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "main.py").write_text("")
    (tmp_path / "w.safetensors").write_bytes(b"")  # present: nothing to generate on a GPU
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "e2e", "gpu_server.py"), "--comfy", str(tree),
                        "--cases", "stock_gguf", "--gguf-pack", str(tmp_path / "none"), "--flags=--cpu",
                        "--weights", str(tmp_path / "w.safetensors")], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert "argument --gguf-pack: no ComfyUI-GGUF at" in p.stderr, p.stderr
