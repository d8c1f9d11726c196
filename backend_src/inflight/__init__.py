"""inflight: an iteration-level (continuous-batching) LLM engine for Triton's Python backend."""
from .config import EngineConfig, SamplingParams
from .engine import LLMEngine, QueueFullError
from .logprobs import Logprob
from .request import RequestOutput, StepOutput

__all__ = ["EngineConfig", "LLMEngine", "Logprob", "QueueFullError", "RequestOutput", "SamplingParams", "StepOutput"]
