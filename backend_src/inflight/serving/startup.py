"""Start-up checks: every cause of a failed start that a user can fix, as one line naming the file
and the field.

Each model's `initialize` runs the checks it depends on before anything heavy loads (the checkpoint
checks need no torch), so a broken checkpoint fails in seconds. The Python backend reports any
exception from `initialize` with its "At:" frames; `one_line_errors` re-raises a StartupError from
its own frame, so Triton's log shows the message and one frame, and the launcher
(`serving/launch.py`) prints the messages alone.
"""
from __future__ import annotations

import functools
import glob
import json
import os
from contextlib import contextmanager
from types import SimpleNamespace

from ..config import EngineConfig
from ..tokenizer import TOKENIZER_FILES, has_tokenizer_files


class StartupError(Exception):
    """A start-up failure the user can fix; the message is one line naming the file and the field."""


def one_line_errors(initialize):
    """Wrap a model's initialize: a StartupError leaves with this frame alone, not the frames it came
    through (the Python backend prints every frame of an exception after "At:")."""
    @functools.wraps(initialize)
    def wrapper(self, args):
        try:
            return initialize(self, args)
        except StartupError as exc:
            error = StartupError(str(exc))
        raise error
    return wrapper


def read_settings(path: str, known: tuple[str, ...]) -> dict:
    """model.json as a dict with only `known` keys and a 'model' string."""
    if not os.path.isfile(path):
        raise StartupError(f"{path} does not exist: the llm model's settings (checkpoint and engine)")
    with open(path) as f:
        try:
            raw = json.load(f)
        except json.JSONDecodeError as exc:
            raise StartupError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise StartupError(f"{path} must hold a JSON object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise StartupError(f"{path}: unknown key(s) {unknown}; known: {sorted(known)}")
    if not isinstance(raw.get("model"), str) or not raw["model"]:
        raise StartupError(f"{path}: 'model' must name the checkpoint directory, got {raw.get('model')!r}")
    if not isinstance(raw.get("engine", {}), dict):
        raise StartupError(f"{path}: 'engine' must be a JSON object of EngineConfig fields")
    return raw


def engine_config(values: dict, path: str) -> EngineConfig:
    try:
        return EngineConfig.from_dict(values)
    except (TypeError, ValueError) as exc:
        raise StartupError(f"{path}: 'engine': {exc}") from None


def check_model_dir(model_dir: str, source: str) -> None:
    if not os.path.isdir(model_dir):
        what = "is not a directory" if os.path.exists(model_dir) else "does not exist"
        raise StartupError(f"checkpoint directory {model_dir!r} {what} ({source})")


def check_tokenizer(model_dir: str, source: str) -> None:
    check_model_dir(model_dir, source)
    if not has_tokenizer_files(model_dir):
        raise StartupError(f"checkpoint directory {model_dir!r} has no tokenizer (none of "
                           f"{', '.join(TOKENIZER_FILES)}) ({source})")


def check_checkpoint(model_dir: str, source: str) -> None:
    """Everything the llm needs from the directory: config.json with a supported architecture,
    safetensors weights and a tokenizer."""
    from ..context_length import architecture, rope_scaling
    from ..models import SUPPORTED_ARCHITECTURES, SUPPORTED_ROPE_TYPES

    check_tokenizer(model_dir, source)
    config_path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(config_path):
        raise StartupError(f"checkpoint directory {model_dir!r} has no config.json: not a Hugging Face "
                           f"checkpoint ({source})")
    with open(config_path) as f:
        try:
            config = json.load(f)
        except json.JSONDecodeError as exc:
            raise StartupError(f"{config_path} is not valid JSON: {exc}") from None
    fields = SimpleNamespace(**config)      # as transformers' config object reads them
    try:
        named = architecture(fields)
    except ValueError as exc:
        raise StartupError(f"{config_path}: {exc}") from None
    if named not in SUPPORTED_ARCHITECTURES:
        raise StartupError(f"{config_path}: 'architectures' is {config['architectures']}; supported: "
                           f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    # refused before the weights load (minutes for a large checkpoint), not after
    rope_type, _ = rope_scaling(fields)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise StartupError(f"{config_path}: rope_type {rope_type!r} is not supported; supported: "
                           f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    if "quantization_config" in config:
        quantization = config["quantization_config"]
        method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else "?"
        raise StartupError(f"{config_path}: 'quantization_config' ({method}): quantized checkpoints are not "
                           "supported; serve the unquantized weights")
    if not glob.glob(os.path.join(glob.escape(model_dir), "*.safetensors")):
        raise StartupError(f"checkpoint directory {model_dir!r} has no *.safetensors weights (only "
                           f"safetensors checkpoints load) ({source})")
    check_shard_index(os.path.join(model_dir, "model.safetensors.index.json"))


def check_shard_index(index_path: str) -> None:
    """Every shard the index names is there: found in seconds, not after the shards before it loaded."""
    if not os.path.isfile(index_path):
        return
    with open(index_path) as f:
        try:
            index = json.load(f)
        except json.JSONDecodeError as exc:
            raise StartupError(f"{index_path} is not valid JSON: {exc}") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise StartupError(f"{index_path}: no 'weight_map' of tensor names to shard files")
    missing = sorted({name for name in map(str, weight_map.values())
                      if not os.path.isfile(os.path.join(os.path.dirname(index_path), name))})
    if missing:
        raise StartupError(f"{index_path} names {len(missing)} shard file(s) that are not there, e.g. {missing[0]!r}")


@contextmanager
def engine_errors(model_dir: str, settings_path: str):
    """The engine's own checks (max_model_len, the KV budget, the device) as StartupErrors."""
    try:
        yield
    except ValueError as exc:
        raise StartupError(f"cannot serve {model_dir!r}: {exc} (engine settings in {settings_path})") from None


def tokenizer_error(model_dir: str, exc: Exception) -> StartupError:
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return StartupError(f"the tokenizer in {model_dir!r} does not load: {type(exc).__name__}: {first_line}")
