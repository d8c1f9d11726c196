"""The OpenAI request bodies this server accepts (pydantic), with vLLM's extra sampling fields
(`top_k`, `min_p`, `min_tokens`, `ignore_eos`, `stop_token_ids`, `include_stop_str_in_output`,
`repetition_penalty`, `cache_salt`, `prompt_logprobs`, `return_tokens_as_token_ids`, `return_token_ids`,
`truncate_prompt_tokens`, `bad_words`, and the
constraints `structured_outputs`, `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`),
its chat-template fields (`add_generation_prompt`, `continue_final_message`, `chat_template_kwargs`,
`documents`, `add_special_tokens`) and inflight's `priority`. Every other field of vLLM's request
models is accepted too, so that a vLLM client's request is never refused for its shape: those
`llm` reads pass through (`skip_special_tokens`, `allowed_token_ids`, ...), those that change
nothing here are accepted as vLLM accepts them, and those this server cannot honour (UNSERVED:
disaggregated serving, ...; and OpenAI's audio, moderation, ...) are refused, when
not null or their default, with a message saying so. Other unknown fields are refused by name (a
typo is not silently dropped, as vLLM would drop it). Value ranges the engine checks
(top_p, penalties, ...) are left to `llm`, whose messages name the field, so each rule lives in one
place; max_tokens is fitted to the context here (context.py), as vLLM's server fits it.
"""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from inflight.config import MAX_LOGPROBS
from inflight.serving.protocol import MAX_N

from .errors import APIError
from .logprobs import as_token_ids


def _not_a_boolean(value):
    """pydantic reads true as 1 where a number is expected; OpenAI's API and `llm` refuse it."""
    if isinstance(value, bool):
        raise PydanticCustomError("bool_not_number", "Input should be a number, not a boolean")
    return value


Int = Annotated[int, BeforeValidator(_not_a_boolean)]
Float = Annotated[float, BeforeValidator(_not_a_boolean)]
Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]     # OpenAI's reasoning effort


class Body(BaseModel):
    """A request body or part of one: unknown fields refused by name, and JSON null taken as the
    field's default, as OpenAI's types ("boolean or null") and vLLM's (`bool | None = False`) allow."""
    model_config = ConfigDict(extra="forbid")
    # fields accepted only at their default (or null), as clients that send every field send
    # them: name -> why any other value is refused
    UNSERVED: ClassVar[dict[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data):
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None or key not in cls.model_fields}
        return data

    @model_validator(mode="after")
    def _refuse_unserved(self):
        for name, why in self.UNSERVED.items():
            if getattr(self, name) != type(self).model_fields[name].default:
                raise APIError(400, f"'{name}' is not supported{why}", name)
        return self


class JSONSchemaFormat(Body):
    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None                   # accepted: the output always follows the schema


class ResponseFormat(Body):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JSONSchemaFormat | None = None
    format: Any = None                           # structural_tag: xgrammar's format (vLLM's)
    structures: list[dict] | None = None         # structural_tag: the older form, with triggers
    triggers: list[str] | None = None

    @model_validator(mode="after")
    def _check_schema(self):
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise APIError(400, "'response_format' of type 'json_schema' needs 'json_schema.schema' (an object)",
                           "response_format")
        if self.type == "structural_tag" and self.format is None and (self.structures is None or self.triggers is None):
            raise APIError(400, "'response_format' of type 'structural_tag' needs 'format', or 'structures' and "
                           "'triggers'", "response_format")
        return self

    def structural_tag(self) -> dict:
        """The structural tag as vLLM hands it to the engine: the response format itself."""
        return self.model_dump(include={"type", "format", "structures", "triggers"}, exclude_none=True)


class StreamOptions(Body):
    include_usage: bool = False                  # vLLM 0.32's default (as OpenAI's)
    continuous_usage_stats: bool = False         # vLLM's: every chunk also has its choice's usage (with include_usage)
    include_obfuscation: bool | None = None      # OpenAI's: accepted, unused (nothing here is obfuscated)


