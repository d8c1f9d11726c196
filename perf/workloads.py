"""Seeded synthetic workloads shared by the engine and serving benchmarks (no dataset download).

uniform      prompts U(32, 512), outputs U(16, 256) tokens
chat         ShareGPT-shaped lognormal lengths (prompt ln-mean 7.0, ln-sd 1.6; output ln-mean 5.8,
             ln-sd 1.0), clipped to the model's limits and scaled down by `scale` for CPU runs
long-mix     mostly short chats plus a few long prompts near max_model_len
shared-prefix one common system prompt + a short unique question per request
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(slots=True)
class WorkItem:
    prompt_token_ids: list[int]
    max_tokens: int


def _tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(3, vocab_size) for _ in range(n)]


def uniform(n: int, vocab_size: int, seed: int = 0, prompt=(32, 512), output=(16, 256)) -> list[WorkItem]:
    rng = random.Random(seed)
    return [WorkItem(_tokens(rng, rng.randint(*prompt), vocab_size), rng.randint(*output)) for _ in range(n)]


def chat(n: int, vocab_size: int, max_model_len: int, seed: int = 0, scale: float = 1.0) -> list[WorkItem]:
    rng = random.Random(seed)
    items = []
    for _ in range(n):
        prompt = max(4, int(math.exp(rng.gauss(7.0, 1.6)) * scale))
        output = max(4, int(math.exp(rng.gauss(5.8, 1.0)) * scale))
        prompt = min(prompt, max_model_len // 2)
        output = min(output, max_model_len - prompt)
        items.append(WorkItem(_tokens(rng, prompt, vocab_size), output))
    return items


def long_mix(n: int, vocab_size: int, max_model_len: int, seed: int = 0, long_every: int = 8,
             scale: float = 1.0) -> list[WorkItem]:
    """Short chats, and every `long_every`-th request a prompt near max_model_len."""
    rng = random.Random(seed + 1)
    items = chat(n, vocab_size, max_model_len, seed, scale)
    for i in range(0, n, long_every):
        output = items[i].max_tokens = min(items[i].max_tokens, 32)
        length = int(max_model_len * rng.uniform(0.8, 0.9)) - output
        items[i].prompt_token_ids = _tokens(rng, length, vocab_size)
    return items


def shared_prefix(n: int, vocab_size: int, prefix_len: int = 1024, question=(16, 64), output: int = 32,
                  seed: int = 0, shared: bool = True) -> list[WorkItem]:
    """A common system prompt + a short unique question; shared=False gives unique prefixes of the
    same length (the 0%-shared control)."""
    rng = random.Random(seed)
    common = _tokens(rng, prefix_len, vocab_size)
    return [WorkItem((common if shared else _tokens(rng, prefix_len, vocab_size))
                     + _tokens(rng, rng.randint(*question), vocab_size), output) for _ in range(n)]
