"""What the request handlers share: the Triton channel, the tokenizer and chat template, the
served model ids and the defaults the command line set."""
from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from inflight.reasoning import Reasoning
from inflight.serving.protocol import RequestError, bytes_per_token, check_text_size

from .chat_template import ChatTemplate
from .errors import APIError
from .models import ServedModels
from .triton import TritonLLM

if TYPE_CHECKING:
    from .classify import Classifier

OPENAI_DEFAULT_MAX_TOKENS = 16      # OpenAI's default for a completion, and vLLM's
LARGE_BODY_BYTES = 256 * 1024       # a request body over this has its prompt work done on the large pool


def added_bos(tokenizer) -> str | None:
    """The BOS text the tokenizer puts before every text it encodes; None if it puts none."""
    bos = tokenizer.bos_token
    return bos if bos and tokenizer("")["input_ids"][:1] == [tokenizer.bos_token_id] else None


@dataclass(slots=True)
class Context:
    triton: TritonLLM
    tokenizer: object
    chat: ChatTemplate
    models: ServedModels
    default_max_tokens: int | None               # --default-max-tokens; None: vLLM's defaults, below
    disable_any_whitespace: bool = False         # added to every output constraint (structured.py)
    tool_call_parser: str | None = None          # with --enable-auto-tool-choice: tool_choice "auto" (tool_parsers.py)
    # the checkpoint's generation_config.json sampling defaults (generation_config.py; {}: none or ignored)
    sampling_defaults: dict = field(default_factory=dict)
    reasoning: Reasoning | None = None           # --reasoning-parser's markers: chat replies split (reasoning.py)
    prompt_tokens_details: bool = False          # --enable-prompt-tokens-details: usage has the cached tokens
    classifier: Classifier | None = None         # classify.py: the model's labels; None: not a classifier
    large_pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(thread_name_prefix="large"))
    bytes_per_token: int = field(init=False)     # protocol.bytes_per_token of the tokenizer
    added_bos: str | None = field(init=False)    # added_bos() of the tokenizer

    def __post_init__(self) -> None:
        self.bytes_per_token = bytes_per_token(self.tokenizer)
        self.added_bos = added_bos(self.tokenizer)

    async def offload(self, large: bool, fn, *args):
        """fn(*args) on a thread (templates and tokenizing take seconds on a long prompt, which
        would stop every stream): the event loop's default pool, or for a request whose body is
        over LARGE_BODY_BYTES a pool of its own, so that a few huge prompts cannot take every
        thread the other requests need (six 2 MB prompts held a small completion up 6.2 s)."""
        pool = self.large_pool if large else None
        return await asyncio.get_running_loop().run_in_executor(pool, functools.partial(fn, *args))

    @property
    def completion_max_tokens(self) -> int:
        """max_tokens for a completion that gives none."""
        return OPENAI_DEFAULT_MAX_TOKENS if self.default_max_tokens is None else self.default_max_tokens

    @property
    def chat_max_tokens(self) -> int:
        """For a chat that gives none: --default-max-tokens, else the checkpoint's max_new_tokens
        (as vLLM's get_max_tokens), else the whole context; fit() cuts each to the room the prompt
        leaves (a reply runs to its end, as from vLLM's server and OpenAI's API)."""
        if self.default_max_tokens is not None:
            return self.default_max_tokens
        return self.sampling_defaults.get("max_tokens", self.models.max_model_len)

    def prompt_text(self, prompt: str | list[int]) -> str:
        """A prompt as text (for echo): a token prompt decoded with its special tokens, as vLLM
        echoes it (so a BOS is in the text as in the echoed log-probabilities' tokens)."""
        if isinstance(prompt, str):
            return prompt
        return self.tokenizer.decode(prompt, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def check_size(self, prompt: str | list[int], field: str) -> None:
        """Refuse a text prompt too long for the context before the tokenizer spends seconds on it
        (`llm`'s bound, for the prompts this server tokenizes itself)."""
        if isinstance(prompt, list):
            return
        try:
            check_text_size(prompt, self.models.max_model_len, self.bytes_per_token, field)
        except RequestError as exc:
            raise APIError(400, str(exc), field, "context_length_exceeded") from None

    def prompts_ids(self, prompts: list[str | list[int]], field: str, add_special_tokens: bool = True,
                    truncate: int | None = None, side: str | None = None,
                    default_side: str = "left") -> list[list[int]]:
        """Prompts as completions and embeddings take them (text or token ids) as token ids: cut
        where `truncate` (vLLM's truncate_prompt_tokens) asks (see truncate), else every one
        size-checked before any is tokenized; an empty one is refused, naming `field`."""
        if truncate is not None:
            ids = [self.truncate(p, truncate, side, add_special_tokens, default_side) for p in prompts]
        else:
            for prompt in prompts:
                self.check_size(prompt, field)
            ids = [self.tokenize(p, add_special_tokens) for p in prompts]
        if not all(ids):
            raise APIError(400, f"'{field}' is empty, and without a BOS ('add_special_tokens' false, or a tokenizer "
                           "that adds none) there is no token to start from", field)
        return ids

    def tokenize(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        """A prompt's token ids (a token prompt is already its ids)."""
        if isinstance(prompt, list):
            return prompt
        return self.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"]

    def text_input(self, text: str, add_special_tokens: bool) -> str:
        """A rendered chat prompt for a model that takes text only and tokenizes it with its
        special tokens (the vLLM backend): where the tokenizer adds a BOS and the template already
        wrote one, the template's is dropped, so the model does not read two."""
        bos = self.added_bos
        if add_special_tokens or bos is None or not text.startswith(bos):
            return text
        return text[len(bos):]

    def truncate(self, prompt: str | list[int], keep: int, side: str | None = None,
                 add_special_tokens: bool = True, default_side: str = "left") -> list[int]:
        """vLLM's truncate_prompt_tokens: the prompt cut to `keep` tokens (-1: the context length
        less one, the room for one output token). With no `side`, a text prompt is cut as vLLM has
        the tokenizer truncate it, on its default side (left for generation, right for pooling
        models): the special tokens it adds (a BOS) stay. An explicit `side` cuts the token ids
        themselves, as vLLM does then (from the left, a BOS goes)."""
        keep = self.truncation_length(keep)
        ids = self.tokenize(prompt, add_special_tokens)
        if len(ids) <= keep:
            return ids
        right = (side or default_side) == "right"
        if side is not None:
            return ids[:keep] if right else ids[-keep:]
        bare = ids if not add_special_tokens else self.tokenize(prompt, add_special_tokens=False)
        start = next((i for i in range(len(ids) - len(bare) + 1) if ids[i:i + len(bare)] == bare), None)
        room = keep - (len(ids) - len(bare))
        if start is None or room <= 0:
            return ids[:keep] if right else ids[-keep:]
        return ids[:start] + (bare[:room] if right else bare[-room:]) + ids[start + len(bare):]

    def truncation_length(self, keep: int) -> int:
        """truncate_prompt_tokens as a number of tokens (-1: the context length less one, the room
        for one output token); more than the context length is refused."""
        if keep == -1:
            return self.models.max_model_len - 1
        if keep > self.models.max_model_len:         # vLLM's 400 too: no prompt that long could run
            raise APIError(400, f"'truncate_prompt_tokens' {keep} cannot be greater than the context length "
                           f"(max_model_len) {self.models.max_model_len}", "truncate_prompt_tokens")
        return keep

    def fit(self, sampling: dict, prompt_ids: list[int], field: str) -> dict:
        """`sampling` with max_tokens cut to the room the context leaves after the prompt, as vLLM's
        server cuts it (a long prompt with the default or a large max_tokens still runs, and stops
        with finish_reason "length"). A prompt that leaves no room is refused in the words clients
        look for ("maximum context length", code context_length_exceeded)."""
        limit = self.models.max_model_len
        if len(prompt_ids) >= limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, your prompt "
                           f"contains {len(prompt_ids)} input tokens, which leaves no room for output. Please "
                           "reduce the length of the input prompt.", field, "context_length_exceeded")
        room = limit - len(prompt_ids)
        return sampling if sampling["max_tokens"] <= room else {**sampling, "max_tokens": room}
