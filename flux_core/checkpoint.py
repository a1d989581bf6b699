"""FLUX.1 checkpoints: header inspection, config inference, loading in any storage dtype.

Reads the layout ComfyUI's UNETLoader reads (``double_blocks.N.img_attn.qkv.weight`` ...), with
or without the ``model.diffusion_model.`` prefix, stored as bf16 / fp16 / fp32 / fp8 (e4m3fn,
e5m2, optionally with ComfyUI's ``scale_weight`` per-tensor scales).  Inspection reads only the
safetensors header, never the tensor data.
"""
from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass, asdict, field
from typing import Dict, List

import torch

PREFIXES = ("model.diffusion_model.", "diffusion_model.", "model.")
DETECT_KEYS = ("double_blocks.0.img_attn.norm.key_norm.scale", "img_in.weight")

_DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class CheckpointError(ValueError):
    """The file cannot be read as a safetensors checkpoint (missing, truncated, corrupt)."""


class NotFluxError(ValueError):
    """The file is a valid checkpoint but not a FLUX.1 diffusion model."""


@dataclass
class FluxConfig:
    in_channels: int = 16
    out_channels: int = 16
    vec_in_dim: int = 768
    context_in_dim: int = 4096
    hidden_size: int = 3072
    mlp_ratio: float = 4.0
    num_heads: int = 24
    depth: int = 19
    depth_single_blocks: int = 38
    axes_dim: List[int] = field(default_factory=lambda: [16, 56, 56])
    theta: int = 10000
    patch_size: int = 2
    qkv_bias: bool = True
    guidance_embed: bool = True

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def mlp_hidden_dim(self) -> int:
        return int(self.hidden_size * self.mlp_ratio)

    def comfy_kwargs(self) -> dict:
        """Keyword arguments for ComfyUI's ``comfy.ldm.flux.model.Flux``."""
        d = asdict(self)
        d["txt_ids_dims"] = []
        return d

    def n_params(self) -> int:
        C, M = self.hidden_size, self.mlp_hidden_dim
        dbl = 2 * (C * 6 * C + 6 * C + C * 3 * C + 3 * C + 2 * self.head_dim + C * C + C + C * M + M + M * C + C)
        sgl = C * 3 * C + 3 * C + C * (3 * C + M) + 3 * C + M + (C + M) * C + C + 2 * self.head_dim
        emb = (self.in_channels * self.patch_size ** 2 + 1) * C + 2 * (256 * C + C + C * C + C) \
            + self.vec_in_dim * C + C + C * C + C + (self.context_in_dim + 1) * C
        final = C * 2 * C + 2 * C + C * self.out_channels * self.patch_size ** 2 + self.out_channels * self.patch_size ** 2
        return self.depth * dbl + self.depth_single_blocks * sgl + emb + final


FLUX1_DEV = FluxConfig()


def axes_for_head_dim(head_dim: int) -> List[int]:
    """RoPE axes split: FLUX's [16, 56, 56] for 128, the same proportions otherwise."""
    if head_dim == 128:
        return [16, 56, 56]
    a = head_dim // 8
    a -= a % 2
    b = (head_dim - a) // 2
    b -= b % 2
    a = head_dim - 2 * b
    if a <= 0 or a % 2:
        raise NotFluxError(f"head dim {head_dim} cannot be split into FLUX RoPE axes")
    return [a, b, b]


def strip_prefix(keys) -> str:
    """The key prefix in front of FLUX's own names ('' when there is none)."""
    for p in PREFIXES:
        if any(k.startswith(p + "img_in.") for k in keys):
            return p
    return ""


