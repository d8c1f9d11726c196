#!/usr/bin/env python3
"""Build the demo LoRA adapter that ships with the repo: ``pydoc-json``.

A short PEFT LoRA fine-tune of the shipped default model (``inflight-tiny``, trained on the
language reference in ``pydoc_data``) on a different offline text: the ``pydoc`` page of the
standard library's ``json`` module (what ``help(json)`` prints). Served next to the base model,
``"lora_name": "pydoc-json"`` makes the same prompt continue in the style of that page.

Steps: tokenize the page with the base model's tokenizer; train rank-8 LoRA on all seven
projections (q/k/v/o/gate/up/down) with AdamW, warmup + cosine decay, fully seeded, the base
weights frozen; save with PEFT (adapter_config.json + adapter_model.safetensors) and a card.
The data split, batching, schedule and samples reuse scripts/build_default_model.py.

Usage:
  python scripts/build_demo_adapter.py                  # ~3 minutes on 2 CPU cores
  python scripts/build_demo_adapter.py --steps 10 --out /tmp/adapter   # smoke build
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import pydoc
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import build_default_model as base  # noqa: E402  (the default model's data and training helpers)

ADAPTER_NAME = "pydoc-json"
MODULE = "json"
DEFAULT_OUT = base.REPO_ROOT / "model_repository" / "llm" / "1" / "loras" / ADAPTER_NAME
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SAMPLE_PROMPTS = ["The json module", "The assert statement"]
EXPECTED_FILES = {"adapter_config.json", "adapter_model.safetensors", "README.md"}


def load_text() -> str:
    return pydoc.render_doc(MODULE, renderer=pydoc.plaintext)


def write_card(out: Path, info: dict) -> None:
    samples = "\n".join(f"- `{p}`\n  - base: {json.dumps(b, ensure_ascii=False)}\n"
                        f"  - with `{ADAPTER_NAME}`: {json.dumps(a, ensure_ascii=False)}"
                        for p, b, a in info["samples"])
    (out / "README.md").write_text(f"""# {ADAPTER_NAME}

A demo PEFT LoRA adapter for `inflight-tiny` (the default model): served with the base model,
`"lora_name": "{ADAPTER_NAME}"` switches a request to it. Like the base model it is a test fixture,
not a useful model.

- Built by `{info['command']}` ({info['train_minutes']:.1f} minutes on CPU, {info['threads']} threads).
- Training text: `pydoc.render_doc("{MODULE}", renderer=pydoc.plaintext)` from Python {info['python']}
  ({info['n_chars']:,} characters, {info['n_tokens']:,} tokens with the base tokenizer);
  {info['n_val_blocks']} blocks of {info['seq_len']} tokens held out for validation.
- LoRA: rank {info['r']}, alpha {info['alpha']}, on {', '.join(TARGET_MODULES)}; {info['n_params']:,} trained
  parameters; the base weights frozen (loaded in float32).
- AdamW (lr {info['lr']:g}), {info['warmup']} warmup steps, cosine decay, batch {info['batch_size']} x
  {info['seq_len']} tokens, {info['steps']} steps, seed {info['seed']}.
- Validation loss on the held-out `{MODULE}` text: base model {info['base_val_loss']:.3f}, with the adapter
  {info['val_loss']:.3f}.

Greedy continuations (transformers + peft):

{samples}