class SamplingFields(Body):
    """Fields shared by completions and chat completions."""
    UNSERVED = {"watermarking": "",
                "logprob_token_ids": " (ask for the top-N with 'logprobs')",
                "kv_transfer_params": " (no disaggregated serving)",
                "ec_transfer_params": " (no disaggregated serving)",
                "vllm_xargs": " (no custom extensions)",
                "repetition_detection": ""}
    model: str | None = None                     # none: the served base model (vLLM's default)
    temperature: Float | None = Field(None, ge=0)
    top_p: Float | None = None
    top_k: Int | None = None
    min_p: Float | None = None
    min_tokens: Int | None = None
    seed: Int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int] | None = None
    include_stop_str_in_output: bool | None = None
    ignore_eos: bool | None = None
    n: Int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: Float | None = None
    presence_penalty: Float | None = None
    repetition_penalty: Float | None = None
    logit_bias: dict[str, Float] | None = None
    prompt_logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)    # vLLM's: `llm`'s JSON in the response
    return_tokens_as_token_ids: bool = False     # vLLM's: logprobs name tokens "token_id:<id>"
    return_token_ids: bool = False               # vLLM's: prompt_token_ids and each choice's token_ids
    truncate_prompt_tokens: Int | None = None    # vLLM's: keep the prompt's last N tokens (-1: the context length)
    bad_words: list[str] | None = None           # vLLM's: words never generated
    allowed_token_ids: list[Int] | None = None   # vLLM's: the only tokens that may be generated
    skip_special_tokens: bool | None = None      # vLLM's: false keeps special tokens in the text
    spaces_between_special_tokens: bool | None = None     # vLLM's (slow tokenizers only, as in vLLM)
    truncation_side: Literal["left", "right"] | None = None    # vLLM's: which end truncate_prompt_tokens cuts
    stream_interval: Int | None = Field(None, ge=1)     # vLLM's: tokens per streamed chunk (llm's setting, if more)
    request_id: str | None = None                # vLLM's: the response id is <kind>-<request_id> (X-Request-Id wins)
    use_beam_search: bool = False                # vLLM's: n is the beam width (beam_search.py)
    length_penalty: Float = 1.0                  # vLLM's, read by beam search only
    user: str | None = None                      # accepted, unused
    # vLLM's fields that change nothing here: accepted, unused, as vLLM accepts them
    session_id: str | None = None                # a routing key across requests
    routed_experts_prompt_start: Int = Field(0, ge=0)    # for mixture-of-experts routing data, not returned here
    return_token_offsets: bool | None = None     # these three: read by vLLM's /render endpoints only
    mm_payload: str | None = None
    return_mm_kwargs: bool | None = None
    # vLLM's fields for what this server does not do (UNSERVED)
    watermarking: bool | None = None
    logprob_token_ids: list[Int] | None = None
    kv_transfer_params: dict | None = None
    ec_transfer_params: dict | None = None
    vllm_xargs: dict | None = None
    repetition_detection: dict | None = None
    # vLLM's: at most this many reasoning tokens, then </think> is forced (`llm`'s reasoning_parser); -1: no bound
    thinking_token_budget: Int = Field(-1, ge=-1)
    priority: Literal["high", "normal", "low"] | Int | None = None     # an integer as vLLM's: lower runs sooner
    cache_salt: str | None = Field(None, min_length=1)
    # constraints (structured.py turns them into `llm`'s "structured_outputs")
    response_format: ResponseFormat | None = None
    structured_outputs: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def shown(self, positions: list[dict]) -> list[dict]:
        """Log-probability positions as this request shows their tokens."""
        return as_token_ids(positions) if self.return_tokens_as_token_ids else positions

    def stream_usage(self) -> tuple[bool, bool]:
        """(a usage chunk at the end, usage in every chunk): vLLM 0.32's should_include_usage, where
        the second needs the first, so continuous_usage_stats alone gives no usage at all (its
        include_usage defaults to false; earlier vLLM defaulted it to true)."""
        options = self.stream_options or StreamOptions()
        return options.include_usage, options.include_usage and options.continuous_usage_stats

    @model_validator(mode="after")
    def _check_shared(self):
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "'stream_options' can only be used when 'stream' is true", "stream_options")
        if self.truncate_prompt_tokens is not None and not (self.truncate_prompt_tokens == -1
                                                             or self.truncate_prompt_tokens >= 1):
            raise APIError(400, f"'truncate_prompt_tokens' must be -1 (the context length) or a positive number of "
                           f"tokens, got {self.truncate_prompt_tokens}", "truncate_prompt_tokens")
        if self.prompt_logprobs is not None and self.stream:
            raise APIError(400, "'prompt_logprobs' is not available when 'stream' is true (as in vLLM)",
                           "prompt_logprobs")
        return self


