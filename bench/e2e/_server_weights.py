"""gpu_server.py's weight files: the random FLUX.1-dev checkpoint (--weights), the random LoRA,
the FLUX.1 family members' files (schnell, fill, ControlNet) made from --weights' own tensors, and the
random VAE.  None of them needs real weights."""
from __future__ import annotations

import json
import math
import os
import re
import struct
import subprocess
import sys

from _server_nodes import MAKE_VAE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root


def write_weights(path, seed=0):
    """Random full-size FLUX.1-dev in ComfyUI's layout (bf16), generated on the GPU."""
    if os.path.exists(path):
        return
    import torch
    from safetensors.torch import save_file
    sys.path.insert(0, ROOT)
    import _pack
    _pack.load()
    from flux_numba_pack.flux_core.checkpoint import FLUX1_DEV, expected_shapes
    g = torch.Generator(device="cuda").manual_seed(seed)
    sd = {}
    for k, shape in expected_shapes(FLUX1_DEV).items():
        if "norm" in k and (k.endswith(".scale") or k.endswith(".weight")) and len(shape) == 1:
            t = torch.ones(shape, dtype=torch.bfloat16)
        else:
            t = (torch.randn(shape, generator=g, device="cuda", dtype=torch.float32) * 0.02).to(torch.bfloat16).cpu()
        sd[k] = t
    save_file(sd, path + ".tmp")
    os.replace(path + ".tmp", path)


LORA_RANK = 16
LORA_FILE = "flux_lora_random.safetensors"


# ---------------------------------------------------------------- the FLUX.1 family's weight files
FAMILIES = ("schnell", "kontext", "fill", "redux", "cn")
FAMILY_FILES = ("schnell", "fill", "cn")  # the members with weights of their own, written next to --weights
FILL_IN = 384            # FLUX.1 Fill's img_in features: (16 latent + 16 masked-image latent + 64 mask) x 2x2
CN_DEPTH = 2             # double blocks of the random ControlNet (XLabs layout)
_ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "F8_E4M3": 1, "F8_E5M2": 1, "U8": 1, "I8": 1, "BOOL": 1,
             "I16": 2, "I32": 4, "I64": 8}



def write_lora(path, seed=1):
    """A random rank-16 LoRA over every block Linear of FLUX.1-dev (ComfyUI's generic
    ``<key>.lora_up.weight`` / ``.lora_down.weight`` / ``.alpha`` format, bf16, ~110 MB): up / down
    ~N(0, 0.01), so a full-strength LoRA moves each weight by ~8% of its spread."""
    if os.path.exists(path):
        return
    import torch
    from safetensors.torch import save_file
    sys.path.insert(0, ROOT)
    import _pack
    _pack.load()
    from flux_numba_pack.flux_core.checkpoint import FLUX1_DEV, expected_shapes
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for k, shape in expected_shapes(FLUX1_DEV).items():
        if not (k.endswith(".weight") and len(shape) == 2 and ("_blocks." in k)):
            continue
        base = "diffusion_model." + k[: -len(".weight")]
        out, inp = shape
        sd[base + ".lora_up.weight"] = (torch.randn(out, LORA_RANK, generator=g) * 0.01).to(torch.bfloat16)
        sd[base + ".lora_down.weight"] = (torch.randn(LORA_RANK, inp, generator=g) * 0.01).to(torch.bfloat16)
        sd[base + ".alpha"] = torch.tensor(float(LORA_RANK))
    save_file(sd, path + ".tmp")
    os.replace(path + ".tmp", path)



def family_file(weights, fam):
    """Where a family member's weights go: named after --weights and next to it (a tiny and a full-size
    --weights in one folder each get their own), ``<stem>_schnell`` / ``_fill`` / ``_cn.safetensors``.
    With a bare file name (graph()'s ``unet``) the bare name of the member's file."""
    d, b = os.path.split(weights)
    stem = b[: -len(".safetensors")] if b.endswith(".safetensors") else b
    return os.path.join(d, f"{stem}_{fam}.safetensors")


