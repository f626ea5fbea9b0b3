"""spec_accept: the kernel (unscheduled and with the template's defaults) against the reference,
integers exact, on seeded inputs and on built cases: every draft accepted (q = p, the token then
drawn from the bonus position), none accepted (p = 0 at the first draft), a rejection in the middle,
the all-zero residual falling back to p, greedy matches, mismatches and argmax ties; the ONNX graph
on the same cases; the reference against a plain per-row loop; and the rule's point: the first
emitted token is distributed as the target's p whatever q is."""

import functools

import numpy as np
import pytest
import tvm

from autofuse.target import parse_target
from search_spaces.speculative import spec_accept as sa

TARGET = parse_target("llvm")
DEV = tvm.cpu()
SCHEDULES = pytest.mark.parametrize("scheduled", [False, True], ids=["unscheduled", "row_parallel"])


def _shape(batch=2, k=3, vocab=64, greedy=0):
    return {"batch": batch, "k": k, "vocab": vocab, "greedy": greedy}


@functools.lru_cache(maxsize=None)
def _kernel(shape_items, scheduled):
    func = sa.build(dict(shape_items), "float32")
    mod = sa.row_parallel.apply(func, TARGET, tunable=False).mod if scheduled else tvm.IRModule({"main": func})
    return tvm.tirx.build(mod, target=TARGET)


def _run(shape, inputs, scheduled):
    outs = [tvm.runtime.tensor(np.full(shape["batch"], -1, "int32"), DEV) for _ in range(2)]
    _kernel(tuple(sorted(shape.items())), scheduled)(*(tvm.runtime.tensor(a, DEV) for a in inputs), *outs)
    return tuple(o.numpy() for o in outs)


def _onnx(shape, inputs):
    import onnxruntime as ort
    sess = ort.InferenceSession(sa.onnx_graph(shape, "float32").SerializeToString(),
                                providers=["CPUExecutionProvider"])
    return tuple(sess.run(None, dict(zip(["d", "logits", "q", "u"], inputs))))


def _check(shape, inputs, scheduled):
    """The kernel's outputs, after asserting they equal the reference's exactly."""
    got = _run(shape, inputs, scheduled)
    want = sa.reference(*inputs, shape=shape)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    return got


def _probs(logits):
    return sa.softmax64(logits).astype(np.float32)


def _cdf_draw(w, uk):
    """Inverse-CDF draw, written independently of the reference's inverse_cdf."""
    w = np.asarray(w, np.float64)
    return min(int(np.searchsorted(np.cumsum(w), uk * w.sum(), side="right")), len(w) - 1)


def _clear(d, logits, q, u, seed=0):
    """u with only the entries that sit on a tie redrawn; asserts the chosen accept uniforms stay."""
    cleared = sa.clear_uniforms(d, logits, q, u, np.random.default_rng(seed))
    np.testing.assert_array_equal(cleared[:, :-1], u[:, :-1])
    return cleared


def _base(shape, seed):
    d, logits, q, u = sa.make_inputs(shape, "float32", seed)
    return d, logits, q, u


@SCHEDULES
@pytest.mark.parametrize("vocab", [64, 100, 37], ids=["chunks16", "chunks20", "prime"])
def test_seeded_inputs_match_reference(vocab, scheduled):
    # 100: chunks of 20 (not a multiple of the 16 lanes); 37 (prime): chunks of one token.
    shape = _shape(batch=4, k=3, vocab=vocab)
    seen = set()
    for seed in range(6):
        accepted, _ = _check(shape, sa.make_inputs(shape, "float32", seed), scheduled)
        seen.update(accepted.tolist())
    assert len(seen) >= 3, f"make_inputs should spread n over 0..k, saw {sorted(seen)}"


@SCHEDULES
def test_all_accepted_draws_from_the_bonus_position(scheduled):
    shape = _shape()
    d, logits, q, u = _base(shape, 1)
    K = shape["k"]
    q = _probs(logits[:, :K])                              # q = p: every ratio is 1
    d = q.argmax(axis=-1).astype(np.int32)
    u[:, :K] = 0.5
    u = _clear(d, logits, q, u)
    accepted, nxt = _check(shape, [d, logits, q, u], scheduled)
    np.testing.assert_array_equal(accepted, [K, K])
    p = sa.softmax64(logits)
    assert nxt.tolist() == [_cdf_draw(p[b, K], u[b, K]) for b in range(2)]


