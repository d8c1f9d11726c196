"""The model ids this server answers to: the checkpoint's (its directory name, or
--served-model-name). Issue 14 adds LoRA adapters here as extra ids, each resolving to the
adapter name that sampling.py passes to `llm` as "lora_name"."""
from __future__ import annotations

import time

from .errors import APIError


class ServedModels:
    def __init__(self, name: str):
        self.name = name
        self.created = int(time.time())

    def check(self, model: str) -> None:
        """404 unless `model` is one of the ids this server serves."""
        if model != self.name:
            raise APIError(404, f"The model '{model}' does not exist; this server serves {self.ids()}",
                           "model", "model_not_found")

    def ids(self) -> list[str]:
        return [self.name]

    def listing(self) -> dict:
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": self.created,
                                            "owned_by": "inflight"} for model_id in self.ids()]}
