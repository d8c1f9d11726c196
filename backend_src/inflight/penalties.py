"""vLLM's (and the OpenAI API's) repetition, frequency and presence penalties on a step's logits.

- repetition_penalty r (as transformers and vLLM): a token already in the prompt or the output
  has its logit divided by r where positive, multiplied by r where not.
- frequency_penalty f and presence_penalty p (OpenAI's definition): a token's logit loses
  f x its count in the output so far, and p once it is there at all.
Only the rows that ask for a penalty are touched, in place.

Every penalty falls on tokens the row has seen, a few hundred of a vocabulary of up to ~150k:
each row keeps the list of its distinct tokens and their counts in its output (host arrays, per
batch-table row, from the first penalized request on), counted once when a request takes a row
(its prompt, and its output so far after a recompute) and then one token per step; a step
gathers, changes and scatters back only those logits.
"""
from __future__ import annotations

import numpy as np
import torch

from .batch_table import BatchTable


def penalized_rows(table: BatchTable, rows: np.ndarray) -> np.ndarray:
    """Positions in `rows` whose requests ask for a penalty."""
    return np.flatnonzero((table.repetition_penalty[rows] != 1) | (table.frequency_penalty[rows] != 0)
                          | (table.presence_penalty[rows] != 0))


class Penalties:
    def __init__(self):
        self.seen = np.zeros((0, 0), dtype=bool)           # [rows, vocab]: in the prompt or the output
        self.output_counts = np.zeros((0, 0), dtype=np.int32)   # [rows, vocab]: occurrences in the output
        self.distinct = np.zeros((0, 0), dtype=np.int32)   # [rows, max_model_len]: the seen tokens, once each
        self.num_distinct = np.zeros(0, dtype=np.int32)
        self.counted = np.zeros(0, dtype=np.int32)         # per row: its first tokens already counted
        self.admission = np.zeros(0, dtype=np.int64)       # per row: the occupant they were counted for

    def __call__(self, logits: torch.Tensor, table: BatchTable, rows: np.ndarray) -> None:
        """Penalize logits [len(rows), vocab] in place."""
        picked = penalized_rows(table, rows)
        if not picked.size:
            return
        seats = rows[picked]
        vocab = logits.shape[-1]
        self._count(table, seats, vocab)
        widths = self.num_distinct[seats]
        which = np.repeat(np.arange(len(seats)), widths)          # entry -> position in seats
        seat_of = seats[which]
        col = np.arange(len(which)) - np.repeat(np.cumsum(widths) - widths, widths)
        ids = self.distinct.reshape(-1).take(seat_of * self.distinct.shape[1] + col)

        def per_entry(values: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(values).to(logits.device, logits.dtype)

        counts = per_entry(self.output_counts.reshape(-1).take(seat_of * vocab + ids))
        r = per_entry(table.repetition_penalty[seat_of])
        f = per_entry(table.frequency_penalty[seat_of])
        p = per_entry(table.presence_penalty[seat_of])
        at = torch.from_numpy(picked[which] * vocab + ids).to(logits.device)
        flat = logits.view(-1)
        values = flat[at]
        values = torch.where(values > 0, values / r, values * r)
        flat[at] = values - (f * counts + p * (counts > 0))

    def _count(self, table: BatchTable, seats: np.ndarray, vocab: int) -> None:
        """Bring the seats' counts up to their tokens so far, starting over for a new occupant."""
        rows = len(table.requests)
        if self.seen.shape != (rows, vocab):       # zeros: pages a row never touches cost nothing
            self.seen = np.zeros((rows, vocab), dtype=bool)
            self.output_counts = np.zeros((rows, vocab), dtype=np.int32)
            self.distinct = np.zeros((rows, table.max_model_len), dtype=np.int32)
            self.num_distinct, self.counted = np.zeros(rows, dtype=np.int32), np.zeros(rows, dtype=np.int32)
            self.admission = np.zeros(rows, dtype=np.int64)
        for row in seats[self.admission[seats] != table.admission[seats]].tolist():
            listed = self.distinct[row, :self.num_distinct[row]]
            self.seen[row, listed] = False
            self.output_counts[row, listed] = 0
            self.num_distinct[row] = self.counted[row] = 0
            self.admission[row] = table.admission[row]
        start, end = self.counted[seats], table.num_tokens[seats]
        width = int((end - start).max())
        if width <= 0:
            return
        positions = start[:, None] + np.arange(width)[None, :]
        inside = positions < end[:, None]
        row_of = np.broadcast_to(seats[:, None], positions.shape)[inside]
        positions = positions[inside]
        ids = table.token_ids[row_of, positions]
        output = positions >= table.num_prompt[row_of]
        np.add.at(self.output_counts, (row_of[output], ids[output]), 1)
        self.counted[seats] = end
        # each newly seen token once, appended to its row's list
        keys = np.unique(row_of.astype(np.int64) * vocab + ids)
        new_rows, new_ids = keys // vocab, keys % vocab
        fresh = ~self.seen[new_rows, new_ids]
        new_rows, new_ids = new_rows[fresh], new_ids[fresh]
        self.seen[new_rows, new_ids] = True
        group_start = np.searchsorted(new_rows, new_rows)         # sorted: each row's new tokens together
        slots = self.num_distinct[new_rows] + np.arange(len(new_rows)) - group_start
        self.distinct[new_rows, slots] = new_ids
        np.add.at(self.num_distinct, new_rows, 1)
