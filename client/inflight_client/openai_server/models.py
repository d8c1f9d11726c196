"""The model ids this server answers to: the checkpoint's (its directory name, or
--served-model-name) and one per LoRA adapter `llm` serves (--lora-modules, the names in its
multi_lora.json), as vLLM's OpenAI server lists them. A request naming an adapter runs the base
model with that adapter: sampling.py passes the name to `llm` as "lora_name"."""
from __future__ import annotations

import time

from .errors import APIError


class ServedModels:
    def __init__(self, name: str, max_model_len: int, lora_names: list[str] = ()):
        if name in lora_names:
            raise ValueError(f"the LoRA adapter name {name!r} is also the served model name")
        self.name = name
        self.lora_names = list(lora_names)
        self.max_model_len = max_model_len      # in each model card, as vLLM lists it
        self.created = int(time.time())

    def check(self, model: str | None) -> str | None:
        """The adapter `model` names (None: the base model, also when the request names none, as
        vLLM takes it); 404 unless this server serves it."""
        if model is None:
            return None
        if model in self.lora_names:
            return model
        if model != self.name:
            raise APIError(404, f"The model '{model}' does not exist; this server serves {self.ids()}",
                           "model", "model_not_found")
        return None

    def ids(self) -> list[str]:
        return [self.name, *self.lora_names]

    def listing(self) -> dict:
        return {"object": "list", "data": [self.card(model) for model in self.ids()]}

    def card(self, model: str) -> dict:
        """GET /v1/models/{model} (OpenAI's retrieve); 404 for a model this server does not serve."""
        adapter = self.check(model) is not None
        # as vLLM's cards: an adapter's names its parent and carries no max_model_len of its own
        return {"object": "model", "created": self.created, "owned_by": "inflight",
                "max_model_len": None if adapter else self.max_model_len, "id": model, "root": model,
                "parent": self.name if adapter else None}
