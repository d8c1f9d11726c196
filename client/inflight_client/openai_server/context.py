"""What the request handlers share: the Triton channel, the tokenizer and chat template, the
served model ids and the defaults the command line set."""
from __future__ import annotations

from dataclasses import dataclass

from .chat_template import ChatTemplate
from .errors import APIError
from .models import ServedModels
from .triton import TritonLLM


@dataclass(slots=True)
class Context:
    triton: TritonLLM
    tokenizer: object
    chat: ChatTemplate
    models: ServedModels
    default_max_tokens: int
    disable_any_whitespace: bool = False         # added to every output constraint (structured.py)

    def prompt_text(self, prompt: str | list[int]) -> str:
        """A prompt as text (for echo): a token prompt decoded as `llm` decodes its outputs
        (inflight.detokenizer.decode; not imported, as the engine package would load torch)."""
        if isinstance(prompt, str):
            return prompt
        return self.tokenizer.decode(prompt, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def truncate(self, ids: list[int], keep: int) -> list[int]:
        """vLLM's truncate_prompt_tokens: the prompt's last `keep` tokens (-1: the context length)."""
        if keep == -1:
            if self.models.max_model_len is None:
                raise APIError(400, "'truncate_prompt_tokens' -1 needs the context length, which this server does "
                               "not know (start it with --max-model-len)", "truncate_prompt_tokens")
            keep = self.models.max_model_len
        return ids[-keep:]
