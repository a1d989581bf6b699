"""gpu_fp8.py --ptx-only: every fp8 kernel variant (fp8_rows' and ln_modulate's fp8 PTX_CASES) compiled
for sm_90 without a GPU, with the instruction counts that matter (e4m3x2 converts, div.rn, shuffles,
vector loads, local memory) and ptxas -v's registers / spill bytes where ptxas is on PATH."""
import os
import sys


def ptx_report(note):
    """Compile every fp8 kernel variant for cc 9.0 (no GPU needed) and read ptxas -v; each kernel's
    counts go to ``note`` (gpu_fp8's record).  Returns how many failed to compile."""
    from flux_numba_pack.cuda_kernels import fp8_rows as FR, ln_modulate as LM
    import re
    import shutil
    import subprocess
    import tempfile
    import types as _t
    from numba import cuda
    import numba.cuda.dispatcher as _d
    _d.get_current_device = lambda: _t.SimpleNamespace(compute_capability=(9, 0))
    cases = dict(FR.PTX_CASES)
    cases.update({k: v for k, v in LM.PTX_CASES.items() if "fp8" in k})
    exe = shutil.which("ptxas")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "probes"))
    from ptx_hash_attention import ptx_toolchain_missing
    why = ptx_toolchain_missing()
    if why:  # one line, not the same error once per kernel
        print(f"gpu_fp8.py: error: {why}", file=sys.stderr)
        sys.exit(2)
    if exe is None:
        print("ptxas not on PATH: registers / spills not reported (the PTX is still compiled)", flush=True)
    failed = 0
    for name, mk in cases.items():
        try:
            disp, sig = mk()
            ptx, _ = cuda.compile_ptx(disp.py_func, sig, cc=(9, 0), fastmath=True,
                                      launch_bounds=disp.targetoptions.get("launch_bounds"))
            body = [ln for ln in ptx.splitlines() if not ln.strip().startswith("//")]
            cnt = {k: sum(1 for ln in body if re.search(p, ln)) for k, p in
                   [("cvt_e4m3x2", r"e4m3x2"), ("div.rn", r"div\.rn"), ("shfl", r"\bshfl\."), ("ld.v", r"\bld\.(global\.)?v[24]"),
                    ("local", r"\b(ld|st)\.local")]}
            if exe:
                with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
                    f.write(ptx)
                r = subprocess.run([exe, "-arch=sm_90", "-v", f.name, "-o", os.devnull], capture_output=True, text=True, timeout=120)
                os.unlink(f.name)
                m = re.findall(r"Used (\d+) registers", r.stderr)
                sp = re.findall(r"(\d+) bytes spill stores", r.stderr)
                cnt["regs"] = int(m[0]) if m else None
                cnt["spill_B"] = int(sp[0]) if sp else None
            note("ptx " + name, **cnt)
        except Exception as e:
            failed += 1
            note("ptx " + name, error=f"{type(e).__name__}: {str(e)[:300]}")
    return failed
