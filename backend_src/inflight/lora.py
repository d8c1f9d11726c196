"""Multi-LoRA: PEFT adapters served beside the base weights, many adapters in one step (the
S-LoRA / Punica way: the base weights stay unmerged, each token adds its own adapter's low-rank
term).

Loading (`load_adapter`): a PEFT LoRA directory (adapter_config.json + adapter_model.safetensors,
or adapter_model.bin) checked against the base model. Served exactly: any subset of q/k/v/o/gate/
up/down_proj, per-module ranks and alphas (`rank_pattern`, `alpha_pattern`), scaling lora_alpha / r
or lora_alpha / sqrt(r) (`use_rslora`). Anything else (DoRA, embedding or lm_head adapters,
modules_to_save, LoRA biases, other variants, a rank over max_lora_rank, shapes that do not fit the
base model) is refused with a message naming the adapter and the field or tensor.

Weights (`LoraWeights`): every adapter named at start-up is written once into a row of per-layer
host tensors, ranks zero-padded to the largest; the step reads `max_loras` slots of the same shape
on the device. With runtime loading (EngineConfig.allow_runtime_lora_updating), `max_cpu_loras`
more rows take adapters a request names by path (`lookup`, `add`: the least recently named one
no request holds gives its row up), and every module gets columns of rank max_lora_rank. The
model keeps its fused base projections; per fused group (qkv, o, gate_up, down) the group's
modules share one input, so their A matrices sit side by side in A [slots, in, modules x R] (one
shrink serves q, k and v) and their B matrices, each scaled by its lora_alpha / r (or / sqrt(r)),
sit block-diagonally in B [slots, modules x R, the group's output columns] (one expand adds every
module's term into its own columns of the fused output). Without runtime loading, only modules
some adapter targets get tensors.

Slots (vLLM's `max_loras`: the adapters one step may hold): the scheduler admits no request whose
adapter would make more than `max_loras` distinct adapters run at once, and each step
(`LoraWeights.group_step`) copies an adapter missing from the slots into the slot used least
recently by an adapter not in the step. With no more adapters than slots nothing is ever copied.

A step (`LoraWeights.group_step`): the runner packs the step's rows grouped by slot (base rows
first), so each adapter's tokens are one contiguous run; the logits come back in the scheduler's
order. A step without adapter tokens is not touched and the model runs exactly as without LoRA.
`LoraBatch.layer(i).add(group, x, y)` after each base projection adds (x A_i)(scale_i B_i) for the
tokens of each adapter i, in place (base tokens pay nothing). Three paths, following the attention
backend: on CUDA ('triton') one SGMV shrink and one expand launch per group for all adapters at
once (`inflight.kernels.lora`); on CPU ('cpu') one call of the compiled kernel (cpu_kernels.cpp
`lora_add`) for the tokens of every request with a few in the step (decodes and short prompts,
where torch's per-matmul overhead is most of the cost) and one matmul pair per long prefill chunk
(where the BLAS matmul is faster); otherwise ('torch', and float64) one matmul pair per run, on
views of it. Up to rounding, that is PEFT's `base(x) + lora_B(lora_A(x)) * scaling`.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field

import numpy as np
import torch

from .batch_table import BatchTable
from .models.llama import ModelSpec
from .packed_linear import shape_bucket
from .scheduler import SchedulerOutput

SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# fused projection group of the model -> its modules, in the column order of the fused output
GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
          "down": ("down_proj",)}
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
# PEFT's key for a LoRA weight of a decoder layer's linear module (saved without the adapter name;
# its base_model.model. prefix optional, as vLLM reads adapters saved by other tools)
_TENSOR = re.compile(r"^(?:base_model\.model\.)?((?:model\.)?layers\.(\d+)\.(\w+)\.(\w+))\.lora_([AB])\.weight$")
# init_lora_weights methods under which PEFT rebuilds the base weights as it loads the adapter (the
# adapter is then exact only on that residual base, until converted with
# path_initial_model_for_weight_conversion)
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")
# adapter_config.json fields that ask for something other than plain LoRA on linear layers
_UNSUPPORTED_FIELDS = {
    "use_dora": "DoRA adapters are not supported",
    "modules_to_save": "full copies of base modules (modules_to_save) are not supported",
    "trainable_token_indices": "trainable token embeddings are not supported",
    "lora_bias": "LoRA biases are not supported",
    "target_parameters": "LoRA on parameters (target_parameters) is not supported",
    "layer_replication": "layer replication is not supported",
    "alora_invocation_tokens": "activated LoRA (aLoRA) is not supported",
    "velora_config": "VeLoRA is not supported",
    "monteclora_config": "MonteCLoRA is not supported",
    "use_bdlora": "BD-LoRA is not supported",
    "arrow_config": "Arrow routing is not supported",
    "kasa_config": "KaSA is not supported",
    "use_qalora": "QA-LoRA is not supported",
    "megatron_config": "Megatron parallel layers are not supported",
}


class LoraError(ValueError):
    """An adapter that cannot be served; the message names the adapter and the field or tensor."""


@dataclass(slots=True)
class LoraModule:
    a: torch.Tensor          # [r, in], as PEFT stores lora_A
    b: torch.Tensor          # [out, r], as PEFT stores lora_B
    scale: float


@dataclass(slots=True)
class LoraAdapter:
    name: str
    path: str
    rank: int                                          # the largest rank of its modules
    modules: dict[tuple[int, str], LoraModule]         # (layer, module name) -> weights
    key: bytes = b""                                   # identity in prefix-cache hashes


def module_shapes(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """(in, out) features of each supported module of the base model."""
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    h, i = spec.hidden_size, spec.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def load_adapter(name: str, path: str, spec: ModelSpec, max_rank: int) -> LoraAdapter:
    """Read and check one PEFT LoRA adapter directory; weights stay in their saved dtype on CPU.
    Whatever goes wrong is a LoraError naming the adapter: at runtime it is the request's error, and
    must never reach the engine as a fault of its own."""
    try:
        return _read_adapter(name, path, spec, max_rank)
    except LoraError:
        raise
    except Exception as exc:        # a file that will not read, JSON nested past Python's limit, ...
        raise LoraError(f"LoRA adapter {name!r} ({path}): cannot be read: {type(exc).__name__}: {exc}") from None


def _read_adapter(name: str, path: str, spec: ModelSpec, max_rank: int) -> LoraAdapter:
    if not isinstance(name, str) or not name:
        raise LoraError(f"LoRA adapter names must be non-empty strings, got {name!r}")
    if not isinstance(path, str) or not os.path.isdir(path):
        raise LoraError(f"LoRA adapter {name!r}: directory {path!r} does not exist")
    where = f"LoRA adapter {name!r} ({path})"

    def fail(message: str):
        raise LoraError(f"{where}: {message}")

    identity = adapter_key(name, path)     # taken before the files are read: a run saving new ones meanwhile shows

    config_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(config_path):
        fail("no adapter_config.json in the directory")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        fail(f"adapter_config.json is not valid JSON: {exc}")
    if not isinstance(config, dict):
        fail("adapter_config.json must hold a JSON object")
    _check_config(config, fail)
    tensors = _read_tensors(path, fail)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}     # (layer, module) -> {"A": .., "B": ..}
    keys: dict[tuple[int, str], str] = {}                           # (layer, module) -> PEFT module key
    shapes = module_shapes(spec)
    for tensor_name, tensor in tensors.items():
        match = _TENSOR.match(tensor_name)
        if match is None:
            fail(_unsupported_tensor(tensor_name))
        key, layer, parent, module, which = match.groups()
        if module not in shapes:
            fail(f"target module {module!r} (tensor {tensor_name!r}) is not supported; "
                 f"supported: {list(SUPPORTED_MODULES)}")
        if parent != _PARENT[module]:
            fail(f"tensor {tensor_name!r}: {module} belongs under {_PARENT[module]}, not {parent}")
        if int(layer) >= spec.num_layers:
            fail(f"tensor {tensor_name!r} is for layer {layer}, but the base model has {spec.num_layers} layers "
                 f"(was it trained for another base model, {config.get('base_model_name_or_path')!r}?)")
        pairs.setdefault((int(layer), module), {})[which] = tensor
        keys[(int(layer), module)] = key
    if not pairs:
        fail("adapter_model holds no LoRA weights")
    alpha_pattern = config.get("alpha_pattern") or {}
    modules = {}
    for (layer, module), ab in sorted(pairs.items()):
        key = keys[(layer, module)]
        if set(ab) != {"A", "B"}:
            fail(f"{key} has lora_{next(iter(ab))} but no lora_{'B' if 'A' in ab else 'A'}")
        a, b = ab["A"], ab["B"]
        fan_in, fan_out = shapes[module]
        rank = a.shape[0] if a.dim() else 0
        if a.dim() != 2 or b.dim() != 2 or rank < 1 or a.shape[1] != fan_in or b.shape != (fan_out, rank):
            fail(f"{key} has lora_A {list(a.shape)} and lora_B {list(b.shape)}, but the base model's {module} "
                 f"maps {fan_in} -> {fan_out} features (hidden_size {spec.hidden_size}); was it trained for "
                 f"another base model ({config.get('base_model_name_or_path')!r})?")
        if rank > max_rank:
            fail(f"{key} has rank {rank}, over 'max_lora_rank' {max_rank}")
        alpha = alpha_pattern.get(_pattern_key(alpha_pattern, key), config.get("lora_alpha", 8))
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
            fail(f"'lora_alpha' / 'alpha_pattern' for {key} must be a number, got {alpha!r}")
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        modules[(layer, module)] = LoraModule(a, b, scale)
    if not identity or adapter_key(name, path) != identity:     # keyless, it would share blocks with another
        fail("its files changed, or went away, while they were read: load it again")
    return LoraAdapter(name, path, max(m.a.shape[0] for m in modules.values()), modules, identity)


def adapter_key(name: str, path: str) -> bytes:
    """An adapter's identity in prefix-cache hashes: its name, directory and files' sizes and
    modification times (an adapter trained again in place is another adapter)."""
    path = os.path.realpath(path)
    try:
        files = sorted(f for f in os.listdir(path) if f.startswith("adapter_"))
    except OSError:                 # no directory (any more), or none this process may read
        return b""
    return hashlib.blake2b(f"{name}|{path}|{[_stamp(path, f) for f in files]}".encode(), digest_size=16).digest()


def _stamp(path: str, file: str) -> tuple:
    """A file's size and modification time; a link to nothing (a pruned download) has none."""
    try:
        stat = os.stat(os.path.join(path, file))
    except OSError:
        return file, None
    return file, stat.st_size, stat.st_mtime_ns


