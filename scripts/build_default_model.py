#!/usr/bin/env python3
"""Build the default model that ships with the repo: ``inflight-tiny``.

Everything comes from text that is available offline: the Python standard
library's ``pydoc_data.topics.topics`` (the ~79 documentation topics that
``help()`` shows, ~465 KB of text from the CPython docs).

Steps:
  1. Train a byte-level BPE tokenizer (HF ``tokenizers``), vocab 4096,
     specials ``<unk>``=0 ``<s>``=1 ``</s>``=2 ``<pad>``=3, a post-processor
     that prepends ``<s>`` (like Llama).
  2. Train a small Llama (hidden 256, 6 layers, 8 heads, 4 KV heads, GQA) from
     scratch on the tokenized topics (one document per topic, ending in
     ``</s>``; 256-token sequences; ~3% held out for a validation loss), AdamW
     with linear warmup + cosine decay, fully seeded.
  3. Save in standard HF format (weights in bfloat16) with a model card.

Usage:
  python scripts/build_default_model.py                 # full build (about an hour on 2 CPU cores, 1800 steps)
  python scripts/build_default_model.py --steps 20 --out /tmp/tiny   # quick smoke build
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "model_repository" / "llm" / "1" / "inflight-tiny"
CARD_TITLE = "# inflight-tiny"      # the model card's first line: how a later build knows an earlier one

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]  # ids 0, 1, 2, 3
UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3

MODEL_PARAMS = dict(
    vocab_size=4096,
    hidden_size=256,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=4,
    intermediate_size=768,
    max_position_embeddings=1024,
    tie_word_embeddings=True,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    hidden_act="silu",
    initializer_range=0.02,
    attention_bias=False,
    mlp_bias=False,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    pad_token_id=PAD_ID,
)

SAMPLE_PROMPTS = [
    "The assert statement",
    "A class definition",
    "The import statement",
    "Exceptions",
]

# The files the script writes: the only ones it replaces in --out (anything else there is left alone).
EXPECTED_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "README.md",
}


def log(msg: str) -> None:
    print(msg, flush=True)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    os.environ["PYTHONHASHSEED"] = str(seed)


# --------------------------------------------------------------------------- data


def load_documents() -> list[str]:
    from pydoc_data.topics import topics

    # Sorted by topic name so the order never depends on dict construction.
    return [topics[name] for name in sorted(topics)]


# --------------------------------------------------------------------- tokenizer


def train_tokenizer(docs: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer, length=len(docs))
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A",
        pair="<s> $A <s> $B",
        special_tokens=[("<s>", BOS_ID)],
    )
    return tok


def wrap_tokenizer(tok):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=MODEL_PARAMS["max_position_embeddings"],
    )


# A plain "Role: content" transcript, so OpenAI chat requests work out of the box (the model
# was never trained on chats; this only gives the prompt a shape). BOS comes from the template:
# chat prompts are tokenized without special tokens, as vLLM does.
CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{{ message['role'] | capitalize }}: "
                 "{{ message['content'] }}\n{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}")


def save_tokenizer(hf_tok, out: Path) -> None:
    hf_tok.save_pretrained(str(out))
    # Make the config self-describing and stable regardless of what the installed
    # transformers version chooses to write.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    cfg.update(
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "pad_token": "<pad>",
            "add_bos_token": True,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "padding_side": "left",
            "model_max_length": MODEL_PARAMS["max_position_embeddings"],
            "chat_template": CHAT_TEMPLATE,
        }
    )
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    stm = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
    (out / "special_tokens_map.json").write_text(json.dumps(stm, indent=2) + "\n")
    # Some transformers versions also write chat_template / added_tokens files; we
    # keep only the files listed in EXPECTED_FILES (see clean_output_dir).


# --------------------------------------------------------------------------- model


def build_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**MODEL_PARAMS)
    model = LlamaForCausalLM(config)
    return model


def lr_at(step: int, total: int, peak: float, warmup: int, min_ratio: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class Batcher:
    """Random 257-token windows from the training part of the packed stream."""

    def __init__(self, segments: list[torch.Tensor], seq_len: int, gen: torch.Generator):
        self.segments = [s for s in segments if s.numel() > seq_len + 1]
        self.seq_len = seq_len
        self.gen = gen
        lens = torch.tensor([s.numel() - seq_len - 1 for s in self.segments], dtype=torch.float64)
        self.weights = lens / lens.sum()

    def batch(self, batch_size: int) -> torch.Tensor:
        seg_idx = torch.multinomial(self.weights, batch_size, replacement=True, generator=self.gen)
        rows = []
        for i in seg_idx.tolist():
            seg = self.segments[i]
            start = int(torch.randint(0, seg.numel() - self.seq_len - 1, (1,), generator=self.gen))
            rows.append(seg[start : start + self.seq_len + 1])
        return torch.stack(rows)


def split_stream(stream: torch.Tensor, seq_len: int, val_frac: float, gen: torch.Generator):
    """Cut the stream into seq_len blocks, hold out ~val_frac of them.

    Returns (train_segments, val_blocks). Training segments are the maximal runs of
    consecutive non-held-out blocks (so training windows can straddle block
    boundaries but never touch validation text)."""
    n_blocks = stream.numel() // seq_len
    n_val = max(1, round(n_blocks * val_frac))
    perm = torch.randperm(n_blocks, generator=gen)
    val_ids = set(perm[:n_val].tolist())
    val_blocks, train_segments, run = [], [], []
    for b in range(n_blocks):
        block = stream[b * seq_len : (b + 1) * seq_len]
        if b in val_ids:
            val_blocks.append(block)
            if run:
                train_segments.append(torch.cat(run))
                run = []
        else:
            run.append(block)
    tail = stream[n_blocks * seq_len :]
    if tail.numel():
        run.append(tail)
    if run:
        train_segments.append(torch.cat(run))
    return train_segments, torch.stack(val_blocks)


@torch.no_grad()
def eval_loss(model, val_blocks: torch.Tensor, batch_size: int = 16) -> float:
    model.eval()
    total, count = 0.0, 0
    for i in range(0, val_blocks.size(0), batch_size):
        x = val_blocks[i : i + batch_size]
        out = model(input_ids=x, labels=x)
        n = x.size(0) * (x.size(1) - 1)
        total += out.loss.item() * n
        count += n
    model.train()
    return total / count


@torch.no_grad()
def greedy_samples(model, hf_tok, prompts, max_new_tokens: int) -> list[str]:
    model.eval()
    outs = []
    for p in prompts:
        enc = hf_tok(p, return_tensors="pt")
        gen = model.generate(
            **enc,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=EOS_ID,
            pad_token_id=PAD_ID,
        )
        outs.append(hf_tok.decode(gen[0], skip_special_tokens=True))
    model.train()
    return outs


# --------------------------------------------------------------------------- output


def clean_output_dir(out: Path) -> None:
    for p in out.iterdir():
        if p.name not in EXPECTED_FILES:
            if p.is_dir():
                shutil.rmtree(p)
            else:
                p.unlink()


def check_output(out: Path) -> None:
    """Refuse, before any training, an --out that holds files of our names not written by an
    earlier build (whose model card starts with CARD_TITLE): `--out .` from the repository root
    would replace the project's README.md."""
    card = out / "README.md"
    if card.is_file() and card.read_text(errors="replace").startswith(CARD_TITLE):
        return
    taken = sorted(name for name in EXPECTED_FILES if (out / name).exists() or (out / name).is_symlink())
    if taken:
        raise SystemExit(f"--out {out} already holds {', '.join(taken)}, not from an earlier build of this "
                         "model: choose an empty or new directory")