class CompletionRequest(SamplingFields):
    UNSERVED = {**SamplingFields.UNSERVED, "prompt_embeds": " (prompts are text or token ids)"}
    prompt: str | list[str] | list[Int] | list[list[Int]]
    max_tokens: Int | None = None
    echo: bool = False
    add_special_tokens: bool = True              # vLLM's: false tokenizes a text prompt without a BOS
    prompt_embeds: Any = None
    logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: Int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _check_completion(self):
        if self.prompt == [] or any(p == [] for p in self.prompts()):     # "" is the BOS alone, as in vLLM
            raise APIError(400, "'prompt' must not be empty", "prompt")
        for prompt in self.prompts():
            # `llm` checks ids against its vocabulary, but its input_ids are INT32: Triton would wrap
            # an id outside them into another one first
            huge = [(i, t) for i, t in enumerate(prompt) if not 0 <= t < 2**31] if isinstance(prompt, list) else []
            if huge:
                raise APIError(400, f"'prompt': token id {huge[0][1]} at position {huge[0][0]} is outside the "
                               "vocabulary", "prompt")
        if self.suffix is not None:
            raise APIError(400, "'suffix' is not supported", "suffix")
        if self.best_of not in (None, 1):
            raise APIError(400, "'best_of' is not supported (only 1)", "best_of")
        if self.max_tokens == 0 and not self.echo:
            raise APIError(400, "'max_tokens' may be 0 only with 'echo' (the prompt alone, e.g. to score it "
                           "with 'logprobs')", "max_tokens")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompt forms the OpenAI spec allows, as a list of prompts."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and all(isinstance(t, int) for t in prompt):
            return [prompt]
        return list(prompt)


class PoolingFields(Body):
    """The fields vLLM's pooling requests (embeddings, score, rerank) share."""
    UNSERVED = {"padding": " (prompts are not padded)", "mm_processor_kwargs": " (text models only)"}
    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: Int | None = None    # vLLM's, as for completions
    truncation_side: Literal["left", "right"] | None = None     # none: the right, a pooling model's (context.py)
    use_activation: bool | None = None           # vLLM's: false returns the vector unnormalized
    priority: Literal["high", "normal", "low"] | Int | None = None
    cache_salt: str | None = Field(None, min_length=1)
    request_id: str | None = None
    padding: str | None = None
    mm_processor_kwargs: Any = None

    @field_validator("padding")
    @classmethod
    def _not_padding(cls, value):
        return None if value == "do_not_pad" else value        # vLLM's name for no padding

    @model_validator(mode="after")
    def _check_truncation(self):
        if self.truncate_prompt_tokens is not None and not (self.truncate_prompt_tokens == -1
                                                             or self.truncate_prompt_tokens >= 1):
            raise APIError(400, f"'truncate_prompt_tokens' must be -1 (the context length) or a positive number of "
                           f"tokens, got {self.truncate_prompt_tokens}", "truncate_prompt_tokens")
        return self


class ScoringFields(PoolingFields):
    """vLLM's fields for scoring text pairs: each side's texts cut to a number of tokens (0: not
    cut); `instruction` and `chat_template_kwargs` feed a cross-encoder's template, which an
    embedding model has none of (accepted, as vLLM accepts them for one)."""
    max_tokens_per_query: Int = Field(0, ge=0)
    max_tokens_per_doc: Int = Field(0, ge=0)
    instruction: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def template_variables(self) -> dict[str, Any]:
        """vLLM's: chat_template_kwargs, with `instruction` where they do not set it."""
        variables = dict(self.chat_template_kwargs or {})
        if self.instruction is not None:
            variables.setdefault("instruction", self.instruction)
        return variables


class ScoreRequest(ScoringFields):
    """POST /score: two sides of texts under any of vLLM's pairs of names, 1:1, 1:N or N:N."""
    SIDES: ClassVar[tuple[tuple[str, str], ...]] = (("queries", "documents"), ("queries", "items"),
                                                    ("data_1", "data_2"), ("text_1", "text_2"))
    queries: str | list[str] | None = None
    documents: str | list[str] | None = None
    items: str | list[str] | None = None
    data_1: str | list[str] | None = None
    data_2: str | list[str] | None = None
    text_1: str | list[str] | None = None
    text_2: str | list[str] | None = None

    def sides(self) -> tuple[tuple[str, list[str]], tuple[str, list[str]]]:
        """The two sides given, each as its field's name and its texts."""
        given = [(first, second) for first, second in self.SIDES
                 if getattr(self, first) is not None and getattr(self, second) is not None]
        names = {name for pair in self.SIDES for name in pair if getattr(self, name) is not None}
        if len(given) != 1 or names != set(given[0]):
            pairs = ", ".join(f"'{first}' and '{second}'" for first, second in self.SIDES)
            raise APIError(400, f"give one pair of sides to score: {pairs} (got {sorted(names) or 'none'})",
                           "queries")
        return tuple((name, _as_list(getattr(self, name))) for name in given[0])