def _check_config(config: dict, fail) -> None:
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        fail(f"'peft_type' is {peft_type!r}; only LORA adapters are supported")
    for name, message in _UNSUPPORTED_FIELDS.items():
        if config.get(name):
            fail(f"'{name}' is set: {message}")
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
        fail(f"'init_lora_weights' is {init!r}: PEFT changes the base weights when it loads such an adapter; "
             "convert it to plain LoRA first (PEFT's save_pretrained(path_initial_model_for_weight_conversion=...))")
    if config.get("bias", "none") != "none":
        fail(f"'bias' is {config['bias']!r}: adapters that train base biases are not supported (need 'none')")
    # target_modules is not checked: PEFT needs only one name to match (generic training scripts list
    # other architectures' names too), and what an adapter changes is its tensors, each checked by name
    for name in ("rank_pattern", "alpha_pattern"):
        if not isinstance(config.get(name) or {}, dict):
            fail(f"'{name}' must be a JSON object")
        for pattern in config.get(name) or {}:
            try:
                re.compile(pattern)
            except re.error as exc:
                fail(f"'{name}' key {pattern!r} is not a regular expression: {exc}")


def _pattern_key(patterns: dict, key: str) -> str | None:
    """PEFT's rule for rank_pattern / alpha_pattern: the first pattern matching the end of the
    module's key at a dot boundary."""
    for pattern in patterns:
        if re.match(rf"(.*\.)?({pattern})$", key):
            return pattern
    return None


