"""vLLM's (and the OpenAI API's) repetition, frequency and presence penalties on a step's logits.

- repetition_penalty r (as transformers and vLLM): a token already in the prompt or the output
  has its logit divided by r where positive, multiplied by r where not.
- frequency_penalty f and presence_penalty p (OpenAI's definition): a token's logit loses
  f x its count in the output so far, and p once it is there at all.
Only the rows that ask for a penalty are touched, on a copy (the log-probabilities stay those of
the model's own distribution, as vLLM's default).
"""
from __future__ import annotations

import numpy as np
import torch

from .batch_table import BatchTable


def penalized_rows(table: BatchTable, rows: np.ndarray) -> np.ndarray:
    """Positions in `rows` whose requests ask for a penalty."""
    return np.flatnonzero((table.repetition_penalty[rows] != 1) | (table.frequency_penalty[rows] != 0)
                          | (table.presence_penalty[rows] != 0))


def apply_penalties(logits: torch.Tensor, table: BatchTable, rows: np.ndarray) -> torch.Tensor:
    """logits [len(rows), vocab] -> the same, or a penalized copy."""
    picked = penalized_rows(table, rows)
    if not picked.size:
        return logits
    seats = rows[picked]
    vocab = logits.shape[-1]
    prompt_counts = _token_counts(table, seats, vocab, False, logits.device)
    output_counts = _token_counts(table, seats, vocab, True, logits.device)
    logits = logits.clone()
    index = torch.from_numpy(picked).to(logits.device)
    penalized = logits[index]
    seen = (prompt_counts + output_counts) > 0
    r = torch.from_numpy(table.repetition_penalty[seats]).to(logits.device, logits.dtype)[:, None]
    penalized = torch.where(seen, torch.where(penalized > 0, penalized / r, penalized * r), penalized)
    f = torch.from_numpy(table.frequency_penalty[seats]).to(logits.device, logits.dtype)[:, None]
    p = torch.from_numpy(table.presence_penalty[seats]).to(logits.device, logits.dtype)[:, None]
    penalized -= f * output_counts + p * (output_counts > 0)
    logits[index] = penalized
    return logits


def _token_counts(table: BatchTable, seats: np.ndarray, vocab: int, output: bool, device) -> torch.Tensor:
    """[len(seats), vocab] counts of each token in the rows' prompts (or outputs so far)."""
    start = table.num_prompt[seats] if output else np.zeros_like(seats)
    end = table.num_tokens[seats] if output else table.num_prompt[seats]
    width = max(int((end - start).max()), 1)
    positions = start[:, None] + np.arange(width)[None, :]
    inside = positions < end[:, None]
    ids = np.where(inside, table.token_ids[seats[:, None], np.minimum(positions, table.max_model_len - 1)], vocab)
    counts = torch.zeros(len(seats), vocab + 1, dtype=torch.int32)     # column `vocab`: the padding
    counts.scatter_add_(1, torch.from_numpy(ids.astype(np.int64)), torch.ones(ids.shape, dtype=torch.int32))
    return counts[:, :vocab].to(device)
