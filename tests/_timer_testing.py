"""Shared by the step-timer tests (test_timer.py, test_timing_report.py): the ComfyUI pieces the
timer node touches, faked, and a sampler loop that drives its wrappers.

The timer node only calls ``model.clone()`` and ``add_wrapper_with_key`` / ``remove_wrappers_with_key``
with ``comfy.patcher_extension.WrappersMP`` names, and ComfyUI calls the wrappers as
``wrapper(executor, *args)``.  Here a fake patcher and a fake executor stand in for them: fixture
``fake_comfy`` puts a fake ``comfy.patcher_extension`` in sys.modules, ``sent`` collects what the
timer sends to the page, ``test_op`` is a throw-away registry op with a 'numba' backend (the test
files import these fixtures by name); ``run_sampler`` calls the wrappers as ComfyUI's sampler does.
tests/test_browser_*.py run the real thing inside ComfyUI.
"""
import sys
import types

import pytest
import torch

from flux_numba_pack.cuda_kernels.registry import registry
from flux_numba_pack.nodes import timing

TEST_OP = "_timer_test_op"



class Exec:
    """Stands in for comfy.patcher_extension.WrapperExecutor (the next wrapper / the original)."""

    def __init__(self, fn, class_obj=None):
        self.fn, self.class_obj = fn, class_obj

    def __call__(self, *a, **k):
        return self.fn(*a, **k)


class FakePatcher:
    def __init__(self, model_options=None):
        self.model_options = model_options or {"transformer_options": {}}
        self.wrappers = {}
        self.load_device = "cpu"

    def clone(self):
        import copy
        n = FakePatcher(copy.deepcopy(self.model_options))
        n.wrappers = {k: {k1: list(v1) for k1, v1 in v.items()} for k, v in self.wrappers.items()}
        return n

    def add_wrapper_with_key(self, t, key, fn):
        self.wrappers.setdefault(t, {}).setdefault(key, []).append(fn)

    def remove_wrappers_with_key(self, t, key):
        self.wrappers.get(t, {}).pop(key, None)


@pytest.fixture
def fake_comfy(monkeypatch):
    pe = types.ModuleType("comfy.patcher_extension")

    class WrappersMP:
        OUTER_SAMPLE = "outer_sample"
        APPLY_MODEL = "apply_model"
    pe.WrappersMP = WrappersMP
    comfy = types.ModuleType("comfy")
    comfy.patcher_extension = pe
    monkeypatch.setitem(sys.modules, "comfy", comfy)
    monkeypatch.setitem(sys.modules, "comfy.patcher_extension", pe)
    return pe


@pytest.fixture
def sent():
    msgs = []
    prev = timing.set_sender(lambda ev, data: msgs.append((ev, data)))
    timing.clear_runs()
    yield msgs
    timing.set_sender(prev)
    timing.clear_runs()


@pytest.fixture
def test_op():
    """A throw-away registry op with a 'numba' backend, removed afterwards."""
    registry.register(TEST_OP, lambda x: x * 2)
    registry.register_backend(TEST_OP, "numba", lambda x: x + x, check=lambda x: None if x.shape[0] > 1 else "batch 1")
    yield TEST_OP
    registry.ops.pop(TEST_OP, None)
    for k in [k for k in registry.usage if k[0] == TEST_OP]:
        del registry.usage[k]


def run_sampler(model, n_steps, x=None, per_step=None):
    """Drive the wrappers the way ComfyUI does: OUTER_SAMPLE once, then APPLY_MODEL once per step."""
    x = torch.randn(2, 4, 8, 8) if x is None else x
    sigmas = torch.linspace(1.0, 0.0, n_steps + 1)
    outer = model.wrappers["outer_sample"]["flux_numba_step_timer"][0]
    apply_w = model.wrappers["apply_model"]["flux_numba_step_timer"][0]
    guider = types.SimpleNamespace(model_options=model.model_options,
                                   model_patcher=types.SimpleNamespace(load_device="cpu"))

    def diffusion(x_, t, c_concat, c_crossattn, control, transformer_options, **kw):
        if per_step:
            per_step(x_)
        w = torch.randn(x_.shape[-1], x_.shape[-1], device=x_.device)
        return x_ @ w

    def outer_fn(noise, latent, sampler, sigmas_, *a, **k):
        y = latent
        for i in range(n_steps):
            to = dict(model.model_options["transformer_options"], sample_sigmas=sigmas_, cond_or_uncond=[0])
            y = apply_w(Exec(diffusion), y, sigmas_[i:i + 1].expand(y.shape[0]), None, None, None, to)
        return y

    return outer(Exec(outer_fn, guider), torch.zeros_like(x), x, None, sigmas)


def _patched_model(active=True, reason=None, patch_id=None):
    return FakePatcher({"transformer_options": {"flux_numba": {"profile": "exact", "active": active, "reason": reason,
                                                              "id": patch_id}}})


def _op_step(op):
    def per_step(x):
        with registry.force("numba"):
            registry.call(op, x)
    return per_step
