"""Logits -> next tokens for a whole step, with torch ops over the batch.

The grammar mask (structured outputs) comes first, then logit_bias, bans (min_tokens, bad words),
penalties (penalties.py), allowed_token_ids, and the end marker a spent thinking_token_budget
forces. Greedy rows (temperature under SAMPLING_EPS, as in vLLM) take the argmax. Sampled rows
apply temperature, min-p, top-k and top-p, then draw with the exponential-race trick (argmax of
p / E, E ~ Exp(1)), which needs exactly one noise vector per token: a seeded request draws it from
its own generator, so its tokens do not depend on what else is in the batch. Log-probabilities
(logprobs.py) are those of the model's own distribution within its grammar: vLLM masks the logits
with the grammar before its sampler, whose default mode, raw_logprobs, takes them before
logit_bias, bans, penalties and allowed_token_ids. So they are taken right after the mask, and
every later edit works on the logits in place.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from . import cpu_kernels
from .batch_table import BatchTable
from .config import SAMPLING_EPS
from .logprobs import StepLogprobs, asked_logprobs, step_logprobs
from .penalties import Penalties


class Sampler:
    def __init__(self, device: torch.device, seed: int):
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.penalties = Penalties()

    def __call__(self, logits: torch.Tensor, table: BatchTable, rows: np.ndarray,
                 grammar_mask: Callable[[torch.Tensor], None] | None = None, forced: dict[int, int] | None = None
                 ) -> tuple[np.ndarray, StepLogprobs | None]:
        """logits [len(rows), vocab] -> (token ids, log-probs of the rows that asked, or None).
        The logits are edited in place (a float32 or float64 tensor is the caller's). grammar_mask
        (structured outputs) sets the tokens outside each constrained row's grammar to -inf, in
        place, before anything else (-inf stays -inf through the edits after it). `forced`: row
        position -> the one token it takes (a spent thinking_token_budget's end marker), last."""
        if logits.dtype != torch.float64:   # float64 stays: exactness tests compare argmaxes
            logits = logits.float()
        if grammar_mask is not None:
            grammar_mask(logits)
        asked = asked_logprobs(logits, table.num_logprobs[rows])
        self._apply_bias(logits, table, rows)
        self._apply_bans(logits, table, rows)
        self.penalties(logits, table, rows)
        self._apply_allowed(logits, table, rows)
        for i, token in (forced or {}).items():
            logits[i].fill_(-math.inf)
            logits[i, token] = 0.0
        temperature = table.temperature[rows]
        tokens = cpu_kernels.argmax(logits)
        sampled = np.flatnonzero(temperature >= SAMPLING_EPS)
        if sampled.size:
            index = torch.from_numpy(sampled).to(logits.device)
            probs = self._probs(logits[index], temperature[sampled], table.top_k[rows[sampled]],
                                table.top_p[rows[sampled]], table.min_p[rows[sampled]])
            noise = self._noise(probs, table, rows[sampled])
            tokens[index] = (probs / noise).argmax(dim=-1)
        return tokens.cpu().numpy(), step_logprobs(asked, tokens)

    @staticmethod
    def _apply_bias(logits: torch.Tensor, table: BatchTable, rows: np.ndarray) -> None:
        """OpenAI's logit_bias: each listed token's logit plus its bias."""
        biased = np.flatnonzero(table.has_logit_bias[rows])
        if not biased.size:
            return
        for i in biased.tolist():       # a row at a time: one index_add of the tensors made at admission
            tokens, biases = table.logit_bias[int(rows[i])]
            logits[i].index_add_(0, tokens.to(logits.device), biases.to(logits.device, logits.dtype))

    @staticmethod
    def _apply_allowed(logits: torch.Tensor, table: BatchTable, rows: np.ndarray) -> None:
        """vLLM's allowed_token_ids: -inf for every other token, EOS included. Last, so
        that it can see what the grammar and the bans left: a row where they exclude every allowed
        token (a grammar that can only end, with EOS not allowed; min_tokens banning the one allowed
        stop token) samples as if unrestricted, within its grammar and bans, where vLLM would sample
        from nothing (token 0, or NaN)."""
        limited = np.flatnonzero(table.has_allowed_ids[rows])
        if not limited.size:
            return
        device = logits.device
        keep = torch.zeros((len(limited), logits.shape[1]), dtype=torch.bool, device=device)
        for k, row in enumerate(rows[limited].tolist()):
            keep[k, table.allowed_ids[row].to(device)] = True
        index = torch.from_numpy(limited).to(device)
        subset = logits[index]
        keep &= subset > -torch.inf
        keep |= ~keep.any(dim=-1, keepdim=True)
        logits[index] = subset.masked_fill(~keep, -torch.inf)

    def _apply_bans(self, logits: torch.Tensor, table: BatchTable, rows: np.ndarray) -> None:
        """-inf for stop tokens before min_tokens is reached (EOS also under ignore_eos, as vLLM's
        min_tokens bans every stop token), and for the last token of any bad word whose other
        tokens were just generated (in the output: a prompt's tail does not count, as in vLLM)."""
        below_min = np.flatnonzero(table.num_tokens[rows] < table.min_total[rows])
        with_bad_words = np.flatnonzero(table.has_bad_words[rows])
        if not below_min.size and not with_bad_words.size:
            return
        if below_min.size:
            stops = table.stop_ids[rows[below_min]]
            i, j = np.nonzero(stops >= 0)
            logits[torch.from_numpy(below_min[i]), torch.from_numpy(stops[i, j].astype(np.int64))] = -torch.inf
            if table.eos_ids:
                logits[torch.from_numpy(below_min)[:, None], torch.tensor(table.eos_ids)[None, :]] = -torch.inf
        for i in with_bad_words.tolist():
            row = int(rows[i])
            length = int(table.num_tokens[row])
            generated = length - int(table.num_prompt[row])
            for size, endings in table.bad_words[row]:
                if size > generated:
                    break
                banned = endings.get(tuple(table.token_ids[row, length - size:length].tolist()))
                if banned:
                    logits[i, torch.tensor(banned, device=logits.device)] = -torch.inf

    @staticmethod
    def _probs(logits: torch.Tensor, temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray,
               min_p: np.ndarray) -> torch.Tensor:
        device = logits.device
        logits = logits / torch.from_numpy(temperature).to(device, logits.dtype)[:, None]
        if (min_p > 0).any():       # p < min_p x p_max  <=>  logit < max logit + log(min_p)
            log_min_p = torch.from_numpy(min_p).to(device, logits.dtype).log()[:, None]
            floor = logits.max(dim=-1, keepdim=True).values + log_min_p
            logits = logits.masked_fill(logits < floor, -torch.inf)
        vocab = logits.shape[-1]
        k = np.where(top_k > 0, np.minimum(top_k, vocab), vocab)
        if (k < vocab).any() or (top_p < 1).any():
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            # top-k keeps every token tied with the k-th (vLLM's and transformers' rule)
            kth = sorted_logits.gather(1, torch.from_numpy(k - 1).to(device)[:, None])
            sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, -torch.inf)
            sorted_probs = sorted_logits.softmax(dim=-1)
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            # top-p keeps the tokens whose more likely ones hold less than p (the first always)
            top_p_t = torch.from_numpy(top_p).to(device, sorted_probs.dtype)[:, None]
            dropped = (mass_before >= top_p_t) & (top_p_t < 1)
            dropped[:, 0] = False           # also where top_p rounds to 0 in float32
            sorted_logits = sorted_logits.masked_fill(dropped, -torch.inf)
            logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
        return logits.softmax(dim=-1)

    def _noise(self, probs: torch.Tensor, table: BatchTable, rows: np.ndarray) -> torch.Tensor:
        noise = torch.empty_like(probs)
        noise.exponential_(generator=self.generator)
        for i, row in enumerate(rows.tolist()):
            generator = table.requests[row].generator
            if generator is not None:
                noise[i].exponential_(generator=generator)
        return noise
