"""FluxNumbaQualityCompare: PSNR and SSIM between two IMAGE batches (scikit-image's ``skimage.metrics``).

ComfyUI IMAGE = float tensor [B, H, W, C] in 0..1.  Both batches must have the same shape; the metrics
are computed per image pair (data_range 1.0, SSIM over the colour channels with ``channel_axis=-1``) and
averaged over the batch.  Identical images give PSNR = inf.
"""
from __future__ import annotations

import functools
import math

from .host import api


def _as_numpy(img, name):
    import numpy as np
    if img is None:
        raise ValueError(f"FluxNumbaQualityCompare: {name} is missing (connect an IMAGE output to it)")
    if hasattr(img, "detach"):
        img = img.detach().float().cpu().numpy()
    try:
        a = np.asarray(img, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"FluxNumbaQualityCompare: {name} must be an IMAGE batch [B,H,W,C], "
                         f"got {type(img).__name__}") from None
    if a.ndim == 3:
        a = a[None]
    if a.ndim != 4:
        raise ValueError(f"FluxNumbaQualityCompare: {name} must be an IMAGE batch [B,H,W,C], got shape {tuple(a.shape)}")
    return a


def _win_size(h, w):
    win = min(7, h, w)
    if win % 2 == 0:
        win -= 1
    if win < 3:
        raise ValueError(f"FluxNumbaQualityCompare: images of {h}x{w} pixels are too small for SSIM (need >= 3x3)")
    return win


def compare(image_a, image_b):
    """(psnr, ssim, per_image list of (psnr, ssim)) averaged over the batch."""
    from skimage.metrics import peak_signal_noise_ratio, structural_similarity

    a = _as_numpy(image_a, "image_a")
    b = _as_numpy(image_b, "image_b")
    if a.shape != b.shape:
        raise ValueError(
            f"FluxNumbaQualityCompare: the two images must have the same shape, got image_a {tuple(a.shape)} and "
            f"image_b {tuple(b.shape)} ([batch, height, width, channels]); use the same resolution and batch "
            f"size in both branches (or upscale/crop one first)")
    win = _win_size(a.shape[1], a.shape[2])
    per = []
    for i in range(a.shape[0]):
        x, y = a[i], b[i]
        # skimage divides by the MSE: identical images -> inf (it warns); do it explicitly
        p = math.inf if not (x != y).any() else float(peak_signal_noise_ratio(x, y, data_range=1.0))
        s = float(structural_similarity(x, y, data_range=1.0, channel_axis=-1, win_size=win))
        per.append((p, s))
    psnr = sum(p for p, _ in per) / len(per)
    ssim = sum(s for _, s in per) / len(per)
    return psnr, ssim, per


def _fmt_psnr(p):
    return "inf (identical)" if math.isinf(p) else f"{p:.2f} dB"


NODE_ID = "FluxNumbaQualityCompare"
DISPLAY_NAME = "FluxNumba Quality Compare (PSNR/SSIM)"


def report(image_a, image_b):
    """What the node does: (psnr, ssim, the text shown on the node)."""
    psnr, ssim, per = compare(image_a, image_b)
    lines = [f"PSNR {_fmt_psnr(psnr)}   SSIM {ssim:.5f}"]
    if len(per) > 1:
        lines += [f"  image {i}: PSNR {_fmt_psnr(p)}, SSIM {s:.5f}" for i, (p, s) in enumerate(per)]
    return float(psnr), float(ssim), "\n".join(lines)


@functools.lru_cache(maxsize=None)
def node_class():
    """The V3 node class, defined on first use (it needs ComfyUI's ``comfy_api``)."""
    io = api.io()

    class FluxNumbaQualityCompare(io.ComfyNode):
        @classmethod
        def define_schema(cls):
            return io.Schema(
                node_id=NODE_ID, display_name=DISPLAY_NAME, category="FluxNumba", is_output_node=True,
                description="PSNR and SSIM between two image batches (skimage.metrics), shown on the node. Same "
                            "seed and settings in both branches make this a check that the patched model draws the "
                            "same picture.",
                inputs=[io.Image.Input("image_a", tooltip="Reference images, e.g. the stock model's output."),
                        io.Image.Input("image_b", tooltip="Images to compare, e.g. the patched model's output. "
                                                          "Same batch size and resolution as image_a.")],
                outputs=[io.Float.Output(display_name="psnr", tooltip="PSNR in dB (data range 1.0), mean over the "
                                                                      "batch; inf when identical."),
                         io.Float.Output(display_name="ssim", tooltip="SSIM (scikit-image, colour channels), mean "
                                                                      "over the batch; 1.0 when identical.")],
                hidden=[io.Hidden.unique_id])

        @classmethod
        def execute(cls, image_a, image_b):
            psnr, ssim, text = report(image_a, image_b)
            return io.NodeOutput(psnr, ssim, ui={"text": [text]})

    return FluxNumbaQualityCompare
