"""Start a real `tritonserver` on this repository's model repository.

Where `tritonserver` is on PATH (the NGC container) it is used as is. Elsewhere the server, the
Python backend and the backend stub come from the `nvidia-pytriton` wheel: the stub matching the
running Python is copied next to the backend library, the interpreter's shared-library directory
goes first in LD_LIBRARY_PATH (the stub links libpython), and the virtual environment's `bin` goes
first in PATH so model.py imports this environment's torch and transformers.

`--model PATH` (and `--engine key=value`) serves a checkpoint through a model repository written
for it. The launcher passes tritonserver's output through, prints the endpoints once the server is
ready, and if it does not start, a summary of the causes the models reported (startup.py).
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import glob
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from http.client import HTTPException

from .parent import signalled_when_parent_dies

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
DEFAULT_REPOSITORY = os.path.join(REPO, "model_repository")

# the production profile (README "Limits and failure behaviour"): no model control, restricted
# admin APIs, no prompt text in logs at the default level
PRODUCTION_FLAGS = [
    "--model-control-mode=none",
    "--strict-readiness=true",
    "--exit-timeout-secs=30",
    "--http-restricted-api=model-repository,shared-memory,logging,trace:admin-key=${INFLIGHT_ADMIN_KEY}",
    "--grpc-restricted-protocol=model-repository,shared-memory,logging,trace:admin-key=${INFLIGHT_ADMIN_KEY}",
    "--log-verbose=0",
]


@dataclass(slots=True)
class Server:
    binary: str
    backend_dir: str | None
    env: dict[str, str] = field(default_factory=dict)


def locate_server(build_dir: str = os.path.join(REPO, "build", "tritonserver")) -> Server:
    system = shutil.which("tritonserver")
    if system:
        return Server(system, None, _with_engine_on_path(dict(os.environ)))
    try:
        import pytriton
    except ImportError as exc:
        raise SystemExit("no tritonserver on PATH and the nvidia-pytriton wheel is not installed "
                         "(run `make venv`)") from exc
    _require_numpy_1()
    root = os.path.join(os.path.dirname(pytriton.__file__), "tritonserver")
    libs = os.path.join(os.path.dirname(os.path.dirname(pytriton.__file__)), "nvidia_pytriton.libs")
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = os.path.join(root, "python_backend_stubs", version, "triton_python_backend_stub")
    if not os.path.exists(stub):
        raise SystemExit(f"the nvidia-pytriton wheel ships no Python backend stub for Python {version}")
    backend_dir = os.path.join(build_dir, "backends")
    python_backend = os.path.join(backend_dir, "python")
    os.makedirs(python_backend, exist_ok=True)
    for src in (os.path.join(root, "backends", "python", "libtriton_python.so"),
                os.path.join(root, "backends", "python", "triton_python_backend_utils.py"), stub):
        dst = os.path.join(python_backend, os.path.basename(src))
        if not os.path.exists(dst) or os.path.getmtime(dst) < os.path.getmtime(src):
            shutil.copy2(src, dst)
    env = _with_engine_on_path(dict(os.environ))
    lib_path = [sysconfig.get_config_var("LIBDIR"), libs, env.get("LD_LIBRARY_PATH", "")]
    env["LD_LIBRARY_PATH"] = ":".join(p for p in lib_path if p)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return Server(os.path.join(root, "bin", "tritonserver"), backend_dir, env)


def _require_numpy_1() -> None:
    """The wheel's Triton 2.51 backend stub misreads BYTES inputs under NumPy 2: the first request
    kills the stub ("Stub process 'llm_0_0' is not healthy"), seen where a Python brought NumPy 2.5."""
    import numpy
    if int(numpy.__version__.split(".")[0]) >= 2:
        raise SystemExit(f"numpy {numpy.__version__} is installed in {sys.prefix}, and the nvidia-pytriton wheel's "
                         "Python backend stub (Triton 2.51) needs numpy<2: it misreads string inputs and exits. "
                         "Install numpy 1.26.4 (requirements.txt), or use a tritonserver on PATH (the NGC container)")


def _with_engine_on_path(env: dict[str, str]) -> dict[str, str]:
    """model.py finds backend_src beside model_repository; a copied repository (tests, benchmarks)
    finds it through INFLIGHT_BACKEND_SRC (the backend stub ignores PYTHONPATH)."""
    src = os.path.join(REPO, "backend_src")
    if os.path.isdir(src):
        env.setdefault("INFLIGHT_BACKEND_SRC", src)
    return env


def server_command(server: Server, model_repository: str, http_port: int, grpc_port: int, metrics_port: int,
                   extra: list[str] = (), auto_complete: bool = False, shm_prefix: str | None = None) -> list[str]:
    """auto_complete: let models fill in their config.pbtxt (the vLLM backend declares its tensors
    that way); this repository's configs are complete. shm_prefix: the Python backend's name prefix
    for this server's shared-memory regions (`remove_shm_regions`), unless `extra` sets one."""
    cmd = [server.binary, f"--model-repository={model_repository}", f"--http-port={http_port}",
           f"--grpc-port={grpc_port}", f"--metrics-port={metrics_port}", "--allow-metrics=true",
           "--allow-gpu-metrics=false", *([] if auto_complete else ["--disable-auto-complete-config"])]
    if server.backend_dir:
        cmd.append(f"--backend-directory={server.backend_dir}")
    if shm_prefix and not any(SHM_PREFIX_OPTION in arg for arg in extra):
        cmd.append(f"--backend-config=python,{SHM_PREFIX_OPTION}={shm_prefix}")
    return cmd + list(extra)


