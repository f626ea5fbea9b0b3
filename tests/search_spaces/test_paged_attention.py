"""paged_attention: decode (q_len=1) and causal prefill (q_len>1) against the reference on sequences
of different lengths, the reference against plain per-query loops, independence from the physical
page order, and that nothing outside a query's visible keys reaches its output."""

import functools
import math

import numpy as np
import pytest
import tvm

from autofuse.target import parse_target
from search_spaces.attention import paged_attention as pa

TARGET = parse_target("llvm")
DEV = tvm.cpu()
JUNK = 1e3          # what unused pool slots hold: large enough to show if any of it leaks in


def _shape(q_len):
    return {"batch": 3, "q_len": q_len, "num_heads": 4, "num_kv_heads": 2, "head_dim": 8,
            "page_size": 4, "max_pages": 3, "num_pages": 12}


@functools.lru_cache(maxsize=None)
def _kernel(q_len, scheduled):
    func = pa.build(_shape(q_len), "float32")
    if scheduled:
        mod = pa.row_parallel.apply(func, TARGET, tunable=False).mod
    else:
        mod = tvm.IRModule({"main": func})
    return tvm.tirx.build(mod, target=TARGET)


def _run(q_len, scheduled, inputs):
    rt = _kernel(q_len, scheduled)
    out = tvm.runtime.tensor(np.zeros(inputs[0].shape, "float32"), DEV)
    rt(*[tvm.runtime.tensor(a, DEV) for a in inputs], out)
    return out.numpy()


def _logical(shape, seq_lens, seed):
    """q and each sequence's logical K/V, (batch, kv_heads, max context, head_dim)."""
    rng = np.random.default_rng(seed)
    b, h, kvh, d = shape["batch"], shape["num_heads"], shape["num_kv_heads"], shape["head_dim"]
    ctx = shape["max_pages"] * shape["page_size"]
    q = rng.standard_normal((b, shape["q_len"], h, d)).astype("float32")
    k = rng.standard_normal((b, kvh, ctx, d)).astype("float32")
    v = rng.standard_normal((b, kvh, ctx, d)).astype("float32")
    return q, k, v, np.asarray(seq_lens, "int32")