class RerankRequest(ScoringFields):
    """POST /rerank (Jina's and Cohere's shape, as vLLM serves it): documents ordered by relevance."""
    query: str
    documents: str | list[str]
    top_n: Int = Field(0, ge=0)      # 0: every document

    def sides(self) -> tuple[tuple[str, list[str]], tuple[str, list[str]]]:
        """The query and the documents, as ScoreRequest.sides gives its two sides."""
        return ("query", [self.query]), ("documents", _as_list(self.documents))


def _as_list(texts: str | list[str]) -> list[str]:
    return [texts] if isinstance(texts, str) else list(texts)


class ChatMessage(BaseModel):
    """Any role (templates have their own, such as Llama 3.1's ipython); other keys (name,
    tool_call_id, tool_calls, ...) are handed to the template, which reads its own."""
    model_config = ConfigDict(extra="allow")
    NEEDS_CONTENT: ClassVar[tuple[str, ...]] = ("system", "developer", "user", "tool")     # OpenAI's rule
    role: str
    content: str | list[dict | str] | None = None

    @model_validator(mode="after")
    def _check_content(self):
        """A misspelt `content` would otherwise render an empty turn."""
        if self.content is None and self.role in self.NEEDS_CONTENT:
            keys = ", ".join(f"'{key}'" for key in ("role", *(self.model_extra or {})))
            raise APIError(400, f"'messages': a '{self.role}' message needs 'content' (this one has {keys})",
                           "messages")
        return self


class FunctionDefinition(Body):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict | None = None               # a JSON schema
    strict: bool | None = None                   # accepted: a forced call's arguments always follow `parameters`


class Tool(Body):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Body):
    name: str


class NamedToolChoice(Body):
    type: Literal["function"]
    function: FunctionName


class TemplateFields(Body):
    """vLLM's chat-template fields, for chat completions and /tokenize's messages form."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False         # the final (assistant) message left open, to be continued
    chat_template_kwargs: dict | None = None     # more variables for the template (e.g. enable_thinking)
    documents: list[dict] | None = None          # for templates that render them (RAG)
    chat_template: str | None = None             # vLLM's: this request's template (--trust-request-chat-template)
    # OpenAI's, for reasoning models: a template variable, and enable_thinking (unless
    # chat_template_kwargs sets it) = effort != "none", as vLLM hands them to the template
    reasoning_effort: Effort | None = None

    def template_variables(self) -> dict:
        variables = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            variables.setdefault("reasoning_effort", self.reasoning_effort)
            variables.setdefault("enable_thinking", self.reasoning_effort != "none")
        return variables

    @model_validator(mode="after")
    def _check_template_fields(self):
        if self.continue_final_message and self.add_generation_prompt:
            if "add_generation_prompt" in self.model_fields_set:
                raise APIError(400, "'continue_final_message' and 'add_generation_prompt' cannot both be true",
                               "continue_final_message")
            self.add_generation_prompt = False   # the default gives way to the explicit choice,
            self.model_fields_set.discard("add_generation_prompt")     # and still counts as not given
        return self


class PoolingInputs(PoolingFields, TemplateFields):
    """What vLLM's embedding and classification requests take: `input` (text or token ids, one or
    a list), or its chat form, `messages` (one conversation or a list of them; also taken as
    `input`) rendered with the chat template as /tokenize renders them, without a generation
    prompt by default."""
    input: str | list[str] | list[Int] | list[list[Int]] | None = None
    messages: list[ChatMessage] | list[list[ChatMessage]] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None       # vLLM's: true for `input`, false for `messages` (the template's)
    add_generation_prompt: bool = False

    @model_validator(mode="before")
    @classmethod
    def _conversations_given_as_input(cls, data):
        """vLLM's: an `input` of chat messages (or of lists of them) is `messages`."""
        if isinstance(data, dict) and "messages" not in data and _chat_form(data.get("input")):
            data = {**data, "messages": data["input"]}
            del data["input"]
        return data

    @model_validator(mode="after")
    def _check_input(self):
        if (self.input is None) == (self.messages is None):
            raise APIError(400, "give exactly one of 'input' and 'messages'", "input")
        if self.messages is not None:
            if any(not conversation for conversation in self.conversations()):
                raise APIError(400, "'messages' must not hold an empty conversation", "messages")
            return self
        given = sorted(TemplateFields.model_fields.keys() & self.model_fields_set)
        if given:
            raise APIError(400, f"'{given[0]}' goes with 'messages', not 'input'", given[0])
        inputs = self.inputs()
        if not inputs or any(p == [] for p in inputs):
            raise APIError(400, "'input' must not be empty", "input")
        return self

    def inputs(self) -> list[str | list[int]]:
        """The input forms the OpenAI spec allows, as a list of inputs."""
        given = self.input
        if isinstance(given, str) or (given and all(isinstance(t, int) for t in given)):
            return [given]
        return list(given)

    def conversations(self) -> list[list[ChatMessage]]:
        return self.messages if isinstance(self.messages[0], list) else [self.messages]

    def special_tokens(self) -> bool:
        return self.add_special_tokens if self.add_special_tokens is not None else self.messages is None


