"""Triton's real vLLM backend (perf/vllm_backend.py) for the `peer` tests, `make
test-vllm-backend`: VLLM_PYTHON and VLLM_BACKEND_SRC name it; the test model in float32."""
import os

import pytest

from perf import vllm_backend
from perf.vllm_backend import MODEL_NAME as PEER_MODEL  # noqa: F401  (the tests' name for it)

from .conftest import DEFAULT_MODEL

PEER_ENGINE = {"model": DEFAULT_MODEL, "dtype": "float32", "enforce_eager": True, "max_model_len": 1024,
               "max_num_seqs": 64}


def vllm_backend_server(tmp_path_factory, engine: dict = PEER_ENGINE):
    """tritonserver with the real vLLM backend as `vllm_model` (not started); `engine` its model.json."""
    python, src = os.environ.get("VLLM_PYTHON"), os.environ.get("VLLM_BACKEND_SRC")
    missing = vllm_backend.check_inputs(python, src)
    if missing:
        pytest.fail(f"the peer tests: {missing}")
    return vllm_backend.server(python, src, str(tmp_path_factory.mktemp("vllm-backend")), engine,
                               env={"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"})