def _unsupported_tensor(name: str) -> str:
    if "lora_magnitude_vector" in name:
        return f"tensor {name!r} is a DoRA magnitude: DoRA adapters are not supported"
    if "lora_embedding" in name or "embed_tokens" in name:
        return f"tensor {name!r}: embedding adapters are not supported"
    if "lm_head" in name:
        return f"tensor {name!r}: lm_head adapters are not supported"
    if "modules_to_save" in name:
        return f"tensor {name!r}: modules_to_save is not supported"
    if ".lora_B.bias" in name:
        return f"tensor {name!r}: LoRA biases are not supported"
    return (f"tensor {name!r} is not a LoRA A/B weight of a decoder layer's "
            f"{'/'.join(SUPPORTED_MODULES)}")


def _read_tensors(path: str, fail) -> dict[str, torch.Tensor]:
    safetensors_path = os.path.join(path, "adapter_model.safetensors")
    bin_path = os.path.join(path, "adapter_model.bin")
    try:
        if os.path.isfile(safetensors_path):
            from safetensors.torch import load_file
            return load_file(safetensors_path)
        if os.path.isfile(bin_path):
            return torch.load(bin_path, map_location="cpu", weights_only=True)
    except Exception as exc:          # a corrupt file: say which, without a traceback
        fail(f"cannot read the adapter weights: {type(exc).__name__}: {exc}")
    fail("no adapter_model.safetensors (or adapter_model.bin) in the directory")


