"""Speculative decoding end to end on a tiny draft/target pair: greedy generation with and without
speculation, which must produce the same tokens; tokens/s, acceptance rate and speed-up.

    python benchmarks/spec_decode.py [--tokens 64] [--draft-tokens 4] [--prompt 8]

The models (seeded random weights) are Llama-style decoders like models/decoder_block.onnx: pre-LN
blocks of causal GQA attention (4 query heads, 2 K/V heads of 64) and a SwiGLU FFN, with a shared
embedding and (untied) LM head over a 512-token vocabulary. The target has 4 blocks; the draft is the
target's first block alone (early-exit self-speculation), and the target's later blocks add small
residual updates (their output projections scaled by 0.1), which is what makes a cheap draft
agree with its target often, as a distilled draft does with a trained one.

What runs on which kernel:
- attention, in every decode step, every draft step and every verify pass: ONE flash_attention
  library built with symbolic seq_q and seq_kv (``autofuse.dynamic``), so a decode step (1 query
  over the cache), a verify pass (k+1 queries over the cache and themselves, the end-aligned
  causal mask being exactly the chain mask among drafts) and the prompt all share it, at every
  cache length, with no recompilation;
- acceptance: the spec_accept pattern kernel in greedy mode (accepted prefix length and the
  corrected/bonus token in one kernel), built once for k;
- the rest (projections, LayerNorm, SwiGLU, LM head) is numpy (float32 BLAS): the demo is about
  the decoding loop, and these GEMMs are the same work with and without speculation.
Both loops use the same kernels and the same numpy code; speculation changes only how many
tokens each target pass scores. Writes benchmarks/results/spec_decode-<target-key>.json.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from autofuse.dynamic import build_dynamic  # noqa: E402
from autofuse.registry import get_pattern  # noqa: E402
from autofuse.report import machine_info, write_json  # noqa: E402
from autofuse.target import device_for, parse_target, target_key  # noqa: E402

VOCAB, D, HEADS, KV_HEADS, HEAD_DIM, FFN = 512, 256, 4, 2, 64, 704
EPS = 1e-5


class Weights:
    """One decoder's parameters; ``blocks`` is a list of per-block dicts."""

    def __init__(self, embed, blocks, final_gamma, final_beta, head):
        self.embed, self.blocks, self.final_gamma, self.final_beta = embed, blocks, final_gamma, final_beta
        self.head = head


def make_models(seed: int, target_blocks: int = 4, later_scale: float = 0.1) -> tuple[Weights, Weights]:
    rng = np.random.default_rng(seed)

    def dense(rows, cols, scale=1.0):
        return (rng.uniform(-1, 1, (rows, cols)) * scale / math.sqrt(rows)).astype(np.float32)

    def block(out_scale):
        return {"ln1": (np.ones(D, np.float32), np.zeros(D, np.float32)),
                "wq": dense(D, HEADS * HEAD_DIM), "wk": dense(D, KV_HEADS * HEAD_DIM),
                "wv": dense(D, KV_HEADS * HEAD_DIM), "wo": dense(HEADS * HEAD_DIM, D, out_scale),
                "ln2": (np.ones(D, np.float32), np.zeros(D, np.float32)),
                "w1": dense(D, FFN), "w3": dense(D, FFN), "w2": dense(FFN, D, out_scale)}

    embed = rng.standard_normal((VOCAB, D)).astype(np.float32)
    blocks = [block(1.0)] + [block(later_scale) for _ in range(target_blocks - 1)]
    final = (np.ones(D, np.float32), np.zeros(D, np.float32))
    # Untied: with the embedding as the head, a random model mostly predicts its input token again.
    head = dense(D, VOCAB)
    target = Weights(embed, blocks, *final, head)
    draft = Weights(embed, blocks[:1], *final, head)
    return draft, target


def layer_norm(x, gamma_beta):
    gamma, beta = gamma_beta
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + EPS) * gamma + beta


def silu(x):
    return x / (1.0 + np.exp(-x))


