"""Multi-LoRA: PEFT adapters served beside the base weights, many adapters in one step (the
S-LoRA / Punica way: the base weights stay unmerged, each token adds its own adapter's low-rank
term).

Loading (`load_adapter`): a PEFT LoRA directory (adapter_config.json + adapter_model.safetensors,
or adapter_model.bin) checked against the base model. Served exactly: any subset of q/k/v/o/gate/
up/down_proj, per-module ranks and alphas (`rank_pattern`, `alpha_pattern`), scaling lora_alpha / r
or lora_alpha / sqrt(r) (`use_rslora`). Anything else (DoRA, embedding or lm_head adapters,
modules_to_save, LoRA biases, other variants, a rank over max_lora_rank, shapes that do not fit the
base model) is refused with a message naming the adapter and the field or tensor.

Weights (`LoraWeights`): every adapter gets a slot in stacked per-layer tensors, ranks zero-padded
to the largest. The model's fused projections keep their fused base weights; per fused group
(qkv, o, gate_up, down) the group's modules share one input, so their A matrices sit side by side
in A [slots, in, modules x R] (one shrink serves q, k and v) and each module has B [slots, R, out]
and a scale per slot; its expand adds into its own columns of the fused output. Only modules that
some adapter targets get tensors. All adapters named at start-up stay resident: more than
`max_loras` is refused at load (no slot swapping).

A step (`LoraWeights.batch`): the tokens that run with an adapter, grouped by slot. Tokens of the
base model are left out and pay nothing; a step with no adapter token gets None and the model runs
exactly as without LoRA. `LoraBatch.layer(i).add(group, x, y)` after each base projection adds
scale_i * (x A_i) B_i for every token's adapter i: on CPU one matmul pair per adapter present in the
step over its gathered rows (no per-token weight copies), on CUDA one SGMV shrink launch and one
expand launch per module for all adapters at once (`inflight.kernels.lora`).
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
from .scheduler import SchedulerOutput

SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# fused projection group of the model -> its modules, in the column order of the fused output
GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
          "down": ("down_proj",)}
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
# PEFT's key for a LoRA weight of a decoder layer's linear module (saved without the adapter name)
_TENSOR = re.compile(r"^base_model\.model\.((?:model\.)?layers\.(\d+)\.(\w+)\.(\w+))\.lora_([AB])\.weight$")
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

    @property
    def target_modules(self) -> list[str]:
        return sorted({module for _, module in self.modules}, key=SUPPORTED_MODULES.index)


def module_shapes(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """(in, out) features of each supported module of the base model."""
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    h, i = spec.hidden_size, spec.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def load_adapter(name: str, path: str, spec: ModelSpec, max_rank: int) -> LoraAdapter:
    """Read and check one PEFT LoRA adapter directory; weights stay in their saved dtype on CPU."""
    where = f"LoRA adapter {name!r} ({path})"

    def fail(message: str):
        raise LoraError(f"{where}: {message}")

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
        rank = a.shape[0]
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
    key = hashlib.blake2b(f"{name}|{os.path.realpath(path)}".encode(), digest_size=16).digest()
    return LoraAdapter(name, path, max(m.a.shape[0] for m in modules.values()), modules, key)


def _check_config(config: dict, fail) -> None:
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        fail(f"'peft_type' is {peft_type!r}; only LORA adapters are supported")
    for name, message in _UNSUPPORTED_FIELDS.items():
        if config.get(name):
            fail(f"'{name}' is set: {message}")
    if config.get("bias", "none") != "none":
        fail(f"'bias' is {config['bias']!r}: adapters that train base biases are not supported (need 'none')")
    targets = config.get("target_modules")
    if isinstance(targets, list):      # a regex string or "all-linear" is checked through the tensors
        bad = [t for t in targets if not isinstance(t, str) or t.split(".")[-1] not in SUPPORTED_MODULES]
        if bad:
            fail(f"'target_modules' {bad} not supported; supported: {list(SUPPORTED_MODULES)} "
                 f"(embedding and lm_head adapters are not served)")
    for name in ("rank_pattern", "alpha_pattern"):
        if not isinstance(config.get(name) or {}, dict):
            fail(f"'{name}' must be a JSON object")


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


# ---- stacked weights ----------------------------------------------------------------------------
@dataclass(slots=True)
class ModuleWeights:
    """One module's expand half: B [slots, R, out], and where its columns sit."""
    column: int                 # its rank block in the group's A / shrink output: [column*R, (column+1)*R)
    offset: int                 # its first column in the fused projection's output
    b: torch.Tensor
    scales: torch.Tensor        # [slots] float32 (the kernels read it)
    host_scales: list[float]    # the same, for the torch path (a Python float multiplies exactly like PEFT)


