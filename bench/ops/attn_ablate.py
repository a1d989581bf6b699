"""Ablation trees of the 8-bit wgmma attention kernel: where its loop's time goes, without counters.

    python bench/ops/attn_ablate.py OUTDIR [NAME ...]    # writes OUTDIR/NAME/cuda_kernels for each
    python bench/ops/gpu_attn_ab.py new=cuda_kernels noexp=OUTDIR/noexp/cuda_kernels ...

Each tree is a copy of this repo's ``cuda_kernels`` with one textual change to
``attention/int8_wgmma.py`` (the full-tile path, ``folded``, and the loop), so timing it against the
unchanged kernel in one process (gpu_attn_ab.py) gives that piece's share of the kernel's time.
The results are WRONG on purpose (gpu_attn_ab prints their error); they are diagnostics only:
  noexp      P = S f - max (one FFMA) instead of exp2 of it: the MUFU.EX2 share
  nosoftmax  no softmax on full tiles (P keeps its first tile's values): the MMA + ring + pack floor
  nopv       no P V (an empty commit group keeps wgmma.wait_group's counting): the P V share
"""
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(os.path.dirname(HERE)), "cuda_kernels")  # the repo's

EXP = ("s[nt * 4 + e] = exp2(y_of(",)
CHANGES = {
    "noexp": [(e, e.replace("exp2(", "(", 1)) for e in EXP],
    "nosoftmax": [("                folded(si, s, st, q0 * ka, q0 * kb2, q1 * ka, q1 * kb2, scrf)",
                   "                pass")],
    "nopv": [("            issue_pv(acc, pr, dv, sm, scr)", "            _mma.wg_commit()")],
}


def make(outdir, name):
    dst = os.path.join(outdir, name, "cuda_kernels")
    if os.path.exists(dst):
        shutil.rmtree(dst)
    shutil.copytree(SRC, dst, ignore=shutil.ignore_patterns("__pycache__"))
    path = os.path.join(dst, "attention", "int8_wgmma.py")
    text = open(path).read()
    for old, new in CHANGES[name]:
        assert text.count(old) == 1, (name, old)
        text = text.replace(old, new)
    open(path, "w").write(text)
    return dst


if __name__ == "__main__":
    out = sys.argv[1]
    for n in sys.argv[2:] or CHANGES:
        print(f"{n}={make(out, n)}")
