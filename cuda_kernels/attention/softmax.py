"""Online softmax over one S tile in the accumulator layout (all four kernels).

Base 2: S arrives in log2 units, or the scale rides in the exp2 argument (one FFMA per element);
running max / sum per row in fp32; S -> P in place.  Two pieces, so the int8 mma kernel with
per-token Q scales can pass a factor per row; ``_make_softmax`` composes them for the others.
  mask_ragged  S *= sl, + the additive mask (x LOG2E x a per-row factor i0 / i1, floored at
               -1e30), key columns >= L -> -3e38;
  update       running max (over the 4 lanes of a row), alpha = exp2((old - new) e), P =
               exp2(S e - max e) with a per-row exponent factor e0 / e1, running sums.
st = [max0, max1, sum0, sum1, alpha0, alpha1] (this thread's rows g and g + 8).
"""
from .launch import cuda, float32, _mma, _math
from .launch import _LOG2E


def make_parts(BN, HAS_MASK):
    """(mask_ragged, update) for BN-key tiles."""
    NT = BN // 8
    NS = NT * 4
    LOG2E = float32(_LOG2E)
    MASK_FLOOR = float32(-1e30)
    NEG = float32(-3e38)
    quad_max = _mma.quad_max

    @cuda.jit(device=True, inline=True)
    def mask_ragged(s, mask, b, h, ms0, ms1, ms2, n0, row0, L, t, sl, i0, i1):
        if HAS_MASK:
            for i in range(NS):
                s[i] = s[i] * sl
            for nt in range(NT):
                for e in range(4):
                    col = n0 + nt * 8 + 2 * t + (e % 2)
                    row = row0 + 8 * (e // 2)
                    if row < L and col < L:
                        mv = mask[b * ms0 + h * ms1 + row * ms2 + col] * LOG2E
                        s[nt * 4 + e] += max(mv * (i0 if e < 2 else i1), MASK_FLOOR)
        if n0 + BN > L:
            for nt in range(NT):
                for e in range(4):
                    if n0 + nt * 8 + 2 * t + (e % 2) >= L:
                        s[nt * 4 + e] = NEG

    @cuda.jit(device=True, inline=True)
    def update(s, st, e0, e1, scrf):
        x0 = NEG
        x1 = NEG
        for nt in range(NT):
            x0 = max(x0, max(s[nt * 4 + 0], s[nt * 4 + 1]))
            x1 = max(x1, max(s[nt * 4 + 2], s[nt * 4 + 3]))
        x0 = max(quad_max(x0, scrf), st[0])
        x1 = max(quad_max(x1, scrf), st[1])
        st[4] = _math.exp2((st[0] - x0) * e0)
        st[5] = _math.exp2((st[1] - x1) * e1)
        st[0] = x0
        st[1] = x1
        y0 = x0 * e0
        y1 = x1 * e1
        ps0 = float32(0)
        ps1 = float32(0)
        for nt in range(NT):
            p = _math.exp2(s[nt * 4 + 0] * e0 - y0)
            s[nt * 4 + 0] = p
            ps0 += p
            p = _math.exp2(s[nt * 4 + 1] * e0 - y0)
            s[nt * 4 + 1] = p
            ps0 += p
            p = _math.exp2(s[nt * 4 + 2] * e1 - y1)
            s[nt * 4 + 2] = p
            ps1 += p
            p = _math.exp2(s[nt * 4 + 3] * e1 - y1)
            s[nt * 4 + 3] = p
            ps1 += p
        st[2] = st[2] * st[4] + ps0
        st[3] = st[3] * st[5] + ps1

    return mask_ragged, update


def _make_softmax(BN, HAS_MASK):
    """softmax(s, st, mask, b, h, ms0, ms1, ms2, n0, row0, L, t, sl, es, scrf): one exponent
    factor es for both rows, the mask unscaled (row0 = this thread's first row; columns
    n0 + 8 nt + 2 t + e % 2)."""
    mask_ragged, update = make_parts(BN, HAS_MASK)
    ONE = float32(1)

    @cuda.jit(device=True, inline=True)
    def softmax(s, st, mask, b, h, ms0, ms1, ms2, n0, row0, L, t, sl, es, scrf):
        mask_ragged(s, mask, b, h, ms0, ms1, ms2, n0, row0, L, t, sl, ONE, ONE)
        update(s, st, es, es, scrf)

    return softmax
