"""The Triton Python-backend models, written against the `pb_utils` module each model.py passes in
(it only exists inside the backend stub). model.py files only pick one of these classes.

llm            decoupled; one LLMEngine per instance, driven by an EngineLoop
preprocessing  TensorRT-LLM-style knobs -> input_ids + sampling_parameters JSON for `llm`
postprocessing (context_ids, token_ids) from `llm` -> exactly the text those tokens add
"""
from __future__ import annotations

import functools
import gc
import json
import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from ..config import MAX_BAD_WORDS, MAX_STOP_STRINGS, EngineConfig, usable_cpus
from ..context_length import checkpoint_max_len
from ..detokenizer import decode_delta
from ..structured import json_value
from . import vllm_settings
from .metrics import EngineMetrics
from .parent import when_parent_exits
from .protocol import (BOOL_INPUTS, RequestError, bytes_per_token, check_count, check_text_size, ignored_parameter,
                       one_value, parse_request, string_input, string_value)
from .startup import (check_checkpoint, check_tokenizer, engine_config, engine_errors, one_line_errors,
                      StartupError, read_settings, tokenizer_error)

if TYPE_CHECKING:       # the loop imports the engine and torch: only the llm model loads it
    from .loop import EngineLoop

log = logging.getLogger("inflight")
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

LLM_INPUTS = ("text_input", "input_ids", "sampling_parameters", "priority", "cache_salt",
              "embedding_request") + BOOL_INPUTS


