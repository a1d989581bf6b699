"""gpu_server.py's ComfyUI servers: start one (serve: main.py on a free port, its flag set's
NAME=value tokens into its environment), queue a prompt and wait for its result (run_prompt), the
peak GPU memory while it runs (GpuMem), the tree's version."""
from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
import uuid


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url, timeout=30):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read().decode())


def _post(url, data):
    req = urllib.request.Request(url, data=json.dumps(data).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read().decode())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"HTTP {e.code}: {e.read().decode(errors='replace')[:800]}") from None


class GpuMem:
    """Peak of nvidia-smi's memory.used while running (MiB)."""

    def __init__(self, period=0.1):
        self.period, self.peak, self._stop = period, 0, threading.Event()
        self.t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=5).stdout
                self.peak = max(self.peak, int(out.split()[0]))
            except Exception:
                pass
            self._stop.wait(self.period)

    def __enter__(self):
        self.t.start()
        return self

    def __exit__(self, *a):
        self._stop.set()
        self.t.join()


def run_prompt(url, prompt, timeout):
    cid = uuid.uuid4().hex
    pid = _post(url + "/prompt", {"prompt": prompt, "client_id": cid})["prompt_id"]
    t0 = time.time()
    while True:
        h = _get(f"{url}/history/{pid}")
        if pid in h and h[pid].get("status", {}).get("completed") is not None:
            st = h[pid]["status"]
            if st.get("status_str") in ("success", "error") or st.get("completed"):
                break
        if time.time() - t0 > timeout:
            return {"ok": False, "error": "timeout"}
        time.sleep(0.2)
    msgs = {m[0]: m[1] for m in st.get("messages", [])}
    ok = st.get("status_str") == "success"
    out = {"ok": ok}
    if "execution_start" in msgs and ("execution_success" in msgs or "execution_error" in msgs):
        end = msgs.get("execution_success") or msgs.get("execution_error")
        out["s"] = round((end["timestamp"] - msgs["execution_start"]["timestamp"]) / 1000.0, 3)
    if not ok:
        err = msgs.get("execution_error", {})
        out["error"] = f"{err.get('exception_type')}: {err.get('exception_message')}"[:500]
    return out


def split_flags(flags, env):
    """A flag set's leading NAME=value tokens go into the server's environment (A/B runs of one
    setting, e.g. "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"); the rest are main.py arguments."""
    argv, env = shlex.split(flags), dict(env)
    while argv and re.match(r"^[A-Z_][A-Z0-9_]*=", argv[0]):
        k, v = argv.pop(0).split("=", 1)
        env[k] = v
    return argv, env


def serve(py, comfy, base, flags, env, start_timeout=600):
    port = _free_port()
    logp = os.path.join(base, f"comfyui_{port}.log")
    logf = open(logp, "w")
    fe = os.path.join(base, "frontend")
    os.makedirs(fe, exist_ok=True)
    with open(os.path.join(fe, "index.html"), "w") as f:
        f.write("<html><body>bench</body></html>")
    argv, env = split_flags(flags, env)
    cmd = [py, "main.py", "--listen", "127.0.0.1", "--port", str(port), "--base-directory", base,
           "--database-url", "sqlite:///:memory:", "--disable-auto-launch", "--front-end-root", fe, *argv]
    proc = subprocess.Popen(cmd, cwd=comfy, stdout=logf, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    t0 = time.time()
    while True:
        if proc.poll() is not None:
            raise RuntimeError("ComfyUI exited at start:\n" + open(logp).read()[-3000:])
        try:
            _get(url + "/system_stats", timeout=5)
            break
        except Exception:
            if time.time() - t0 > start_timeout:
                proc.kill()
                raise RuntimeError("ComfyUI did not start:\n" + open(logp).read()[-3000:])
            time.sleep(0.5)
    return proc, url, logp, logf


def comfy_version(comfy):
    ns = {}
    try:
        exec(open(os.path.join(comfy, "comfyui_version.py")).read(), ns)
    except Exception:
        pass
    return ns.get("__version__", "?")
