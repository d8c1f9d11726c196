"""The checkpoint's tokenizer: whether the directory has one, and loading it.

Shared by the engine (EOS ids, structured outputs) and the start-up checks (which must not import
torch), so nothing here imports transformers before it is needed.
"""
from __future__ import annotations

import logging
import os

log = logging.getLogger("inflight")

# a tokenizer is one of these in the checkpoint directory (fast tokenizer, sentencepiece, BPE/WordPiece)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


def has_tokenizer_files(model_dir: str) -> bool:
    return any(os.path.isfile(os.path.join(model_dir, name)) for name in TOKENIZER_FILES)


def load_tokenizer(model_dir: str):
    """The checkpoint's tokenizer, or None for one without (the engine then runs on token ids, and
    structured outputs name the missing tokenizer when asked for)."""
    if not has_tokenizer_files(model_dir):
        return None         # transformers 5 builds an empty Qwen2 tokenizer here, whose EOS (id 0) would end outputs
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as exc:      # what transformers raises for missing tokenizer files
        log.info("inflight: %s has no usable tokenizer (%s); EOS from its configs alone", model_dir,
                 str(exc).splitlines()[0])
        return None
