"""Which callable a FLUX block call's attention runs (a mixin of ``runner._Runner``).

attention "auto": the registry picks the attention op's backend once per input signature (the pack's
kernels are opt-in; SDPA in torch's order -- FLASH first -- or cuDNN first, whichever measures
faster: BENCHMARKS.md "Attention"; v0.33 itself orders FLASH first, v0.8.0 cuDNN first on Windows
only).  Where it picks SDPA and ComfyUI's attention is its plain SDPA path, the measured order runs;
where ComfyUI's attention is something else (sage / flash-attn / xformers / split ...), ComfyUI's is
called.  An ``optimized_attention_override`` from another node always goes through ComfyUI's
attention; a checkpoint's per-block attention (ComfyUI 0.36+) is honoured as stock honours it.
"""
from __future__ import annotations

import logging

from .host import attention_override, block_attention, default_sdpa_attention, flux_attention
from .plan import ATTENTION_OP

REFERENCE_NAME = "torch"  # the registry's reference backend
SDPA_BACKENDS = (REFERENCE_NAME, "cudnn")  # the attention op's torch SDPA backends (torch's order / cuDNN first)


class AttentionRoute:
    """Needs on the runner: ``attn_route``, ``attn_choice`` (signature -> backend), ``_sdpa_direct``
    (None until known), ``registry`` and ``note(key, level, msg, *a)``."""

    def sdpa_direct(self) -> bool:
        """attention "auto", the registry's pick is an SDPA backend: True when ComfyUI's attention is
        its plain SDPA path (``host.default_sdpa_attention``) -- the measured SDPA order then runs;
        False when ComfyUI's attention is something else (sage, flash-attn, xformers, split ...:
        chosen by the user or by ComfyUI for this platform), which is then called as ComfyUI's."""
        d = self._sdpa_direct
        if d is None:
            d = self._sdpa_direct = default_sdpa_attention()
            self.note(("sdpa direct",), logging.INFO, "attention auto: %s", "ComfyUI's attention is plain SDPA; "
                      "the SDPA backend order is picked by measurement per shape" if d else
                      "ComfyUI's attention is not plain SDPA (sage / flash-attn / xformers / split ...): it is called "
                      "as ComfyUI's where the registry picks SDPA")
        return d

    def _attention(self, topts, sig, blk=None):
        """The BlockContext.attention callable for one block call (None: the registry's op)."""
        route = self.attn_route
        choice = self.attn_choice.get(sig) if route == "auto" else None
        registry = self.registry

        def comfy_attention(q, k, v, mask):
            oa = flux_attention()  # exactly what stock FLUX calls, looked up per call
            registry.count(ATTENTION_OP, "comfy")
            return oa(q, k, v, q.shape[1], skip_reshape=True, mask=mask, transformer_options=topts)

        if attention_override(topts) is not None:
            self.note(("attention override",), logging.INFO, "another node set transformer_options['%s']: "
                      "attention runs through ComfyUI's optimized_attention, which applies it (logged once)",
                      "optimized_attention_override")
            return comfy_attention
        own = block_attention(blk)
        if own is not None:  # the checkpoint chose this block's attention (ComfyUI 0.36+): honoured
            self.note(("block attention",), logging.INFO, "the checkpoint sets per-block attention (%s): those "
                      "blocks' attention runs it, as stock does (logged once)", getattr(own, "__name__", type(own).__name__))

            def checkpoint_attention(q, k, v, mask):
                registry.count(ATTENTION_OP, "checkpoint")
                return own(q, k, v, q.shape[1], skip_reshape=True, mask=mask, transformer_options=topts)
            return checkpoint_attention
        if route == "comfy" or (choice in SDPA_BACKENDS and not self.sdpa_direct()):
            return comfy_attention
        if route == "registry" or choice is not None:
            return None  # BlockContext calls the registry's "attention" op under the policy

        def auto_attention(q, k, v, mask):
            """First call of an input signature: let the registry choose, remember the choice."""
            b = registry.choose(ATTENTION_OP, q, k, v, mask)
            self.attn_choice[sig] = b.name
            if b.name in SDPA_BACKENDS and not self.sdpa_direct():
                return comfy_attention(q, k, v, mask)
            registry.count(ATTENTION_OP, b.name)
            return b.fn(q, k, v, mask)
        return auto_attention
