"""Engine and sampling configuration, validated with messages that name the offending field."""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field, fields

from .reasoning import MARKERS as REASONING_MARKERS
from .structured import GrammarSpec, parse_spec

POLICIES = ("continuous", "dynamic", "static")
RUNNERS = ("auto", "generate", "pooling")    # vLLM's: a model generates, or serves embeddings (pooling.py)
PRIORITIES = {"high": 0, "normal": 1, "low": 2}
DTYPES = ("auto", "float32", "float16", "bfloat16", "float64")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "cpu")
REASONING_PARSERS = tuple(REASONING_MARKERS)
MAX_LOGPROBS = 20       # most top log-probabilities per token (vLLM's default max_logprobs)
SAMPLING_EPS = 1e-5     # vLLM's: a temperature below it is greedy (dividing by less overflows float32)
MIN_TEMPERATURE = 0.01  # vLLM 0.32's: a temperature above 0 and below it is raised to it (nan or inf otherwise)


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"'{name}' {message}")


def is_int(value) -> bool:
    """An integer, not a boolean (JSON's true is not 1 here)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_sequence(value) -> bool:
    return isinstance(value, (list, tuple))


def _is_seed(value) -> bool:
    """torch's generators take 64 bits, signed (vLLM's API) or not (TensorRT-LLM's random_seed)."""
    return is_int(value) and -2**63 <= value < 2**64


def _is_number(value) -> bool:
    """A finite int or float; an int past float's range is not one."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def parse_priority(value: str | int) -> int:
    """'high' | 'normal' | 'low', or vLLM's integer (lower runs sooner; 0, its default, is normal,
    below 0 high, above 0 low; also as a string) -> the class 0 | 1 | 2; lower runs first."""
    if isinstance(value, str):
        if value.strip().lower() in PRIORITIES:
            return PRIORITIES[value.strip().lower()]
        try:
            value = int(value.strip())
        except ValueError:
            pass
    if is_int(value):
        return 1 + (value > 0) - (value < 0)
    raise ValueError(f"'priority' must be 'high', 'normal', 'low' or an integer (vLLM's: lower runs sooner, "
                     f"0 normal), got {value!r}")


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity mask, so a cpuset container's or a taskset's
    share, not the host's count (which is all there is where the OS has no affinity call: macOS)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


# what one request may list: a request is admitted (bad words) and every token of its output is
# checked (stop strings) on threads that every other request shares, and 100,000 bad words held
# Triton's request thread seconds, 20,000 stop strings cost milliseconds a token (a review's).
# Bad words are bounded where requests arrive (serving/protocol.py), each list as sent.
MAX_BAD_WORDS = 10_000
MAX_STOP_STRINGS = 1_000


@dataclass(slots=True)
class EngineConfig:
    block_size: int = 16
    num_kv_blocks: int | None = None          # explicit pool size; else derived from the memory budget
    kv_cache_gb: float | None = None          # memory budget for the KV pool (CPU default 1 GiB)
    gpu_memory_utilization: float = 0.9       # CUDA: share of device memory the engine may use in all
    engines_per_device: int = 1               # CUDA: engines sharing that share (Triton instances on one GPU)
    max_num_seqs: int = 64                    # seats in the running batch
    max_num_batched_tokens: int = 2048        # token budget of one step
    max_model_len: int | None = None          # prompt + output; default: the model's max positions
    policy: str = "continuous"
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    static_batch_size: int | None = None      # static policy: requests per batch (default max_num_seqs)
    batch_wait_timeout_s: float = 0.1         # static policy: start a short batch after this long
    dynamic_length_window: int = 128          # dynamic policy: prompt-length spread within a group
    max_queue_size: int | None = None         # waiting requests; beyond it add_request fails at once
    max_queue_wait_s: float | None = None     # a request waiting longer than this fails
    stream_interval: int = 1                  # a stream's responses each carry this many tokens (the first
                                              # and the last go at once): vLLM's --stream-interval
    device: str = "auto"
    dtype: str = "auto"
    attention_backend: str = "auto"
    enforce_eager: bool = False               # CUDA: no decode-step graphs (vLLM's --enforce-eager)
    cpu_threads: int | None = None
    seed: int = 0                             # for unseeded sampling
    enable_lora: bool = False                 # serve PEFT LoRA adapters next to the base model
    max_loras: int = 4                        # distinct adapters running at once (the device's adapter slots)
    max_lora_rank: int = 16                   # the largest adapter rank accepted
    # requests may load adapters by path (SamplingParams.lora_path; vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING),
    # max_cpu_loras of them kept at once (vLLM's; default max_loras), besides those named at start-up
    allow_runtime_lora_updating: bool = False
    max_cpu_loras: int | None = None
    reasoning_parser: str | None = None       # vLLM's: structured outputs wait for the end of reasoning (reasoning.py)
    runner: str = "auto"                      # vLLM's: "pooling" serves embeddings instead; "auto" as vLLM (pooling.py)
    hf_overrides: dict | None = None          # vLLM's: config.json values set over the file's (score_head.py)

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "dynamic_length_window", "stream_interval",
                     "engines_per_device"):
            value = getattr(self, name)
            _check(is_int(value) and value > 0, name, f"must be a positive integer, got {value!r}")
        for name in ("num_kv_blocks", "max_model_len", "static_batch_size", "max_queue_size", "cpu_threads"):
            value = getattr(self, name)
            _check(value is None or (is_int(value) and value > 0), name,
                   f"must be a positive integer or None, got {value!r}")
        # more threads than cores only contend (a million never got a step done)
        cpus = usable_cpus()
        _check(self.cpu_threads is None or self.cpu_threads <= cpus, "cpu_threads",
               f"must be at most the {cpus} CPUs this process may run on, got {self.cpu_threads}")
        for name in ("kv_cache_gb", "max_queue_wait_s"):
            value = getattr(self, name)
            _check(value is None or (_is_number(value) and value > 0), name,
                   f"must be a positive number or None, got {value!r}")
        _check(_is_number(self.batch_wait_timeout_s) and self.batch_wait_timeout_s >= 0,
               "batch_wait_timeout_s", f"must be >= 0, got {self.batch_wait_timeout_s!r}")
        _check(_is_number(self.gpu_memory_utilization) and 0 < self.gpu_memory_utilization <= 1,
               "gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization!r}")
        _check(self.policy in POLICIES, "policy", f"must be one of {POLICIES}, got {self.policy!r}")
        _check(self.runner in RUNNERS, "runner", f"must be one of {RUNNERS}, got {self.runner!r}")
        _check(self.dtype in DTYPES, "dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        _check(self.attention_backend in ATTENTION_BACKENDS, "attention_backend",
               f"must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        _check(isinstance(self.device, str) and re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device) is not None,
               "device", f"must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        _check(_is_seed(self.seed), "seed", f"must be an integer in [-2**63, 2**64), got {self.seed!r}")
        # "False" from a command line or a JSON string would otherwise count as true
        for name in ("enable_lora", "enforce_eager", "enable_prefix_caching", "enable_chunked_prefill",
                     "allow_runtime_lora_updating"):
            _check(isinstance(getattr(self, name), bool), name, f"must be a boolean, got {getattr(self, name)!r}")
        if self.reasoning_parser == "":       # vLLM's default, written out in a vLLM-backend model.json: none
            self.reasoning_parser = None
        _check(self.reasoning_parser in (None, *REASONING_PARSERS), "reasoning_parser",
               f"must be one of {REASONING_PARSERS} or None, got {self.reasoning_parser!r}")
        _check(self.hf_overrides is None or isinstance(self.hf_overrides, dict), "hf_overrides",
               f"must be an object of config.json keys and values, got {self.hf_overrides!r}")
        for name in ("max_loras", "max_lora_rank"):
            _check(is_int(getattr(self, name)) and getattr(self, name) > 0, name,
                   f"must be a positive integer, got {getattr(self, name)!r}")
        _check(self.max_cpu_loras is None or (is_int(self.max_cpu_loras) and self.max_cpu_loras > 0), "max_cpu_loras",
               f"must be a positive integer or None, got {self.max_cpu_loras!r}")

    @classmethod
    def from_dict(cls, values: dict) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown engine config keys {unknown}; known: {sorted(known)}")
        return cls(**values)


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0                  # 0 means greedy; above 0, at least MIN_TEMPERATURE
    top_k: int = -1                           # -1 or 0: off
    top_p: float = 1.0
    min_p: float = 0.0                        # drop tokens under min_p x the likeliest one's probability
    seed: int | None = None                   # per-request generator: same tokens in any batch; -1 none (vLLM's)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None               # None: off; N >= 0: the sampled token's log-prob + the top N (vLLM)
    prompt_logprobs: int | None = None        # the same for every prompt token after the first (vLLM)
    repetition_penalty: float = 1.0           # 1: off (penalties.py)
    frequency_penalty: float = 0.0            # 0: off
    presence_penalty: float = 0.0             # 0: off
    logit_bias: tuple[tuple[int, float], ...] = ()    # (token id, added to its logit): OpenAI's, given as a dict
    bad_words_ids: tuple[tuple[int, ...], ...] = ()   # token sequences that must not be generated
    allowed_token_ids: tuple[int, ...] | None = None  # None: any token; else only these are sampled (vLLM's)
    stop: tuple[str, ...] = field(default=())  # stop strings: applied by the detokenizing layer
    skip_special_tokens: bool = True           # false: special tokens are in the text (detokenizing layer too)
    spaces_between_special_tokens: bool = True  # for the tokenizers that honour it (detokenizer.decode)
    # vLLM's {"json": schema} | {"regex": ...} | {"choice": [...]} | {"grammar": ebnf} | {"json_object": True}
    structured_outputs: GrammarSpec | dict | str | None = None
    lora_name: str | None = None              # the adapter to run with (None: the base model)
    # where lora_name's adapter is (vLLM's LoRARequest.lora_path): loaded on first use, with
    # EngineConfig.allow_runtime_lora_updating; for one named at start-up, only its own directory
    lora_path: str | None = None
    # vLLM's: the most tokens the model may reason before its end marker is forced (reasoning.py); -1/None: no bound
    thinking_token_budget: int | None = None
    # vLLM's engine-level `reasoning_ended` (its server sets it where the chat's parser reads no reasoning, as
    # qwen3's with enable_thinking false): the reasoning counts as ended, a constraint applies from the first token
    reasoning_ended: bool = False

    def __post_init__(self) -> None:
        _check(is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        _check(is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens, "min_tokens",
               f"must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        _check(_is_number(self.temperature) and self.temperature >= 0, "temperature",
               f"must be a finite number >= 0, got {self.temperature!r}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE
        _check(is_int(self.top_k) and self.top_k >= -1, "top_k", f"must be an integer >= -1, got {self.top_k!r}")
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p!r}")
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p!r}")
        if isinstance(self.logit_bias, dict):
            self.logit_bias = tuple(self.logit_bias.items())
        _check(isinstance(self.logit_bias, tuple) and all(
            isinstance(e, tuple) and len(e) == 2 and is_int(e[0]) and e[0] >= 0 and _is_number(e[1])
            for e in self.logit_bias), "logit_bias", "must map token ids to numbers")
        # OpenAI's range; vLLM's SamplingParams clamps to it rather than refuse. A token given twice
        # ("5" and "05" in JSON) once, the last bias winning as in vLLM's dict (a repeated index
        # in one tensor write is undefined on CUDA)
        self.logit_bias = tuple({int(token): min(100.0, max(-100.0, float(bias)))
                                 for token, bias in self.logit_bias}.items())
        if self.seed == -1 and is_int(self.seed):
            self.seed = None
        _check(self.seed is None or _is_seed(self.seed), "seed",
               f"must be an integer in [-2**63, 2**64), got {self.seed!r}")
        # beyond this range float32 logits overflow or underflow into NaN
        _check(_is_number(self.repetition_penalty) and 1e-6 <= self.repetition_penalty <= 1e6, "repetition_penalty",
               f"must be a number in [1e-06, 1e+06] (1: off), got {self.repetition_penalty!r}")
        for name in ("frequency_penalty", "presence_penalty"):       # vLLM's and OpenAI's range
            value = getattr(self, name)
            _check(_is_number(value) and -2 <= value <= 2, name, f"must be a number in [-2, 2], got {value!r}")
        _check(_is_sequence(self.stop_token_ids) and all(is_int(t) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids", "must be a list of non-negative integers")
        self.stop_token_ids = tuple(self.stop_token_ids)
        # once each: the batch table is as wide as the longest list of the requests it holds
        self.stop_token_ids = tuple(dict.fromkeys(self.stop_token_ids))
        _check(_is_sequence(self.bad_words_ids) and all(
            _is_sequence(w) and w and all(is_int(t) and t >= 0 for t in w) for w in self.bad_words_ids),
            "bad_words_ids", "must be a list of non-empty lists of non-negative integers")
        self.bad_words_ids = tuple(tuple(w) for w in self.bad_words_ids)
        if self.allowed_token_ids is not None:
            _check(_is_sequence(self.allowed_token_ids) and all(is_int(t) and t >= 0 for t in self.allowed_token_ids),
                   "allowed_token_ids", "must be a list of non-negative integers")
            # once each: the sampler spreads them into a mask every step (at most the vocabulary)
            self.allowed_token_ids = tuple(dict.fromkeys(self.allowed_token_ids))
            _check(bool(self.allowed_token_ids), "allowed_token_ids", "must not be empty")
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        _check(_is_sequence(self.stop) and all(isinstance(s, str) and s for s in self.stop), "stop",
               "must be a string or a list of non-empty strings")
        self.stop = tuple(self.stop)
        _check(len(self.stop) <= MAX_STOP_STRINGS, "stop",
               f"holds {len(self.stop)} strings, more than {MAX_STOP_STRINGS}")
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "reasoning_ended"):
            _check(isinstance(getattr(self, name), bool), name, "must be a boolean")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or (is_int(value) and 0 <= value <= MAX_LOGPROBS), name,
                   f"must be None or an integer in [0, {MAX_LOGPROBS}] (the number of top tokens), got {value!r}")
        if self.structured_outputs is not None:
            self.structured_outputs = parse_spec(self.structured_outputs)
            # the grammar decides where the output ends; banning EOS before that could leave no token
            _check(self.min_tokens == 0, "min_tokens", "cannot be combined with 'structured_outputs'")
        for name in ("lora_name", "lora_path"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, str) and value != ""), name,
                   f"must be a non-empty string or None, got {value!r}")
        _check(self.lora_path is None or self.lora_name is not None, "lora_path", "needs 'lora_name'")
        _check(self.thinking_token_budget is None or (is_int(self.thinking_token_budget)
                                                      and self.thinking_token_budget >= -1),
               "thinking_token_budget", f"must be an integer >= 0, or -1 for none, got {self.thinking_token_budget!r}")
        if self.thinking_token_budget == -1:
            self.thinking_token_budget = None
