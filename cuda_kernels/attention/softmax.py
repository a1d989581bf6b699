"""Online softmax of the wgmma kernels (m64nN accumulator layout)."""
from .launch import cuda, float32, _mma, _math
from .launch import _LOG2E


def _make_softmax(BN, HAS_MASK):
    """The wgmma kernels' online softmax over one BN-key S tile in the m64nN accumulator layout
    (row0 = this thread's first row; columns n0 + 8 nt + 2 t + e%2): mask (added after scaling by
    sl), ragged-tail columns -> -3e38, running max / sum in st, S -> P in place."""
    NT = BN // 8
    NS = NT * 4
    LOG2E = float32(_LOG2E)
    MASK_FLOOR = float32(-1e30)
    NEG = float32(-3e38)
    quad_max = _mma.quad_max

    @cuda.jit(device=True, inline=True)
    def softmax(s, st, mask, b, h, ms0, ms1, ms2, n0, row0, L, t, sl, es, scrf):
        """st = [mr0, mr1, lr0, lr1, al0, al1]: online-softmax state; S -> P in place."""
        if HAS_MASK:
            for i in range(NS):
                s[i] = s[i] * sl
            for nt in range(NT):
                for e in range(4):
                    col = n0 + nt * 8 + 2 * t + (e % 2)
                    row = row0 + 8 * (e // 2)
                    if row < L and col < L:
                        mv = mask[b * ms0 + h * ms1 + row * ms2 + col] * LOG2E
                        s[nt * 4 + e] += max(mv, MASK_FLOOR)
        if n0 + BN > L:
            for nt in range(NT):
                for e in range(4):
                    if n0 + nt * 8 + 2 * t + (e % 2) >= L:
                        s[nt * 4 + e] = NEG
        x0 = NEG
        x1 = NEG
        for nt in range(NT):
            x0 = max(x0, max(s[nt * 4 + 0], s[nt * 4 + 1]))
            x1 = max(x1, max(s[nt * 4 + 2], s[nt * 4 + 3]))
        x0 = max(quad_max(x0, scrf), st[0])
        x1 = max(quad_max(x1, scrf), st[1])
        st[4] = _math.exp2((st[0] - x0) * es)
        st[5] = _math.exp2((st[1] - x1) * es)
        st[0] = x0
        st[1] = x1
        y0 = x0 * es
        y1 = x1 * es
        ps0 = float32(0)
        ps1 = float32(0)
        for nt in range(NT):
            p = _math.exp2(s[nt * 4 + 0] * es - y0)
            s[nt * 4 + 0] = p
            ps0 += p
            p = _math.exp2(s[nt * 4 + 1] * es - y0)
            s[nt * 4 + 1] = p
            ps0 += p
            p = _math.exp2(s[nt * 4 + 2] * es - y1)
            s[nt * 4 + 2] = p
            ps1 += p
            p = _math.exp2(s[nt * 4 + 3] * es - y1)
            s[nt * 4 + 3] = p
            ps1 += p
        st[2] = st[2] * st[4] + ps0
        st[3] = st[3] * st[5] + ps1

    return softmax
