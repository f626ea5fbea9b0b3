"""A mixture of experts' routing on the GPU, as tirx-script kernels around its expert GEMMs (the
grouped GEMMs of ``cuda_wgmma``): one PrimFunc (``tirx_sequence``) of

  zero      the experts' row counters (the workspaces of a call start undefined)
  route     a warp per token: the router logits (lanes over hidden, shuffle sums), each expert's
            rank among the token's (lane e ranks expert e, and e + 32), the chosen k's renormalised
            gate, and the choice's slot in its expert's rows (an atomic add on the expert's counter;
            the order of rows within an expert changes no value)
  place     a block per choice: its row (its expert's first row, a sum of the padded counts before
            it, plus its slot), x's row copied there; the group table of the row tiles
  up, down  the expert kernels (the caller's), hidden rows in the dtype, the expert outputs float32
  combine   a block per token: its k expert rows weighted, summed in float32, rounded once

Each expert's rows are padded to whole row tiles; rows of a tile past its expert's count are never
read back (they hold whatever was there), and tiles past the last expert's rows do nothing.
Routing ranks logits as the pattern does: the k largest, a tie to the lower index.
"""

from __future__ import annotations

from tvm.script import tirx as T

from .cuda_wgmma import GROUP_ROWS
from .tirx_sequence import buffer, sequence, workspace

MAX_EXPERTS = 64  # route ranks an expert per lane, two per lane at most
_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}  # float32: the routing kernels alone (tests)