# The Python backend keeps each stub's messages in a /dev/shm region named <prefix><uuid> (1 MiB,
# growing under load) and removes it when the model unloads. A tritonserver killed outright (the
# OOM killer, SIGKILL) removes nothing, and the regions held memory until a reboot; with a prefix
# of its own, whoever started the server removes them once it has exited.
SHM_PREFIX_OPTION = "shm-region-prefix-name"
SHM_DIR = "/dev/shm"


def shm_prefix() -> str:
    return f"inflight_{os.getpid()}_{secrets.token_hex(4)}_"


def remove_shm_regions(prefix: str) -> None:
    """Remove the regions a server started with `prefix` left behind."""
    for path in glob.glob(os.path.join(SHM_DIR, glob.escape(prefix) + "*")):
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


# Triton 2.51 finalizes a decoupled Python model only after its last response, so a long
# generation would outlive --exit-timeout-secs and be cut off without a final response. The
# launcher therefore marks the shutdown in a file the engine loop watches (INFLIGHT_SHUTDOWN_FLAG)
# before passing the signal on: every request in flight then ends promptly with a final response.
SHUTDOWN_FLAG_ENV = "INFLIGHT_SHUTDOWN_FLAG"


def shutdown_flag_path() -> str:
    return os.path.join(tempfile.gettempdir(), f"inflight-shutdown-{os.getpid()}-{time.monotonic_ns()}")


def request_shutdown(flag: str, process: subprocess.Popen, signum: int = signal.SIGTERM) -> None:
    with open(flag, "w") as f:
        f.write(str(signum))
    if process.poll() is None:
        process.send_signal(signum)