class EmbeddingRequest(PoolingInputs):
    """POST /v1/embeddings: OpenAI's fields, and vLLM's extras."""
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int | None = Field(None, ge=1)
    embed_dtype: Literal["float32"] = "float32"  # vLLM's base64 encodings of other dtypes are not served
    endianness: Literal["native", "little"] = "native"     # float32 bytes as little-endian (this host's too)


class ClassificationRequest(PoolingInputs):
    """POST /classify: vLLM's; `use_activation` false gives the raw logits."""


def _chat_form(value) -> bool:
    """A chat conversation (a list of {"role": ...} objects), or a list of them."""
    def conversation(item) -> bool:
        return isinstance(item, list) and bool(item) and all(isinstance(m, dict) and "role" in m for m in item)
    return isinstance(value, list) and bool(value) and (conversation(value) or all(map(conversation, value)))


class ChatCompletionRequest(SamplingFields, TemplateFields):
    UNSERVED = {**SamplingFields.UNSERVED, "audio": "", "prediction": "", "web_search_options": "", "moderation": "",
                "functions": " (give 'tools')", "function_call": " (give 'tool_choice')",
                "mm_processor_kwargs": " (text-only models)", "media_io_kwargs": " (text-only models)"}
    messages: list[ChatMessage] = Field(min_length=1)
    add_special_tokens: bool = False             # vLLM's: on top of what the template writes
    echo: bool = False                           # vLLM's: the reply starts with a final assistant message
    max_completion_tokens: Int | None = None
    max_tokens: Int | None = None                # deprecated by OpenAI, still sent by many clients
    logprobs: bool = False
    top_logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = Field(None, min_length=1)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None      # false: "required" gives exactly one call
    metadata: dict | None = None                 # accepted, unused
    store: bool | None = None                    # accepted, unused
    # OpenAI's fields about its own service: accepted, unused, as vLLM accepts them
    service_tier: str | None = None
    prompt_cache_key: str | None = None          # prefix caching here needs no key
    safety_identifier: str | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    modalities: list[Literal["text"]] | None = None
    prompt_cache_options: dict | None = None
    prompt_cache_retention: str | None = None
    # vLLM's
    return_prompt_text: bool = False             # the rendered prompt in the response (a stream: its role chunks)
    include_reasoning: bool = True               # false: no `reasoning` in the reply (--reasoning-parser)
    # OpenAI's and vLLM's fields for what a text model served here cannot do (UNSERVED)
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    moderation: Any = None
    functions: Any = None                        # the deprecated form of 'tools'
    function_call: Any = None                    # the deprecated form of 'tool_choice'
    mm_processor_kwargs: dict | None = None
    media_io_kwargs: dict | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_tool_choice_is_none(cls, data):
        # vLLM reads an explicit null as no tool parsing (text; the tools still reach the template),
        # where an absent tool_choice with tools is OpenAI's "auto"
        if isinstance(data, dict) and "tool_choice" in data and data["tool_choice"] is None:
            return {**data, "tool_choice": "none"}
        return data

    @model_validator(mode="after")
    def _check_chat(self):
        if self.top_logprobs and not self.logprobs:       # 0 alone asks for nothing, as vLLM reads it
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
        if self.tool_choice not in (None, "none") and not self.tools:
            raise APIError(400, "'tool_choice' needs 'tools'", "tool_choice")
        if self.tools and self.tool_choice is None:
            self.tool_choice = "auto"            # OpenAI's default when tools are given (chat_completions.py)
        if isinstance(self.tool_choice, NamedToolChoice):
            names = [tool.function.name for tool in self.tools]
            if self.tool_choice.function.name not in names:
                raise APIError(400, f"'tool_choice' names the function {self.tool_choice.function.name!r}, which "
                               f"is not in 'tools' ({', '.join(names)})", "tool_choice")
        return self