Trained only on Python documentation text (Python Software Foundation License), as the base model.
""")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", type=Path, default=base.DEFAULT_OUT, help="base model directory (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="adapter directory (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--alpha", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--val-frac", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sample-tokens", type=int, default=40)
    args = ap.parse_args(argv)

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True, warn_only=True)
    base.seed_everything(args.seed)
    warmup = max(1, round(0.05 * args.steps))
    t_start = time.time()

    tokenizer = AutoTokenizer.from_pretrained(str(args.base))
    text = load_text()
    stream = torch.tensor(tokenizer(text)["input_ids"] + [base.EOS_ID], dtype=torch.long)
    gen = torch.Generator().manual_seed(args.seed)
    train_segments, val_blocks = base.split_stream(stream, args.seq_len, args.val_frac, gen)
    batcher = base.Batcher(train_segments, args.seq_len, gen)
    base.log(f"text: pydoc {MODULE}, {len(text):,} chars, {stream.numel():,} tokens, "
             f"{val_blocks.size(0)} validation blocks")

    model = AutoModelForCausalLM.from_pretrained(str(args.base), dtype=torch.float32)
    base_val = base.eval_loss(model, val_blocks)
    base_samples = base.greedy_samples(model, tokenizer, SAMPLE_PROMPTS, args.sample_tokens)
    torch.manual_seed(args.seed)
    model = get_peft_model(model, LoraConfig(r=args.rank, lora_alpha=args.alpha, target_modules=TARGET_MODULES,
                                             lora_dropout=0.0, task_type="CAUSAL_LM"))
    trained = [p for p in model.parameters() if p.requires_grad]
    n_params = sum(p.numel() for p in trained)
    base.log(f"base val loss {base_val:.3f}; LoRA rank {args.rank}: {n_params:,} trained parameters")
    opt = torch.optim.AdamW(trained, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    model.train()
    t_train = time.time()
    for step in range(args.steps):
        lr = base.lr_at(step, args.steps, args.lr, warmup, 0.05)
        for group in opt.param_groups:
            group["lr"] = lr
        batch = batcher.batch(args.batch_size)
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        opt.step()
        if (step + 1) % 20 == 0 or step + 1 == args.steps:
            base.log(f"step {step + 1:4d}/{args.steps} loss {loss.item():.4f} lr {lr:.2e} "
                     f"{(time.time() - t_train) / (step + 1):.2f}s/step")
    train_minutes = (time.time() - t_train) / 60
    val = base.eval_loss(model, val_blocks)
    samples = base.greedy_samples(model, tokenizer, SAMPLE_PROMPTS, args.sample_tokens)
    base.log(f"val loss {val:.3f} (ppl {math.exp(val):.1f}) vs base {base_val:.3f}")
    for prompt, before, after in zip(SAMPLE_PROMPTS, base_samples, samples):
        base.log(f"--- {prompt!r}\n  base: {before!r}\n  lora: {after!r}")

    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="inflight-adapter-") as tmp:
        tmp_path = Path(tmp)
        model.save_pretrained(str(tmp_path))
        config_path = tmp_path / "adapter_config.json"
        config = json.loads(config_path.read_text())
        config["base_model_name_or_path"] = "inflight-tiny"        # not this machine's path
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        command = "python scripts/build_demo_adapter.py" + (" " + " ".join(sys.argv[1:]) if argv is None and
                                                             sys.argv[1:] else "")
        write_card(tmp_path, dict(
            command=command, train_minutes=train_minutes, threads=args.threads, python=platform.python_version(),
            n_chars=len(text), n_tokens=stream.numel(), n_val_blocks=val_blocks.size(0), seq_len=args.seq_len,
            r=args.rank, alpha=args.alpha, n_params=n_params, lr=args.lr, warmup=warmup,
            batch_size=args.batch_size, steps=args.steps, seed=args.seed, base_val_loss=base_val, val_loss=val,
            samples=[(p, b[len(p):], a[len(p):]) for p, b, a in zip(SAMPLE_PROMPTS, base_samples, samples)]))
        for path in tmp_path.iterdir():
            if path.name not in EXPECTED_FILES:
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        for path in out.iterdir():
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        for path in tmp_path.iterdir():
            shutil.move(str(path), str(out / path.name))
            (out / path.name).chmod(0o644)
    base.log(f"saved to {out}: {sorted(p.name for p in out.iterdir())}; total {(time.time() - t_start) / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