# A request's tokens in a step go through the compiled CPU kernel up to this many, through a matmul
# pair past it (BLAS wins once a run has enough rows to fill its tiles: ~256 on a Zen 4 core, bf16).
# Decided per request, not per adapter: the two paths round differently, and by the adapter's run a
# request's bf16 output changed with the other requests of its adapter in the step
CPU_KERNEL_MAX_TOKENS = 128


# ---- stacked weights ----------------------------------------------------------------------------
@dataclass(slots=True)
class GroupWeights:
    """One fused projection group of one layer, every adapter stacked by slot. The group's targeted
    modules sit side by side: module j owns shrink columns [j*R, (j+1)*R) of `a` and, in `b`, the
    block of those rows under its own output columns, pre-multiplied by the adapter's scale for it
    (zero elsewhere), so one shrink and one expand per adapter serve the whole group."""
    a: torch.Tensor             # [slots, in, modules x R]: A^T of each module, rank zero-padded to R
    b: torch.Tensor             # [slots, modules x R, end - start]: scale * B^T, block-diagonal
    start: int                  # the fused output columns the group's modules cover
    end: int
    module_cols: np.ndarray     # int32 [modules, 2]: each module's columns in b (begin, end)
    modules: tuple[str, ...]    # the targeted modules, in column order
    cpu_add: object = None      # the compiled kernel bound to a and b (CpuKernels.lora_adder)