def replace_output(new: Path, out: Path) -> list[str]:
    """Move the files built in `new` into `out`, replacing only the names in EXPECTED_FILES: --out
    may name a directory that holds other things (`--out .`), and those are left as they were.
    Returns their names."""
    for name in EXPECTED_FILES:
        old = out / name
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old)
        elif old.exists() or old.is_symlink():
            old.unlink()
    for p in new.iterdir():
        shutil.move(str(p), str(out / p.name))
        os.chmod(out / p.name, 0o644)
    return sorted(p.name for p in out.iterdir() if p.name not in EXPECTED_FILES)


def write_model_card(out: Path, info: dict) -> None:
    p = MODEL_PARAMS
    text = f"""{CARD_TITLE}

A deliberately tiny Llama-architecture causal language model that ships with the
`inflight` repository as its default model, so the Triton model repository can be
served and tested end to end without downloading anything. It is a test fixture,
not a useful assistant: it writes text that looks like the Python reference
documentation it was trained on.

## What it is

- Architecture: `LlamaForCausalLM` (RoPE, RMSNorm, SwiGLU MLP, grouped-query attention)
- Parameters: {info['n_params']:,} (tied input/output embeddings)
- vocab {p['vocab_size']}, hidden {p['hidden_size']}, {p['num_hidden_layers']} layers,
  {p['num_attention_heads']} attention heads, {p['num_key_value_heads']} key/value heads,
  intermediate {p['intermediate_size']}, max positions {p['max_position_embeddings']},
  rope_theta {p['rope_theta']:g}, rms_norm_eps {p['rms_norm_eps']:g}
- Weights stored in bfloat16 (`model.safetensors`, {info['weights_mb']:.1f} MB)
- Tokenizer: byte-level BPE (HF `tokenizers`), vocab {p['vocab_size']}; any UTF-8 text
  round-trips. Special tokens: `<unk>`=0, `<s>`=1 (prepended to every encoding, like
  Llama), `</s>`=2 (end of document), `<pad>`=3.

## How it was built

Built from scratch, offline, by `scripts/build_default_model.py`:

```
{info['command']}
```

- Training text: `pydoc_data.topics.topics` from the Python {info['python']} standard library
  ({info['n_docs']} documentation topics, {info['n_chars']:,} characters). Each topic is one
  document, `<s> ... </s>`, concatenated into one stream of {info['n_tokens']:,} tokens
  and cut into {info['seq_len']}-token blocks; {info['n_val_blocks']} blocks (~{info['val_frac']:.0%}) are held out
  for validation.
- Tokenizer trained on the same text (BPE, min frequency 2).
- Optimisation: AdamW (lr {info['lr']:g}, betas (0.9, 0.95), weight decay {info['weight_decay']:g}),
  {info['warmup']} warmup steps then cosine decay to {info['min_lr_ratio']:g}x, gradient clipping 1.0,
  batch {info['batch_size']} x {info['seq_len']} tokens, {info['steps']} steps, fp32 on CPU
  ({info['threads']} threads), seed {info['seed']}.
- Training time: {info['train_minutes']:.1f} minutes.
- Final training loss (mean of last 50 steps): {info['final_train_loss']:.3f};
  final validation loss: {info['final_val_loss']:.3f} (best seen {info['best_val_loss']:.3f} at step {info['best_val_step']}).
  The corpus is tiny, so the model largely memorises it; the validation loss is
  reported for completeness, not as a quality claim.

Greedy samples after training:

{info['samples_md']}

## License

Trained only on Python documentation text from the CPython distribution
(`pydoc_data/topics.py`), which is distributed under the Python Software Foundation
License; the weights and tokenizer are derived from that text. Use it for testing the
serving stack, not for anything that needs a real language model.
"""
    (out / "README.md").write_text(text)


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1800, help="optimizer steps (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT,
                    help="output directory: the files the script writes are replaced there, nothing else "
                         "(default: %(default)s)")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.05)
    ap.add_argument("--warmup", type=int, default=None, help="warmup steps (default: 5%% of --steps, >= 1)")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--val-frac", type=float, default=0.03)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=2, help="torch threads (capped at 2)")
    ap.add_argument("--sample-tokens", type=int, default=60)
    args = ap.parse_args(argv)

    threads = max(1, min(2, args.threads))
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True, warn_only=True)
    seed_everything(args.seed)
    warmup = args.warmup if args.warmup is not None else max(1, round(0.05 * args.steps))
    out: Path = args.out.resolve()
    check_output(out)

    # Silence the "no accelerator" / generation-flag chatter from transformers.
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()

    t_start = time.time()
    docs = load_documents()
    n_chars = sum(len(d) for d in docs)
    log(f"corpus: {len(docs)} topics, {n_chars:,} chars (Python {platform.python_version()})")

    # ---- tokenizer
    tok = train_tokenizer(docs, MODEL_PARAMS["vocab_size"])
    hf_tok = wrap_tokenizer(tok)
    for s in ["Hello, world!", "  def f(x):\n\treturn x ** 2  # ünïcödé ✓ 日本語\n"]:
        assert hf_tok.decode(hf_tok.encode(s), skip_special_tokens=True) == s, s
    ids = []
    for d in docs:
        ids.extend(tok.encode(d).ids)  # starts with <s> via the post-processor
        ids.append(EOS_ID)
    stream = torch.tensor(ids, dtype=torch.long)
    log(f"tokenizer: vocab {tok.get_vocab_size()}, stream {stream.numel():,} tokens "
        f"({n_chars / stream.numel():.2f} chars/token)")

    # ---- data split
    gen = torch.Generator().manual_seed(args.seed)
    train_segments, val_blocks = split_stream(stream, args.seq_len, args.val_frac, gen)
    batcher = Batcher(train_segments, args.seq_len, gen)
    n_train_tokens = sum(s.numel() for s in train_segments)
    log(f"split: {n_train_tokens:,} train tokens in {len(train_segments)} segments, "
        f"{val_blocks.size(0)} val blocks of {args.seq_len}")

    # ---- model
    torch.manual_seed(args.seed)
    model = build_model()
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params:,} parameters")

    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() >= 2 and "norm" not in name else no_decay).append(p)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )

    t_train = time.time()
    losses: list[float] = []
    val_history: list[tuple[int, float]] = []
    for step in range(args.steps):
        lr = lr_at(step, args.steps, args.lr, warmup, args.min_lr_ratio)
        for g in opt.param_groups:
            g["lr"] = lr
        batch = batcher.batch(args.batch_size)
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        last = step + 1 == args.steps
        if (step + 1) % 10 == 0 or step < 5 or last:
            el = time.time() - t_train
            eta = el / (step + 1) * (args.steps - step - 1)
            log(f"step {step + 1:5d}/{args.steps} loss {loss.item():.4f} lr {lr:.2e} "
                f"{el / (step + 1):.2f}s/step elapsed {el / 60:.1f}m eta {eta / 60:.1f}m")
        if (step + 1) % args.eval_every == 0 or last:
            vl = eval_loss(model, val_blocks)
            val_history.append((step + 1, vl))
            log(f"  val loss {vl:.4f} (ppl {math.exp(vl):.1f})")
    train_seconds = time.time() - t_train
    final_val = val_history[-1][1]
    best_step, best_val = min(val_history, key=lambda t: t[1])
    final_train = sum(losses[-50:]) / len(losses[-50:])
    log(f"training done in {train_seconds / 60:.1f} min; final train loss {final_train:.4f}, "
        f"final val loss {final_val:.4f} (best {best_val:.4f} at step {best_step})")

    samples = greedy_samples(model, hf_tok, SAMPLE_PROMPTS, args.sample_tokens)
    for p, s in zip(SAMPLE_PROMPTS, samples):
        log(f"--- greedy: {p!r}\n{s}\n")

    # ---- save
    del opt
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="inflight-tiny-") as tmp:
        tmp_path = Path(tmp)
        model = model.to(torch.bfloat16)
        model.config.torch_dtype = torch.bfloat16
        model.generation_config.bos_token_id = BOS_ID
        model.generation_config.eos_token_id = EOS_ID
        model.generation_config.pad_token_id = PAD_ID
        model.save_pretrained(str(tmp_path), safe_serialization=True)
        save_tokenizer(hf_tok, tmp_path)
        # config.json: make dtype explicit under both the old and new key names.
        cfg_path = tmp_path / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["torch_dtype"] = "bfloat16"
        cfg["dtype"] = "bfloat16"
        cfg["architectures"] = ["LlamaForCausalLM"]
        cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        gcfg = {"_from_model_config": False, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID,
                "pad_token_id": PAD_ID}
        gpath = tmp_path / "generation_config.json"
        old = json.loads(gpath.read_text()) if gpath.exists() else {}
        if "transformers_version" in old:
            gcfg["transformers_version"] = old["transformers_version"]
        gpath.write_text(json.dumps(gcfg, indent=2) + "\n")

        weights_mb = (tmp_path / "model.safetensors").stat().st_size / 1e6
        samples_md = "\n".join(
            f"- `{p}` → {json.dumps(s[len(p):] if s.startswith(p) else s, ensure_ascii=False)}"
            for p, s in zip(SAMPLE_PROMPTS[:3], samples[:3])
        )
        cmd = "python scripts/build_default_model.py"
        if argv is None:
            extra = sys.argv[1:]
            if extra:
                cmd += " " + " ".join(extra)
        write_model_card(
            tmp_path,
            dict(
                n_params=n_params, weights_mb=weights_mb, command=cmd,
                python=platform.python_version(), n_docs=len(docs), n_chars=n_chars,
                n_tokens=stream.numel(), seq_len=args.seq_len, n_val_blocks=val_blocks.size(0),
                val_frac=args.val_frac, lr=args.lr, weight_decay=args.weight_decay, warmup=warmup,
                min_lr_ratio=args.min_lr_ratio, batch_size=args.batch_size, steps=args.steps,
                threads=threads, seed=args.seed, train_minutes=train_seconds / 60,
                final_train_loss=final_train, final_val_loss=final_val, best_val_loss=best_val,
                best_val_step=best_step, samples_md=samples_md,
            ),
        )
        clean_output_dir(tmp_path)
        left = replace_output(tmp_path, out)
    log(f"saved to {out}: " + ", ".join(sorted(EXPECTED_FILES)))
    if left:
        log(f"  (also in {out}, left as they were: {', '.join(left)})")

    # ---- verify the saved folder loads with the Auto classes
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok2 = AutoTokenizer.from_pretrained(str(out))
    m2 = AutoModelForCausalLM.from_pretrained(str(out))
    assert (tok2.bos_token_id, tok2.eos_token_id, tok2.unk_token_id, tok2.pad_token_id) == (1, 2, 0, 3)
    assert m2.dtype == torch.bfloat16, m2.dtype
    s = "The assert statement, x = 1  # ü\n"
    assert tok2.decode(tok2.encode(s), skip_special_tokens=True) == s
    assert tok2.encode("hi")[0] == BOS_ID
    reloaded = greedy_samples(m2, tok2, SAMPLE_PROMPTS[:1], 30)
    log(f"reload check ok (bf16 greedy): {reloaded[0]!r}")
    log(f"total build time {(time.time() - t_start) / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