@dataclass(slots=True)
class Settings:
    """model.json beside the llm's model.py: the checkpoint and every EngineConfig field (under
    "engine", or at the top level as the vLLM backend's model.json has vLLM's engine arguments:
    vllm_settings.py); with enable_lora, multi_lora.json beside it names the adapters."""
    model_dir: str
    engine: EngineConfig
    path: str                   # the model.json, for start-up errors
    lora_modules: dict[str, str] = field(default_factory=dict)     # adapter name -> directory
    lora_file: str | None = None                                   # the multi_lora.json they came from
    labels: dict[str, str] = field(default_factory=dict)   # this instance's metrics labels, where there are several
    instances: int = 1          # how many Triton starts of this model (placed())
    vllm_metrics: bool = True   # False: model.json's disable_log_stats turns off the vllm: metrics

    KEYS = ("model", "engine", *vllm_settings.KEYS)      # model.json's keys

    @classmethod
    def load(cls, version_dir: str) -> "Settings":
        path = os.path.join(version_dir, "model.json")
        raw = read_settings(path, cls.KEYS)
        model_dir = os.path.normpath(os.path.join(version_dir, os.path.expanduser(raw["model"])))
        engine = dict(raw.get("engine", {}))
        top_level, vllm_metrics = vllm_settings.read_top_level(raw, path)
        for key, value in top_level.items():
            if key in engine:
                raise StartupError(f"{path}: '{key}' is given both at the top level and in 'engine'")
            engine[key] = value
        config = engine_config(engine, path)
        if not config.enable_lora:
            return cls(model_dir, config, path, vllm_metrics=vllm_metrics)
        lora_file = os.path.join(version_dir, "multi_lora.json")
        return cls(model_dir, config, path, read_multi_lora(lora_file), lora_file, vllm_metrics=vllm_metrics)

    def placed(self, args) -> "Settings":
        """These settings for one of the model's instances. Triton may start several, each in its
        own process with its own engine (weights and KV pool): `count` per GPU of a KIND_GPU group,
        or `count` of another kind. A KIND_GPU instance's engine goes to the GPU Triton names, as
        the vLLM backend pins its instances (with 'auto' all would go to the first, where the
        second's KV pool finds no memory). Several instances share the CPU's cores, an even part
        each unless 'cpu_threads' is given, and label their metrics with their instance name and
        GPU (Triton gives the instances of one count index the same name on every GPU): under the
        same labels each one's gauges would overwrite the others'."""
        model_config = json.loads(args.get("model_config", "{}"))
        engine, count = self.engine, instance_count(model_config)
        labels = {"model_instance": args["model_instance_name"]} if count > 1 else {}
        on_gpu = args.get("model_instance_kind") == "GPU"
        gpu = int(args["model_instance_device_id"]) if on_gpu else 0     # the others go to the first ('auto')
        if on_gpu:
            if engine.device not in ("auto", "cuda", f"cuda:{gpu}"):
                raise StartupError(f"{self.path}: 'device' {engine.device!r} contradicts the KIND_GPU instance "
                                   f"{args.get('model_instance_name')} of config.pbtxt, which Triton placed on "
                                   f"cuda:{gpu}; leave 'device' \"auto\", or make the instance_group KIND_MODEL")
            engine = replace(engine, device=f"cuda:{gpu}")
            if labels:
                labels["gpu"] = str(gpu)
        if count > 1 and engine.cpu_threads is None:
            engine = replace(engine, cpu_threads=max(usable_cpus() // count, 1))
        engine = replace(engine, engines_per_device=engines_per_device(model_config, gpu))
        return replace(self, engine=engine, labels=labels, instances=count)

    @property
    def source(self) -> str:
        """Where the checkpoint directory was named, for start-up errors."""
        return f"'model' in {self.path}"


def instance_count(model_config: dict) -> int:
    """How many instances Triton starts for a model: each group's count, per GPU it lists (Triton
    lists every GPU for a KIND_GPU group that names none)."""
    groups = model_config.get("instance_group") or [{}]
    return sum(int(group.get("count", 1)) * max(len(group.get("gpus") or ()), 1) for group in groups)


def engines_per_device(model_config: dict, gpu: int) -> int:
    """How many of the model's engines run on GPU `gpu` (one instance's): each KIND_GPU group's
    `count` on every GPU it lists (all of them where it lists none), and the instances of the other
    kinds on the first ('auto' placement)."""
    engines = 0
    for group in model_config.get("instance_group") or [{}]:
        count = int(group.get("count", 1))
        if group.get("kind") == "KIND_GPU":
            engines += count if not group.get("gpus") or gpu in group["gpus"] else 0
        else:
            engines += count if gpu == 0 else 0
    return max(engines, 1)


def read_multi_lora(path: str) -> dict[str, str]:
    """multi_lora.json (the vLLM backend's file): adapter name -> PEFT adapter directory, relative
    to the file. No file: LoRA is on but no adapter is served."""
    if not os.path.exists(path):
        log.warning("inflight: enable_lora is set but there is no %s: no adapters", path)
        return {}
    def unique(pairs):
        names = [name for name, _ in pairs]
        for name in names:
            if names.count(name) > 1:      # json.load would keep the last silently
                raise StartupError(f"{path}: the adapter name {name!r} is given {names.count(name)} times")
        return dict(pairs)
    try:
        with open(path) as f:
            raw = json.load(f, object_pairs_hook=unique)
    except ValueError as exc:
        raise StartupError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise StartupError(f"{path}: must be a JSON object mapping adapter names to adapter directories")
    modules = {}
    for name, directory in raw.items():
        if not name:
            raise StartupError(f"{path}: an entry has an empty adapter name")
        if not isinstance(directory, str) or not directory:
            raise StartupError(f"{path}: entry {name!r}: the adapter directory must be a non-empty string, "
                               f"got {directory!r}")
        full = os.path.normpath(os.path.join(os.path.dirname(path), os.path.expanduser(directory)))
        if not os.path.isdir(full):
            raise StartupError(f"{path}: entry {name!r}: adapter directory {full!r} does not exist")
        modules[name] = full
    return modules


def llm_settings(model_repository_dir: str) -> Settings:
    """The llm's settings, found from any model's directory in the same repository: those of its
    newest version, which the ensemble (model_version -1) calls."""
    llm = os.path.join(os.path.dirname(os.path.normpath(model_repository_dir)), "llm")
    if not os.path.isdir(llm):
        raise StartupError(f"the repository has no llm model ({llm} does not exist)")
    versions = [int(name) for name in os.listdir(llm) if name.isdigit() and os.path.isdir(os.path.join(llm, name))]
    if not versions:
        raise StartupError(f"{llm} has no version directory (such as 1/)")
    return Settings.load(os.path.join(llm, str(max(versions))))


def load_tokenizer(settings: Settings, without_torch: bool = False):
    """transformers' tokenizer for the checkpoint. `without_torch`: for processes that only
    tokenize; transformers imports torch whenever it can (235 MiB more resident per process)."""
    check_tokenizer(settings.model_dir, settings.source)
    if without_torch:
        hide_torch()
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(settings.model_dir)
    except Exception as exc:        # whatever transformers raises for a tokenizer it cannot read
        raise tokenizer_error(settings.model_dir, exc) from None


def hide_torch() -> None:
    """Make `import torch` fail in this process (None in sys.modules is Python's import blocker):
    transformers then takes its tokenizer-only path, with exactly the same tokenizer code."""
    if "torch" not in sys.modules:
        sys.modules["torch"] = None
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")   # its "PyTorch was not found"


def config_flag(args, key: str) -> bool:
    """A yes/true string parameter of config.pbtxt, read as the vLLM backend reads its own."""
    parameters = json.loads(args["model_config"]).get("parameters", {})
    return parameters.get(key, {}).get("string_value", "").strip().lower() in ("yes", "true")


def read_inputs(pb_utils, request, names) -> dict[str, np.ndarray]:
    inputs = {}
    for name in names:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        if tensor is not None:
            inputs[name] = tensor.as_numpy()
    return inputs


def request_parameters(request) -> dict:
    raw = request.parameters()
    try:
        values = json.loads(raw) if raw else {}
    except (json.JSONDecodeError, RecursionError):
        raise RequestError("request parameters are not valid JSON") from None
    return values if isinstance(values, dict) else {}


# `llm` errors of the server's state, not of the request: Triton's UNAVAILABLE (HTTP 503 where
# Triton maps a response's code, as for its own queue-full refusals), a request's fault
# INVALID_ARG (400), not the Python backend's default INTERNAL (500). Triton 2.51's generate
# endpoints answer all three with 400 (measured): there the message's start tells them apart
UNAVAILABLE_ERRORS = ("queue full", "timed out in queue", "the server is shutting down", "the model is being unloaded")
# and of a fault in the server: INTERNAL
INTERNAL_ERRORS = ("the engine failed", "the server failed", "the request could not be read",
                   "the grammar could not be compiled")


class TritonSink:
    """A request's Triton response sender behind the EngineLoop's ResponseSink interface."""

    def __init__(self, pb_utils, request):
        self.pb = pb_utils
        self.sender = request.get_response_sender()

    def send(self, outputs, final: bool, error: str | None = None) -> None:
        flags = self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
        if error is not None:
            code = self.pb.TritonError.UNAVAILABLE if error.startswith(UNAVAILABLE_ERRORS) else \
                self.pb.TritonError.INTERNAL if error.startswith(INTERNAL_ERRORS) else self.pb.TritonError.INVALID_ARG
            self.sender.send(self.pb.InferenceResponse(error=self.pb.TritonError(error, code)), flags=flags)
        elif outputs is None:
            self.sender.send(flags=flags)
        else:
            tensors = [self.pb.Tensor(name, value) for name, value in outputs.items()]
            self.sender.send(self.pb.InferenceResponse(output_tensors=tensors), flags=flags)

    def is_cancelled(self) -> bool:
        return self.sender.is_cancelled()


def run_on_own_thread(work):
    """Run `work` on a thread of its own that then exits, and return its result (or raise its error).

    Used to load the model: every thread that runs torch ops keeps an OpenMP team, and once a
    process has more OpenMP threads than cores, libgomp puts its workers to sleep between parallel
    regions instead of spinning. Loaded on the stub's main thread and stepped on the engine thread,
    a CPU step took a third longer (the stub at 140% CPU of 2 cores instead of 185%); the loading
    thread's team goes away with it."""
    result: list = []

    def run() -> None:
        try:
            result.append((work(), None))
        except BaseException as exc:       # re-raised on the calling thread
            result.append((None, exc))

    thread = threading.Thread(target=run, name="inflight-load")
    thread.start()
    thread.join()
    value, error = result[0]
    if error is not None:
        raise error
    return value


# tritonserver: this process's parent from the start (read when a model first imports this, before it loads)
SERVER_PID = os.getppid()


def stop_server(reason: str) -> None:
    """The engine failed: every request in flight has its error. Triton 2.51's Python backend has
    no way for a model to mark itself not ready, so ask the server to shut down (as vLLM's server
    exits when its engine dies): readiness fails at once, in-flight work is finished or failed,
    and the orchestrator restarts the container."""
    log.error("inflight: engine failure (%s); shutting the server down", reason)
    os.kill(SERVER_PID, signal.SIGTERM)


def unload_model(pb_utils, model_name: str, reason: str) -> None:
    """The engine failed and config.pbtxt's ENABLE_VLLM_HEALTH_CHECK is on: as the vLLM backend
    does then, unload this model, so its readiness fails while the server and its other models go
    on. Triton allows that only under --model-control-mode=explicit; where it refuses, the server
    shuts down as without the switch (a model that stays ready while it fails every request would
    keep getting traffic)."""
    log.error("inflight: engine failure (%s); unloading model %r (ENABLE_VLLM_HEALTH_CHECK)", reason, model_name)
    mode = model_control_mode()
    if mode not in ("explicit", None):
        # Asked anyway, Triton 2.51 refuses, but its reply to the stub is sometimes lost and the
        # call never returns: the server then neither unloads the model nor shuts down.
        log.error("inflight: Triton did not unload %r (it unloads a model only under --model-control-mode=explicit, "
                  "this server's is %s); shutting the server down instead", model_name, mode)
        stop_server(reason)
        return
    outcome: list[BaseException | None] = []

    def unload() -> None:
        try:
            pb_utils.unload_model(model_name)
            outcome.append(None)
        except Exception as exc:
            outcome.append(exc)

    thread = threading.Thread(target=unload, name="inflight-unload", daemon=True)
    thread.start()
    thread.join(UNLOAD_REPLY_S)
    if not outcome or outcome[0] is not None:
        why = f"{type(outcome[0]).__name__}: {outcome[0]}" if outcome else f"no reply in {UNLOAD_REPLY_S:.0f} s"
        log.error("inflight: Triton did not unload %r (%s); shutting the server down instead", model_name, why)
        stop_server(reason)


UNLOAD_REPLY_S = 30.0      # Triton answers an unload request at once; a lost reply must not leave the model ready


def model_control_mode() -> str | None:
    """tritonserver's --model-control-mode ("none" unless given), read from its command line;
    None where that cannot be read."""
    try:
        with open(f"/proc/{SERVER_PID}/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")
    except OSError:
        return None
    mode = "none"
    for i, arg in enumerate(argv):
        if arg.startswith("--model-control-mode="):
            mode = arg.split("=", 1)[1]
        elif arg == "--model-control-mode" and i + 1 < len(argv):
            mode = argv[i + 1]
    return mode


def exit_with_server() -> None:
    """End this stub the moment tritonserver is gone. The Python backend's own check misses a
    server that died and was not yet reaped (kill(pid, 0) succeeds on a zombie), and its exit can
    hang behind a thread that waits forever for the dead server's reply to a metric update: a
    killed server left `llm`'s stub, with its engine's memory, running for good. os._exit runs
    nothing that could wait."""
    def exit_now() -> None:
        log.error("inflight: tritonserver (pid %d) is gone; this model's process exits", SERVER_PID)
        os._exit(1)

    when_parent_exits(SERVER_PID, exit_now, "inflight-server-watch")


class LLMModel:
    def __init__(self, pb_utils):
        self.pb = pb_utils
        self.loop: EngineLoop | None = None
        self.metrics: EngineMetrics | None = None

    @one_line_errors
    def initialize(self, args) -> None:
        exit_with_server()
        version_dir = os.path.join(args["model_repository"], args["model_version"])
        settings = Settings.load(version_dir).placed(args)
        check_checkpoint(settings.model_dir, settings.source)
        from ..engine import LLMEngine
        from ..lora import LoraError
        from .loop import EngineLoop
        tokenizer = load_tokenizer(settings)        # a broken one fails the load before the weights are read
        log.info("inflight: %sloading %s with %s", "".join(f"{k}={v} " for k, v in settings.labels.items()),
                 settings.model_dir, settings.engine)
        with engine_errors(settings.model_dir, settings.path):
            try:
                engine = run_on_own_thread(lambda: LLMEngine.from_pretrained(
                    settings.model_dir, settings.engine, settings.lora_modules, tokenizer=tokenizer))
            except LoraError as exc:      # an adapter of multi_lora.json: name the file too
                raise StartupError(f"{settings.lora_file}: {exc}") from None
        vllm_labels = {"model": args["model_name"], "version": args["model_version"]} \
            if config_flag(args, "REPORT_CUSTOM_METRICS") and settings.vllm_metrics else None
        self.metrics = EngineMetrics(self.pb, args["model_name"], lora_names=engine.lora_names,
                                     max_loras=engine.config.max_loras if engine.config.enable_lora else 0,
                                     vllm_labels=vllm_labels,
                                     max_model_len=engine.max_model_len, labels=settings.labels)
        self.metrics.publish(self.metrics.snapshot(engine, force=True))      # before the loop's threads use it
        on_failure = stop_server
        if config_flag(args, "ENABLE_VLLM_HEALTH_CHECK"):
            on_failure = functools.partial(unload_model, self.pb, args["model_name"])
        self.loop = EngineLoop(engine, tokenizer, self.metrics, on_failure=on_failure,
                               heartbeat_share=1 / settings.instances).start()

    def execute(self, requests):
        for request in requests:
            sink = TritonSink(self.pb, request)
            try:
                parsed = parse_request(read_inputs(self.pb, request, LLM_INPUTS), request_parameters(request))
            except RequestError as exc:
                self.loop.refuse(sink, str(exc))
                continue
            except Exception as exc:  # a bug reading this request: its error, not a traceback
                log.exception("inflight: a request could not be read")
                self.loop.refuse(sink, f"the request could not be read: {type(exc).__name__}: {exc}")
                continue
            self.loop.submit(parsed, sink)
        return None

    def finalize(self) -> None:
        if self.loop is not None:
            self.loop.shutdown()
        # Triton 2.51's stub would free the metric families with this object as it is destroyed,
        # when a family can no longer reach its shared memory: a segfault's stack in the log at a
        # stop (triton-inference-server/python_backend#429, fixed after 2.51). Freed here instead.
        self.loop = self.metrics = None
        gc.collect()


# ---- ensemble steps ---------------------------------------------------------------------------------
# TensorRT-LLM inflight_batcher_llm knob -> (llm sampling parameter, value kind)
TRTLLM_KNOBS = {
    "max_tokens": ("max_tokens", int), "temperature": ("temperature", float), "top_k": ("top_k", int),
    "top_p": ("top_p", float), "min_tokens": ("min_tokens", int), "min_length": ("min_tokens", int),
    "seed": ("seed", int), "random_seed": ("seed", int), "repetition_penalty": ("repetition_penalty", float),
    "frequency_penalty": ("frequency_penalty", float), "presence_penalty": ("presence_penalty", float),
}
# the ensemble's inputs preprocessing reads (the others, stream and exclude_input_in_output, go to llm as they are)
PREPROCESSING_INPUTS = ("text_input", "stop_words", "bad_words", "end_id", "pad_id", "return_log_probs", "priority",
                        "cache_salt", "lora_name", "guided_decoding_guide_type", "guided_decoding_guide", *TRTLLM_KNOBS)
ENSEMBLE_INPUTS = sorted((*PREPROCESSING_INPUTS, "stream", "exclude_input_in_output"))
# TensorRT-LLM guided_decoding_guide_type -> the llm's structured_outputs key (None: needs no guide)
GUIDE_TYPES = {"json": None, "json_schema": "json", "regex": "regex", "ebnf_grammar": "grammar"}


class TokenizerModel:
    """An ensemble step that needs only the llm's tokenizer."""

    def __init__(self, pb_utils):
        self.pb = pb_utils

    @one_line_errors
    def initialize(self, args) -> None:
        exit_with_server()
        settings = llm_settings(args["model_repository"])
        self.tokenizer = load_tokenizer(settings, without_torch=True)
        self.settings = settings


def check_parameters(names: set[str]) -> None:
    """The ensemble reads its knobs from input tensors only; a request parameter (gRPC's
    `parameters`, or an HTTP generate key that is no input) is refused, naming the tensor where
    there is one, so that the vLLM backend's habit of sending knobs as parameters is told what to do."""
    as_inputs = sorted(names & set(ENSEMBLE_INPUTS))
    if as_inputs:
        raise RequestError(f"{as_inputs} sent as request parameter(s); the ensemble reads them only as input "
                           "tensors of the same name (see its config.pbtxt)")
    if names:
        raise RequestError(f"unknown input(s) {sorted(names)}; the ensemble's inputs: {ENSEMBLE_INPUTS}")


class PreprocessingModel(TokenizerModel):
    @one_line_errors
    def initialize(self, args) -> None:
        super().initialize(args)
        # llm's bound on a text prompt, before tokenizing it (the engine's max_model_len is within both)
        self.max_model_len = self.settings.engine.max_model_len or checkpoint_max_len(self.settings.model_dir)
        self.bytes_per_token = bytes_per_token(self.tokenizer)

    def execute(self, requests):
        return [self._one(request) for request in requests]

    def _one(self, request):
        pb = self.pb
        try:
            # a key of an HTTP generate request that names no input arrives as a parameter, which
            # Triton hands to every step: llm would take it as one of its own knobs
            check_parameters({name for name in request_parameters(request) if not ignored_parameter(name)})
            input_ids, sampling = self.translate(read_inputs(pb, request, PREPROCESSING_INPUTS))
        except RequestError as exc:
            return pb.InferenceResponse(error=pb.TritonError(str(exc)))
        return pb.InferenceResponse(output_tensors=[
            pb.Tensor("input_ids", np.asarray(input_ids, dtype=np.int32)),
            pb.Tensor("sampling_parameters", np.array([json.dumps(sampling).encode()], dtype=object)),
            pb.Tensor("return_token_ids", np.array([True])),
        ])

    def translate(self, inputs: dict) -> tuple[list[int], dict]:
        """Ensemble inputs -> (prompt token ids, llm sampling_parameters)."""
        if "text_input" not in inputs:
            raise RequestError("input 'text_input' is required")
        text = inputs["text_input"].reshape(-1)
        if text.size != 1 or not isinstance(text[0], bytes):
            raise RequestError("input 'text_input' must hold exactly one string")
        prompt = string_value("text_input", text[0])
        if not prompt:
            raise RequestError("input 'text_input' is empty")
        if self.max_model_len is not None:
            check_text_size(prompt, self.max_model_len, self.bytes_per_token)
        sampling: dict = {}
        for name, (knob, kind) in TRTLLM_KNOBS.items():
            if name in inputs:
                value = _scalar(name, inputs[name])
                if knob in sampling:
                    raise RequestError(f"'{name}' and another name for '{knob}' are both given")
                sampling[knob] = kind(value)
        _trtllm_sampling(sampling)
        for name, knob, limit in (("stop_words", "stop", MAX_STOP_STRINGS), ("bad_words", "bad_words", MAX_BAD_WORDS)):
            if name in inputs:
                words = [string_value(name, w) for w in inputs[name].reshape(-1)]
                check_count(name, words, limit)       # named as this model's input, not llm's knob
                if any(words):       # "" is none, as TensorRT-LLM's preprocessing skips a word of no tokens
                    sampling[knob] = [w for w in words if w]
        if "return_log_probs" in inputs and bool(_scalar("return_log_probs", inputs["return_log_probs"])):
            raise RequestError("'return_log_probs' is not available through the ensemble; "
                               "ask the llm model with 'return_logprobs'")
        if "end_id" in inputs:          # TensorRT-LLM's end token: it ends generation instead of EOS
            end_id, vocab = int(_scalar("end_id", inputs["end_id"])), len(self.tokenizer)
            if not 0 <= end_id < vocab:
                raise RequestError(f"'end_id' must be a token id in [0, {vocab}), got {end_id}")
            sampling["stop_token_ids"] = [end_id]
            sampling["ignore_eos"] = True
        for name in ("priority", "cache_salt", "lora_name"):
            if name in inputs:
                sampling[name] = string_input(name, inputs[name])
        constraint = _guided_decoding(inputs)
        if constraint is not None:
            sampling["structured_outputs"] = constraint
        return self.tokenizer(prompt)["input_ids"], sampling


def _trtllm_sampling(sampling: dict) -> None:
    """TensorRT-LLM's rule for top_k and top_p: greedy unless either is above 0 (its default, both
    0, is greedy, whatever the temperature); a 0 or less is that filter off."""
    if sampling.get("top_k", 0) < 0:
        raise RequestError(f"'top_k' must be 0 (off) or more, got {sampling['top_k']}")
    top_k, top_p = sampling.pop("top_k", 0), sampling.pop("top_p", 0.0)
    if top_k == 0 and top_p <= 0 and sampling.get("temperature", 0.0) >= 0:     # a negative one: llm refuses it
        sampling["temperature"] = 0.0
    if top_k > 0:
        sampling["top_k"] = top_k
    if top_p > 0:
        sampling["top_p"] = top_p


def _guided_decoding(inputs: dict) -> dict | None:
    """TensorRT-LLM's (guided_decoding_guide_type, guided_decoding_guide) -> structured_outputs.
    'json' is a JSON object or array, as TensorRT-LLM's built-in JSON grammar."""
    guide = None
    if "guided_decoding_guide" in inputs:
        guide = string_input("guided_decoding_guide", inputs["guided_decoding_guide"])
    if "guided_decoding_guide_type" not in inputs:
        if guide:
            raise RequestError("'guided_decoding_guide' needs 'guided_decoding_guide_type'")
        return None
    kind = string_input("guided_decoding_guide_type", inputs["guided_decoding_guide_type"])
    if kind not in GUIDE_TYPES:
        raise RequestError(f"'guided_decoding_guide_type' must be one of {sorted(GUIDE_TYPES)}, got {kind!r}")
    if GUIDE_TYPES[kind] is None:
        if guide:
            raise RequestError("'guided_decoding_guide' is not used with guide type 'json' (a JSON object or array)")
        return {"json": {"type": ["object", "array"]}}     # TensorRT-LLM's built-in JSON grammar
    if not guide:
        raise RequestError(f"guide type {kind!r} needs 'guided_decoding_guide'")
    if kind == "json_schema":
        try:
            return {"json": json_value(guide, "guided_decoding_guide")}
        except ValueError as exc:
            raise RequestError(str(exc)) from None
    return {GUIDE_TYPES[kind]: guide}


def _scalar(name: str, array: np.ndarray):
    value = one_value(name, array)
    if isinstance(value, (float, np.floating)) and not np.isfinite(value):
        raise RequestError(f"'{name}' must be a finite number, got {value}")
    return value.item() if hasattr(value, "item") and not isinstance(value, bytes) else value


class PostprocessingModel(TokenizerModel):
    """Decodes the text llm's token ids add to their context; also a public model, so its ids are checked."""

    def execute(self, requests):
        pb = self.pb
        responses = []
        for request in requests:
            inputs = read_inputs(pb, request, ("token_ids", "context_ids"))
            try:
                new, context = (self._ids(name, inputs[name]) for name in ("token_ids", "context_ids"))
            except RequestError as exc:
                responses.append(pb.InferenceResponse(error=pb.TritonError(str(exc))))
                continue
            text = decode_delta(self.tokenizer, context, new)
            responses.append(pb.InferenceResponse(output_tensors=[
                pb.Tensor("text_output", np.array([text.encode("utf-8")], dtype=object))]))
        return responses

    @staticmethod
    def _ids(name: str, array: np.ndarray) -> list[int]:
        """Negative ids fail the tokenizer's decode; ids past its vocabulary (a padded one) decode to ''."""
        ids = array.reshape(-1).tolist()
        if any(token < 0 for token in ids):
            raise RequestError(f"'{name}' must hold token ids (0 or more), got {min(ids)}")
        return ids
