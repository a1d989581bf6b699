"""The FLUX VAE decoder NHWC end to end (ComfyUI-free): the math between the convolutions, on the
decoder's own modules (the FLUX VAE's architecture: ``conv_in``, ``mid.block_1 / attn_1 / block_2``,
``up[i].block / attn / upsample``, ``norm_out``, ``conv_out``).

The latent is made channels_last once at entry and the image NCHW once at exit; in between every
activation stays channels_last, so each of the host's own convolutions (its ops, its weight casting)
runs cuDNN's NHWC implicit GEMM without the nchwToNhwc / nhwcToNchw conversions cuDNN wraps around
an NCHW bf16 convolution (8.1 ms of a 1024^2 decode).  The ops between the convolutions that torch
runs slowly on channels_last memory are the pack's: GroupNorm(+SiLU) -> ``groupnorm_silu_nhwc``, the
Upsample's nearest 2x -> ``upsample_nearest2x``, and each convolution's bias, which torch's cuDNN
path adds in a slow broadcast pass of its own: the convolution runs without it
(``conv._conv_forward`` with the weights the host hands out, as its op would), then a ResnetBlock's
conv1 bias goes into norm2's statistics (``pre_bias``), conv2's bias and the residual add are one
``bias_residual_nhwc`` pass (the attention's proj_out likewise), every other conv's bias a
``bias_residual_nhwc`` pass alone.  The mid block's attention (head dim 512, where torch's SDPA
falls back to its mem-efficient kernel) -> ``vae_attention`` when the host's attention is plain SDPA
(its reference); otherwise the host's attention takes the channels_last q / k / v as they are.
Outside the NHWC path (NCHW input) the GroupNorm(+SiLU) pairs still go through ``groupnorm_silu``.

The low-resolution stage (``stage_low``: everything at the latent's resolution, host-bound op by op)
replays as a CUDA graph (``LowResGraph``).

``DecoderHost`` is the port to whoever owns the modules: how an op gets its weights (``module``,
from ``context.Weights``), a per-op hook (``every_op``), how the decoder's blocks are called, and
whether the block's attention is plain SDPA.  The defaults serve plain torch modules; ComfyUI's
adapter (``nodes/host/vae.py``) subclasses it.
"""
from __future__ import annotations

import contextlib
import logging

import torch

from ..cuda_kernels import ops, registry
from .context import Weights
from .graphs import GraphGuard, Guarded

log = logging.getLogger("flux_numba")

CL = torch.channels_last
OPS = ("groupnorm_silu", "groupnorm_silu_nhwc", "upsample_nearest2x", "bias_residual_nhwc", "vae_attention")


class DecoderHost(Weights):
    """How the decoder's modules are reached (module docstring); plain torch modules by default."""

    def call_block(self, blk, h, kwargs):
        """A ResnetBlock of a level or of the mid block, as the decoder calls it."""
        return blk(h, **kwargs)

    def call_attn(self, blk, h, kwargs):
        return blk(h, **kwargs)

    def call_upsample(self, up, h):
        return up(h)

    def sdpa_attention(self, blk) -> bool:
        """The block's attention is plain scaled-dot-product attention (``vae_attention``'s reference)."""
        return True

    def attention(self, blk, q, k, v):
        """The block's attention on q, k, v [B, C, H, W]: one head over every pixel (SDPA)."""
        B, C, H, W = q.shape
        rows = lambda t: t.reshape(B, 1, C, H * W).transpose(2, 3)  # noqa: E731
        out = torch.nn.functional.scaled_dot_product_attention(rows(q), rows(k), rows(v))
        return out.transpose(2, 3).reshape(B, C, H, W)


def is_nhwc(x):
    """x is a 4-D channels_last activation (the NHWC path's), not a plain NCHW one."""
    return x.ndim == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=CL)


def backend_ctx(backend: str):
    """The VAE ops forced to ``backend`` ("auto": the registry decides)."""
    return contextlib.nullcontext() if backend == "auto" else registry.force(backend, ops=list(OPS))


def group_norm_act(norm, x, silu: bool, host: Weights, pre_bias=None):
    """``norm(x [+ pre_bias])`` (+ SiLU) through the registry, with the weights the host hands out;
    ``pre_bias`` (the producing conv's bias, not yet added) only on the NHWC path."""
    host.every_op()
    with host.module(norm, x) as (w, b):
        if is_nhwc(x):
            kw = {} if pre_bias is None else {"pre_bias": pre_bias}
            return ops.groupnorm_silu_nhwc(x, norm.num_groups, w, b, norm.eps, silu=silu, **kw)
        if pre_bias is not None:
            x = x + pre_bias.to(x.dtype).view(1, -1, 1, 1)
        return ops.groupnorm_silu(x, norm.num_groups, w, b, norm.eps, silu=silu)


