"""benchmarks/spec_decode.py: greedy speculative decoding gives exactly the plain greedy tokens,
whatever the draft proposes (a draft equal to the target, a close one, an unrelated one)."""

import importlib.util
import os

import numpy as np
import pytest

from autofuse.target import parse_target
from conftest import REPO

TARGET = parse_target("llvm")


def _demo():
    spec = importlib.util.spec_from_file_location("spec_decode", os.path.join(REPO, "benchmarks", "spec_decode.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def demo():
    module = _demo()
    return module, module.Attention(TARGET), module.Acceptor(3, TARGET)


@pytest.mark.parametrize("draft_kind", ["same", "close", "unrelated"])
def test_speculative_greedy_equals_plain_greedy(demo, draft_kind):
    sd, attention, accept = demo
    draft_w, target_w = sd.make_models(seed=5)
    if draft_kind == "same":
        draft_w = target_w
    elif draft_kind == "unrelated":
        draft_w, _ = sd.make_models(seed=6)
    prompt = [3, 141, 59, 26, 5]
    plain = sd.greedy(sd.Decoder(target_w, attention), prompt, 20)
    spec, drafted, accepted = sd.speculative(sd.Decoder(draft_w, attention), sd.Decoder(target_w, attention),
                                             accept, prompt, 20, 3)
    assert spec == plain
    assert drafted > 0
    if draft_kind == "same":
        assert accepted == drafted          # the target agrees with itself on every draft
    if draft_kind == "unrelated":
        assert accepted < drafted


def test_the_attention_library_serves_every_length(demo):
    sd, attention, _ = demo
    from search_spaces.attention.flash_attention import reference

    rng = np.random.default_rng(0)
    for n, total in [(1, 1), (1, 37), (4, 70), (9, 9)]:
        q = rng.standard_normal((sd.HEADS, n, sd.HEAD_DIM)).astype("float32")
        k, v = (rng.standard_normal((sd.KV_HEADS, total, sd.HEAD_DIM)).astype("float32") for _ in range(2))
        expected = reference(q[None], k[None], v[None], shape={"causal": 1})[0]
        np.testing.assert_allclose(attention(q, k, v), expected, rtol=1e-4, atol=1e-5)