@SCHEDULES
def test_none_accepted_when_p_is_zero_at_the_first_draft(scheduled):
    shape = _shape()
    d, logits, q, u = _base(shape, 2)
    for b in range(2):
        logits[b, 0, d[b, 0]] = -1e4                        # p_0[d_0] = 0 (exp underflows)
    u[:, 0] = 0.3
    u = _clear(d, logits, q, u)
    accepted, nxt = _check(shape, [d, logits, q, u], scheduled)
    np.testing.assert_array_equal(accepted, [0, 0])
    p = sa.softmax64(logits)
    for b in range(2):
        assert nxt[b] != d[b, 0]                           # the residual is 0 at the rejected draft
        assert nxt[b] == _cdf_draw(np.maximum(p[b, 0] - q[b, 0], 0), u[b, 3])


@SCHEDULES
def test_rejection_in_the_middle_draws_from_the_residual(scheduled):
    shape = _shape()
    d, logits, q, u = _base(shape, 3)
    p = _probs(logits)
    q = p[:, :3].copy()
    d[:, :2] = p[:, :2].argmax(axis=-1)
    d[:, 2] = p[:, 2].argmin(axis=-1)                      # a token the target finds unlikely ...
    for b in range(2):
        q[b, 2] *= 0.1 / (1.0 - q[b, 2, d[b, 2]])
        q[b, 2, d[b, 2]] = 0.9                             # ... that the draft was sure of
    u[:, :2] = 0.5
    u[:, 2] = 0.7
    u = _clear(d, logits, q, u)
    accepted, nxt = _check(shape, [d, logits, q, u], scheduled)
    np.testing.assert_array_equal(accepted, [2, 2])
    p64 = sa.softmax64(logits)
    for b in range(2):
        assert nxt[b] != d[b, 2]
        assert nxt[b] == _cdf_draw(np.maximum(p64[b, 2] - q[b, 2], 0), u[b, 3])


@SCHEDULES
def test_all_zero_residual_falls_back_to_p(scheduled):
    shape = _shape()
    d, logits, q, u = _base(shape, 4)
    q[:, 0] = 2.0 * _probs(logits[:, 0])                   # q >= p everywhere: residual all 0, ratio 0.5
    u[:, 0] = 0.9
    u = _clear(d, logits, q, u)
    accepted, nxt = _check(shape, [d, logits, q, u], scheduled)
    np.testing.assert_array_equal(accepted, [0, 0])
    p = sa.softmax64(logits)
    assert nxt.tolist() == [_cdf_draw(p[b, 0], u[b, 3]) for b in range(2)]


@SCHEDULES
def test_greedy_seeded_inputs_match_reference(scheduled):
    shape = _shape(batch=4, greedy=1)
    seen = set()
    for seed in range(6):
        accepted, _ = _check(shape, sa.make_inputs(shape, "float32", seed), scheduled)
        seen.update(accepted.tolist())
    assert len(seen) >= 3


@SCHEDULES
def test_greedy_match_mismatch_and_ties(scheduled):
    shape = _shape(batch=3, greedy=1)
    d, logits, q, u = _base(shape, 5)
    top = logits.argmax(axis=-1)
    d[0] = top[0, :3]                                       # row 0: every draft matches
    d[1] = top[1, :3]
    d[1, 1] = (top[1, 1] + 1) % 64                          # row 1: mismatch at 1
    logits[2, 0, [5, 9]] = logits[2, 0].max() + 1.0         # row 2: a tie at 0 goes to index 5
    d[2, 0] = 9
    q[:] = np.nan                                           # greedy reads neither q nor u
    u[:] = np.nan
    accepted, nxt = _check(shape, [d, logits, q, u], scheduled)
    np.testing.assert_array_equal(accepted, [3, 1, 0])
    np.testing.assert_array_equal(nxt, [top[0, 3], top[1, 1], 5])


