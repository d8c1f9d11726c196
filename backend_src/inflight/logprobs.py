"""Log-probabilities as vLLM reports them: for each generated token, the sampled token's
log-probability and rank plus the N most likely tokens (`SamplingParams.logprobs = N`); for each
prompt token after the first, the same for that token (`SamplingParams.prompt_logprobs = N`).

Values are those of the model's own distribution (log_softmax of the raw logits, before
temperature, top-k/top-p and bans), as vLLM's default `raw_logprobs` mode; for a request with
structured outputs, of the logits its grammar masked, as vLLM masks them before its sampler. A rank counts the
tokens at least as likely as the token (1 = the most likely; ties share the larger rank), as
vLLM counts it; a sampled token that is also among the top N takes its place there, as in
vLLM's per-position dict (where the top-N entries are written after the sampled one). Only the rows that asked are computed: a step where nobody asked costs nothing.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True, frozen=True)
class Logprob:
    logprob: float
    rank: int


# one generated position: token id -> Logprob; the sampled token first, then the top N by rank
# (N + 1 entries when the sampled token is not among the top N), like vLLM's per-position dict
TokenLogprobs = dict[int, Logprob]


@dataclass(slots=True)
class StepLogprobs:
    """The log-probabilities of the rows of one step that asked for them."""
    index: np.ndarray          # [k] positions, within the step's sampled rows, of the rows that asked
    sampled: np.ndarray        # [k] log-probability of each row's sampled token
    ranks: np.ndarray          # [k] its rank
    top_ids: np.ndarray        # [k, max N] the most likely tokens, best first
    top_logprobs: np.ndarray   # [k, max N]
    num: np.ndarray            # [k] N asked for by each row

    def entry(self, i: int, token_id: int) -> TokenLogprobs:
        """Row i's dict (sampled token first; its rank the top-N place where it has one)."""
        out = {token_id: Logprob(float(self.sampled[i]), int(self.ranks[i]))}
        for rank, (top_id, top_logprob) in enumerate(zip(self.top_ids[i, :self.num[i]].tolist(),
                                                         self.top_logprobs[i, :self.num[i]].tolist()), start=1):
            out[top_id] = Logprob(top_logprob, rank)
        return out


@dataclass(slots=True)
class AskedLogprobs:
    """log_softmax of the raw logits of the rows that asked, taken before a step edits them."""
    index: np.ndarray          # [k] positions of those rows among the step's rows
    logprobs: torch.Tensor     # [k, vocab]
    num: np.ndarray            # [k] N asked for by each row


def asked_logprobs(raw_logits: torch.Tensor, num_logprobs: np.ndarray) -> AskedLogprobs | None:
    """raw_logits [rows, vocab]; num_logprobs [rows] is N per row, -1 where the row did not ask.
    None when no row asked."""
    index = np.flatnonzero(num_logprobs >= 0)
    if not index.size:
        return None
    rows = torch.from_numpy(index).to(raw_logits.device)
    return AskedLogprobs(index, torch.log_softmax(raw_logits[rows], dim=-1), num_logprobs[index])


def step_logprobs(asked: AskedLogprobs | None, tokens: torch.Tensor) -> StepLogprobs | None:
    """The asking rows' entries, given the tokens [rows] the step chose."""
    if asked is None:
        return None
    logprobs = asked.logprobs
    sampled = logprobs.gather(1, tokens[torch.from_numpy(asked.index).to(tokens.device)][:, None])
    ranks = (logprobs >= sampled).sum(dim=-1)
    top_logprobs, top_ids = logprobs.topk(int(asked.num.max()), dim=-1)
    return StepLogprobs(asked.index, sampled.squeeze(1).cpu().numpy(), ranks.cpu().numpy(), top_ids.cpu().numpy(),
                        top_logprobs.cpu().numpy(), asked.num)


PROMPT_CHUNK = 256      # prompt positions scored at once: bounds the [positions, vocab] logits


@dataclass(slots=True)
class PromptPositions:
    """The tokens of a step whose logits score the prompt token after them, for the requests
    that asked for prompt log-probabilities (each position once, also across a recompute)."""
    index: np.ndarray                  # [k] the tokens' places in the step's packed batch
    rows: np.ndarray                   # [k] their requests' batch-table rows
    targets: np.ndarray                # [k] the prompt token each one scores
    hidden: torch.Tensor | None = None     # [k, hidden size]: filled by the forward pass


@torch.no_grad()
def prompt_logprobs(prompt: PromptPositions, num_logprobs: np.ndarray,
                    compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> list[TokenLogprobs]:
    """One entry per position (the prompt token first, then the top N of num_logprobs [k])."""
    entries = []
    for start in range(0, len(prompt.index), PROMPT_CHUNK):
        part = slice(start, start + PROMPT_CHUNK)
        logits = compute_logits(prompt.hidden[part])
        if logits.dtype != torch.float64:    # float64 stays, as in the sampler
            logits = logits.float()
        targets = prompt.targets[part]
        scored = step_logprobs(asked_logprobs(logits, num_logprobs[part]), torch.from_numpy(targets).to(logits.device))
        entries += [scored.entry(i, token) for i, token in enumerate(targets.tolist())]
    return entries
