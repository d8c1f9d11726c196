"""The model ids this server answers to: the checkpoint's (its directory name, or
--served-model-name) and one per LoRA adapter `llm` serves (--lora-modules, the names in its
multi_lora.json; and those loaded at runtime, lora_updates.py), as vLLM's OpenAI server lists them.
A request naming an adapter runs the base model with that adapter: `check` gives the keys that
name it to `llm` ("lora_name", and "lora_path" for one loaded at runtime, as vLLM's LoRARequest
carries its path), which sampling.py and embeddings.py pass on."""
from __future__ import annotations

import asyncio
import time

from .errors import APIError


class ServedModels:
    def __init__(self, name: str, max_model_len: int, lora_names: list[str] = ()):
        if name in lora_names:
            raise ValueError(f"the LoRA adapter name {name!r} is also the served model name")
        self.name = name
        self.lora_names = list(lora_names)
        self.loaded: dict[str, str] = {}        # adapters loaded at runtime: name -> directory on Triton's host
        self.changes = asyncio.Lock()           # one load or unload at a time: each checks, then changes, the lists
        self.max_model_len = max_model_len      # in each model card, as vLLM lists it
        self.created = int(time.time())

    def check(self, model: str | None) -> dict[str, str]:
        """`llm`'s keys for the adapter `model` names ({}: the base model, also when the request
        names none, as vLLM takes it); 404 unless this server serves it."""
        if model is None or model == self.name:
            return {}
        if model in self.lora_names:
            return {"lora_name": model}
        if model in self.loaded:
            return {"lora_name": model, "lora_path": self.loaded[model]}
        raise APIError(404, f"The model '{model}' does not exist; this server serves {self.ids()}",
                       "model", "model_not_found")

    def ids(self) -> list[str]:
        return [self.name, *self.lora_names, *self.loaded]

    def listing(self) -> dict:
        return {"object": "list", "data": [self.card(model) for model in self.ids()]}

    def card(self, model: str) -> dict:
        """GET /v1/models/{model} (OpenAI's retrieve); 404 for a model this server does not serve."""
        adapter = self.check(model)
        # as vLLM's cards: an adapter's names its parent and carries no max_model_len of its own; one
        # loaded at runtime has its directory as root
        return {"object": "model", "created": self.created, "owned_by": "inflight",
                "max_model_len": None if adapter else self.max_model_len, "id": model,
                "root": adapter.get("lora_path", model), "parent": self.name if adapter else None}