def plain_conv(conv):
    return isinstance(conv, torch.nn.Conv2d) and hasattr(conv, "_conv_forward")


@contextlib.contextmanager
def conv_without_bias(conv, x, host: Weights):
    """(y, bias): the convolution of channels_last ``x`` without its bias (weights as the host's op
    gets them, valid inside the context), y channels_last."""
    host.every_op()
    with host.module(conv, x) as (w, b):
        y = conv._conv_forward(x, w, None)
        if not is_nhwc(y) and y.shape[1] % 8 == 0:   # (cuDNN keeps channels_last; some CPU kernels do not)
            y = y.contiguous(memory_format=CL)
        yield y, b


def conv_nhwc(conv, x, host: Weights, residual=None):
    """The convolution with its bias (+ residual) added in one pass by ``bias_residual_nhwc`` instead
    of torch's broadcast add."""
    if not plain_conv(conv):
        y = conv(x)
        return y if residual is None else y + residual
    with conv_without_bias(conv, x, host) as (y, b):
        if b is None:
            return y if residual is None else y.add_(residual)
        return ops.bias_residual_nhwc(y, b, residual)


def dropout_off(blk):
    d = getattr(blk, "dropout", None)
    return d is None or not (d.training and d.p)


def resnet(blk, x, host: Weights):
    """A ResnetBlock: NHWC (norm1+SiLU -> conv1, its bias folded into norm2 -> norm2+SiLU -> conv2 +
    bias + shortcut in one pass) for a channels_last x, else the stock order with the fused norms."""
    if is_nhwc(x) and dropout_off(blk):
        h = group_norm_act(blk.norm1, x, True, host)
        if plain_conv(blk.conv1):
            with conv_without_bias(blk.conv1, h, host) as (h, b):
                h = group_norm_act(blk.norm2, h, True, host, pre_bias=b)
        else:
            h = group_norm_act(blk.norm2, blk.conv1(h), True, host)
        if blk.in_channels != blk.out_channels:
            x = conv_nhwc(_shortcut(blk), x, host)
        return conv_nhwc(blk.conv2, h, host, residual=x)
    h = group_norm_act(blk.norm1, x, True, host)
    h = blk.conv1(h)
    h = group_norm_act(blk.norm2, h, True, host)
    d = getattr(blk, "dropout", None)
    h = blk.conv2(d(h) if d is not None else h)
    if blk.in_channels != blk.out_channels:
        x = _shortcut(blk)(x)
    return x + h


def _shortcut(blk):
    """The ResnetBlock's channel-changing shortcut (a 3x3 ``conv_shortcut`` where the block asks for
    one, else the 1x1 ``nin_shortcut``)."""
    return blk.conv_shortcut if getattr(blk, "use_conv_shortcut", False) else blk.nin_shortcut


def attn(blk, x, host: DecoderHost):
    """An AttnBlock (the mid block's single-head attention over every pixel)."""
    if is_nhwc(x):
        h_ = group_norm_act(blk.norm, x, False, host)
        q, k, v = (conv_nhwc(m, h_, host) for m in (blk.q, blk.k, blk.v))
        if host.sdpa_attention(blk):
            h_ = ops.vae_attention(q, k, v)     # its reference is SDPA
        else:                                      # the host's other attention (xformers, split ...)
            h_ = host.attention(blk, q, k, v)
        if not is_nhwc(h_):
            h_ = h_.contiguous(memory_format=CL)
        return conv_nhwc(blk.proj_out, h_, host, residual=x)
    h_ = group_norm_act(blk.norm, x, False, host)
    h_ = host.attention(blk, blk.q(h_), blk.k(h_), blk.v(h_))
    return x + blk.proj_out(h_)


def is_2x(sf):
    return sf in (2, 2.0) or (isinstance(sf, (tuple, list)) and len(sf) == 2 and all(v in (2, 2.0) for v in sf))


def upsample_nhwc(up, x, host: Weights):
    """An Upsample of a channels_last x: nearest 2x (``upsample_nearest2x``), then its conv."""
    x = ops.upsample_nearest2x(x)
    if up.with_conv:
        x = conv_nhwc(up.conv, x, host)
    return x


def level_blocks(dec, i_level, h, host: DecoderHost, kwargs):
    for i_block in range(dec.num_res_blocks + 1):
        h = host.call_block(dec.up[i_level].block[i_block], h, kwargs)
        if len(dec.up[i_level].attn) > 0:
            h = host.call_attn(dec.up[i_level].attn[i_block], h, kwargs)
    return h