class TokenizeRequest(TemplateFields):
    """vLLM's two forms: `prompt` (special tokens added by default), or `messages` rendered with
    the chat template (no special tokens added by default: the template writes them)."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    tools: list[Tool] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _check_form(self):
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "give exactly one of 'prompt' and 'messages'", "prompt")
        chat_only = {"tools", "add_generation_prompt", "continue_final_message", "chat_template_kwargs", "documents",
                     "reasoning_effort", "chat_template"}
        given = sorted(chat_only & self.model_fields_set)
        if self.prompt is not None and given:
            raise APIError(400, f"'{given[0]}' goes with 'messages', not 'prompt'", given[0])
        return self


class DetokenizeRequest(Body):
    model: str | None = None
    tokens: list[Int]


# vLLM's runtime LoRA routes (lora_updates.py)

class LoadLoRAAdapterRequest(Body):
    UNSERVED = {"is_3d_lora_weight": " (3D, mixture-of-experts LoRA weights: inflight serves dense models)"}
    lora_name: str
    lora_path: str
    load_inplace: bool = False
    is_3d_lora_weight: bool = False


class UnloadLoRAAdapterRequest(Body):
    lora_name: str
    lora_int_id: Int | None = None          # vLLM's, unused there too: the name says which


# POST /v1/responses (responses.py): OpenAI's Responses request, with vLLM 0.32's extra fields

class InputText(Body):
    type: Literal["input_text"]
    text: str


class OutputText(Body):
    """An earlier reply's text, sent back (its annotations and logprobs unused)."""
    type: Literal["output_text"]
    text: str
    annotations: list | None = None
    logprobs: list | None = None


class Refusal(Body):
    type: Literal["refusal"]
    refusal: str


TextPart = Annotated[InputText | OutputText | Refusal, Field(discriminator="type")]


def _text_as_a_part(value):
    """Text content as the one input_text part it stands for: so that a list's wrong part is what
    an error names (not the string the content could also have been)."""
    return [{"type": "input_text", "text": value}] if isinstance(value, str) else value


TextParts = Annotated[list[TextPart], BeforeValidator(_text_as_a_part)]


class MessageItem(Body):
    type: Literal["message"]
    role: Literal["user", "assistant", "system", "developer"]
    content: TextParts                           # a string, or text parts
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None     # an assistant's unfinished: continued
    phase: Literal["commentary", "final_answer"] | None = None


class FunctionCallItem(Body):
    """An earlier reply's call: the template gets it as that assistant turn's tool_calls."""
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(Body):
    """A call's result: the template gets it as a tool message."""
    type: Literal["function_call_output"]
    call_id: str
    output: Annotated[list[InputText], BeforeValidator(_text_as_a_part)]     # a string, or input_text parts
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class ReasoningPart(Body):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(Body):
    """An earlier reply's reasoning: the template gets it as that assistant turn's reasoning."""
    type: Literal["reasoning"]
    summary: list[ReasoningPart] = []
    content: list[ReasoningPart] | None = None
    encrypted_content: str | None = None          # none is made here, so none can be read (responses.py)
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


InputItem = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem,
                      Field(discriminator="type")]


class FunctionTool(Body):
    """The Responses API's flat function tool."""
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict | None = None               # a JSON schema
    strict: bool | None = None


class FunctionChoice(Body):
    type: Literal["function"]
    name: str


class TextFormat(Body):
    type: Literal["text", "json_schema", "json_object"]
    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None                   # accepted: the output always follows the schema

    @model_validator(mode="after")
    def _check_schema(self):
        if self.type == "json_schema" and self.schema_ is None:
            raise APIError(400, "'text.format' of type 'json_schema' needs 'schema' (an object)", "text")
        return self