class LoraWeights:
    """Every adapter's weights stacked on the host, `max_loras` of them in the device's slots;
    name -> adapter id (its row of the host stack), adapter id -> slot. With `runtime_rows`, that
    many more rows take adapters loaded while serving (`add`), the least recently used one not
    held by a request giving its row up."""

    def __init__(self, adapters: list[LoraAdapter], spec: ModelSpec, dtype: torch.dtype, device: torch.device,
                 kernels: str = "torch", max_loras: int | None = None, runtime_rows: int = 0, max_rank: int = 0):
        """kernels: the attention backend's name ('triton', 'cpu' or 'torch'): which path computes
        the adapters' terms where the dtype allows it. max_loras: how many adapters may run at once
        (default: all); the device holds that many slots, or one per row where there are fewer.
        runtime_rows: rows for adapters loaded later; any of max_rank or less may come, so every
        module gets columns of rank max_rank (without them, only the adapters' modules and ranks)."""
        self.ids = {adapter.name: i for i, adapter in enumerate(adapters)}
        self.keys = [adapter.key for adapter in adapters] + [b""] * runtime_rows
        self.static_paths = [os.path.realpath(adapter.path) for adapter in adapters]
        # row -> the name it was loaded under: an older adapter of a name keeps its row while its requests run
        self.row_names: list[str | None] = [adapter.name for adapter in adapters] + [None] * runtime_rows
        self.num_static = len(adapters)
        self.recent: dict[str, int] = {}         # runtime adapters' names -> rows, least recently named first
        num_rows = len(adapters) + runtime_rows
        self.max_loras = num_rows if max_loras is None else max_loras
        assert self.max_loras >= 1 or not num_rows
        num_slots = min(self.max_loras, num_rows)
        self.rank = max_rank if runtime_rows else max((adapter.rank for adapter in adapters), default=0)
        self.device = device
        from . import cpu_kernels
        from .kernels.lora import DTYPES
        self.use_kernels = kernels == "triton" and dtype in DTYPES
        self.cpu_kernels = cpu_kernels.load() if kernels == "cpu" and dtype in cpu_kernels.DTYPES else None
        if self.cpu_kernels is not None:
            self.rank = -(-self.rank // 16) * 16        # the compiled kernel works in vectors of 16
        # every adapter on the host, where the slots are loaded from (pinned: a CUDA copy does not
        # wait for the host)
        shapes = module_shapes(spec)
        self.host: list[dict[str, GroupWeights]] | None = [
            self._layer_groups(layer, adapters, shapes, num_rows, dtype, runtime_rows > 0, pin=device.type == "cuda")
            for layer in range(spec.num_layers)]
        for row, adapter in enumerate(adapters):
            self._write(row, adapter)
        self.layers: list[dict[str, GroupWeights]] = [
            {group: GroupWeights(w.a.new_zeros((num_slots, *w.a.shape[1:]), device=device),
                                 w.b.new_zeros((num_slots, *w.b.shape[1:]), device=device),
                                 w.start, w.end, w.module_cols, w.modules) for group, w in layer.items()}
            for layer in self.host]
        if self.cpu_kernels is not None:
            for layer in self.layers:
                for w in layer.values():
                    w.cpu_add = self.cpu_kernels.lora_adder(w.a, w.b, self.rank, w.module_cols, w.start)
        self.slot_of = np.full(num_rows, -1, dtype=np.int32)         # adapter id -> its slot; -1: none
        self.last_used = np.zeros(num_slots, dtype=np.int64)         # slot -> the step that last used it
        self.num_steps = 0
        self.num_loads = 0       # adapters copied into a slot
        for adapter_id in range(min(num_slots, len(adapters))):
            self._load(adapter_id, adapter_id)
        self.num_loads = 0       # the first adapters fill the slots at start-up: not swaps
        if num_slots == num_rows and not runtime_rows:
            self.host = None     # every adapter has a slot for good: nothing is ever copied again

    def _layer_groups(self, layer: int, adapters: list[LoraAdapter], shapes, num_rows: int, dtype,
                      every_module: bool, pin: bool) -> dict[str, GroupWeights]:
        """One layer's host stack, zeros: a group for the modules some adapter targets (every
        module where adapters may come later)."""
        groups = {}
        for group, names in GROUPS.items():
            targeted = list(names) if every_module else [
                n for n in names if any((layer, n) in a.modules for a in adapters)]
            if not targeted:
                continue
            offsets = {n: sum(shapes[m][1] for m in names[:names.index(n)]) for n in names}
            start, end = offsets[targeted[0]], offsets[targeted[-1]] + shapes[targeted[-1]][1]
            a = torch.zeros(num_rows, shapes[targeted[0]][0], len(targeted) * self.rank, dtype=dtype)
            b = torch.zeros(num_rows, len(targeted) * self.rank, end - start, dtype=dtype)
            module_cols = np.array([(offsets[n] - start, offsets[n] - start + shapes[n][1]) for n in targeted],
                                   dtype=np.int32)
            groups[group] = GroupWeights(a.pin_memory() if pin else a, b.pin_memory() if pin else b, start, end,
                                         module_cols, tuple(targeted))
        return groups

    def _write(self, row: int, adapter: LoraAdapter) -> None:
        """An adapter's weights into its host row (scale * B in float64, then rounded once)."""
        rank = self.rank
        for layer, groups in enumerate(self.host):
            for weights in groups.values():
                weights.a[row].zero_()
                weights.b[row].zero_()
                for j, name in enumerate(weights.modules):
                    module = adapter.modules.get((layer, name))
                    if module is not None:
                        r = module.a.shape[0]
                        cols = slice(*weights.module_cols[j])
                        weights.a[row, :, j * rank:j * rank + r] = module.a.t().to(weights.a.dtype)
                        weights.b[row, j * rank:j * rank + r, cols] = (module.b.t().double() * module.scale).to(
                            weights.b.dtype)
        self.keys[row] = adapter.key
        self.row_names[row] = adapter.name

    @property
    def names(self) -> list[str]:
        return list(self.ids)

    def named(self, name: str) -> int | None:
        """The row serving `name` (None: none does); a runtime adapter's marked used now."""
        if name in self.recent:
            self.recent[name] = self.recent.pop(name)
        return self.ids.get(name)

    def lookup(self, name: str, path: str) -> int | None:
        """The row of the runtime adapter `name` loaded from `path` as its files are now (None: not
        loaded), marked used. A static adapter's name with a path is refused unless the path is its own."""
        row = self.ids.get(name)
        if row is not None and row < self.num_static:
            if self.static_paths[row] != os.path.realpath(path):
                raise LoraError(f"'lora_path': LoRA adapter {name!r} is served from {self.static_paths[row]} (named at "
                                f"start-up), not {path}")
            return row
        if row is None or self.keys[row] != adapter_key(name, path):
            return None                  # not loaded, or loaded from another path or before its files changed
        return self.named(name)

    def add(self, adapter: LoraAdapter, held: set[int]) -> int:
        """Put a runtime adapter into the row of an older adapter of its name, a free row, or the row of
        the least recently used one, where no request in `held` (adapter ids) holds that row; a row the
        older adapter of that name held is kept until its requests end, as the new one takes the
        name. Returns its id."""
        taken = set(self.recent.values()) | held
        free = [row for row in range(self.num_static, len(self.keys)) if row not in taken]
        own = self.recent.get(adapter.name)          # the name's row before its files changed
        if own is not None and own not in held:
            free = [own]                             # replaced in place: no other adapter is forgotten for it
        elif not free:
            name = next((n for n, row in self.recent.items() if row not in held), None)
            if name is None:
                raise LoraError(f"'lora_path': LoRA adapter {adapter.name!r} cannot be loaded: requests hold all "
                                f"{len(self.keys) - self.num_static} runtime adapter rows ('max_cpu_loras')")
            free = [self.recent.pop(name)]
            del self.ids[name]
        row = free[0]
        self._write(row, adapter)
        self.slot_of[row] = -1                    # a slot holding the row's previous adapter is stale
        self.recent.pop(adapter.name, None)
        self.recent[adapter.name] = self.ids[adapter.name] = row
        return row

    def _load(self, adapter_id: int, slot: int) -> None:
        """Copy an adapter's weights into a slot (in stream order on CUDA: the steps before that
        read the slot are done with it first)."""
        self.slot_of[self.slot_of == slot] = -1         # the adapter it held, if any
        for host, layer in zip(self.host, self.layers):
            for group, weights in layer.items():
                weights.a[slot].copy_(host[group].a[adapter_id], non_blocking=True)
                weights.b[slot].copy_(host[group].b[adapter_id], non_blocking=True)
        self.slot_of[adapter_id] = slot
        self.num_loads += 1

    def activate(self, adapter_ids: np.ndarray) -> np.ndarray:
        """The slot of each of a step's adapter ids (-1 stays -1, the base model), loading the
        adapters that are not in a slot first (only where there are more adapters than slots)."""
        if self.host is not None:
            self._load_missing(adapter_ids)
        return np.where(adapter_ids >= 0, self.slot_of[np.maximum(adapter_ids, 0)], -1)

    def _load_missing(self, adapter_ids: np.ndarray) -> None:
        """Load the step's adapters that are not in a slot into the least recently used slots no
        other adapter of the step holds. The scheduler runs at most max_loras distinct adapters at
        once."""
        self.num_steps += 1
        wanted = np.unique(adapter_ids[adapter_ids >= 0])
        assert len(wanted) <= self.max_loras, f"{len(wanted)} adapters in one step, over max_loras {self.max_loras}"
        slots = self.slot_of[wanted]
        missing = wanted[slots < 0]
        if len(missing):
            in_use = np.zeros(len(self.last_used), dtype=bool)
            in_use[slots[slots >= 0]] = True
            free = np.flatnonzero(~in_use)
            least_recent = free[np.argsort(self.last_used[free], kind="stable")]
            for adapter_id, slot in zip(missing.tolist(), least_recent.tolist()):
                self._load(adapter_id, slot)
        self.last_used[self.slot_of[wanted]] = self.num_steps

    def group_step(self, out: SchedulerOutput, table: BatchTable) -> tuple[SchedulerOutput, "LoraBatch | None",
                                                                             np.ndarray | None]:
        """Load the step's adapters into slots and reorder its rows by slot (base rows first, then
        slot 0, 1, ...; stable), so each adapter's tokens form one contiguous run of the packed
        batch. Returns the grouped step, its LoraBatch (None when no row has an adapter: the step is
        left as it is) and the order that maps the grouped step's sampling rows back to `out`'s
        (None when nothing moved)."""
        adapter_ids = table.lora_id[out.rows]
        if not len(adapter_ids) or adapter_ids.max() < 0:
            return out, None, None
        row_slots = self.activate(adapter_ids)
        sample_order = None
        if np.any(row_slots[1:] < row_slots[:-1]):
            perm = np.argsort(row_slots, kind="stable")
            out = SchedulerOutput(out.rows[perm], out.num_scheduled[perm], out.start[perm], out.sample_mask[perm],
                                  out.num_padding_tokens)
            row_slots = row_slots[perm]
            sample_order = np.argsort(perm[out.sample_mask], kind="stable")
        return out, self.batch_runs(row_slots, out.num_scheduled), sample_order

    def batch_runs(self, row_slots: np.ndarray, counts: np.ndarray) -> "LoraBatch | None":
        """The LoraBatch of packed rows already grouped by slot: row i holds counts[i] tokens."""
        ends = np.cumsum(counts)
        requests = [(int(slot), int(end - count), int(end)) for slot, count, end in zip(row_slots, counts, ends)
                    if slot >= 0 and count > 0]
        return LoraBatch(self, requests) if requests else None


def merged_runs(runs: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Runs (slot, start, end) in order, each one that continues the previous run's slot where it
    ended folded into it."""
    merged = []
    for slot, start, end in runs:
        if merged and merged[-1][0] == slot and merged[-1][2] == start:
            merged[-1] = (slot, merged[-1][1], end)
        else:
            merged.append((slot, start, end))
    return merged


@dataclass(slots=True)
class LoraBatch:
    """One step's adapter tokens as contiguous runs of the packed batch: segment (slot, start, end)
    covers tokens [start, end). Tokens outside every segment run the base model alone."""
    weights: LoraWeights
    requests: list[tuple[int, int, int]]        # each request's tokens, (slot, start, end), in order
    segments: list[tuple[int, int, int]] = field(init=False)    # each adapter's run of them
    tokens: torch.Tensor | None = field(init=False, default=None)        # the Triton kernels' token list
    seg_starts: torch.Tensor | None = field(init=False, default=None)
    seg_slots: torch.Tensor | None = field(init=False, default=None)
    max_segment: int = field(init=False)
    # the CPU path: the runs the compiled kernel takes (int32 [n, 3], None: none) and the others
    short_segments: np.ndarray | None = field(init=False, default=None)
    short_address: int = field(init=False, default=0)         # of short_segments' data, for the kernel
    long_segments: list[tuple[int, int, int]] = field(init=False)

    def __post_init__(self) -> None:
        self.segments = merged_runs(self.requests)
        self.max_segment = max(end - start for _, start, end in self.segments)
        self.long_segments = self.segments
        if self.weights.cpu_kernels is not None:
            self.long_segments = [r for r in self.requests if r[2] - r[1] > CPU_KERNEL_MAX_TOKENS]
            # the next requests of an adapter share one kernel segment
            short = merged_runs([r for r in self.requests if r[2] - r[1] <= CPU_KERNEL_MAX_TOKENS])
            if short:
                self.short_segments = np.array(short, dtype=np.int32)
                self.short_address = self.short_segments.ctypes.data
        if self.weights.use_kernels:
            device = self.weights.device
            tokens = np.concatenate([np.arange(start, end) for _, start, end in self.segments])
            starts = np.cumsum([0] + [end - start for _, start, end in self.segments])
            to = lambda a: torch.from_numpy(np.asarray(a, dtype=np.int32)).to(device, non_blocking=True)  # noqa: E731
            self.tokens, self.seg_starts = to(tokens), to(starts)
            self.seg_slots = to([slot for slot, _, _ in self.segments])

    def layer(self, index: int) -> "LayerLora":
        return LayerLora(self, self.weights.layers[index])

    def add(self, groups: dict[str, GroupWeights], group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        weights = groups.get(group)
        if weights is None:
            return
        if self.weights.use_kernels:
            self._add_kernels(weights, x, y)
        else:
            self._add_cpu(weights, x, y)

    def _add_cpu(self, weights: GroupWeights, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += (x A) (scale B) into the group's columns, in place: the short runs in one call of
        the compiled kernel, the long ones (all of them on the torch path) one matmul pair each."""
        if self.short_segments is not None:
            weights.cpu_add(x, y, self.short_address, len(self.short_segments))
        out = y[:, weights.start:weights.end]
        for slot, start, end in self.long_segments:
            if self.weights.cpu_kernels is None:
                out[start:end].addmm_(torch.mm(x[start:end], weights.a[slot]), weights.b[slot])
                continue
            # oneDNN builds a matmul for every new row count (packed_linear.shape_bucket): the pair
            # runs on a window of a bucket's rows around the run, and keeps the run's rows
            rows = min(shape_bucket(end - start), len(x))
            first = min(start, len(x) - rows)
            window = out[first:first + rows].clone()
            window.addmm_(torch.mm(x[first:first + rows], weights.a[slot]), weights.b[slot])
            out[start:end] = window[start - first:end - first]

    def _add_kernels(self, weights: GroupWeights, x: torch.Tensor, y: torch.Tensor) -> None:
        from .kernels.lora import lora_expand, lora_shrink
        h = x.new_empty((x.shape[0], weights.a.shape[-1]))
        lora_shrink(x, weights.a, h, self.tokens, self.seg_starts, self.seg_slots, self.max_segment)
        lora_expand(h, weights.b, y[:, weights.start:weights.end], self.tokens, self.seg_starts, self.seg_slots,
                    self.max_segment)


@dataclass(slots=True)
class LayerLora:
    """What one decoder layer sees: add(group, x, y) after each base projection."""
    batch: LoraBatch
    groups: dict[str, GroupWeights]

    def add(self, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        self.batch.add(self.groups, group, x, y)


def load_lora_weights(lora_modules: dict[str, str], spec: ModelSpec, max_loras: int, max_rank: int,
                      dtype: torch.dtype, device: torch.device, kernels: str, runtime_rows: int = 0) -> LoraWeights:
    """Load every adapter named in `lora_modules` (name -> directory) onto the host, and up to
    max_loras of them into the device's slots; runtime_rows: room for that many loaded later."""
    if not isinstance(lora_modules, dict):
        raise LoraError(f"'lora_modules' must map adapter names to directories, got {type(lora_modules).__name__}")
    adapters = [load_adapter(name, path, spec, max_rank) for name, path in lora_modules.items()]
    return LoraWeights(adapters, spec, dtype, device, kernels, max_loras, runtime_rows, max_rank)