def routed_rows(tokens: int, experts: int, k: int, tile: int) -> int:
    """The routed rows' static bound when each expert's rows are padded to whole ``tile`` rows:
    tokens * k rows and at most tile - 1 of padding an expert, no expert past every token."""
    return min((tokens * k + experts * (tile - 1)) // tile, experts * -(-tokens // tile)) * tile


def zero_counts(experts):
    """``zero(counts)``: the experts' row counters, (experts,) int32, set to 0."""

    @T.macro
    def kernel(counts):
        T.device_entry()
        bx = T.cta_id([1])  # noqa: F841 (the launch's grid)
        tx = T.thread_id([32])
        for e in T.serial(-(-experts // 32)):
            if e * 32 + tx < experts:
                counts[e * 32 + tx] = 0

    @T.prim_func
    def zero(counts_h: T.handle):
        counts = T.match_buffer(counts_h, (experts,), "int32", align=16)
        kernel(counts)

    return zero


def route(NT, H, E, K, dtype):
    """``route(x, wg, sel, gate, slot, counts)``: for choice j of token t (index t K + j), sel its
    expert, gate its renormalised weight (float32) and slot its place among the expert's rows, taken
    from counts (which it advances); x (NT, H) and wg (H, E) in ``dtype``."""
    tokens_per_block = 4
    per_lane = -(-E // 32)
    NEG = T.float32(-3.0e38)

    @T.macro
    def kernel(x, wg, sel, gate, slot, counts):
        T.device_entry()
        bx = T.cta_id([-(-NT // tokens_per_block)])
        tx = T.thread_id([32 * tokens_per_block])
        logit = T.alloc_buffer((E,), "float32", scope="local")
        xv = T.alloc_buffer((1,), "float32", scope="local")
        mine = T.alloc_buffer((per_lane,), "float32", scope="local")
        rank = T.alloc_buffer((per_lane,), "int32", scope="local")
        ex = T.alloc_buffer((per_lane,), "float32", scope="local")
        top = T.alloc_buffer((2,), "float32", scope="local")  # the largest logit, the chosen exponentials' sum
        t = T.meta_var(bx * tokens_per_block + tx // 32)
        lane = T.meta_var(tx % 32)
        if t < NT:
            for e in T.unroll(E):
                logit[e] = T.float32(0)
            for c in T.serial(H // 32):
                xv[0] = T.Cast("float32", x[t, c * 32 + lane])
                for e in T.unroll(E):
                    logit[e] = logit[e] + xv[0] * T.Cast("float32", wg[c * 32 + lane, e])
            # every lane gets every sum (butterfly shuffles)
            for e in T.unroll(E):
                logit[e] = T.cuda.warp_sum(logit[e])
            top[0] = NEG
            for e in T.unroll(E):
                top[0] = T.max(top[0], logit[e])
            # lane l ranks experts l and l + 32: how many beat it (a tie goes to the lower index)
            top[1] = T.float32(0)
            for i in T.unroll(per_lane):
                mine[i] = NEG
                for e in T.unroll(E):
                    if e == i * 32 + lane:
                        mine[i] = logit[e]
                rank[i] = 0
                for e in T.unroll(E):
                    rank[i] = rank[i] + T.Select(T.Or(logit[e] > mine[i], T.And(logit[e] == mine[i], e < i * 32 + lane)), 1, 0)
                ex[i] = T.Select(T.And(i * 32 + lane < E, rank[i] < K), T.exp(mine[i] - top[0]), T.float32(0))
                top[1] = top[1] + ex[i]
            top[1] = T.cuda.warp_sum(top[1])
            for i in T.unroll(per_lane):
                if i * 32 + lane < E:
                    if rank[i] < K:
                        sel[t * K + rank[i]] = i * 32 + lane
                        gate[t * K + rank[i]] = ex[i] / top[1]
                        slot[t * K + rank[i]] = T.cuda.atomic_add(T.address_of(counts[i * 32 + lane]), 1)

    @T.prim_func
    def route(x_h: T.handle, wg_h: T.handle, sel_h: T.handle, gate_h: T.handle, slot_h: T.handle,
              counts_h: T.handle):
        x = T.match_buffer(x_h, (NT, H), dtype, align=16)
        wg = T.match_buffer(wg_h, (H, E), dtype, align=16)
        sel = T.match_buffer(sel_h, (NT * K,), "int32", align=16)
        gate = T.match_buffer(gate_h, (NT * K,), "float32", align=16)
        slot = T.match_buffer(slot_h, (NT * K,), "int32", align=16)
        counts = T.match_buffer(counts_h, (E,), "int32", align=16)
        kernel(x, wg, sel, gate, slot, counts)

    return route


def place(NT, H, E, K, rows, tile, dtype):
    """``place(x, sel, slot, counts, row, xg, groups)``: row of each choice in the expert-sorted
    rows (each expert's padded to whole ``tile`` rows), x's row copied there in xg (rows, H); groups
    (rows / GROUP_ROWS,) the expert of each GROUP_ROWS rows, -1 past the last expert's."""
    choices, tables = NT * K, rows // GROUP_ROWS
    chunks = H * _ITEMSIZE[dtype] // 16  # x's rows in 16-byte chunks
    threads = min(256, chunks)

    @T.macro
    def kernel(x, sel, slot, counts, row, xg, groups):
        T.device_entry()
        bx = T.cta_id([max(choices, tables)])
        tx = T.thread_id([threads])
        first = T.alloc_buffer((1,), "int32", scope="local")
        X16 = T.decl_buffer((NT * chunks,), "uint32x4", data=x.data)
        XG16 = T.decl_buffer((rows * chunks,), "uint32x4", data=xg.data)
        if bx < choices:
            # this choice's row: the padded counts of the experts before its own, then its slot
            first[0] = slot[bx]
            for e in T.serial(E):
                if e < sel[bx]:
                    first[0] = first[0] + (counts[e] + (tile - 1)) // tile * tile
            for c in T.serial(-(-chunks // threads)):
                if c * threads + tx < chunks:
                    XG16[first[0] * chunks + c * threads + tx] = X16[bx // K * chunks + c * threads + tx]
            if tx == 0:
                row[bx] = first[0]
        if bx < tables:
            if tx == 0:
                # the expert whose padded rows hold rows bx * GROUP_ROWS.., or -1 past the last
                groups[bx] = -1
                first[0] = 0
                for e in T.serial(E):
                    if first[0] <= bx * GROUP_ROWS:
                        if bx * GROUP_ROWS < first[0] + (counts[e] + (tile - 1)) // tile * tile:
                            groups[bx] = e
                    first[0] = first[0] + (counts[e] + (tile - 1)) // tile * tile

    @T.prim_func
    def place(x_h: T.handle, sel_h: T.handle, slot_h: T.handle, counts_h: T.handle, row_h: T.handle,
              xg_h: T.handle, groups_h: T.handle):
        x = T.match_buffer(x_h, (NT, H), dtype, align=16)
        sel = T.match_buffer(sel_h, (choices,), "int32", align=16)
        slot = T.match_buffer(slot_h, (choices,), "int32", align=16)
        counts = T.match_buffer(counts_h, (E,), "int32", align=16)
        row = T.match_buffer(row_h, (choices,), "int32", align=16)
        xg = T.match_buffer(xg_h, (rows, H), dtype, align=16)
        groups = T.match_buffer(groups_h, (tables,), "int32", align=16)
        kernel(x, sel, slot, counts, row, xg, groups)

    return place


def combine_rows(NT, H, K, rows, dtype):
    """``combine(out, row, gate, y)``: y[t] = sum over j of gate[t K + j] * out[row[t K + j]], in
    float32, rounded once to ``dtype``; out (rows, H) float32."""
    threads = min(256, H // 4)
    quads = H // 4
    quad_dtype = {2: "uint32x2", 4: "uint32x4"}[_ITEMSIZE[dtype]]  # 4 values of y

    @T.macro
    def kernel(out, row, gate, y):
        T.device_entry()
        bx = T.cta_id([NT])
        tx = T.thread_id([threads])
        acc = T.alloc_buffer((4,), "float32", scope="local")
        part = T.alloc_buffer((1,), "float32x4", scope="local")
        part_f = T.decl_buffer((4,), "float32", data=part.data, scope="local")
        res = T.alloc_buffer((1,), quad_dtype, scope="local")
        res_h = T.decl_buffer((4,), dtype, data=res.data, scope="local")
        OUT4 = T.decl_buffer((out.shape[0] * quads,), "float32x4", data=out.data)
        Y4 = T.decl_buffer((NT * quads,), quad_dtype, data=y.data)
        for q in T.serial(-(-quads // threads)):
            if q * threads + tx < quads:
                for v in T.unroll(4):
                    acc[v] = T.float32(0)
                for j in T.unroll(K):
                    part[0] = OUT4[row[bx * K + j] * quads + q * threads + tx]
                    for v in T.unroll(4):
                        acc[v] = acc[v] + gate[bx * K + j] * part_f[v]
                for v in T.unroll(4):
                    res_h[v] = T.Cast(dtype, acc[v])
                Y4[bx * quads + q * threads + tx] = res[0]

    @T.prim_func
    def combine(out_h: T.handle, row_h: T.handle, gate_h: T.handle, y_h: T.handle):
        out = T.match_buffer(out_h, (rows, H), "float32", align=16)
        row = T.match_buffer(row_h, (NT * K,), "int32", align=16)
        gate = T.match_buffer(gate_h, (NT * K,), "float32", align=16)
        y = T.match_buffer(y_h, (NT, H), dtype, align=16)
        kernel(out, row, gate, y)

    return combine


def routed_layer(tokens, hidden, inter, experts, k, dtype, rows, tile, up, down):
    """The PrimFunc ``moe_gate_topk(x, wg, w1, w2, y)``: x (tokens, hidden), wg (hidden, experts), w1
    (experts, hidden, inter), w2 (experts, inter, hidden), y (tokens, hidden) in ``dtype``. Runs
    zero, route and place, then the expert kernels ``up`` (xg, w1 as (experts * hidden, inter), the
    group table, hidden rows) and ``down`` (hidden rows, w2 as (experts * inter, hidden), the group
    table, float32 rows), then combine; the routed rows padded to whole ``tile`` rows per expert,
    ``rows`` in all (``routed_rows``)."""
    NT, H, I, E, K = tokens, hidden, inter, experts, k
    x, y = buffer("x", (NT, H), dtype), buffer("y", (NT, H), dtype)
    wg = buffer("wg", (H, E), dtype)
    w1, w2 = buffer("w1", (E, H, I), dtype), buffer("w2", (E, I, H), dtype)
    counts = workspace("counts", (E,), "int32")
    sel, slot, row = (workspace(name, (NT * K,), "int32") for name in ("sel", "slot", "row"))
    gate = workspace("gate", (NT * K,), "float32")
    groups = workspace("groups", (rows // GROUP_ROWS,), "int32")
    xg, hid = workspace("xg", (rows, H), dtype), workspace("hid", (rows, I), dtype)
    out = workspace("out", (rows, H), "float32")
    return sequence("moe_gate_topk", [x, wg, w1, w2, y], [
        (zero_counts(E), [counts]),
        (route(NT, H, E, K, dtype), [x, wg, sel, gate, slot, counts]),
        (place(NT, H, E, K, rows, tile, dtype), [x, sel, slot, counts, row, xg, groups]),
        (up, [xg, w1, groups, hid]),
        (down, [hid, w2, groups, out]),
        (combine_rows(NT, H, K, rows, dtype), [out, row, gate, y]),
    ], [counts, sel, slot, row, gate, groups, xg, hid, out])