def _paginate(shape, q, k, v, seq_lens, perm_seed):
    """Scatter the logical cache into a pool through a seeded page permutation. Slots past each
    sequence's length, unused pages and the block-table padding all hold or point at JUNK."""
    ps, mp, npg = shape["page_size"], shape["max_pages"], shape["num_pages"]
    b, kvh, _, d = k.shape
    perm = np.random.default_rng(perm_seed).permutation(npg)
    k_pages = np.full((npg, kvh, ps, d), JUNK, "float32")
    v_pages = np.full((npg, kvh, ps, d), -JUNK, "float32")
    table = np.zeros((b, mp), "int32")
    used = 0
    for s in range(b):
        n = -(-int(seq_lens[s]) // ps)
        for i in range(mp):
            if i < n:
                page = perm[used]
                used += 1
                valid = min(ps, int(seq_lens[s]) - i * ps)
                k_pages[page, :, :valid] = k[s, :, i * ps:i * ps + valid]
                v_pages[page, :, :valid] = v[s, :, i * ps:i * ps + valid]
            else:
                page = perm[-1]          # a junk page (the tests leave the last one unused)
            table[s, i] = page
    assert used < npg, "keep one page of junk for the padding entries"
    return [q, k_pages, v_pages, table, seq_lens]


def _naive(q, k, v, seq_lens):
    """Per (sequence, query, head) loops over the logical cache."""
    b, ql, h, d = q.shape
    group = h // k.shape[1]
    out = np.zeros(q.shape, np.float64)
    for s in range(b):
        for t in range(ql):
            pos = int(seq_lens[s]) - ql + t
            for hh in range(h):
                keys = k[s, hh // group, :pos + 1].astype(np.float64)
                vals = v[s, hh // group, :pos + 1].astype(np.float64)
                sc = keys @ q[s, t, hh].astype(np.float64) / math.sqrt(d)
                p = np.exp(sc - sc.max())
                out[s, t, hh] = (p / p.sum()) @ vals
    return out.astype(q.dtype)


# (q_len, seq_lens): the shortest a sequence may be (= q_len), a partly filled last page, a full
# context; all different.
CASES = {"decode": (1, [1, 6, 12]), "prefill": (3, [3, 9, 12])}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_reference_is_per_query_causal_attention(case):
    q_len, lens = CASES[case]
    shape = _shape(q_len)
    q, k, v, seq_lens = _logical(shape, lens, 0)
    inputs = _paginate(shape, q, k, v, seq_lens, 1)
    np.testing.assert_allclose(pa.reference(*inputs), _naive(q, k, v, seq_lens), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scheduled", [False, True], ids=["unscheduled", "row_parallel"])
@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_kernel_matches_reference(case, scheduled):
    q_len, lens = CASES[case]
    shape = _shape(q_len)
    inputs = _paginate(shape, *_logical(shape, lens, 2), 3)
    np.testing.assert_allclose(_run(q_len, scheduled, inputs), pa.reference(*inputs), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_physical_page_order_does_not_matter(case):
    q_len, lens = CASES[case]
    shape = _shape(q_len)
    logical = _logical(shape, lens, 4)
    first = _paginate(shape, *logical, 5)
    second = _paginate(shape, *logical, 6)
    assert not np.array_equal(first[3], second[3])
    got = _run(q_len, True, first)
    np.testing.assert_array_equal(_run(q_len, True, second), got)
    np.testing.assert_allclose(got, _naive(*logical), rtol=1e-4, atol=1e-4)


def test_future_keys_do_not_reach_earlier_queries():
    q_len, lens = CASES["prefill"]
    shape = _shape(q_len)
    q, k, v, seq_lens = _logical(shape, lens, 7)
    before = _run(q_len, True, _paginate(shape, q, k, v, seq_lens, 8))
    # Change every sequence's last token: only each sequence's last query sees it.
    for s, n in enumerate(lens):
        k[s, :, n - 1] += 3.0
        v[s, :, n - 1] -= 5.0
    after = _run(q_len, True, _paginate(shape, q, k, v, seq_lens, 8))
    np.testing.assert_array_equal(after[:, :-1], before[:, :-1])
    assert np.all(np.abs(after[:, -1] - before[:, -1]).max(axis=(-1, -2)) > 1e-3)


def test_make_inputs_scatters_pages_and_varies_lengths():
    shape = pa.PATTERN.default_shape()
    q, k_pages, v_pages, table, seq_lens = pa.make_inputs(shape, "float32", 0)
    assert seq_lens.dtype == table.dtype == np.int32
    assert len(set(seq_lens.tolist())) > 1
    assert np.all(seq_lens >= shape["q_len"]) and np.all(seq_lens <= shape["max_pages"] * shape["page_size"])
    live = np.concatenate([table[b, :-(-int(n) // shape["page_size"])] for b, n in enumerate(seq_lens)])
    assert len(set(live.tolist())) == len(live), "no page belongs to two sequences"
    assert not np.all(np.diff(live) == 1), "pages are scattered, not consecutive"


def test_the_work_counted_is_the_seeded_sequences_and_the_whole_table_graph_is_labelled():
    shape = pa.PATTERN.default_shape()
    *_, seq_lens = pa.make_inputs(shape, "float16", 0)
    np.testing.assert_array_equal(pa.seeded_seq_lens(shape), seq_lens)
    q_len, heads, head_dim, page = shape["q_len"], shape["num_heads"], shape["head_dim"], shape["page_size"]
    visible = sum(int(n) - q_len + t + 1 for n in seq_lens for t in range(q_len))
    assert pa.flops(shape) == heads * visible * (4.0 * head_dim + 5.0)
    pages = sum(-(-int(n) // page) for n in seq_lens)
    assert pa.nbytes(shape, "float16") == (2 * (2 * shape["batch"] * q_len * heads * head_dim
                                                + 2 * pages * shape["num_kv_heads"] * page * head_dim)
                                           + 4 * shape["batch"] * (shape["max_pages"] + 1))
    assert "onnx_graph" in pa.PATTERN.more_work_at(shape)
    # every sequence as long as its table: the graph's work is the kernels'
    full = dict(shape, q_len=shape["max_pages"] * page)
    assert (pa.seeded_seq_lens(full) == full["q_len"]).all() and pa.PATTERN.more_work_at(full) == {}