@dataclass(slots=True)
class GroupWeights:
    a: torch.Tensor             # [slots, in, len(modules) x R]
    modules: list[ModuleWeights]


class LoraWeights:
    """Every adapter's weights stacked into per-layer slot tensors; name -> slot."""

    def __init__(self, adapters: list[LoraAdapter], spec: ModelSpec, dtype: torch.dtype, device: torch.device,
                 use_kernels: bool):
        self.slots = {adapter.name: slot for slot, adapter in enumerate(adapters)}
        self.keys = [adapter.key for adapter in adapters]
        self.adapters = [(adapter.name, adapter.path) for adapter in adapters]
        self.rank = max((adapter.rank for adapter in adapters), default=0)
        self.device = device
        from .kernels.lora import DTYPES
        self.use_kernels = use_kernels and dtype in DTYPES
        shapes = module_shapes(spec)
        self.layers: list[dict[str, GroupWeights]] = [
            self._stack_layer(layer, adapters, shapes, dtype, device) for layer in range(spec.num_layers)]

    def _stack_layer(self, layer: int, adapters: list[LoraAdapter], shapes, dtype, device) -> dict[str, GroupWeights]:
        num_slots, rank = len(adapters), self.rank
        groups = {}
        for group, names in GROUPS.items():
            targeted = [n for n in names if any((layer, n) in a.modules for a in adapters)]
            if not targeted:
                continue
            a_stack = torch.zeros(num_slots, shapes[targeted[0]][0], len(targeted) * rank, dtype=dtype)
            modules = []
            for column, name in enumerate(targeted):
                fan_out = shapes[name][1]
                b_stack = torch.zeros(num_slots, rank, fan_out, dtype=dtype)
                scales = [0.0] * num_slots
                for slot, adapter in enumerate(adapters):
                    weights = adapter.modules.get((layer, name))
                    if weights is None:
                        continue
                    r = weights.a.shape[0]
                    a_stack[slot, :, column * rank:column * rank + r] = weights.a.t().to(dtype)
                    b_stack[slot, :r] = weights.b.t().to(dtype)
                    scales[slot] = weights.scale
                offset = sum(shapes[n][1] for n in names[:names.index(name)])
                modules.append(ModuleWeights(column, offset, b_stack.to(device),
                                             torch.tensor(scales, dtype=torch.float32, device=device), scales))
            groups[group] = GroupWeights(a_stack.to(device), modules)
        return groups

    @property
    def names(self) -> list[str]:
        return list(self.slots)

    def batch(self, out: SchedulerOutput, table: BatchTable) -> "LoraBatch | None":
        """The step's tokens that run with an adapter, grouped by slot; None when there are none."""
        row_slots = table.lora_slot[out.rows]
        if not len(row_slots) or row_slots.max() < 0:
            return None
        return self.batch_tokens(np.repeat(row_slots, out.num_scheduled))

    def batch_tokens(self, token_slots: np.ndarray) -> "LoraBatch | None":
        """The same from each token's slot (-1: base model); tokens past the array are padding."""
        listed = np.flatnonzero(token_slots >= 0)
        if not len(listed):
            return None
        order = listed[np.argsort(token_slots[listed], kind="stable")]
        sorted_slots = token_slots[order]
        cuts = np.flatnonzero(np.diff(sorted_slots)) + 1
        starts = np.concatenate([[0], cuts, [len(order)]])
        segments = [(int(sorted_slots[s]), int(s), int(e)) for s, e in zip(starts[:-1], starts[1:])]
        return LoraBatch(self, order, segments, starts)


