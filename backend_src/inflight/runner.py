"""Model runner: loads a local HF checkpoint, owns the KV-cache tensors, packs a scheduled step
into flat tensors and runs the forward pass, returning logits for the rows that sample."""
from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from . import heap, hugepages
from .attention import AttentionMetadata, select_backend
from .batch_table import BatchTable
from .config import EngineConfig
from .cpu_features import cpu_auto_dtype
from .cuda_graphs import DecodeGraphs, capture_sizes
from .logprobs import PromptPositions
from .lora import load_lora_weights
from .models import LlamaForCausalLM, LlamaForSequenceClassification, ModelSpec, rope_tables
from .packed_linear import pack_linears, shape_bucket
from .sampler import Sampler
from .scheduler import SchedulerOutput
from .score_head import with_score_head

log = logging.getLogger("inflight")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "float64": torch.float64}
_CPU_DEFAULT_KV_GB = 1.0


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"'device' is {name!r} but no CUDA device is available")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"'device' is {name!r} but this host has {torch.cuda.device_count()} CUDA device(s)")
    return device


def resolve_dtype(name: str, device: torch.device, hf_config) -> torch.dtype:
    """On CPU bf16 where the CPU has bf16 instructions, else fp32; on CUDA the checkpoint's half
    type (bf16 if it was saved in fp32)."""
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return cpu_auto_dtype()
    saved = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    return saved if saved in (torch.float16, torch.bfloat16) else torch.bfloat16


def iter_checkpoint(model_dir: str):
    """(name, tensor) pairs of a HF checkpoint directory: the shards its model.safetensors.index.json
    names, or without one every *.safetensors file (as vLLM: Mistral's repositories also hold a
    consolidated.safetensors of the same weights in Mistral's own naming)."""
    from safetensors import safe_open
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted({os.path.join(model_dir, name) for name in json.load(f)["weight_map"].values()})
    else:
        files = sorted(glob.glob(os.path.join(glob.escape(model_dir), "*.safetensors")))     # [ ] * ? are a name's
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir!r}")
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


@contextlib.contextmanager
def pool_lock(device: torch.device):
    """CPU: one engine of this host at a time checks the memory left and takes its KV pool, which
    is resident once written. Triton loads a model's instances at once, and each saw the memory
    the others were about to take: pools that fit once but not twice passed, and the OOM killer
    ended one. (CUDA engines split the device's share between them: engines_per_device.)"""
    if device.type != "cpu":
        yield
        return
    path = os.path.join(tempfile.gettempdir(), "inflight-kv-pool.lock")
    try:
        import fcntl
        # read-only, and created only where missing: flock needs no more, so another user's file
        # serves too (an O_CREAT open of it in a sticky /tmp is refused under protected_regular)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)
    except (ImportError, OSError):      # not POSIX, or a temp dir that cannot hold it: unordered
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:                 # a file system without locks (NFS without lockd): unordered
            pass
        yield
    finally:
        os.close(fd)