class TextConfig(Body):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None      # accepted, unused (as chat's)


class ReasoningConfig(Body):
    effort: Effort | None = None                 # a template variable, and enable_thinking (as chat's reasoning_effort)
    summary: Literal["auto", "concise", "detailed"] | None = None           # accepted: the reasoning comes whole,
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # as its content (vLLM's)


class ResponsesStreamOptions(Body):
    include_obfuscation: bool | None = None      # accepted, unused (nothing here is obfuscated)


class ResponsesRequest(Body):
    UNSERVED = {"background": " (responses are not stored here, as in vLLM by default: run it in the foreground)",
                "previous_response_id": " (responses are not stored here, as in vLLM by default: send the "
                                        "conversation in 'input')",
                "conversation": " (conversations are not stored here: send the conversation in 'input')",
                "prompt": " (prompt templates live on OpenAI's platform)", "context_management": "",
                "enable_response_messages": "", "previous_input_messages": " (vLLM's, for Harmony models)",
                "vllm_xargs": " (no custom extensions)", "kv_transfer_params": " (no disaggregated serving)",
                "ec_transfer_params": " (no disaggregated serving)", "watermarking": "",
                "mm_processor_kwargs": " (text-only models)", "media_io_kwargs": " (text-only models)"}
    model: str | None = None
    input: list[InputItem]                       # a string is one user message
    instructions: str | None = None              # a system message before the input
    max_output_tokens: Int | None = None
    temperature: Float | None = Field(None, ge=0)
    top_p: Float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    include: list[Literal["message.output_text.logprobs", "reasoning.encrypted_content", "file_search_call.results",
                          "web_search_call.results", "web_search_call.action.sources", "message.input_image.image_url",
                          "computer_call_output.output.image_url", "code_interpreter_call.outputs"]] | None = None
    top_logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)     # with include's message.output_text.logprobs
    truncation: Literal["auto", "disabled"] | None = None     # "auto": the prompt's start is cut to fit (vLLM's)
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    store: bool | None = None                    # accepted: nothing is stored (vLLM's default)
    metadata: dict[str, str] | None = None       # echoed in the response
    user: str | None = None
    # OpenAI's fields about its own service: accepted, unused (as chat's); max_tool_calls bounds built-in tools
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_options: dict | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    max_tool_calls: Int | None = None
    # vLLM's
    top_k: Int | None = None
    min_p: Float | None = None
    repetition_penalty: Float | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    seed: Int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int] | None = None
    ignore_eos: bool | None = None
    logit_bias: dict[str, Float] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    structured_outputs: dict | None = None
    chat_template_kwargs: dict | None = None
    include_reasoning: bool = True               # false: no reasoning item (--reasoning-parser)
    priority: Literal["high", "normal", "low"] | Int | None = None
    cache_salt: str | None = Field(None, min_length=1)
    request_id: str | None = None                # the response id is resp_<request_id> (X-Request-Id wins)
    session_id: str | None = None
    mm_payload: str | None = None                # read by vLLM's /render endpoints only
    return_mm_kwargs: bool | None = None
    # OpenAI's and vLLM's fields for what this server does not do (UNSERVED)
    background: bool = False
    previous_response_id: str | None = None
    conversation: Any = None
    prompt: Any = None
    context_management: Any = None
    enable_response_messages: bool = False
    previous_input_messages: list | None = None
    vllm_xargs: dict | None = None
    kv_transfer_params: dict | None = None
    ec_transfer_params: dict | None = None
    watermarking: bool | None = None
    mm_processor_kwargs: dict | None = None
    media_io_kwargs: dict | None = None

    @model_validator(mode="before")
    @classmethod
    def _input_as_items(cls, data):
        """A string input is a user message, and a message item may leave out its type (OpenAI's
        EasyInputMessage)."""
        if not isinstance(data, dict):
            return data
        given = data.get("input")
        if isinstance(given, str):
            return {**data, "input": [{"type": "message", "role": "user", "content": given}]}
        if isinstance(given, list):
            return {**data, "input": [{"type": "message", **item} if isinstance(item, dict) and "type" not in item
                                      and "role" in item else item for item in given]}
        return data

    @model_validator(mode="after")
    def _check_responses(self):
        if self.input == []:
            raise APIError(400, "'input' must not be empty", "input")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "'stream_options' can only be used when 'stream' is true", "stream_options")
        return self