def read_header(path: str) -> Dict[str, dict]:
    """safetensors header {name: {dtype, shape, data_offsets}} without reading tensor data."""
    if not os.path.isfile(path):
        raise CheckpointError(f"no such file: {path}")
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise CheckpointError(f"{path}: {size} bytes is too short for a safetensors file")
            (n,) = struct.unpack("<Q", raw)
            if n <= 0 or n > min(size - 8, 100 * 2 ** 20):
                raise CheckpointError(f"{path}: not a safetensors file (header length {n} for a {size}-byte file)")
            header = json.loads(f.read(n))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not a safetensors file (header is not JSON: {e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: not a safetensors file (header is a JSON {type(header).__name__}, "
                              f"not a table of tensors)")
    header.pop("__metadata__", None)
    for k, v in header.items():
        offs = v.get("data_offsets") if isinstance(v, dict) else None
        if not (isinstance(offs, list) and len(offs) == 2 and all(isinstance(o, int) for o in offs)
                and isinstance(v.get("shape"), list)):
            raise CheckpointError(f"{path}: not a safetensors file (header entry {k!r} is not a tensor record)")
    end = max((v["data_offsets"][1] for v in header.values()), default=0)
    if 8 + n + end > size:
        raise CheckpointError(f"{path}: truncated: header promises {8 + n + end} bytes, file has {size}")
    return header


def guess_kind(keys) -> str:
    ks = " ".join(list(keys)[:2000])
    for pat, what in (("joint_blocks", "an SD3 MMDiT"), ("input_blocks", "an SD1/SDXL UNet"),
                      ("decoder.conv_in", "a VAE"), ("encoder.block", "a T5 text encoder"),
                      ("text_model.", "a CLIP text encoder"), ("transformer_blocks", "a diffusers-format transformer "
                                                                                    "(convert it to the original FLUX layout)"),
                      ("lora_", "a LoRA (load it with a LoRA loader)")):
        if pat in ks:
            return f"; it looks like {what}"
    return ""


def infer_config(shapes: Dict[str, tuple], dtypes_ok: bool = True) -> FluxConfig:
    """Config from tensor names and shapes (prefix already stripped)."""
    missing = [k for k in DETECT_KEYS if k not in shapes]
    if missing:
        raise NotFluxError(f"not a FLUX.1 diffusion model: no {missing[0]}{guess_kind(shapes)}")
    try:
        hidden, in_feat = shapes["img_in.weight"]
        head_dim = shapes["double_blocks.0.img_attn.norm.query_norm.scale"][0]
        depth = 1 + max(int(m.group(1)) for k in shapes for m in [re.match(r"double_blocks\.(\d+)\.", k)] if m)
        singles = [int(m.group(1)) for k in shapes for m in [re.match(r"single_blocks\.(\d+)\.", k)] if m]
        depth_single = 1 + max(singles) if singles else 0
        mlp_hidden = shapes["double_blocks.0.img_mlp.0.weight"][0]
        patch = 2
        if in_feat % (patch * patch):
            raise NotFluxError(f"img_in takes {in_feat} features, not a multiple of patch 2x2")
        out_feat = shapes["final_layer.linear.weight"][0]
        cfg = FluxConfig(
            in_channels=in_feat // (patch * patch),
            out_channels=out_feat // (patch * patch),
            vec_in_dim=shapes["vector_in.in_layer.weight"][1],
            context_in_dim=shapes["txt_in.weight"][1],
            hidden_size=hidden,
            mlp_ratio=mlp_hidden / hidden,
            num_heads=hidden // head_dim,
            depth=depth,
            depth_single_blocks=depth_single,
            axes_dim=axes_for_head_dim(head_dim),
            patch_size=patch,
            qkv_bias="double_blocks.0.img_attn.qkv.bias" in shapes,
            guidance_embed="guidance_in.in_layer.weight" in shapes,
        )
    except KeyError as e:
        raise NotFluxError(f"FLUX checkpoint is missing tensor {e.args[0]}") from None
    if hidden % head_dim:
        raise NotFluxError(f"hidden size {hidden} is not a multiple of head dim {head_dim}")
    # every block tensor must have the shape this config implies
    want = expected_shapes(cfg)
    for k, shp in want.items():
        if k in shapes and tuple(shapes[k]) != shp:
            raise NotFluxError(f"tensor {k} has shape {tuple(shapes[k])}, expected {shp} for hidden {hidden}")
    absent = [k for k in want if k not in shapes]
    if absent:
        raise NotFluxError(f"FLUX checkpoint is missing {len(absent)} tensors, e.g. {absent[0]}")
    return cfg


def expected_shapes(cfg: FluxConfig) -> Dict[str, tuple]:
    C, M, D = cfg.hidden_size, cfg.mlp_hidden_dim, cfg.head_dim
    s = {}

    def lin(name, i, o, bias=True):
        s[name + ".weight"] = (o, i)
        if bias:
            s[name + ".bias"] = (o,)
    pin = cfg.in_channels * cfg.patch_size ** 2
    lin("img_in", pin, C)
    lin("time_in.in_layer", 256, C); lin("time_in.out_layer", C, C)
    lin("vector_in.in_layer", cfg.vec_in_dim, C); lin("vector_in.out_layer", C, C)
    if cfg.guidance_embed:
        lin("guidance_in.in_layer", 256, C); lin("guidance_in.out_layer", C, C)
    lin("txt_in", cfg.context_in_dim, C)
    for i in range(cfg.depth):
        p = f"double_blocks.{i}."
        for st in ("img", "txt"):
            lin(p + f"{st}_mod.lin", C, 6 * C)
            lin(p + f"{st}_attn.qkv", C, 3 * C, cfg.qkv_bias)
            s[p + f"{st}_attn.norm.query_norm.scale"] = (D,)
            s[p + f"{st}_attn.norm.key_norm.scale"] = (D,)
            lin(p + f"{st}_attn.proj", C, C)
            lin(p + f"{st}_mlp.0", C, M)
            lin(p + f"{st}_mlp.2", M, C)
    for i in range(cfg.depth_single_blocks):
        p = f"single_blocks.{i}."
        lin(p + "linear1", C, 3 * C + M)
        lin(p + "linear2", C + M, C)
        s[p + "norm.query_norm.scale"] = (D,)
        s[p + "norm.key_norm.scale"] = (D,)
        lin(p + "modulation.lin", C, 3 * C)
    lin("final_layer.linear", C, cfg.out_channels * cfg.patch_size ** 2)
    lin("final_layer.adaLN_modulation.1", C, 2 * C)
    return s


def inspect_checkpoint(path: str) -> FluxConfig:
    """Config of a FLUX.1 diffusion-model file from its header alone.

    Raises CheckpointError for unreadable files and NotFluxError for other models.
    """
    header = read_header(path)
    prefix = strip_prefix(header.keys())
    shapes = {k[len(prefix):]: tuple(v["shape"]) for k, v in header.items() if k.startswith(prefix)}
    for k, v in header.items():
        if v.get("dtype") not in _DTYPES and not k.endswith("scaled_fp8"):
            raise CheckpointError(f"{path}: tensor {k} has unsupported dtype {v.get('dtype')}")
    return infer_config(shapes)


def load_state_dict(path: str, device="cpu") -> Dict[str, torch.Tensor]:
    """All tensors of a checkpoint, prefix stripped, in their stored dtype; fp8 ``scale_weight``
    tensors are kept as ``<name>.scale_weight`` entries for the loader to apply."""
    from safetensors import safe_open
    header = read_header(path)  # validates size first: a truncated file fails with a clear message
    prefix = strip_prefix(header.keys())
    out = {}
    try:
        with safe_open(path, framework="pt", device=str(device)) as f:
            for k in f.keys():
                if k.startswith(prefix):
                    out[k[len(prefix):]] = f.get_tensor(k)
    except Exception as e:
        raise CheckpointError(f"{path}: cannot read tensors ({type(e).__name__}: {e})") from None
    return out


def save_safetensors(tensors: Dict[str, torch.Tensor], path: str):
    """safetensors' save_file, the file then given the mode any new file gets under the umask
    (0644 with the usual 022): save_file writes it 0600, unreadable to other users."""
    from safetensors.torch import save_file
    save_file(tensors, path)
    os.chmod(path, 0o666 & ~_umask())


def _umask() -> int:
    """The process's umask: read from /proc on Linux (setting it to read it back would change it
    for every thread for a moment), else set and restored."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def save_state_dict(sd: Dict[str, torch.Tensor], path: str, prefix: str = ""):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    save_safetensors({prefix + k: v.contiguous() for k, v in sd.items()}, path)