class Attention:
    """The one symbolic-length flash_attention library, called at whatever lengths come."""

    def __init__(self, target, db=None):
        import tvm
        self.tvm = tvm
        self.dev = device_for(target)
        pattern = get_pattern("flash_attention")
        shape = {**pattern.default_shape(), "batch": 1, "heads": HEADS, "kv_heads": KV_HEADS,
                 "head_dim": HEAD_DIM, "causal": 1}
        self.rt, self.source = build_dynamic(pattern, shape, ["seq_q", "seq_kv"], "float32", target, db)
        self.func = self.rt[self.rt.entry_name] if hasattr(self.rt, "entry_name") else self.rt["flash_attention"]
        self.calls = 0

    def __call__(self, q, k, v):
        """q (heads, n, hd) over k, v (kv_heads, total, hd); causal, end-aligned."""
        tvm = self.tvm
        out = tvm.runtime.empty((1, *q.shape), "float32", self.dev)
        args = [tvm.runtime.tensor(np.ascontiguousarray(a[None]), self.dev) for a in (q, k, v)]
        self.func(*args, out)
        self.calls += 1
        return out.numpy()[0]


class Decoder:
    """A decoder with its KV cache: ``forward(tokens)`` scores new tokens after the cached ones."""

    def __init__(self, weights: Weights, attention: Attention):
        self.w = weights
        self.attention = attention
        self.cache = [(np.zeros((KV_HEADS, 0, HEAD_DIM), np.float32),) * 2 for _ in weights.blocks]

    @property
    def length(self) -> int:
        return self.cache[0][0].shape[1]

    def truncate(self, length: int) -> None:
        self.cache = [(k[:, :length], v[:, :length]) for k, v in self.cache]

    def forward(self, tokens) -> np.ndarray:
        """Logits (len(tokens), VOCAB) for ``tokens`` at positions length.., caching their K/V."""
        x = self.w.embed[np.asarray(tokens)]
        n = x.shape[0]
        for index, blk in enumerate(self.w.blocks):
            h = layer_norm(x, blk["ln1"])
            q = (h @ blk["wq"]).reshape(n, HEADS, HEAD_DIM).transpose(1, 0, 2)
            k = (h @ blk["wk"]).reshape(n, KV_HEADS, HEAD_DIM).transpose(1, 0, 2)
            v = (h @ blk["wv"]).reshape(n, KV_HEADS, HEAD_DIM).transpose(1, 0, 2)
            k_all = np.concatenate([self.cache[index][0], k], axis=1)
            v_all = np.concatenate([self.cache[index][1], v], axis=1)
            self.cache[index] = (k_all, v_all)
            o = self.attention(q, k_all, v_all).transpose(1, 0, 2).reshape(n, HEADS * HEAD_DIM)
            x = x + o @ blk["wo"]
            h = layer_norm(x, blk["ln2"])
            x = x + (silu(h @ blk["w1"]) * (h @ blk["w3"])) @ blk["w2"]
        return layer_norm(x, (self.w.final_gamma, self.w.final_beta)) @ self.w.head


def greedy(target: Decoder, prompt: list[int], count: int) -> list[int]:
    logits = target.forward(prompt)
    out = [int(np.argmax(logits[-1]))]
    while len(out) < count:
        out.append(int(np.argmax(target.forward([out[-1]])[-1])))
    return out


class Acceptor:
    """spec_accept (greedy) for one sequence and k drafts, built once."""

    def __init__(self, k: int, target):
        import tvm
        from autofuse.tune_patterns import Job
        from autofuse.verify import build_kernel, default_schedule
        pattern = get_pattern("spec_accept")
        self.shape = {**pattern.default_shape(), "batch": 1, "k": k, "vocab": VOCAB, "greedy": 1}
        job = Job(pattern, self.shape, "float32")
        self.pattern, self.tvm, self.dev = pattern, tvm, device_for(target)
        self.rt = build_kernel(default_schedule(job.func, target, pattern).mod, target)
        self.specs = pattern.output_specs(job.func)
        # q and u are unread in greedy mode; made once, since their inputs redraw near-ties.
        self.unused = [tvm.runtime.tensor(a, self.dev) for a in pattern.make_inputs(self.shape, "float32", 0)[2:]]

    def __call__(self, drafts, logits) -> tuple[int, int]:
        """(accepted prefix length, next token) from the drafts and the target's k+1 logits rows."""
        tvm = self.tvm
        inputs = [np.asarray(drafts, np.int32)[None], logits[None].astype(np.float32)]
        outs = [tvm.runtime.empty(shape, dtype, self.dev) for shape, dtype in self.specs]
        self.rt(*[tvm.runtime.tensor(a, self.dev) for a in inputs], *self.unused, *outs)
        return int(outs[0].numpy()[0]), int(outs[1].numpy()[0])


