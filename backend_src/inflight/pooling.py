"""Pooling models: an engine with `runner` "pooling" (vLLM's setting; "auto" picks it for a
sentence-transformers checkpoint and for a *ForSequenceClassification, as vLLM's does) serves
embedding or classification requests instead of generation.

An embedding model's vector for a prompt is its final hidden state (after the last norm) at the
prompt's last token, L2-normalized: what vLLM gives a *ForCausalLM checkpoint run as an embedding
model (its `as_embedding_model`: LAST pooling, normalized), such as Qwen3-Embedding. A
sentence-transformers checkpoint's modules.json says whether it normalizes (its Normalize module)
and how it pools (only LAST, its "lasttoken", is served). A classifier's (task "classify") is its
score head's logits at that token, through the activation vLLM picks from its config: softmax
over two labels or more, a sigmoid for one (a cross-encoder's relevance score).

The request runs through the scheduler as a one-token generation: its prompt is prefilled as any
other (chunked, prefix-cached, preempted and recomputed), and the step that samples its token
hands back the pooled hidden state; the token itself goes to nobody. Importable without torch:
the request parsing of the tokenizing models and of the OpenAI server's image reads its params."""
from __future__ import annotations

import importlib
import json
import logging
import os
from dataclasses import dataclass

from .config import SamplingParams, is_int
from .context_length import CLASSIFIER

log = logging.getLogger("inflight")

ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0)     # what a pooling request runs as


TASKS = ("embed", "classify")       # vLLM's pooling tasks served: an embedding model's, a classifier's
KINDS = {"embed": ("an embedding model", "embedding"), "classify": ("a classifier", "classification")}


@dataclass(slots=True, frozen=True)
class PoolingParams:
    dimensions: int | None = None     # Matryoshka: the first n values, then normalized (models trained for it)
    use_activation: bool | None = None    # vLLM's: embed L2-normalizes, classify applies its activation
    # (None: as the model does)
    task: str = "embed"


@dataclass(slots=True, frozen=True)
class SentenceTransformers:
    """A sentence-transformers checkpoint's modules.json: its pooling and whether it normalizes."""
    pooling: str | None               # as vLLM names it ("LAST", "MEAN", "CLS", ...), None where not given
    normalize: bool

    @classmethod
    def read(cls, model_dir: str) -> SentenceTransformers | None:
        """None without a modules.json; as vLLM reads one: the Pooling module's config.json names its
        mode ("pooling_mode": "lasttoken", or a "pooling_mode_<name>": true key)."""
        path = os.path.join(model_dir, "modules.json")
        if not os.path.exists(path):
            return None
        with open(path) as f:
            modules = json.load(f)
        types = {module.get("type", "").rsplit(".", 1)[-1]: module for module in modules}
        pooling = None
        if "Pooling" in types:
            with open(os.path.join(model_dir, types["Pooling"].get("path", ""), "config.json")) as f:
                for key, value in json.load(f).items():
                    if key == "pooling_mode" and isinstance(value, str):
                        pooling = _pooling_name(value)
                    elif key.startswith("pooling_mode_") and value is True:
                        pooling = _pooling_name(key)
        return cls(pooling, "Normalize" in types)


def _pooling_name(mode: str) -> str:
    """vLLM's name for a sentence-transformers pooling mode ("pooling_mode_mean_tokens" -> "MEAN")."""
    name = mode.removeprefix("pooling_mode_").split("_", 1)[0]
    return "LAST" if "lasttoken" in name else name.upper()


def is_classifier(hf_config) -> bool:
    return any(name.endswith(CLASSIFIER) for name in getattr(hf_config, "architectures", None) or ())