def _st_header(path):
    """A safetensors file's header {name: {dtype, shape, data_offsets}} and the offset its data starts at."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if not 0 < n <= min(os.path.getsize(path) - 8, 100 << 20):
            raise ValueError(f"{path}: not a safetensors file")
        h = json.loads(f.read(n))
    if not isinstance(h, dict):
        raise ValueError(f"{path}: not a safetensors file")
    h.pop("__metadata__", None)
    return h, 8 + n


def _dev_header():
    """The header write_weights gives --weights (FLUX.1-dev, bf16): sizes for a file not written yet."""
    sys.path.insert(0, ROOT)
    import _pack
    _pack.load()
    from flux_numba_pack.flux_core.checkpoint import FLUX1_DEV, expected_shapes
    h, pos = {}, 0
    for k, shape in expected_shapes(FLUX1_DEV).items():
        n = 2 * math.prod(shape)
        h[k] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [pos, pos + n]}
        pos += n
    return h


def _prefix(header):
    for p in ("model.diffusion_model.", "diffusion_model.", "model."):
        if p + "img_in.weight" in header:
            return p
    return ""


def family_plan(header, fam):
    """The tensors of a family member's file, made from --weights' own tensors (its header ``header``):
    [(name, dtype, shape, how)], ``how`` a --weights tensor name (copied byte for byte) or a new tensor
    -- ("randn", std), ("randn_ref", name, scale): std that of --weights' tensor ``name`` times
    ``scale``, ("fill_img_in", name): --weights' img_in widened to FILL_IN features (the new ones random
    at img_in's std).  So a full-size and a tiny (run.py --write-model --comfy-min) --weights both work.

    schnell: every tensor but ``guidance_in.*`` (ComfyUI's model_detection then picks FluxSchnell);
    fill: ``img_in.weight`` [hidden, 384] (in_channels 96: FluxInpaint); cn: an XLabs-layout FLUX
    ControlNet (ComfyUI's ``load_controlnet_flux_xlabs_mistoline``: FLUX's own key names, no prefix) --
    the embedders and CN_DEPTH double blocks of --weights, controlnet_blocks, pos_embed_input and the
    hint encoder (input_hint_block: 8 3x3 convolutions, 3 of stride 2, image -> 16 x res/8)."""
    pre = _prefix(header)
    if pre + "img_in.weight" not in header:
        raise ValueError("no img_in.weight: not a FLUX.1 checkpoint")
    hidden, pin = header[pre + "img_in.weight"]["shape"]
    dt = header[pre + "img_in.weight"]["dtype"]
    if fam == "schnell":
        return [(k, v["dtype"], v["shape"], k) for k, v in header.items() if not k.startswith(pre + "guidance_in.")]
    if fam == "fill":
        return [(k, v["dtype"], [hidden, FILL_IN], ("fill_img_in", k)) if k == pre + "img_in.weight" else
                (k, v["dtype"], v["shape"], k) for k, v in header.items()]
    if fam != "cn":
        raise ValueError(f"no weight file of its own for {fam!r}")
    out = [(k[len(pre):], v["dtype"], v["shape"], k) for k, v in header.items() if k.startswith(pre) and
           k[len(pre):].split(".")[0] in ("img_in", "time_in", "vector_in", "guidance_in", "txt_in")]
    blocks = [re.match(re.escape(pre) + r"double_blocks\.(\d+)\.", k) for k in header]
    depth = 1 + max(int(m.group(1)) for m in blocks if m)
    ref = pre + "double_blocks.0.img_attn.proj.weight"
    for i in range(CN_DEPTH):
        src = f"{pre}double_blocks.{i % depth}."
        out += [(f"double_blocks.{i}." + k[len(src):], v["dtype"], v["shape"], k) for k, v in header.items()
                if k.startswith(src)]
        out.append((f"controlnet_blocks.{i}.weight", dt, [hidden, hidden], ("randn_ref", ref, 0.1)))
        out.append((f"controlnet_blocks.{i}.bias", dt, [hidden], ("randn", 0.0)))
    out.append(("pos_embed_input.weight", dt, [hidden, pin], ("randn_ref", pre + "img_in.weight", 1.0)))
    out.append(("pos_embed_input.bias", dt, [hidden], ("randn", 0.0)))
    for j in range(8):
        cin = 3 if j == 0 else 16
        out.append((f"input_hint_block.{2 * j}.weight", dt, [16, cin, 3, 3], ("randn", (9 * cin) ** -0.5)))
        out.append((f"input_hint_block.{2 * j}.bias", dt, [16], ("randn", 0.01)))
    return out


def plan_bytes(plan):
    return sum(_ITEMSIZE[dt] * math.prod(shape) for _, dt, shape, _ in plan)


def _family_file_ok(path, plan):
    """An existing member file with exactly the plan's tensors (names, dtypes, shapes) is kept."""
    try:
        h = _st_header(path)[0]
    except (OSError, ValueError, struct.error):
        return False
    return {k: (v["dtype"], list(v["shape"])) for k, v in h.items()} == {n: (dt, list(s)) for n, dt, s, _ in plan}


def _copy_range(fi, fo, start, n):
    """n bytes of fi from ``start`` appended to fo (in-kernel copy_file_range where the file system
    has it, else 64 MiB reads)."""
    fo.flush()
    if hasattr(os, "copy_file_range"):
        try:
            done = 0
            while done < n:
                k = os.copy_file_range(fi.fileno(), fo.fileno(), n - done, start + done)
                if k <= 0:
                    break
                done += k
            fo.seek(0, os.SEEK_END)
            if done == n:
                return
            start, n = start + done, n - done
        except OSError:
            fo.seek(0, os.SEEK_END)
    fi.seek(start)
    while n:
        b = fi.read(min(n, 1 << 26))
        if not b:
            raise OSError("source file ended early")
        fo.write(b)
        n -= len(b)


def write_family(weights, fam, seed=2):
    """A family member's weights (``family_plan``) written next to ``weights`` unless a file with the same
    tensors is there: --weights' tensors copied byte for byte, the new ones generated on the GPU (CPU
    without one), one tensor at a time (no whole model in host memory).  The path, or None if kept."""
    import torch
    path = family_file(weights, fam)
    header, data0 = _st_header(weights)
    plan = family_plan(header, fam)
    if os.path.exists(path) and _family_file_ok(path, plan):
        return None
    dtypes = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
              "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(seed + FAMILIES.index(fam))

    def stored(fi, name):
        v = header[name]
        a, b = v["data_offsets"]
        fi.seek(data0 + a)
        return torch.frombuffer(bytearray(fi.read(b - a)), dtype=dtypes[v["dtype"]]).reshape(v["shape"])

    def randn(shape, std):
        return torch.randn(shape, generator=g, device=dev, dtype=torch.float32) * std

    hdr, pos = {}, 0
    for name, dt, shape, _ in plan:
        n = _ITEMSIZE[dt] * math.prod(shape)
        hdr[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [pos, pos + n]}
        pos += n
    hb = json.dumps(hdr, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    with open(weights, "rb") as fi, open(path + ".tmp", "wb") as fo:
        fo.write(struct.pack("<Q", len(hb)) + hb)
        for name, dt, shape, how in plan:
            if isinstance(how, str):
                a, b = header[how]["data_offsets"]
                _copy_range(fi, fo, data0 + a, b - a)
                continue
            if how[0] == "fill_img_in":
                old = stored(fi, how[1]).float()
                t = torch.cat([old.to(dev), randn([shape[0], shape[1] - old.shape[1]], old.std().item())], dim=1)
            elif how[0] == "randn_ref":
                t = randn(shape, stored(fi, how[1]).float().std().item() * how[2])
            else:
                t = randn(shape, how[1])
            t = t.to(dtypes[dt]).cpu().contiguous()
            fo.write(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    os.replace(path + ".tmp", path)
    return path


def write_vae(path, py, comfy, env):
    """A random FLUX VAE (built from ComfyUI's own decoder definition, so run inside a tree)."""
    if os.path.exists(path):
        return
    r = subprocess.run([py, "-c", MAKE_VAE, ROOT, path], cwd=comfy, capture_output=True, text=True, env=env)
    if r.returncode:
        raise RuntimeError("writing the random VAE failed:\n" + r.stderr[-3000:])
