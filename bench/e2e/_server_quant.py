"""Quantised FLUX.1 checkpoints for the server benchmark, made from a bf16 ``--weights`` file the way
users' downloads are laid out:

* ``write_fp8_scaled``: ComfyUI's "fp8 scaled" safetensors -- every 2-D weight of the double / single
  blocks stored as float8 e4m3 with one fp32 ``<layer>.scale_weight`` (absmax / 448) and the
  ``scaled_fp8`` marker tensor; everything else as stored.  v0.8.0 loads it with its scaled-fp8 ops,
  v0.33.0 converts it to per-layer ``comfy_quant`` metadata (``comfy.utils.convert_old_quants``) and
  loads QuantizedTensor weights through its mixed-precision ops.
* ``write_gguf_q8_0``: a GGUF file as ComfyUI-GGUF's ``tools/convert.py`` writes one for FLUX (arch
  "flux"; 1-D and small tensors F32, the other weights Q8_0: blocks of 32 values along a row, an fp16
  scale absmax / 127 and 32 int8), loaded by ComfyUI-GGUF's UnetLoaderGGUF.  Q8_0 blocks are made
  with torch (on the GPU where there is one) by ``q8_0_blocks``, which tests/test_server_quant.py
  checks byte for byte against gguf-py's own quantiser.

Both stream one tensor at a time (no second full model in host memory) and skip work when the file
is already there."""
import os

FP8_MAX = 448.0
QUANTIZATION_THRESHOLD = 1024   # ComfyUI-GGUF convert.py: tensors this small stay F32
Q8_0_BLOCK = 32


def scaled_fp8_file(weights):
    return _next_to(weights, "_fp8_scaled.safetensors")


def gguf_file(weights):
    return _next_to(weights, "_Q8_0.gguf")


def _next_to(weights, suffix):
    d, b = os.path.split(weights)
    stem = b[: -len(".safetensors")] if b.endswith(".safetensors") else b
    return os.path.join(d, stem + suffix)


def _fp8_layer(name, ndim):
    return ndim == 2 and name.endswith(".weight") and (name.startswith("double_blocks.") or name.startswith("single_blocks."))


def planned_bytes(header, kind):
    """About how many bytes the ``kind`` ("fp8s" / "gguf") file of a safetensors header
    ({name: {dtype, shape, data_offsets}}) takes (the weights_room check before writing)."""
    import math
    n = 0
    for k, v in header.items():
        shape, size = v["shape"], v["data_offsets"][1] - v["data_offsets"][0]
        numel = math.prod(shape)
        if kind == "fp8s":
            n += numel + 4 if _fp8_layer(k, len(shape)) else size
        elif len(shape) == 2 and numel > QUANTIZATION_THRESHOLD and shape[-1] % Q8_0_BLOCK == 0:
            n += numel // Q8_0_BLOCK * 34
        else:
            n += 4 * numel
    return n


def write_fp8_scaled(weights, path=None):
    """The fp8-scaled checkpoint of ``weights`` (path: ``scaled_fp8_file``); returns the path.  Written
    as it is read: the header from the tensors' shapes, then one tensor at a time."""
    import json
    import math
    import struct
    import torch
    from safetensors import safe_open
    path = path or scaled_fp8_file(weights)
    if os.path.exists(path):
        return path
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    st = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float8_e4m3fn: "F8_E4M3"}
    with safe_open(weights, "pt", device="cpu") as f:
        names = list(f.keys())
        plan = [("scaled_fp8", "F8_E4M3", [0], None)]
        for k in names:
            sl = f.get_slice(k)
            shape = list(sl.get_shape())
            if _fp8_layer(k, len(shape)):
                plan += [(k, "F8_E4M3", shape, "fp8"), (k[: -len("weight")] + "scale_weight", "F32", [], "scale")]
            else:
                plan.append((k, sl.get_dtype(), shape, "copy"))
        size = {"F8_E4M3": 1, "BF16": 2, "F16": 2, "F32": 4}
        hdr, pos = {}, 0
        for name, dt, shape, _ in plan:
            n = size[dt] * math.prod(shape)
            hdr[name] = {"dtype": dt, "shape": shape, "data_offsets": [pos, pos + n]}
            pos += n
        hb = json.dumps(hdr, separators=(",", ":")).encode()
        hb += b" " * (-len(hb) % 8)
        with open(path + ".tmp", "wb") as fo:
            fo.write(struct.pack("<Q", len(hb)) + hb)
            scale = None
            for name, dt, shape, how in plan:
                if how is None:
                    continue
                if how == "fp8":
                    w = f.get_tensor(name).to(dev, torch.float32)
                    scale = (w.abs().amax() / FP8_MAX).clamp_min(1e-12)
                    t = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
                elif how == "scale":
                    t = scale.reshape(())
                else:
                    t = f.get_tensor(name)
                if st.get(t.dtype) != dt:
                    raise ValueError(f"{name}: {t.dtype} is not the {dt} of the header")
                fo.write(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    os.replace(path + ".tmp", path)
    return path


def q8_0_blocks(x):
    """Q8_0 bytes of a 2-D float tensor whose rows split into 32-value blocks: uint8 [rows, cols / 32 * 34],
    each block an fp16 d = absmax / 127 then round(x / d) as int8 (gguf-py's rounding: half away from 0)."""
    import torch
    n, k = x.shape
    b = x.float().reshape(n, k // Q8_0_BLOCK, Q8_0_BLOCK)
    d = b.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    v = b * inv
    q = (torch.sign(v) * torch.floor(v.abs() + 0.5)).to(torch.int8)
    return torch.cat([d.to(torch.float16).view(torch.uint8), q.view(torch.uint8)], -1).reshape(n, -1)


def _gguf_kind(name, t):
    """ComfyUI-GGUF convert.py's choice for a FLUX tensor: "F32" or "Q8_0"."""
    if t.ndim <= 1 or t.numel() <= QUANTIZATION_THRESHOLD or t.shape[-1] % Q8_0_BLOCK:
        return "F32"
    return "Q8_0"


def write_gguf_q8_0(weights, path=None):
    """The Q8_0 GGUF of ``weights`` (path: ``gguf_file``); returns the path."""
    import numpy as np
    import torch
    import gguf
    from safetensors import safe_open
    path = path or gguf_file(weights)
    if os.path.exists(path):
        return path
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    Q8 = gguf.GGMLQuantizationType.Q8_0
    with safe_open(weights, "pt", device="cpu") as f:
        names = list(f.keys())
        w = gguf.GGUFWriter(path + ".tmp", arch="flux")
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
        kinds = {}
        for k in names:
            sl = f.get_slice(k)
            shape = tuple(sl.get_shape())
            kind = _gguf_kind(k, torch.empty(shape, device="meta"))
            kinds[k] = kind
            if kind == "Q8_0":
                nbytes = shape[0] * shape[1] // Q8_0_BLOCK * 34
                w.add_tensor_info(k, (shape[0], shape[1] // Q8_0_BLOCK * 34), np.dtype(np.uint8), nbytes, raw_dtype=Q8)
            else:
                n = int(np.prod(shape)) if shape else 1
                w.add_tensor_info(k, shape, np.dtype(np.float32), 4 * n)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for k in names:
            t = f.get_tensor(k)
            if kinds[k] == "Q8_0":
                a = q8_0_blocks(t.to(dev)).cpu().numpy()
            else:
                a = t.float().numpy()
            w.write_tensor_data(np.ascontiguousarray(a))
        w.close()
    os.replace(path + ".tmp", path)
    return path
