"""Which CUDA toolkit pieces (NVVM, libdevice, NVRTC) numba-cuda can find here, asked in a
subprocess with the simulator off (the test process itself runs the simulator)."""
import functools
import os
import subprocess
import sys

_PROBE = r'''
missing = []
try:
    from numba.cuda.cudadrv import nvvm
    nvvm.NVVM()
except Exception as e:
    missing.append(f"NVVM ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})")
try:
    from numba.cuda.cudadrv import libs
    libs.get_libdevice()
except Exception as e:
    missing.append(f"libdevice ({type(e).__name__})")
try:
    from cuda.bindings import nvrtc
    rc = nvrtc.nvrtcVersion()[0]
    if rc != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        missing.append(f"NVRTC ({rc})")
except Exception as e:
    missing.append(f"NVRTC ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})")
print("MISSING:" + "; ".join(missing))
'''


@functools.lru_cache(maxsize=None)
def missing_toolkit():
    """None when NVVM, libdevice and NVRTC are all usable, else a one-line reason."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    r = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, timeout=300)
    out = [ln for ln in r.stdout.splitlines() if ln.startswith("MISSING:")]
    if r.returncode or not out:
        return "toolkit probe failed: " + (r.stderr.strip().splitlines() or ["?"])[-1][:200]
    what = out[-1][len("MISSING:"):]
    return f"CUDA toolkit pieces not found: {what}" if what else None