def make_repository(dest: str, model_dir: str | None = None, engine: dict | None = None,
                    models=("llm", "preprocessing", "postprocessing", "ensemble")) -> str:
    """A copy of model_repository/ whose llm serves `model_dir` (default: the shipped model) with
    these EngineConfig overrides: how tests and benchmarks run variants side by side."""
    settings_path = os.path.join(DEFAULT_REPOSITORY, "llm", "1", "model.json")
    try:
        with open(settings_path) as f:
            settings = json.load(f)
    except FileNotFoundError:
        raise SystemExit(f"inflight: --model and --engine start from the shipped settings, and {settings_path} "
                         "does not exist (the model repository belongs beside backend_src/)") from None
    # an override replaces a top-level key of the same name (model.json's LoRA keys)
    settings = {key: value for key, value in settings.items() if key not in (engine or {})}
    shipped = os.path.abspath(os.path.join(os.path.dirname(settings_path), settings["model"]))
    settings["model"] = os.path.abspath(os.path.expanduser(model_dir) if model_dir else shipped)
    left_out = ["inflight-tiny", "__pycache__", "model.json"]
    if os.path.realpath(settings["model"]) != os.path.realpath(shipped):
        # the shipped multi_lora.json names adapters of the shipped model: LoRA stays off, and an
        # enable_lora override serves no adapters until the caller writes a multi_lora.json of its own
        settings.pop("enable_lora", None)
        left_out += ["multi_lora.json", "loras"]
    settings["engine"] = {**settings["engine"], **(engine or {})}
    for name in models:
        src = os.path.join(DEFAULT_REPOSITORY, name)
        shutil.copytree(src, os.path.join(dest, name), dirs_exist_ok=True, ignore=shutil.ignore_patterns(*left_out))
    with open(os.path.join(dest, "llm", "1", "model.json"), "w") as f:
        json.dump(settings, f, indent=2)
    return dest


