"""Embeddings: an engine with `runner` "pooling" (vLLM's setting) serves embedding requests
instead of generation. A prompt's embedding is the model's final hidden state (after its last
norm) at the prompt's last token, L2-normalized: what vLLM gives a *ForCausalLM checkpoint run as
an embedding model (its `as_embedding_model`: LAST pooling, normalized), such as Qwen3-Embedding.

The request runs through the scheduler as a one-token generation: its prompt is prefilled as any
other (chunked, prefix-cached, preempted and recomputed), and the step that samples its token
hands back the pooled hidden state; the token itself goes to nobody. Importable without torch:
the request parsing of the tokenizing models and of the OpenAI server's image reads its params."""
from __future__ import annotations

from dataclasses import dataclass

from .config import SamplingParams, is_int

ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0)     # what a pooling request runs as


@dataclass(slots=True, frozen=True)
class PoolingParams:
    dimensions: int | None = None     # Matryoshka: the first n values, then normalized (models trained for it)
    normalize: bool = True            # vLLM's use_activation: the vector L2-normalized


class Pooler:
    """The checkpoint's pooling facts: its hidden size, and which dimensions it may be cut to
    (vLLM's rule: only a Matryoshka model's config allows `dimensions`, its matryoshka_dimensions
    if it lists them, else any from 1 to the hidden size)."""

    def __init__(self, hf_config, hidden_size: int):
        self.hidden_size = hidden_size
        listed = getattr(hf_config, "matryoshka_dimensions", None)
        self.matryoshka_dimensions = tuple(listed) if listed else None
        self.matryoshka = bool(listed) or bool(getattr(hf_config, "is_matryoshka", False))

    def check(self, params: PoolingParams) -> None:
        dims = params.dimensions
        if dims is None:
            return
        if not self.matryoshka:
            raise ValueError(f"'dimensions' ({dims}): this model does not support Matryoshka embeddings "
                             "(its config.json sets neither is_matryoshka nor matryoshka_dimensions)")
        if not is_int(dims) or not 1 <= dims <= self.hidden_size:
            raise ValueError(f"'dimensions' must be an integer in [1, {self.hidden_size}], got {dims!r}")
        if self.matryoshka_dimensions is not None and dims not in self.matryoshka_dimensions:
            raise ValueError(f"'dimensions' must be one of {list(self.matryoshka_dimensions)}, got {dims}")

    @staticmethod
    def pool(hidden, params: list[PoolingParams]) -> list[list[float]]:
        """hidden [rows, hidden_size] (a tensor): each row's last-token state -> its embedding (float32)."""
        import torch
        out = []
        for row, p in zip(hidden.float(), params):
            vector = row[:p.dimensions] if p.dimensions is not None else row
            if p.normalize:
                vector = torch.nn.functional.normalize(vector, dim=-1)
            out.append(vector.tolist())
        return out