def stage_low(dec, z, host: DecoderHost, kwargs=None):
    """conv_in, the mid block and the top level's blocks: every op at the latent's resolution (the
    stage the low-resolution graph replays)."""
    kwargs = kwargs or {}
    h = conv_nhwc(dec.conv_in, z, host) if is_nhwc(z) else dec.conv_in(z)
    h = host.call_block(dec.mid.block_1, h, kwargs)
    h = host.call_attn(dec.mid.attn_1, h, kwargs)
    h = host.call_block(dec.mid.block_2, h, kwargs)
    return level_blocks(dec, dec.num_resolutions - 1, h, host, kwargs)


def stage_rest(dec, h, host: DecoderHost, kwargs):
    """The top level's upsample, the other levels, norm_out, conv_out (stock order)."""
    nhwc = is_nhwc(h)
    top = dec.num_resolutions - 1
    for i_level in reversed(range(dec.num_resolutions)):
        if i_level != top:
            h = level_blocks(dec, i_level, h, host, kwargs)
        if i_level != 0:
            h = host.call_upsample(dec.up[i_level].upsample, h)
    h = group_norm_act(dec.norm_out, h, True, host)
    h = conv_nhwc(dec.conv_out, h, host) if nhwc else dec.conv_out(h)
    if getattr(dec, "tanh_out", False):
        h = torch.tanh(h)
    return h


def body(dec, z, host: DecoderHost, kwargs):
    """The whole decoder in the layout ``z`` comes in."""
    return stage_rest(dec, stage_low(dec, z, host, kwargs), host, kwargs)


def nhwc_problem(z, kwargs, layout: str, backend: str, failed_shapes=()):
    """None when this call runs the NHWC path, else why not."""
    if layout != "nhwc":
        return "layout nchw"
    if backend == "torch":
        return "backend torch (stock math, stock layout)"
    if kwargs:
        return "decoder keyword arguments"
    if z.dtype != torch.bfloat16:
        return f"VAE dtype {z.dtype} (the NHWC path is bf16)"
    if tuple(z.shape) in failed_shapes:
        return "the NHWC path failed for this shape"
    return None


def decode_nhwc(dec, z, host: DecoderHost, kwargs, low=None):
    """The NHWC decode of ``z``; ``low(dec, z)`` runs the low-resolution stage (a LowResGraph) when given."""
    z = z.contiguous(memory_format=CL)
    h = low(dec, z) if low is not None else stage_low(dec, z, host, kwargs)
    return stage_rest(dec, h, host, kwargs).contiguous()


class LowResGraph(Guarded):
    """The NHWC decoder's low-resolution stage (``stage_low``: conv_in, the mid block with its
    attention, the top level's ResnetBlocks -- at the latent's resolution, 128^2 for a 1024^2 image)
    replayed as a CUDA graph, per latent shape.

    Why that stage: its kernels are short (~0.3 ms of GPU work per ResnetBlock) and issuing them
    from Python (registry, the host's weight access, cuDNN and Numba launches, ~11 per block) takes
    longer, so without a graph the GPU idles there; every later stage is GPU-bound and the host
    issues it while the replay runs.  What the graph keeps allocated between decodes is that
    stage's activations (216 MB at 1024^2, measured; ``vae_attention`` uses small chunks inside a
    capture) -- the host drops the graphs when it unloads the VAE.

    The policy is ``graphs.GraphGuard``'s (shared with the FLUX forward's graph): two eager decodes of
    a shape (the second proves the stage never syncs the host), then capture and replay; a change of
    any decoder weight's address re-captures; eager (reason logged once) when ``state(dec, device)``
    says a graph is unsafe, for good once a capture failed; out-of-memory (graphs dropped first) and
    the host's interrupt propagate.  ``state`` returns (reasons, weights key) or (reasons, weights key,
    can_capture): where the host's weights move under memory pressure (DynamicVRAM), the key is their
    residency and ``can_capture()`` puts a capture off while there is no room for one.
    """

    def __init__(self, host: DecoderHost, state, name: str = "VAE decoder", max_graphs: int = 2):
        self.host, self.state = host, state
        self.guard = GraphGuard(f"{name}: low-resolution CUDA graph off for this decode", warmup=2,
                                max_graphs=max_graphs, on_oom="raise")

    def __call__(self, dec, z):
        why, wkey, can_capture = self.guard.failed, None, None
        if why is None:
            st = self.state(dec, z.device)
            why, wkey = st[0], st[1]
            can_capture = st[2] if len(st) > 2 else None
            why = "; ".join(why) or None
        eager = lambda: stage_low(dec, z, self.host)  # noqa: E731
        if why:
            return self.guard.eager(why, eager)
        self.host.every_op()  # the interrupt check the replayed ops no longer make
        return self.guard.run(lambda x: stage_low(dec, x, self.host), (z,), wkey, eager, can_capture)
