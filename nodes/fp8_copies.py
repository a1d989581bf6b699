"""The fast profiles' fp8 weight caches of one patch (``flux_core.fast.Fp8Weights`` per device) and
the memory rule for fast-cached's kept copies (~12 GB for FLUX.1-dev): kept while their GPU has room
as ComfyUI budgets it, freed -- with every CUDA graph captured over them -- when it has not."""
from __future__ import annotations

import logging

import torch

from .host import device_room

# another patch of a model runs: the model's kept fp8 copies stay while their GPU has at least this share
# of its memory free (a switch back then replays its graphs at once); below it they are freed
FP8_KEEP_FREE_SHARE = 0.25


class Fp8Copies:
    """Mixed into the runner: ``_fp8`` (device -> Fp8Weights or None), ``plan``, ``graphs``, ``whole``
    and ``note`` are the runner's."""

    def fp8_cache(self, device):
        """The fast profile's fp8 weight cache for ``device`` (None, logged once, where it cannot run)."""
        if device not in self._fp8:
            from ..flux_core import fast
            why = fast.support(device)
            self._fp8[device] = None if why else fast.Fp8Weights(keep=self.plan.keeps_fp8)
            self.note(("fp8", device), logging.WARNING if why else logging.INFO, "profile fast on %s: %s", device,
                      f"{why}; running the exact profile" if why else "block GEMMs in fp8 e4m3 (row-wise scales)")
        return self._fp8[device]

    def fp8_room(self) -> bool:
        """Every GPU this runner keeps fp8 copies on has ``FP8_KEEP_FREE_SHARE`` of its memory free as
        ComfyUI budgets it (``host.device_room``: the memory ``--reserve-vram`` keeps for other programs
        is not room) -- False off a CUDA device or when the driver cannot say: the copies are then freed."""
        for dev, c in self._fp8.items():
            if c is None or not c.nbytes():
                continue
            try:
                d = torch.device(dev)
                if d.type != "cuda":
                    return False
                free, total = device_room(d)  # (ComfyUI's view: less what --reserve-vram keeps free)
            except Exception:
                return False
            if free < FP8_KEEP_FREE_SHARE * total:
                return False
        return True

    def drop_fp8_copies(self, graphs_dropped: bool = False):
        """Free the kept fp8 weight copies, and with them every CUDA graph captured over them (a
        replay would read freed memory: an illegal address that takes the server down);
        ``graphs_dropped``: the caller has just dropped every graph itself."""
        freed = 0
        for c in self._fp8.values():
            if c is not None:
                freed += c.clear() or 0
        if freed and not graphs_dropped:
            if self.graphs is not None:
                self.graphs.drop("its fp8 weight copies were freed")
            if self.whole is not None:
                self.whole.drop()