def free_ports(count: int) -> list[int]:
    """`count` distinct free local ports: the sockets are held together, since one closed before
    the next binds can hand the same port back (http and metrics once got one port, and
    tritonserver refused to start)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def free_port() -> int:
    return free_ports(1)[0]


class ServerProcess:
    """A tritonserver child process on free local ports; `with ServerProcess(repo) as server:`."""

    def __init__(self, model_repository: str, extra: list[str] = (), log_path: str | None = None,
                 ready_timeout_s: float = 300.0, env: dict[str, str] | None = None, auto_complete: bool = False):
        self.http_port, self.grpc_port, self.metrics_port = free_ports(3)
        self.model_repository = model_repository
        self.extra = list(extra)
        self.log_path = log_path or os.path.join(model_repository, "tritonserver.log")
        self.ready_timeout_s = ready_timeout_s
        self.env = env or {}
        self.auto_complete = auto_complete
        self.shutdown_flag = shutdown_flag_path()
        self.shm_prefix = shm_prefix()
        self.process: subprocess.Popen | None = None

    @property
    def http_url(self) -> str:
        return f"localhost:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"localhost:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://localhost:{self.metrics_port}/metrics"

    def start(self) -> "ServerProcess":
        server = locate_server()
        cmd = server_command(server, self.model_repository, self.http_port, self.grpc_port, self.metrics_port,
                             self.extra, self.auto_complete, self.shm_prefix)
        self._log = open(self.log_path, "ab")
        env = {**server.env, SHUTDOWN_FLAG_ENV: self.shutdown_flag, **self.env}
        # a process group of its own, so a terminal's Ctrl-C reaches only the caller and a kill reaches
        # the stubs too; the caller's session, as `make serve` runs it: with Linux autogroup a session
        # is a scheduling group, and a tritonserver in one of its own (setsid, until 2026-12-04) left a
        # load client on the same host waiting up to 0.5 s for a CPU (perf/HISTORY.md, "2026-12-04 late")
        self.process = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT, process_group=0)
        try:
            self.wait_ready()
        except BaseException:       # interrupted or killed while starting: no server left behind
            self.stop()
            raise
        return self

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        url = f"http://{self.http_url}/v2/health/ready"
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"tritonserver exited with {self.process.returncode}; log: {self.log_path}\n"
                                   + self.log_tail())
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"tritonserver not ready after {self.ready_timeout_s}s; log: {self.log_path}\n"
                           + self.log_tail())

    def metrics_text(self) -> str:
        with urllib.request.urlopen(self.metrics_url, timeout=10) as response:
            return response.read().decode()

    def metric(self, name: str, **labels) -> float:
        """Sum of the samples of one metric whose labels include `labels` (0 when there are none)."""
        total = 0.0
        for line in self.metrics_text().splitlines():
            match = re.match(rf"^{name}\{{(.*)\}} (\S+)$", line)
            if match and all(f'{k}="{v}"' in match.group(1) for k, v in labels.items()):
                total += float(match.group(2))
        return total

    def log_tail(self, lines: int = 40) -> str:
        with open(self.log_path, "rb") as f:
            return b"\n".join(f.read().splitlines()[-lines:]).decode("utf-8", "replace")

    def stop(self, timeout_s: float = 45.0) -> int | None:
        if self.process is None:
            return None
        try:
            if self.process.poll() is not None:
                return self.process.returncode
            request_shutdown(self.shutdown_flag, self.process, signal.SIGINT)
            try:
                return self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                return self.process.wait()
        finally:
            self._log.close()
            if os.path.exists(self.shutdown_flag):
                os.remove(self.shutdown_flag)
            remove_shm_regions(self.shm_prefix)

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def engine_overrides(pairs: list[str]) -> dict:
    """`--engine key=value` pairs -> EngineConfig fields. A value is JSON where it parses (128, 0.5,
    true, null), else a string (float32); unknown keys and bad values exit with the known list."""
    from ..config import EngineConfig

    overrides = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"inflight: --engine {pair!r}: expected key=value, e.g. max_num_seqs=128")
        try:
            overrides[key.strip()] = json.loads(text)
        except json.JSONDecodeError:
            overrides[key.strip()] = text
    try:
        EngineConfig.from_dict(overrides)
    except (TypeError, ValueError) as exc:
        raise SystemExit(f"inflight: --engine: {exc}") from None
    return overrides


# tritonserver's line for a model that did not load; a Python model's error goes on after "\n\nAt:"
# with its frames (escaped in the quoted log line of Triton 2.4x+, real newlines before)
_FAILED_LOAD = re.compile(r"failed to load '([^']+)' version \d+: (.*)")


def failure_cause(line: str) -> tuple[str, str] | None:
    """(model, cause) from a tritonserver log line, the cause without status, type or frames."""
    match = _FAILED_LOAD.search(line)
    if not match:
        return None
    cause = match.group(2).split("\\n")[0].rstrip().removesuffix('"').replace('\\"', '"')
    for prefix in ("Internal: ", "StartupError: "):
        cause = cause.removeprefix(prefix)
    return match.group(1), cause


def failure_summary(causes: list[tuple[str, str]], note: str | None = None) -> list[str]:
    """One line per distinct cause, with the models that reported it."""
    models_by_cause: dict[str, list[str]] = {}
    for model, cause in causes:
        models_by_cause.setdefault(cause, []).append(model)
    lines = ["inflight: the server did not start:"]
    lines += [f"  {', '.join(models)}: {cause}" for cause, models in models_by_cause.items()]
    if not causes:
        lines.append("  no model reported a cause; tritonserver's log above says why")
    return lines + ([f"  ({note})"] if note else [])


class TritonOutput:
    """Passes tritonserver's output (its stub processes' included) through to ours and collects the
    causes of models that failed to load."""

    def __init__(self, stream):
        self.stream = stream
        self.causes: list[tuple[str, str]] = []
        self.thread = threading.Thread(target=self._pump, name="tritonserver-output", daemon=True)
        self.thread.start()

    def _pump(self) -> None:
        out = sys.stdout.buffer
        for raw in iter(self.stream.readline, b""):
            try:
                out.write(raw)
                out.flush()
            except OSError:         # our output is gone (a closed pipe): drain on, or tritonserver blocks
                pass
            cause = failure_cause(raw.decode("utf-8", "replace"))
            if cause:
                self.causes.append(cause)

    def join(self, timeout_s: float = 5.0) -> None:
        self.thread.join(timeout_s)


@dataclass(slots=True)
class Endpoints:
    http_port: int
    grpc_port: int
    metrics_port: int
    openai_port: int | None = None       # the OpenAI-compatible server, where one runs
    openai_args: tuple[str, ...] = ()    # and flags of its own (--openai-arg)

    def banner(self, model: str, model_names: list[str]) -> list[str]:
        lines = [f"inflight: ready, serving {model}",
                 f"  HTTP     http://localhost:{self.http_port}  (models: {', '.join(model_names)})",
                 f"  gRPC     localhost:{self.grpc_port}",
                 f"  metrics  http://localhost:{self.metrics_port}/metrics"]
        if self.openai_port:
            from inflight_client.openai_server.auth import API_KEY_ENV
            keyed = f"  (API key: ${API_KEY_ENV})" if os.environ.get(API_KEY_ENV) else ""
            lines.append(f"  OpenAI   http://localhost:{self.openai_port}/v1{keyed}")
        lines.append(f"  try:     curl -s localhost:{self.http_port}/v2/models/llm/generate "
                     "-d '{\"text_input\": \"The assert statement\", \"max_tokens\": 32, \"temperature\": 0}'")
        return lines


def served_model(model_repository: str) -> str:
    """The checkpoint the repository's llm serves (for the banner)."""
    from .startup import StartupError
    from .triton_models import llm_settings
    try:
        return llm_settings(os.path.join(model_repository, "llm")).model_dir
    except StartupError:
        return f"the llm in {model_repository}"