def speculative(draft: Decoder, target: Decoder, accept: Acceptor, prompt: list[int], count: int, k: int):
    """Greedy speculative decoding; returns (tokens, drafted, accepted)."""
    logits = target.forward(prompt)
    draft.forward(prompt)
    out = [int(np.argmax(logits[-1]))]
    drafted = accepted_total = 0
    while len(out) < count:
        base = target.length                       # cached positions: prompt + out[:-1]
        proposals = []
        last = out[-1]
        for _ in range(k):
            last = int(np.argmax(draft.forward([last])[-1]))
            proposals.append(last)
        scores = target.forward([out[-1], *proposals])    # k+1 rows: after out[-1], after each draft
        accepted, next_token = accept(proposals, scores)
        drafted += k
        accepted_total += accepted
        out.extend(proposals[:accepted] + [next_token])
        # Keep the K/V of out[-1] and the accepted drafts; the draft model re-reads from there.
        target.truncate(base + 1 + accepted)
        draft.truncate(base + 1 + accepted)
        if draft.length < target.length:           # all k accepted: the draft never saw its last one
            draft.forward(proposals[accepted - 1:accepted])
    return out[:count], drafted, accepted_total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64, help="tokens to generate")
    parser.add_argument("--draft-tokens", type=int, default=4, help="k, drafts per verify pass")
    parser.add_argument("--prompt", type=int, default=8, help="prompt length")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=3, help="timed generations of each kind (best kept)")
    args = parser.parse_args()
    from autofuse.target import use_host_cores
    use_host_cores()  # before any kernel runs: every core, as compare times

    target_spec = parse_target("llvm")
    draft_w, target_w = make_models(args.seed)
    attention = Attention(target_spec)
    accept = Acceptor(args.draft_tokens, target_spec)
    prompt = [int(t) for t in np.random.default_rng(args.seed + 1).integers(0, VOCAB, args.prompt)]
    print(f"attention kernel: {attention.source}; spec_accept k={args.draft_tokens}")

    plain_secs, spec_secs = [], []
    for _ in range(args.repeat):
        start = time.perf_counter()
        plain = greedy(Decoder(target_w, attention), prompt, args.tokens)
        plain_secs.append(time.perf_counter() - start)
        start = time.perf_counter()
        spec, drafted, accepted = speculative(Decoder(draft_w, attention), Decoder(target_w, attention), accept,
                                              prompt, args.tokens, args.draft_tokens)
        spec_secs.append(time.perf_counter() - start)
    same = plain == spec
    result = {
        "tokens": args.tokens, "draft_tokens": args.draft_tokens, "prompt": args.prompt, "identical": same,
        "plain_tokens_per_s": args.tokens / min(plain_secs), "spec_tokens_per_s": args.tokens / min(spec_secs),
        "speedup": min(plain_secs) / min(spec_secs), "acceptance_rate": accepted / drafted if drafted else None,
        "drafted": drafted, "accepted": accepted, "attention_source": attention.source,
        "first_tokens": plain[:16], "machine": machine_info(),
    }
    print(f"greedy outputs identical: {same}")
    print(f"plain {result['plain_tokens_per_s']:.1f} tokens/s, speculative {result['spec_tokens_per_s']:.1f} tokens/s "
          f"(x{result['speedup']:.2f}); acceptance {accepted}/{drafted} = {result['acceptance_rate']:.2f}")
    path = os.path.join(ROOT, "benchmarks", "results", f"spec_decode-{target_key(target_spec)}.json")
    write_json(path, result)
    print(f"wrote {path}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