@dataclass(slots=True)
class LoraBatch:
    """One step's adapter tokens: `order` lists token rows grouped by slot; segment (slot, start,
    end) covers order[start:end]."""
    weights: LoraWeights
    order_host: np.ndarray
    segments: list[tuple[int, int, int]]
    starts_host: np.ndarray
    order: torch.Tensor = field(init=False)
    seg_starts: torch.Tensor | None = field(init=False, default=None)
    seg_slots: torch.Tensor | None = field(init=False, default=None)
    max_segment: int = field(init=False)

    def __post_init__(self) -> None:
        device = self.weights.device
        self.max_segment = max(end - start for _, start, end in self.segments)
        if self.weights.use_kernels:
            to = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32)).to(device, non_blocking=True)  # noqa: E731
            self.order = to(self.order_host)
            self.seg_starts = to(self.starts_host)
            self.seg_slots = to([slot for slot, _, _ in self.segments])
        else:
            self.order = torch.from_numpy(self.order_host).to(device)

    def layer(self, index: int) -> "LayerLora":
        return LayerLora(self, self.weights.layers[index])

    def add(self, groups: dict[str, GroupWeights], group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        weights = groups.get(group)
        if weights is None:
            return
        if self.weights.use_kernels:
            self._add_kernels(weights, x, y)
        else:
            self._add_torch(weights, x, y)

    def _add_torch(self, weights: GroupWeights, x: torch.Tensor, y: torch.Tensor) -> None:
        rank = self.weights.rank
        xs = x.index_select(0, self.order)
        h = xs.new_empty((len(xs), weights.a.shape[-1]))
        for slot, start, end in self.segments:
            torch.matmul(xs[start:end], weights.a[slot], out=h[start:end])
        for module in weights.modules:
            hm = h[:, module.column * rank:(module.column + 1) * rank]
            delta = xs.new_empty((len(xs), module.b.shape[-1]))
            for slot, start, end in self.segments:
                # (h B) * scale, then added: PEFT's order of operations
                torch.matmul(hm[start:end], module.b[slot], out=delta[start:end])
                delta[start:end].mul_(module.host_scales[slot])
            y[:, module.offset:module.offset + delta.shape[1]].index_add_(0, self.order, delta)

    def _add_kernels(self, weights: GroupWeights, x: torch.Tensor, y: torch.Tensor) -> None:
        from .kernels.lora import lora_expand, lora_shrink
        rank = self.weights.rank
        h = x.new_empty((x.shape[0], weights.a.shape[-1]))
        lora_shrink(x, weights.a, h, self.order, self.seg_starts, self.seg_slots, self.max_segment)
        for module in weights.modules:
            out = y[:, module.offset:module.offset + module.b.shape[-1]]
            lora_expand(h[:, module.column * rank:(module.column + 1) * rank], module.b, out, module.scales,
                        self.order, self.seg_starts, self.seg_slots, self.max_segment)


@dataclass(slots=True)
class LayerLora:
    """What one decoder layer sees: add(group, x, y) after each base projection."""
    batch: LoraBatch
    groups: dict[str, GroupWeights]

    def add(self, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        self.batch.add(self.groups, group, x, y)


def load_lora_weights(lora_modules: dict[str, str], spec: ModelSpec, max_loras: int, max_rank: int,
                      dtype: torch.dtype, device: torch.device, use_kernels: bool) -> LoraWeights:
    """Load every adapter named in `lora_modules` (name -> directory) into resident slots."""
    if not isinstance(lora_modules, dict):
        raise LoraError(f"'lora_modules' must map adapter names to directories, got {type(lora_modules).__name__}")
    if len(lora_modules) > max_loras:
        raise LoraError(f"{len(lora_modules)} LoRA adapters {sorted(lora_modules)} but 'max_loras' is {max_loras}: "
                        f"every adapter stays resident, so raise 'max_loras' or name fewer adapters")
    adapters = []
    for name, path in lora_modules.items():
        if not isinstance(name, str) or not name:
            raise LoraError(f"LoRA adapter names must be non-empty strings, got {name!r}")
        if not isinstance(path, str) or not os.path.isdir(path):
            raise LoraError(f"LoRA adapter {name!r}: directory {path!r} does not exist")
        adapters.append(load_adapter(name, path, spec, max_rank))
    return LoraWeights(adapters, spec, dtype, device, use_kernels)