def test_onnx_graph_on_the_built_cases():
    shape = _shape()
    d, logits, q, u = _base(shape, 4)
    q[:, 0] = 2.0 * _probs(logits[:, 0])
    u[:, 0] = 0.9
    cases = [sa.make_inputs(shape, "float32", 7), [d, logits, q, _clear(d, logits, q, u)]]
    greedy = _shape(batch=3, greedy=1)
    g = sa.make_inputs(greedy, "float32", 8)
    g[1][2, 0, [5, 9]] = g[1][2, 0].max() + 1.0
    g[0][2, 0] = 5
    for s, inputs in [(shape, cases[0]), (shape, cases[1]), (greedy, g)]:
        for got, want in zip(_onnx(s, inputs), sa.reference(*inputs, shape=s)):
            np.testing.assert_array_equal(got, want)


def _loop_reference(d, logits, q, u):
    """The rule written out per row and position, no vectorised numpy."""
    B, K = d.shape
    accepted, nxt = [], []
    for b in range(B):
        p = [sa.softmax64(logits[b, i]) for i in range(K + 1)]
        n = K
        for i in range(K):
            if not u[b, i] < min(1.0, p[i][d[b, i]] / float(q[b, i, d[b, i]])):
                n = i
                break
        w = p[n] if n == K else np.maximum(p[n] - q[b, n].astype(np.float64), 0)
        if w.sum() == 0:
            w = p[n]
        accepted.append(n)
        nxt.append(_cdf_draw(w, float(u[b, K])))
    return np.array(accepted), np.array(nxt)


def test_reference_matches_a_per_row_loop():
    shape = _shape(batch=6, k=4, vocab=50)
    for seed in range(5):
        inputs = sa.make_inputs(shape, "float32", seed)
        for got, want in zip(sa.reference(*inputs, shape=shape), _loop_reference(*inputs)):
            np.testing.assert_array_equal(got, want)


def test_first_emitted_token_is_distributed_as_p():
    """Speculative sampling's guarantee, checked on the kernel: with d ~ q and uniform u, the first
    token emitted (d_0 if accepted, else next_token) follows p_0, however far q is from p."""
    N, V = 20000, 8
    shape = _shape(batch=N, k=1, vocab=V)
    rng = np.random.default_rng(0)
    row = rng.standard_normal((2, V)) * 1.5
    logits = np.broadcast_to(row, (N, 2, V)).astype(np.float32).copy()
    q0 = sa.softmax64(rng.standard_normal(V) * 1.5)          # an unrelated draft distribution
    q = np.broadcast_to(q0.astype(np.float32), (N, 1, V)).copy()
    d = rng.choice(V, size=(N, 1), p=q0).astype(np.int32)
    u = rng.random((N, 2)).astype(np.float32)
    accepted, nxt = _run(shape, [d, logits, q, u], scheduled=True)
    first = np.where(accepted >= 1, d[:, 0], nxt)
    freq = np.bincount(first, minlength=V) / N
    np.testing.assert_allclose(freq, sa.softmax64(row[0]), atol=0.015)
    assert 0.2 < accepted.mean() < 0.9                      # both branches taken


def test_greedy_template_samples_replay_and_match():
    """test_patterns replays sampled knobs at the small shape, which is the sampling kernel; the
    greedy kernel has other blocks under the same template."""
    from tvm import s_tir
    from tvm.s_tir.schedule import Trace

    shape = _shape(batch=4, greedy=1)
    func = sa.build(shape, "float32")
    design = s_tir.Schedule(func, seed=1)
    sa.row_parallel.schedule(design, TARGET, tunable=True)
    space = Trace(design.trace.insts, {})
    inputs = sa.make_inputs(shape, "float32", 9)
    want = sa.reference(*inputs, shape=shape)
    for seed in range(2, 6):
        sch = s_tir.Schedule(func, seed=seed)
        space.apply_to_schedule(sch, remove_postproc=True)
        outs = [tvm.runtime.tensor(np.full(4, -1, "int32"), DEV) for _ in range(2)]
        tvm.tirx.build(sch.mod, target=TARGET)(*(tvm.runtime.tensor(a, DEV) for a in inputs), *outs)
        for got, w in zip(outs, want):
            np.testing.assert_array_equal(got.numpy(), w)
