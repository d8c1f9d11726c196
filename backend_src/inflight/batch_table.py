"""The running batch as arrays: one row per seat, holding each running request's token ids,
progress (`num_computed`), stop conditions, sampling knobs and KV block table.

Keeping this state in numpy rows instead of per-request Python objects makes a decode step's
bookkeeping a handful of vector operations however many requests are running, and lets the
runner pack a step's inputs by fancy indexing.
"""
from __future__ import annotations

import numpy as np
import torch

from .request import Request

FLOAT32_MAX = float(np.finfo(np.float32).max)
INT32_MAX = int(np.iinfo(np.int32).max)


def bad_word_endings(words: tuple[tuple[int, ...], ...]) -> list[tuple[int, dict[tuple[int, ...], list[int]]]]:
    """A request's bad words as (prefix length, {prefix: the tokens it bans next}), shortest
    first: a step looks its last tokens up once per length instead of comparing every word (40,000
    words took 145 ms a step, with every request in the batch waiting)."""
    grouped: dict[int, dict[tuple[int, ...], list[int]]] = {}
    for word in words:
        grouped.setdefault(len(word) - 1, {}).setdefault(word[:-1], []).append(word[-1])
    return sorted(grouped.items())


class BatchTable:
    def __init__(self, max_num_seqs: int, max_model_len: int, block_size: int, eos_token_ids: tuple[int, ...] = ()):
        rows = max_num_seqs
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.token_ids = np.zeros((rows, max_model_len), dtype=np.int32)
        self.num_tokens = np.zeros(rows, dtype=np.int32)        # prompt + output so far
        self.num_computed = np.zeros(rows, dtype=np.int32)      # tokens whose KV is in the cache
        self.num_prompt = np.zeros(rows, dtype=np.int32)
        self.max_total = np.zeros(rows, dtype=np.int32)         # finish ("length") at this many tokens
        self.min_total = np.zeros(rows, dtype=np.int32)         # stop tokens are banned below this
        self.stop_ids = np.full((rows, 1), -1, dtype=np.int32)  # EOS (unless ignore_eos) + stop ids
        self.eos_ids = tuple(eos_token_ids)                     # the model's: banned below min_total, ignore_eos or not
        self.block_table = np.zeros((rows, -(-max_model_len // block_size)), dtype=np.int32)
        self.num_blocks = np.zeros(rows, dtype=np.int32)
        self.temperature = np.zeros(rows, dtype=np.float32)
        self.top_k = np.zeros(rows, dtype=np.int32)
        self.top_p = np.ones(rows, dtype=np.float32)
        self.min_p = np.zeros(rows, dtype=np.float32)
        self.num_logprobs = np.full(rows, -1, dtype=np.int32)   # -1: none; N: sampled token + top N
        self.num_prompt_logprobs = np.full(rows, -1, dtype=np.int32)   # the same for the prompt's tokens
        self.prompt_logprobs_from = np.zeros(rows, dtype=np.int32)     # positions before it have them already
        self.repetition_penalty = np.ones(rows, dtype=np.float32)
        self.frequency_penalty = np.zeros(rows, dtype=np.float32)
        self.presence_penalty = np.zeros(rows, dtype=np.float32)
        self.has_bad_words = np.zeros(rows, dtype=bool)
        self.bad_words: list[list | None] = [None] * rows      # bad_word_endings of the row's request
        self.has_logit_bias = np.zeros(rows, dtype=bool)
        # a row's logit_bias as (token ids, biases) and allowed_token_ids as an array, made once when
        # it is seated: built from the request's tuples at every step, a whole-vocabulary list cost
        # seconds a step (Python over 128k entries a row), for every request in the batch
        self.logit_bias: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * rows
        self.has_allowed_ids = np.zeros(rows, dtype=bool)      # sampling limited to allowed_token_ids
        self.allowed_ids: list[torch.Tensor | None] = [None] * rows
        self.constrained = np.zeros(rows, dtype=bool)          # has structured outputs (a grammar matcher)
        self.lora_id = np.full(rows, -1, dtype=np.int32)        # LoRA adapter id; -1: base model
        self.request_ids = np.empty(rows, dtype=object)
        self.requests: list[Request | None] = [None] * rows
        self.admission = np.zeros(rows, dtype=np.int64)         # which occupant: state kept per row checks it
        self._admissions = 0
        self._free_rows = list(range(rows - 1, -1, -1))

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def add(self, req: Request) -> int:
        """Give a request a row; its token ids move into the table until it leaves."""
        row = self._free_rows.pop()
        params = req.params
        num_tokens = len(req.token_ids)
        self.token_ids[row, :num_tokens] = req.token_ids
        self.num_tokens[row] = num_tokens
        self.num_computed[row] = 0
        self.num_prompt[row] = req.num_prompt_tokens
        self.max_total[row] = min(req.num_prompt_tokens + params.max_tokens, self.max_model_len)
        # capped as max_total: int32, and a min_tokens of 2**32 wrapped to 0 and let EOS through at once
        self.min_total[row] = min(req.num_prompt_tokens + params.min_tokens, self.max_model_len)
        stops = params.stop_token_ids + (() if params.ignore_eos else self.eos_ids)
        if len(stops) > self.stop_ids.shape[1]:
            self.stop_ids = np.pad(self.stop_ids, ((0, 0), (0, len(stops) - self.stop_ids.shape[1])),
                                   constant_values=-1)
        self.stop_ids[row] = -1
        self.stop_ids[row, :len(stops)] = stops
        self.num_blocks[row] = 0
        # float32 / int32 rows: a larger temperature would be inf (NaN against a banned token's
        # -inf) and a larger top_k would wrap; both saturate to what they mean (uniform; all tokens)
        self.temperature[row] = min(params.temperature, FLOAT32_MAX)
        self.top_k[row] = min(params.top_k, INT32_MAX)
        self.top_p[row] = params.top_p
        self.min_p[row] = params.min_p
        self.num_logprobs[row] = -1 if params.logprobs is None else params.logprobs
        self.num_prompt_logprobs[row] = -1 if params.prompt_logprobs is None else params.prompt_logprobs
        self.prompt_logprobs_from[row] = len(req.prompt_logprobs)     # a recompute does not repeat them
        self.repetition_penalty[row] = params.repetition_penalty
        self.frequency_penalty[row] = params.frequency_penalty
        self.presence_penalty[row] = params.presence_penalty
        self.has_bad_words[row] = bool(params.bad_words_ids)
        self.bad_words[row] = bad_word_endings(params.bad_words_ids) if params.bad_words_ids else None
        self.has_logit_bias[row] = bool(params.logit_bias)
        if params.logit_bias:
            ids, biases = zip(*params.logit_bias)
            self.logit_bias[row] = torch.tensor(ids), torch.tensor(biases, dtype=torch.float64)
        self.has_allowed_ids[row] = params.allowed_token_ids is not None
        if params.allowed_token_ids is not None:
            self.allowed_ids[row] = torch.tensor(params.allowed_token_ids, dtype=torch.int64)
        self.constrained[row] = req.matcher is not None
        self.lora_id[row] = req.lora_id
        self.request_ids[row] = req.request_id
        self.requests[row] = req
        self._admissions += 1
        self.admission[row] = self._admissions
        req.row = row
        return row

    def remove(self, row: int) -> Request:
        """Free a row, copying the request's tokens back to it (for output or recompute)."""
        req = self.requests[row]
        req.token_ids = self.token_ids[row, :self.num_tokens[row]].tolist()
        req.row = -1
        self.requests[row] = None
        self.request_ids[row] = None
        self.bad_words[row] = self.logit_bias[row] = self.allowed_ids[row] = None
        self.num_blocks[row] = 0
        self._clear_stop_ids(row)
        self._free_rows.append(row)
        return req

    def _clear_stop_ids(self, row: int) -> None:
        """The widest row leaving narrows the stop ids to the widest left: one request's long
        stop_token_ids would otherwise widen every later step's stop check, for good."""
        widest = self.stop_ids.shape[1] > 1 and self.stop_ids[row, -1] >= 0
        self.stop_ids[row] = -1
        if widest:
            self.stop_ids = self.stop_ids[:, :max(int((self.stop_ids >= 0).sum(axis=1).max()), 1)].copy()

    def blocks(self, row: int) -> list[int]:
        return self.block_table[row, :self.num_blocks[row]].tolist()

    def append_blocks(self, rows, counts, blocks) -> None:
        """Append counts[i] blocks to rows[i]'s table, taking them in order from `blocks`."""
        rows, counts = np.asarray(rows), np.asarray(counts)
        start = self.num_blocks[rows]
        if len(blocks) == len(rows):                       # one block each: every decode step
            self.block_table[rows, start] = blocks
        else:
            first = np.cumsum(counts) - counts             # where each row's share begins in `blocks`
            cols = np.arange(len(blocks)) + np.repeat(start - first, counts)
            self.block_table[np.repeat(rows, counts), cols] = blocks
        self.num_blocks[rows] = start + counts

    def output_ids(self, row: int) -> list[int]:
        return self.token_ids[row, self.num_prompt[row]:self.num_tokens[row]].tolist()
