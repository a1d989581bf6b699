"""Test setup: load the pack as ``flux_numba_pack``; use the Numba CUDA simulator when there is no GPU.

FLUX_NUMBA_REAL_GPU=1 runs the kernel tests on a real GPU instead of the simulator.
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _has_gpu():
    if os.environ.get("FLUX_NUMBA_REAL_GPU") == "1":
        return True
    return False


if not _has_gpu():
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
    # the simulator's block manager busy-polls its threads: a short switch interval makes it 5-10x faster
    sys.setswitchinterval(5e-5)

if os.environ.get("FLUX_TEST_MATH_SDPA") == "1":
    # bench/sanitize.sh synccheck: cuDNN's SDPA kernels trip synccheck's mbarrier check (a false
    # positive that poisons the context), so the torch references use the math backend
    import torch
    torch.backends.cuda.enable_cudnn_sdp(False)
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)

sys.path.insert(0, ROOT)
import _pack  # noqa: E402

_pack.load()


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def comfy_server():
    """The ComfyUI server of the browser tests (tests/test_browser_*.py), one for all of them: started by
    the first browser test that runs, stopped when the session ends (tests/_browser_testing.py)."""
    import _browser_testing
    yield from _browser_testing.browser_server()


def pytest_addoption(parser):
    parser.addoption("--file-progress", action="store_true",
                     help="one line as each test file starts (elapsed time, tests done of all) and one as it ends "
                          "(its counts and time, its skips with the reason): tests/run.sh uses it")


def pytest_configure(config):
    if config.getoption("--file-progress", default=False):
        config.pluginmanager.register(_FileProgress(config), "flux_numba_file_progress")


class _FileProgress:
    """--file-progress: what is running and what did not run, as it happens (not only at the end)."""

    def __init__(self, config):
        import time
        self.config, self.time, self.t0 = config, time.monotonic, time.monotonic()
        self.total, self.done, self.cur, self.per_file = 0, 0, None, {}

    def _line(self, msg):
        tr = self.config.pluginmanager.get_plugin("terminalreporter")
        if tr is None:
            return
        if getattr(tr._tw, "width_of_current_line", 0):
            tr._tw.line()  # after the file's dots
        tr.write_line(msg)

    def _clock(self):
        s = int(self.time() - self.t0)
        return f"{s // 60:d}:{s % 60:02d}"

    def pytest_collection_finish(self, session):
        self.total = len(session.items)
        for it in session.items:
            f = it.nodeid.split("::")[0]
            self.per_file[f] = self.per_file.get(f, 0) + 1

    def pytest_runtest_logstart(self, nodeid, location):
        f = nodeid.split("::")[0]
        if f != self.cur:
            self._end()
            self.cur, self.f_t0, self.counts, self.skips = f, self.time(), {}, {}
            pct = 100 * self.done // max(1, self.total)
            self._line(f"[{self._clock()} {pct:3d}% of {self.total} tests] {f} ({self.per_file.get(f, 0)} tests) ...")

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or (report.when == "setup" and not report.passed):
            out = "error" if report.failed and report.when == "setup" else report.outcome
            self.counts[out] = self.counts.get(out, 0) + 1
            if report.skipped:
                why = " ".join(_skip_reason(report).split())
                self.skips[why] = self.skips.get(why, 0) + 1
        if report.when == "teardown":
            self.done += 1

    def _end(self):
        if self.cur is None:
            return
        counts = ", ".join(f"{n} {k}" for k, n in sorted(self.counts.items()))
        self._line(f"    {self.cur}: {counts or 'nothing ran'} in {self.time() - self.f_t0:.0f} s")
        for why, n in sorted(self.skips.items(), key=lambda kv: -kv[1]):
            self._line(f"      skipped {n}: {why if len(why) <= 140 else why[:137] + '...'}")
        self.cur = None

    def pytest_sessionfinish(self, session):
        self._end()


def pytest_sessionstart(session):
    """A COMFYUI_PATH / COMFYUI_PATHS that names something other than a ComfyUI tree stops the run
    here, with one line, before any test (a wrong explicit path is an error, not a reason to skip
    the ComfyUI tests -- or to spend minutes on the others first)."""
    import _comfy_trees
    errors = _comfy_trees.explicit_path_errors()
    if errors:
        pytest.exit("; ".join(errors) + " (unset it or give a ComfyUI source tree)", returncode=2)


# what a skip reason is about, for the summary (first match wins)
SKIP_KINDS = [
    ("ComfyUI: no tree, interpreter or version feature", ("comfyui", "comfy/", "per tree", "per-tree", "test_comfyui_matrix")),
    ("needs a GPU / CUDA toolkit", ("gpu", "cuda", "sm_8", "sm_9", "simulator", "wgmma", "_scaled_mm", "float8", "fp8",
                               "ptxas", "nvcc", "nvvm", "nvrtc", "sanitizer")),
    ("no network / package index", ("index", "network", "unreachable")),
]


def _skip_reason(rep):
    lr = rep.longrepr
    text = lr[2] if isinstance(lr, tuple) and len(lr) == 3 else str(lr)
    return text[len("Skipped: "):] if text.startswith("Skipped: ") else text


def skip_summary(reports, width=150, per_kind=6):
    """Lines: the skipped tests grouped by kind, then by reason, with counts."""
    by_kind = {}
    for rep in reports:
        reason = " ".join(_skip_reason(rep).split())
        low = reason.lower()
        kind = next((k for k, words in SKIP_KINDS if any(w in low for w in words)), "other")
        by_kind.setdefault(kind, {}).setdefault(reason, 0)
        by_kind[kind][reason] += 1
    if not by_kind:
        return []
    total = sum(sum(r.values()) for r in by_kind.values())
    lines = [f"not run: {total} skipped -- " + ", ".join(f"{sum(r.values())} {k}" for k, r in
                                                        sorted(by_kind.items(), key=lambda kv: -sum(kv[1].values())))]
    for kind, reasons in sorted(by_kind.items(), key=lambda kv: -sum(kv[1].values())):
        lines.append(f"{sum(reasons.values()):5d}  {kind}:")
        ordered = sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0]))
        for reason, n in ordered[:per_kind]:
            lines.append(f"{n:9d}  {reason if len(reason) <= width else reason[:width - 3] + '...'}")
        if len(ordered) > per_kind:
            lines.append(f"{sum(n for _, n in ordered[per_kind:]):9d}  ({len(ordered) - per_kind} more reasons; -rs lists each test)")
    return lines


def pytest_terminal_summary(terminalreporter):
    """One line per ComfyUI tree that test_comfyui_matrix ran (its inner pytest summary and time, then
    its skips per file and reason);
    then what did not run and why: the skips, counted per kind and per reason."""
    m = sys.modules.get("test_comfyui_matrix")
    for label, tree, summary, secs, skips in getattr(m, "RESULTS", ()):
        terminalreporter.write_line(f"ComfyUI {label} ({tree}): {summary} [{secs:.0f} s]")
        for n, fname, why in skips:
            terminalreporter.write_line(f"{n:9d}  skipped there: {fname}: {why}")
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if getattr(r, "when", "") in ("setup", "call")]
    for ln in skip_summary(skipped):
        terminalreporter.write_line(ln)