def model_names(model_repository: str) -> list[str]:
    return sorted(name for name in os.listdir(model_repository)
                  if os.path.isfile(os.path.join(model_repository, name, "config.pbtxt")))


COMPANION_STOP_S = 10.0     # a companion still running this long after SIGTERM is killed


class Children:
    """The processes `make serve` runs: tritonserver, then any companion (such as an OpenAI-compatible
    server), signalled and stopped together; tritonserver gets the shutdown flag first."""

    def __init__(self):
        self.flag = shutdown_flag_path()
        self.shm_prefix = shm_prefix()
        self.processes: list[subprocess.Popen] = []
        self.stopping = False                 # a stop was asked: companions exiting is no news

    def start(self, cmd: list[str], **popen) -> subprocess.Popen:
        process = subprocess.Popen(cmd, **popen)
        self.processes.append(process)
        return process

    def signal(self, signum: int) -> None:
        """Stop every child. The companions get SIGTERM whatever the launcher got: they run in
        sessions of their own, out of a terminal's Ctrl-C, and uvicorn takes SIGTERM as a clean
        stop where a second SIGINT is "stop now" (its shutdown skipped, a traceback printed)."""
        triton, *companions = self.processes
        self.stopping = True
        request_shutdown(self.flag, triton, signum)
        for process in companions:
            if process.poll() is None:
                process.terminate()

    def kill(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()

    def wait(self) -> int:
        """tritonserver's exit code, once every child has exited. The companions serve nothing
        without tritonserver: once it has exited (stopped, or on its own after an engine failure or
        a crash) they are stopped too, so the launcher ends and a supervisor can restart it. A
        companion that exits first is reported (tritonserver goes on)."""
        triton, *companions = self.processes
        reported = set()
        while True:
            try:
                code = triton.wait(timeout=1)
                break
            except subprocess.TimeoutExpired:
                for process in companions:
                    if process.poll() is not None and process.pid not in reported and not self.stopping:
                        reported.add(process.pid)
                        print(f"inflight: {' '.join(map(str, process.args[:3]))} exited with {process.returncode}; "
                              "tritonserver goes on without it", flush=True)
        for process in companions:
            if process.poll() is None:
                process.terminate()
        for process in companions:
            try:
                process.wait(COMPANION_STOP_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if os.path.exists(self.flag):
            os.remove(self.flag)
        remove_shm_regions(self.shm_prefix)
        return code


# a model failed, but tritonserver waits for the others to finish loading: stop it after this long
FAILED_START_GRACE_S = 10.0


def listens_on(pid: int, port: int) -> bool:
    """Whether the process holds a socket listening on the TCP port (from /proc; where there is no
    /proc, True: the readiness probe alone decides)."""
    listening = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = [line.split() for line in f.readlines()[1:]]
        except OSError:
            continue
        listening |= {f"socket:[{row[9]}]" for row in rows      # state 0A: LISTEN
                      if row[3] == "0A" and int(row[1].rsplit(":", 1)[1], 16) == port}
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return not os.path.isdir("/proc")
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") in listening:
                return True
        except OSError:             # closed meanwhile
            continue
    return False


def wait_ready(triton: subprocess.Popen, children: Children, output: TritonOutput, http_port: int) -> bool:
    """Poll readiness until tritonserver is ready (True) or has exited (False). Ready is this
    tritonserver's answer: the port check runs before it binds (after loading, minutes later), so
    another server started meanwhile (a second `make serve`) could answer the probe, and the
    launcher announced a server that was not its own."""
    failed_since = None
    while triton.poll() is None:
        if output.causes and failed_since is None:
            failed_since = time.monotonic()
        if failed_since is not None and time.monotonic() - failed_since > FAILED_START_GRACE_S:
            children.signal(signal.SIGTERM)
            failed_since = float("inf")
        try:
            with urllib.request.urlopen(f"http://localhost:{http_port}/v2/health/ready", timeout=1) as response:
                if response.status == 200 and listens_on(triton.pid, http_port):
                    return True
        except (OSError, HTTPException):      # not up yet (or, on a port someone else holds, not HTTP)
            pass
        time.sleep(0.5)
    return False


def start_openai_server(children: Children, model_repository: str, endpoints: Endpoints) -> bool:
    """The OpenAI-compatible server (inflight_client.openai_server) for the checkpoint `llm` serves,
    started once tritonserver is ready and stopped with it. False (and why) if it did not start."""
    from .startup import StartupError
    from .triton_models import llm_settings
    try:
        from inflight_client.openai_server.process import OpenAIServerProcess      # absent from a backend-only image
        settings = llm_settings(os.path.join(model_repository, "llm"))
        lora_names = sorted(settings.lora_modules)      # each adapter of multi_lora.json is a model id
        extra = [*endpoints.openai_args, *(["--lora-modules", *lora_names] if lora_names else []),
                 "--triton-metrics-url", f"http://localhost:{endpoints.metrics_port}/metrics"]
        engine = settings.engine
        if engine.max_model_len:
            extra += ["--max-model-len", str(engine.max_model_len)]
        if engine.max_queue_size is not None and not any(a.startswith("--max-triton-requests") for a in extra):
            # so that one request's many prompts never fill the engine's queue by themselves
            extra += ["--max-triton-requests", str(engine.max_num_seqs + engine.max_queue_size)]
        if engine.hf_overrides and not any(a.startswith("--hf-overrides") for a in extra):
            extra += ["--hf-overrides", json.dumps(engine.hf_overrides)]       # a reranker's conversion, say
        if engine.allow_runtime_lora_updating:          # llm reads adapters by path: the server's routes load them
            extra.append("--allow-runtime-lora-updating")
        if engine.reasoning_parser is not None and not any(a.startswith("--reasoning-parser") for a in extra):
            extra += ["--reasoning-parser", engine.reasoning_parser]      # one setting splits and gates alike
        openai = OpenAIServerProcess(f"localhost:{endpoints.http_port}", settings.model_dir,
                                     port=endpoints.openai_port, host="0.0.0.0", extra=extra)
        children.processes.append(openai.start(wait=True, timeout_s=60).process)
    except (StartupError, ImportError, RuntimeError, TimeoutError) as exc:
        print(f"inflight: the OpenAI server did not start ({exc}); tritonserver goes on without it", flush=True)
        return False
    return True


def port_number(text: str) -> int:
    """argparse's type for a port: 1-65535 (argparse names the flag in its error)."""
    try:
        port = int(text)
    except ValueError:
        port = 0
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port: give a number from 1 to 65535")
    return port


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-repository", help="serve this model repository (default: model_repository/)")
    parser.add_argument("--model", help="serve this Hugging Face checkpoint directory: the launcher writes a model "
                                        "repository for it (llm, ensemble and its steps)")
    parser.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE",
                        help="an EngineConfig field for the served model, e.g. max_num_seqs=128 (repeatable)")
    parser.add_argument("--http-port", type=port_number, default=8000)
    parser.add_argument("--grpc-port", type=port_number, default=8001)
    parser.add_argument("--metrics-port", type=port_number, default=8002)
    parser.add_argument("--production", action="store_true", help="the production-profile flags (see README)")
    parser.add_argument("--openai-port", type=port_number, default=9000, help="the OpenAI-compatible server's port")
    parser.add_argument("--no-openai", action="store_true", help="do not start the OpenAI-compatible server")
    parser.add_argument("--openai-arg", action="append", default=[], metavar="FLAG",
                        help="a flag for the OpenAI server, in the = form: --openai-arg=--disable-any-whitespace "
                             "(repeatable; `python -m inflight_client.openai_server --help` lists them)")
    args, extra = parser.parse_known_args()
    overrides = engine_overrides(args.engine)
    if (args.model or overrides) and args.model_repository:
        raise SystemExit("inflight: --model and --engine write a model repository of their own; "
                         "leave out --model-repository")
    server = locate_server()
    if args.production:
        if not os.environ.get("INFLIGHT_ADMIN_KEY"):
            raise SystemExit("--production needs INFLIGHT_ADMIN_KEY (the header value for restricted APIs)")
        extra = [os.path.expandvars(flag) for flag in PRODUCTION_FLAGS] + extra
    written, note = None, None
    try:
        if args.model or overrides:
            written = tempfile.mkdtemp(prefix="inflight-repository-")     # removed below, whatever happens
            make_repository(written, args.model, overrides)
            note = f"{written}/llm/1/model.json holds --model and --engine; it is removed on exit"
        code = serve(server, written or args.model_repository or DEFAULT_REPOSITORY,
                     Endpoints(args.http_port, args.grpc_port, args.metrics_port,
                               None if args.no_openai else args.openai_port, tuple(args.openai_arg)), extra, note)
    finally:
        if written:
            shutil.rmtree(written, ignore_errors=True)
    sys.exit(code)


def shown_command(cmd: list[str]) -> str:
    """The command as printed: the production profile's admin key (the restricted APIs' header
    value, expanded into two flags) would otherwise end up in logs anyone may read."""
    shown = " ".join(cmd)
    key = os.environ.get("INFLIGHT_ADMIN_KEY")
    return shown.replace(key, "***") if key else shown


def port_problem(port: int) -> str | None:
    """Why a server could not listen on the port, or None: "is in use" where something listens
    already (SO_REUSEADDR, as the servers bind: a port left in TIME_WAIT by a server that just
    stopped is free), on IPv4 or on IPv6 (a listener on [::1] only: where localhost resolves to
    ::1 first, the readiness probe would reach it); otherwise the system's reason (a port below
    1024 for a user who may not bind it: "Permission denied")."""
    def bound(probe: socket.socket, address: tuple) -> str | None:
        try:
            probe.bind(address)
        except OSError as exc:
            return "is in use" if exc.errno == errno.EADDRINUSE else f"cannot be listened on ({exc.strerror})"
        return None

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        problem = bound(probe, ("0.0.0.0", port))
        if problem:
            return problem
    try:
        probe = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    except OSError:                 # no IPv6 on this host
        return None
    with probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        problem = bound(probe, ("::", port))
    return problem if problem == "is in use" else None      # not "IPv6 is disabled"


def check_ports(endpoints: Endpoints) -> None:
    """Refuse ports in use before anything starts: tritonserver binds its ports only once its models
    have loaded (minutes), and until then its readiness probe would reach whatever holds them. Two
    servers given one port are refused too: the probe would reach the one that bound it."""
    flags = {"--http-port": endpoints.http_port, "--grpc-port": endpoints.grpc_port,
             "--metrics-port": endpoints.metrics_port, "--openai-port": endpoints.openai_port}
    named: dict[int, str] = {}
    for flag, port in flags.items():
        if port and port in named:
            raise SystemExit(f"inflight: {named[port]} and {flag} are both {port}: each server needs a port of "
                             "its own")
        named[port] = flag
    for flag, port in list(flags.items())[:3]:
        problem = port_problem(port)
        if problem:
            remedy = "stop what holds it, or choose another port" if problem == "is in use" else "choose another port"
            raise SystemExit(f"inflight: port {port} ({flag}) {problem}: {remedy} (make serve SERVE_ARGS='{flag} N')")
    problem = endpoints.openai_port and port_problem(endpoints.openai_port)
    if problem:
        print(f"inflight: port {endpoints.openai_port} (--openai-port) {problem}; tritonserver starts without "
              "the OpenAI server", flush=True)
        endpoints.openai_port = None


def serve(server: Server, model_repository: str, endpoints: Endpoints, extra: list[str],
          note: str | None = None) -> int:
    """Run tritonserver (and its companions) until they exit; the ready banner, or why it did not start."""
    check_ports(endpoints)
    children = Children()
    cmd = server_command(server, model_repository, endpoints.http_port, endpoints.grpc_port,
                         endpoints.metrics_port, extra, shm_prefix=children.shm_prefix)
    print(f"inflight: starting {shown_command(cmd)}", flush=True)
    # SIGTERM to tritonserver once the launcher is gone, even killed with SIGKILL (by a supervisor
    # that kills only the main process): it kept the ports, and the next `make serve` found them in
    # use. Set now, before the launcher has threads; the OpenAI server watches its parent itself.
    triton = children.start(cmd, env={**server.env, SHUTDOWN_FLAG_ENV: children.flag},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=signalled_when_parent_dies())
    output = TritonOutput(triton.stdout)
    stopping = []

    def forward(signum, _frame):
        stopping.append((signum, time.monotonic()))
        if len(stopping) == 1:
            children.signal(signum)
        elif signum == signal.SIGINT and time.monotonic() - stopping[0][1] > 1:
            # Ctrl-C again (not one signal delivered twice, as to a whole cgroup and by make too;
            # supervisors send SIGTERM and escalate themselves): a request outliving the exit
            # timeout holds tritonserver up
            print("inflight: stopping now (SIGKILL)", flush=True)
            children.kill()

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    try:
        ready = wait_ready(triton, children, output, endpoints.http_port)
        if ready and endpoints.openai_port:
            if not start_openai_server(children, model_repository, endpoints):
                endpoints.openai_port = None
            elif stopping:                  # asked to stop while it started
                children.processes[-1].terminate()
        if ready and not stopping:        # not "ready" for a server already asked to stop
            print("\n".join(endpoints.banner(served_model(model_repository), model_names(model_repository))),
                  flush=True)
    except BaseException:               # a bug here must not leave tritonserver running on its own
        children.signal(signal.SIGTERM)
        children.wait()
        raise
    code = children.wait()
    output.join()
    if code < 0:        # killed by a signal (the OOM killer, a segfault): tritonserver says nothing then
        if not stopping:
            print(f"inflight: tritonserver was killed by {signal.Signals(-code).name}", flush=True)
        code = 128 - code               # the shell's code, not sys.exit's 256 - N
    if not ready and not stopping:
        print("\n".join(failure_summary(output.causes, note)), flush=True)
        return code if code > 0 else 1
    if ready and not stopping and code == 0:
        # nobody asked it to stop: an engine failure shuts tritonserver down cleanly, and a
        # supervisor that restarts only what fails must still see a failure
        print("inflight: tritonserver stopped on its own (the cause is above); exiting with 1", flush=True)
        return 1
    return code


if __name__ == "__main__":
    main()