class ModelRunner:
    def __init__(self, model_dir: str | None, hf_config, config: EngineConfig,
                 lora_modules: dict[str, str] | None = None, score_rows: tuple[int, ...] | None = None):
        """model_dir None keeps the modules' random initialisation (inflight.testing.random_engine).
        score_rows: a reranker's score head is made of these LM head rows (score_head.py)."""
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device, hf_config)
        if config.cpu_threads:
            torch.set_num_threads(config.cpu_threads)
        self.spec = ModelSpec.from_hf_config(hf_config)
        self.max_model_len = self._resolve_max_model_len(config.max_model_len)
        self.block_size = config.block_size
        self.backend = select_backend(config.attention_backend, self.device, self.dtype)
        # Random weights are drawn in float32 (torch's default dtype, never changed here: it is the
        # whole process's, and two engines loading at once on two threads left it bfloat16 for
        # everything after them), the same values whatever the dtype. A checkpoint sets every
        # parameter (load_hf_weights checks), so its modules are built on the meta device, without
        # drawing random weights first (a 1.2B model: 6 s on 2 cores), and take storage only in the
        # serving dtype, so loading never holds a float32 copy (a 14B model: 59 GB instead of 29).
        with torch.device(self.device if model_dir is None else "meta"):
            model_class = LlamaForCausalLM if self.spec.num_labels is None else LlamaForSequenceClassification
            self.model = model_class(self.spec).to(self.dtype)
        if model_dir is not None:
            self.model.to_empty(device=self.device)
            self.model.tie_weights()        # to_empty gives the tied head a tensor of its own
            with torch.no_grad():
                weights = ((n, t.to(self.dtype)) for n, t in iter_checkpoint(model_dir))
                if score_rows is not None:
                    weights = with_score_head(weights, score_rows, hf_config)
                self.model.load_hf_weights(weights)
        self.model.eval()
        # CPU: weights in oneDNN's layout once, not on every call; steps padded to a few shapes, for
        # which oneDNN keeps its built matmuls (packed_linear.shape_bucket)
        packed = self.device.type == "cpu" and pack_linears(self.model) > 0
        self.bucket = shape_bucket if packed else None
        if self.device.type == "cpu":
            heap.keep_activations_mapped()      # no page faults for each step's activations
        self.lora = None     # LoraWeights when enable_lora: every adapter on the host, max_loras in slots
        if config.enable_lora:
            runtime_rows = (config.max_cpu_loras or config.max_loras) if config.allow_runtime_lora_updating else 0
            self.lora = load_lora_weights(lora_modules or {}, self.spec, config.max_loras, config.max_lora_rank,
                                          self.dtype, self.device, kernels=self.backend.name, runtime_rows=runtime_rows)
        self.cos, self.sin = rope_tables(hf_config, self.max_model_len, self.dtype, self.device)
        self.num_blocks = config.num_kv_blocks or self._blocks_that_fit()
        shape = (self.num_blocks, self.block_size, self.spec.num_kv_heads, self.spec.head_dim)
        with pool_lock(self.device):
            self._check_pool()
            self.kv_caches = [(self._cache_tensor(shape), self._cache_tensor(shape))
                              for _ in range(self.spec.num_layers)]
        # CUDA: decode steps replay captured graphs (the Triton backend never syncs with the host;
        # adapters' per-step segments are not captured)
        self.graphs = None
        if self.device.type == "cuda" and self.backend.name == "triton" and not config.enforce_eager \
                and self.lora is None and config.runner != "pooling":     # a pooling model never decodes
            self.graphs = DecodeGraphs(self, capture_sizes(config.max_num_seqs))
        log.info("inflight runner: %s on %s/%s, attention=%s, %d KV blocks x %d tokens (%.2f GiB)",
                 type(self.model).__name__, self.device, self.dtype, self.backend.name, self.num_blocks,
                 self.block_size, self.num_blocks * self.kv_block_bytes / 2**30)

    def on_device(self):
        """The engine's CUDA device made current, for a forward on any thread: Triton kernels
        launch on the current device, not their tensors' (cuda:N would run them on GPU 0)."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def _cache_tensor(self, shape: tuple[int, ...]) -> torch.Tensor:
        if self.device.type == "cpu":
            return hugepages.zeros(shape, self.dtype)     # the decode kernels read it page by page
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    @property
    def kv_block_bytes(self) -> int:
        s = self.spec
        return 2 * s.num_layers * self.block_size * s.num_kv_heads * s.head_dim * self.dtype.itemsize

    def _resolve_max_model_len(self, requested: int | None) -> int:
        limit = self.spec.longest_context
        if requested is not None and requested > limit:
            raise ValueError(f"'max_model_len' {requested} exceeds what the model supports ({limit})")
        return requested or self.spec.context_length

    def _blocks_that_fit(self) -> int:
        """CUDA: the whole budget (more blocks, more prefix cache). CPU: no more than max_num_seqs
        sequences of max_model_len tokens can use, within the budget, since the pool is host memory
        the rest of the machine could use."""
        if self.device.type == "cpu":
            budget = (self.config.kv_cache_gb or _CPU_DEFAULT_KV_GB) * 2**30
            source = f"kv_cache_gb={self.config.kv_cache_gb}" if self.config.kv_cache_gb else \
                "the CPU default; kv_cache_gb sets it"
        elif self.config.kv_cache_gb:
            budget, source = self.config.kv_cache_gb * 2**30, f"kv_cache_gb={self.config.kv_cache_gb}"
        else:
            with self.on_device():          # its forward launches Triton kernels
                budget = self._cuda_kv_budget()
            source = f"gpu_memory_utilization={self.config.gpu_memory_utilization} after weights and activations"
        blocks = int(budget // self.kv_block_bytes)
        if blocks < 1:
            fix = "'kv_cache_gb'" if self.device.type == "cpu" or self.config.kv_cache_gb else \
                "'gpu_memory_utilization' or set 'kv_cache_gb'"
            raise ValueError(f"the KV cache budget ({source}: {max(budget, 0):.0f} bytes) holds no block of "
                             f"{self.kv_block_bytes} bytes; raise {fix}")
        usable = self.config.max_num_seqs * -(-self.max_model_len // self.block_size)
        if self.device.type == "cpu" and usable < blocks:
            log.info("inflight runner: KV pool of %d blocks (%.0f MiB): what max_num_seqs=%d x max_model_len=%d "
                     "can use, under the budget of %.0f MiB (%s)", usable, usable * self.kv_block_bytes / 2**20,
                     self.config.max_num_seqs, self.max_model_len, budget / 2**20, source)
            return usable
        log.info("inflight runner: KV pool of %d blocks (%.0f MiB): the budget of %.0f MiB (%s); "
                 "max_num_seqs=%d x max_model_len=%d could use %d", blocks, blocks * self.kv_block_bytes / 2**20,
                 budget / 2**20, source, self.config.max_num_seqs, self.max_model_len, usable)
        return blocks

    def _check_pool(self) -> None:
        """Before allocating: the pool holds one sequence of max_model_len (vLLM's start-up check;
        else each request was refused what the server advertises: a chat without max_tokens asks
        for the whole context), and fits the memory there is (else the allocator's traceback)."""
        knob = ("'num_kv_blocks'" if self.config.num_kv_blocks else "'kv_cache_gb'"
                if self.device.type == "cpu" or self.config.kv_cache_gb else "'gpu_memory_utilization'")
        tokens = self.num_blocks * self.block_size
        if tokens < self.max_model_len:
            raise ValueError(f"the KV pool of {self.num_blocks} blocks x {self.block_size} tokens holds {tokens} "
                             f"tokens, less than one sequence of 'max_model_len' {self.max_model_len}: set "
                             f"'max_model_len' to at most {tokens}, or raise {knob}")
        size, available = self.num_blocks * self.kv_block_bytes, self._available_memory()
        if available is not None and size > available:
            raise ValueError(f"the KV pool of {self.num_blocks} blocks needs {size / 2**30:.2f} GiB, more than the "
                             f"{available / 2**30:.2f} GiB available on {self.device.type}: lower {knob}")

    def _available_memory(self) -> int | None:
        if self.device.type == "cuda":
            return torch.cuda.mem_get_info(self.device)[0]
        try:
            with open("/proc/meminfo") as f:
                fields = dict(line.split(":", 1) for line in f)
            return int(fields["MemAvailable"].split()[0]) * 1024
        except (OSError, KeyError, ValueError):         # not Linux: the allocator decides
            return None

    def _cuda_kv_budget(self) -> float:
        """What gpu_memory_utilization leaves after weights and the peak of a full step, measured:
        a forward pass of max_num_batched_tokens padding tokens, then top-p sampling of
        max_num_seqs rows (the sampler's fp32 copies and sort of the logits)."""
        torch.cuda.synchronize(self.device)
        # random weights were drawn in fp32 and then cast: give those freed blocks back to the
        # device, or they would stay reserved beside the KV pool and push the total past the target
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        n = self.config.max_num_batched_tokens
        empty = torch.zeros(0, dtype=torch.int32, device=self.device)
        meta = AttentionMetadata(empty.long(), torch.zeros(1, dtype=torch.int32, device=self.device),
                                 empty, empty.view(0, 0), 0, 0)
        # a step gathers one rope row per token (n may exceed max_model_len: no slice of the tables)
        zeros = torch.zeros(n, dtype=torch.long, device=self.device)
        with torch.no_grad():
            hidden = self.model(zeros, self.cos[zeros], self.sin[zeros], meta,
                                [(None, None)] * self.spec.num_layers, self.backend)
            logits = self.model.compute_logits(hidden[:self.config.max_num_seqs])
            del hidden
            # the sampler's working set on these logits: fp32 copy, min-p mask, top-p sort and scatter, the draw
            rows = logits.shape[0]
            probs = Sampler._probs(logits.float(), np.ones(rows), np.full(rows, -1), np.full(rows, 0.9),
                                   np.full(rows, 0.1))
            (probs / torch.empty_like(probs).exponential_()).argmax(dim=-1)
        # reserved, not allocated: the allocator keeps the step's segments cached beside the KV pool
        # allocated next, so the device holds the reserved peak (on the H200 run, the allocated
        # peak put the device 1.5 GiB past its target)
        peak = torch.cuda.max_memory_reserved(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        used_by_others = total - free - torch.cuda.memory_reserved(self.device)
        target = total * self.config.gpu_memory_utilization
        # engines sharing the device (Triton instances on one GPU, which load at once) each take an
        # even part of the target; alone, what the device has left under it (others counted): else
        # the second engine counted the first's pool as another user's and found no memory
        return min(target / self.config.engines_per_device - peak, target - used_by_others - peak)

    # ---- one step ------------------------------------------------------------------------------
    def prepare(self, step: PackedStep, sample_order: np.ndarray | None = None):
        """sample_order: which of the packed sampling rows comes first, second, ... (when the rows
        were packed in another order than the caller samples them in)."""
        to = self.to_device
        meta = AttentionMetadata(to(step.slot_mapping), to(step.cu_seqlens_q), to(step.seq_lens),
                                 to(step.block_table), step.num_real_tokens,
                                 int(step.seq_lens.max()) if len(step.seq_lens) else 0)
        logits_index = step.logits_index if sample_order is None else step.logits_index[sample_order]
        return to(step.input_ids), to(step.positions), meta, to(logits_index), step.prompt

    def to_device(self, array: np.ndarray) -> torch.Tensor:
        host = torch.from_numpy(np.ascontiguousarray(array))
        if self.device.type == "cuda":
            # from pageable memory the driver stages the copy synchronously; a pinned block (torch's
            # caching host allocator, held until the copy is done) makes it truly asynchronous
            host = host.pin_memory()
        return host.to(self.device, non_blocking=True)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                lora=None) -> torch.Tensor:
        """The model over packed tokens at their positions, reading and writing the KV caches."""
        return self.model(input_ids, self.cos[positions], self.sin[positions], meta, self.kv_caches, self.backend,
                          lora)

    @torch.no_grad()
    def execute(self, out: SchedulerOutput, table: BatchTable,
                keep_hidden: bool = False) -> tuple[torch.Tensor, PromptPositions | None, torch.Tensor | None]:
        """Forward one scheduled step: logits [num_sampling_rows, vocab] for the rows that sample,
        the hidden states of the positions that score prompt tokens (None: nobody asked), and with
        keep_hidden those of the sampling rows (an embedding's: pooling.py), else None."""
        lora = sample_order = None
        if self.lora is not None:      # rows grouped by adapter; lora is None when no row has one
            out, lora, sample_order = self.lora.group_step(out, table)
        step = pack_step(out, table, self.block_size, self.bucket)
        if self.graphs is not None and step.prompt is None and not keep_hidden and self.graphs.fits(step):
            return self.graphs.run(step), None, None
        input_ids, positions, meta, logits_index, prompt = self.prepare(step, sample_order)
        hidden = self.forward(input_ids, positions, meta, lora)
        if prompt is not None:
            prompt.hidden = hidden[self.to_device(prompt.index)]
        sampled = hidden[logits_index]
        return self.compute_logits(sampled), prompt, sampled if keep_hidden else None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head's logits of these rows (sampled rows, or scored prompt positions: any count);
        a bucketed runner runs it on a shape bucket's rows, padded with copies of the last, as it
        runs the steps."""
        rows = len(hidden)
        if self.bucket is not None and rows:
            hidden = torch.cat([hidden, hidden[-1:].expand(self.bucket(rows) - rows, -1)])
        return self.model.compute_logits(hidden)[:rows]


@dataclass(slots=True)
class PackedStep:
    input_ids: np.ndarray       # [num_tokens] int64, real tokens then padding
    positions: np.ndarray       # [num_tokens] int64
    slot_mapping: np.ndarray    # [num_real_tokens] int64
    cu_seqlens_q: np.ndarray    # [num_seqs + 1] int32
    seq_lens: np.ndarray        # [num_seqs] int32
    block_table: np.ndarray     # [num_seqs, max_blocks] int32
    logits_index: np.ndarray    # [num_sampling_rows] int64: each sampling row's last token
    num_real_tokens: int
    prompt: PromptPositions | None     # tokens that score prompt tokens (prompt_logprobs)


def pack_step(out: SchedulerOutput, table: BatchTable, block_size: int,
              bucket: Callable[[int], int] | None = None) -> PackedStep:
    """Flatten a scheduled step by fancy indexing into the batch table (no per-request loop);
    bucket: the token count (with the policy's padding) padded up to bucket(count)."""
    rows, n = out.rows, out.num_scheduled.astype(np.int64)
    start = out.start.astype(np.int64)
    cu = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(n, out=cu[1:])
    total = int(cu[-1])
    seq = np.repeat(np.arange(len(rows)), n)
    positions = np.arange(total) - cu[seq] + start[seq]
    token_rows = rows[seq]
    input_ids = table.token_ids[token_rows, positions].astype(np.int64)
    slots = table.block_table[token_rows, positions // block_size].astype(np.int64) * block_size \
        + positions % block_size
    seq_lens = start + n
    prompt = _prompt_positions(table, rows, token_rows, positions)
    max_blocks = int(-(-seq_lens.max() // block_size)) if len(rows) else 0
    pad = out.num_padding_tokens
    if bucket is not None:
        pad = bucket(total + pad) - total
    if pad:
        input_ids = np.concatenate([input_ids, np.zeros(pad, dtype=np.int64)])
        positions = np.concatenate([positions, np.zeros(pad, dtype=np.int64)])
    return PackedStep(input_ids, positions, slots, cu.astype(np.int32), seq_lens.astype(np.int32),
                      table.block_table[rows, :max_blocks], cu[1:][out.sample_mask] - 1, total, prompt)


def _prompt_positions(table: BatchTable, rows: np.ndarray, token_rows: np.ndarray,
                      positions: np.ndarray) -> PromptPositions | None:
    """The step's tokens followed by a prompt token, of requests that asked for prompt
    log-probabilities, that do not have theirs yet."""
    if not (table.num_prompt_logprobs[rows] >= 0).any():
        return None
    index = np.flatnonzero((table.num_prompt_logprobs[token_rows] >= 0)
                           & (positions + 1 < table.num_prompt[token_rows])
                           & (positions >= table.prompt_logprobs_from[token_rows]))
    if not index.size:
        return None
    scoring = token_rows[index]
    return PromptPositions(index, scoring, table.token_ids[scoring, positions[index] + 1].astype(np.int64))
