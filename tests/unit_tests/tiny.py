"""A tiny randomly initialised Llama (2 layers, 2 KV heads, head_dim 8) that runs the real engine without weights.

Shared by the unit tests (persistence, fuzzing) and by integration tests that need a second, different model.
"""

from __future__ import annotations

import random

import torch

from emllm import EMConfig, EMEngine

# A layout small enough for a 2-layer toy model yet with every part in play: sinks, window, events, retrieval.
TINY = dict(n_init=8, n_local=32, n_mem=32, chunk_size=16, max_block_size=8, min_block_size=2, surprise_window=64,
            page_tokens=8)
VOCAB = 96


def tiny_model(dtype=torch.float32, seed=0, hidden=32, intermediate=64, vocab=VOCAB):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.3, bos_token_id=0, eos_token_id=1, pad_token_id=1)
    return LlamaForCausalLM(config).to(dtype).eval()


def tiny_tokenizer(vocab=VOCAB):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t1", unk_token="t2")


def tiny_engine(preset="SM+C", dtype=torch.float32, seed=0, name="tiny", **overrides) -> EMEngine:
    model = tiny_model(dtype, seed, **{k: overrides.pop(k) for k in ("hidden", "intermediate") if k in overrides})
    return EMEngine(model, tiny_tokenizer(), EMConfig.from_preset(preset, **{**TINY, **overrides}), model_name=name)


def token_ids(n, seed=0, vocab=VOCAB):
    """Random ids with repeated phrases, so attention and surprise have structure; never the eos id 1."""
    rng = random.Random(seed)
    phrases = [[rng.randrange(2, vocab) for _ in range(rng.randrange(3, 9))] for _ in range(12)]
    out: list[int] = []
    while len(out) < n:
        out.extend(rng.choice(phrases) if rng.random() < 0.6 else [rng.randrange(2, vocab)])
    return out[:n]


class Recording:
    """A scorer that scores as ``inner`` does and keeps every score vector it returned (with the forward's plan), so
    tests see what ranked the events without patching the engine."""

    def __init__(self, inner):
        self.inner = inner
        self.calls: list[tuple[torch.Tensor, bool]] = []  # (scores, answering)
        self.layers: list[int] = []                       # the layer each call scored

    @property
    def uses_stored_keys(self) -> bool:
        from emllm.scoring import uses_stored_keys

        return uses_stored_keys(self.inner)

    def layer_scores(self, layer: int) -> list[torch.Tensor]:
        return [scores for (scores, _), index in zip(self.calls, self.layers) if index == layer]

    def score(self, step):
        scores = self.inner.score(step)
        self.calls.append((scores.clone(), step.plan.answering))
        self.layers.append(step.layer.layer_index)
        return scores


class Fixed:
    """A scorer returning given scores: the composition under test gets known inputs."""

    def __init__(self, scores: torch.Tensor):
        self.scores = scores

    def score(self, step):
        return self.scores