def resolve_runner(runner: str, model_dir: str, hf_config) -> str:
    """vLLM's runner "auto": pooling for a classifier and for a sentence-transformers checkpoint
    (some are *ForCausalLM, as Qwen3-Embedding), generation otherwise. A classifier cannot generate
    (it has no LM head)."""
    if is_classifier(hf_config):
        if runner == "generate":
            raise ValueError(f"{model_dir} is a classifier ({hf_config.architectures[0]}): it has no LM head to "
                             'generate with; serve it with runner "pooling" (or "auto")')
        return "pooling"
    if runner != "auto":
        return runner
    if not os.path.exists(os.path.join(model_dir, "modules.json")):
        return "generate"
    log.info("inflight: runner 'auto' is 'pooling': %s is a sentence-transformers checkpoint (modules.json)",
             model_dir)
    return "pooling"


def activation(hf_config):
    """A classifier's activation as vLLM picks it from config.json (transformers' loss for its
    problem_type; else a cross-encoder's sentence-transformers activation_fn; else softmax over
    two labels or more, sigmoid for one): a function of a logits tensor."""
    import torch
    problem = getattr(hf_config, "problem_type", None)
    if problem == "regression":
        return lambda logits: logits
    if problem == "multi_label_classification":
        return torch.sigmoid
    named = (getattr(hf_config, "sentence_transformers", None) or {}).get("activation_fn") \
        or getattr(hf_config, "sbert_ce_default_activation_function", None)
    if named is not None and problem != "single_label_classification":
        if not named.startswith("torch.nn.modules."):
            raise ValueError(f"the classifier's activation function {named!r} is not a torch.nn.modules class "
                             "(vLLM refuses others too, for security)")
        module, _, name = named.rpartition(".")
        return getattr(importlib.import_module(module), name)()
    if hf_config.num_labels < 2:
        return torch.sigmoid
    return lambda logits: torch.softmax(logits, dim=-1)


class Pooler:
    """The checkpoint's pooling facts: its task, its hidden size, which dimensions it may be cut to
    (vLLM's rule: only a Matryoshka model's config allows `dimensions`, its matryoshka_dimensions if
    it lists them, else any from 1 to the hidden size), and whether it normalizes by default; a
    classifier's head (the model's compute_logits) and activation."""

    def __init__(self, hf_config, hidden_size: int, model_dir: str, head=None):
        """head: a classifier's (the model's compute_logits); None for an embedding model."""
        self.task = "classify" if head is not None else "embed"
        self.head, self.activation = head, activation(hf_config) if head is not None else None
        self.hidden_size = hidden_size
        listed = getattr(hf_config, "matryoshka_dimensions", None)
        self.matryoshka_dimensions = tuple(listed) if listed else None
        self.matryoshka = bool(listed) or bool(getattr(hf_config, "is_matryoshka", False))
        st = SentenceTransformers.read(model_dir)
        if st is not None and st.pooling not in (None, "LAST"):     # vLLM would pool MAX and others as LAST
            raise ValueError(f"{model_dir}: its sentence-transformers pooling is {st.pooling} (modules.json); "
                             "inflight serves LAST pooling (lasttoken) only")
        self.normalize = True if st is None else st.normalize

    def check(self, params: PoolingParams) -> None:
        if params.task != self.task:
            kind = KINDS[self.task][0]
            serves = "classification and cross-encoder scores" if self.task == "classify" else "embeddings"
            raise ValueError(f"this model is {kind}, whose pooling task is {self.task} ({serves}), not {params.task}")
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

    def pool(self, hidden, params: list[PoolingParams]) -> list[list[float]]:
        """hidden [rows, hidden_size] (a tensor): each row's last-token state -> its embedding, or
        a classifier's scores (float32)."""
        if self.head is not None:
            return [(self.activation(row) if p.use_activation is not False else row).tolist()
                    for row, p in zip(self.head(hidden), params)]
        import torch
        out = []
        for row, p in zip(hidden.float(), params):
            vector = row[:p.dimensions] if p.dimensions is not None else row
            if self.normalize if p.use_activation is None else p.use_activation:
                vector = torch.nn.functional.normalize(vector, dim=-1)
            out.append(vector.tolist())
        return out
