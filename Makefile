# The single entry points. `make serve` and `make test` set everything up on a fresh machine.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
SERVE_ARGS ?=
PYTEST_ARGS ?=

.PHONY: venv serve test test-stress bench-engine bench-kernels bench-serve bench-prefix perf-sweep model clean

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -e .
	touch $(STAMP)

venv: $(STAMP)

# a real tritonserver on :8000 (HTTP) :8001 (gRPC) :8002 (metrics) with model_repository/
serve: venv
	$(PY) -m inflight.serving.launch $(SERVE_ARGS)

test: venv
	$(PY) -m pytest -q $(PYTEST_ARGS)

# 500 concurrent streams and the cancel storm (each under 10 minutes on 2 cores)
test-stress: venv
	$(PY) -m pytest -q -m stress $(PYTEST_ARGS)

bench-engine: venv
	$(PY) perf/engine_bench.py $(BENCH_ARGS)

bench-kernels: venv
	$(PY) perf/kernel_bench.py $(BENCH_ARGS)

bench-serve: venv
	$(PY) perf/serve_bench.py $(BENCH_ARGS)

perf-sweep: venv
	$(PY) perf/perf_sweep.py $(BENCH_ARGS)

# rebuild the shipped default model (tokenizer + weights) from pydoc text; about an hour on 2 cores
model: venv
	$(PY) scripts/build_default_model.py

clean:
	rm -rf build perf/results .pytest_cache .hypothesis

bench-prefix: venv
	$(PY) perf/prefix_bench.py $(BENCH_ARGS)

.PHONY: bench-lora lora-adapter
# mixed-adapter batches (1, 4, 8 adapters of rank 16) vs the base model, in-process
bench-lora: venv
	$(PY) perf/lora_bench.py $(BENCH_ARGS)

# rebuild the demo LoRA adapter (model_repository/llm/1/loras/pydoc-json); about 4 minutes on 2 cores
lora-adapter: venv
	$(PY) scripts/build_demo_adapter.py
