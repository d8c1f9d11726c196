"""The first hour, through the real launcher (`make serve` runs `python -m inflight.serving.launch`):
a checkpoint given with --model is served through llm and the ensemble, each broken checkpoint
ends the launcher within 30 s with one line naming the cause and the path, and the tokenizing
ensemble steps run without torch."""
import glob
import http.client
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
import torch

from inflight.serving.launch import ServerProcess, failure_cause, failure_summary, free_ports, make_repository
from inflight_client.streams import http_generate

from .conftest import DEFAULT_MODEL, REPO, TEST_ENGINE
from .helpers import SOURCE_PATH_ENV, child_processes, rss_mib

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# a subprocess imports this checkout's code, not an installed copy
ENV = {**os.environ, **SOURCE_PATH_ENV}


class Launcher:
    """`python -m inflight.serving.launch ARGS` on free ports, its output collected line by line."""

    def __init__(self, *args: str, env: dict | None = None):
        self.http_port, self.grpc_port, self.metrics_port, self.openai_port = free_ports(4)
        cmd = [sys.executable, "-m", "inflight.serving.launch", f"--http-port={self.http_port}",
               f"--grpc-port={self.grpc_port}", f"--metrics-port={self.metrics_port}",
               f"--openai-port={self.openai_port}", *args]
        self.started = time.monotonic()
        # its own process group, which a test may signal as a terminal's Ctrl-C does
        self.process = subprocess.Popen(cmd, env={**ENV, **(env or {})}, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for raw in iter(self.process.stdout.readline, b""):
            self.lines.append(raw.decode("utf-8", "replace").rstrip("\n"))

    def wait_for(self, text: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not any(text in line for line in self.lines):
            assert self.process.poll() is None, "\n".join(self.lines[-30:])
            assert time.monotonic() < deadline, f"no {text!r} after {timeout_s} s:\n" + "\n".join(self.lines[-30:])
            time.sleep(0.2)

    def wait(self, timeout_s: float) -> tuple[int, float]:
        """(exit code, seconds since start); kills it after timeout_s."""
        try:
            code = self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.send_signal(signal.SIGINT)
            self.process.wait(60)
            pytest.fail(f"the launcher still ran after {timeout_s} s:\n" + "\n".join(self.lines[-30:]))
        self.reader.join(5)
        return code, time.monotonic() - self.started


@pytest.fixture(scope="module")
def served_checkpoint(tmp_path_factory):
    """A random Llama with the shipped model's vocabulary and tokenizer: what a user's checkpoint
    directory holds (config.json, model.safetensors, tokenizer files)."""
    from inflight.testing import make_random_checkpoint
    with open(os.path.join(DEFAULT_MODEL, "config.json")) as f:
        vocab_size = json.load(f)["vocab_size"]
    path = make_random_checkpoint(str(tmp_path_factory.mktemp("user") / "checkpoint"), "llama", seed=7,
                                  vocab_size=vocab_size)
    for name in TOKENIZER_FILES:
        shutil.copy(os.path.join(DEFAULT_MODEL, name), path)
    return path


@pytest.mark.server
def test_a_checkpoint_given_with_model_is_served_through_llm_and_the_ensemble(served_checkpoint):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    launcher = Launcher("--model", served_checkpoint, "--engine", "dtype=float64", "--engine", "max_num_seqs=4",
                        "--engine", "cpu_threads=1", "--engine", "max_model_len=256", "--engine", "max_queue_size=2",
                        "--openai-arg=--served-model-name=user-model")
    try:
        launcher.wait_for("inflight: ready", 120)
        banner = "\n".join(launcher.lines[-8:])
        for endpoint in (f"http://localhost:{launcher.http_port}", f"localhost:{launcher.grpc_port}",
                         f"http://localhost:{launcher.metrics_port}/metrics", f"serving {served_checkpoint}",
                         f"http://localhost:{launcher.openai_port}/v1"):
            assert endpoint in banner
        with urllib.request.urlopen(f"http://localhost:{launcher.openai_port}/v1/models", timeout=10) as response:
            cards = json.load(response)["data"]
        assert [m["id"] for m in cards] == ["user-model"], "--openai-arg reaches the OpenAI server"
        assert cards[0]["max_model_len"] == 256, "the engine's context length, passed on by the launcher"
        many = json.dumps({"model": "user-model", "prompt": ["x"] * 10, "max_tokens": 2}).encode()
        request = urllib.request.Request(f"http://localhost:{launcher.openai_port}/v1/completions", many,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:      # 2 in flight at a time: no 429
            assert len(json.load(response)["choices"]) == 10
        prompt = "The assert statement"
        url = f"localhost:{launcher.http_port}"
        llm = http_generate(url, "llm", {"text_input": prompt, "max_tokens": 8, "temperature": 0,
                                         "exclude_input_in_output": True})["text_output"]
        ensemble = http_generate(url, "ensemble", {"text_input": prompt, "max_tokens": 8, "temperature": 0.0,
                                                   "exclude_input_in_output": True})["text_output"]
        tokenizer = AutoTokenizer.from_pretrained(served_checkpoint)
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        model = AutoModelForCausalLM.from_pretrained(served_checkpoint, dtype=torch.float64)
        expected = model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:]
        assert llm == ensemble == tokenizer.decode(expected, skip_special_tokens=True) != ""
        if shutil.which("curl"):        # the banner's curl line, as printed
            curl = re.search(r"try:\s+(curl .*)$", banner, re.M).group(1)
            reply = json.loads(subprocess.run(curl, shell=True, check=True, capture_output=True, timeout=60).stdout)
            assert reply["model_name"] == "llm" and reply["text_output"].startswith("The assert statement")
    finally:
        launcher.process.send_signal(signal.SIGINT)
    code, _ = launcher.wait(60)
    assert code == 0, "\n".join(launcher.lines[-30:])
    written = re.search(r"--model-repository=(\S+)", launcher.lines[0]).group(1)
    assert not os.path.exists(written)


@pytest.mark.server
def test_the_launcher_ends_when_tritonserver_dies_and_never_prints_the_admin_key(served_checkpoint):
    """tritonserver gone (a crash, or stopped after an engine failure): the launcher stops the
    OpenAI server too and exits with tritonserver's code, so a supervisor can restart it. The
    OpenAI server gone first is reported, and tritonserver goes on. With --production the admin
    key, expanded into two flags, is masked in the printed command."""
    key = "admin-key-for-the-test"
    launcher = Launcher("--model", served_checkpoint, "--production", "--engine", "dtype=float32", "--engine",
                        "max_num_seqs=2", "--engine", "cpu_threads=1", "--engine", "max_model_len=128",
                        env={"INFLIGHT_ADMIN_KEY": key})
    try:
        launcher.wait_for("inflight: ready", 120)
        children = child_processes(launcher.process.pid)
        (triton,) = [pid for pid, command in children.items() if "tritonserver" in command]
        (openai_server,) = [pid for pid, command in children.items() if "openai_server" in command]
        os.kill(openai_server, signal.SIGKILL)
        launcher.wait_for("tritonserver goes on without it", 30)
        assert launcher.process.poll() is None and os.path.exists(f"/proc/{triton}")
        os.kill(triton, signal.SIGKILL)
        code, _ = launcher.wait(60)
    finally:
        if launcher.process.poll() is None:
            launcher.process.send_signal(signal.SIGINT)
    assert code == 128 + signal.SIGKILL and "inflight: tritonserver was killed by SIGKILL" in launcher.lines
    assert "admin-key=***" in launcher.lines[0] and not any(key in line for line in launcher.lines)
    prefix = re.search(r"shm-region-prefix-name=(\S+)", launcher.lines[0]).group(1)
    assert not glob.glob(f"/dev/shm/{prefix}*"), "the killed server's shared-memory regions are removed"


def running(pid: int) -> bool:
    """Whether the process runs (one reaped by nobody yet, a zombie, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


@pytest.mark.server
def test_tritonserver_and_the_openai_server_stop_when_the_launcher_is_killed(served_checkpoint):
    """SIGKILL to the launcher alone (a supervisor that kills only the main process, or a user whose
    stop hung): tritonserver and the OpenAI server stop too, and the next `make serve` finds the
    ports free (before, both served on for good)."""
    from inflight.serving.launch import port_problem
    launcher = Launcher("--model", served_checkpoint, "--engine", "dtype=float32", "--engine", "max_num_seqs=2",
                        "--engine", "cpu_threads=1", "--engine", "max_model_len=128")
    children = {}
    try:
        launcher.wait_for("inflight: ready", 120)
        children = child_processes(launcher.process.pid)
        (triton,) = [pid for pid, command in children.items() if "tritonserver" in command]
        (openai_server,) = [pid for pid, command in children.items() if "openai_server" in command]
        launcher.process.kill()
        launcher.process.wait()
        deadline = time.monotonic() + 60
        while (running(triton) or running(openai_server)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not running(triton) and not running(openai_server)
        assert all(port_problem(port) is None for port in (launcher.http_port, launcher.openai_port))
    finally:
        for pid in children:
            if running(pid):
                os.kill(pid, signal.SIGKILL)


def test_readiness_answered_by_another_server_on_the_port_is_not_this_launchers(server):
    """Triton binds its ports only after loading, minutes after the port check: a server started
    meanwhile on the port (a second `make serve`) answered the probe, and the launcher announced
    it as its own. Here the other server is the suite's; this launcher's tritonserver never
    listens and exits."""
    import io
    import subprocess

    from inflight.serving.launch import Children, TritonOutput, listens_on, wait_ready
    assert listens_on(server.process.pid, server.http_port) and not listens_on(os.getpid(), server.http_port)
    never_listens = subprocess.Popen(["sleep", "3"])
    assert not wait_ready(never_listens, Children(), TritonOutput(io.BytesIO()), server.http_port)


def test_ports_in_use_are_refused_before_anything_starts(capsys):
    """tritonserver binds its ports only once its models have loaded: until then its readiness
    probe would reach whatever holds them. A held Triton port ends the launcher naming the flag;
    a held OpenAI port leaves the OpenAI server out."""
    import socket

    from inflight.serving.launch import Endpoints, check_ports, port_problem
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert port_problem(port) == "is in use"
        http, metrics, openai = free_ports(3)
        with pytest.raises(SystemExit, match=f"port {port} \\(--grpc-port\\) is in use"):
            check_ports(Endpoints(http, port, metrics, openai))
        endpoints = Endpoints(*free_ports(3), port)
        check_ports(endpoints)
        assert endpoints.openai_port is None and "without the OpenAI server" in capsys.readouterr().out
    assert port_problem(port) is None
    http, grpc, metrics = free_ports(3)
    with pytest.raises(SystemExit, match=f"--http-port and --openai-port are both {http}: each server needs a port"):
        check_ports(Endpoints(http, grpc, metrics, http))


def test_a_model_given_with_a_tilde_is_found_in_the_home_directory(tmp_path, monkeypatch):
    """--model=~/ckpt (no shell expanded it, as after an `=`) is the home's ckpt, as model.json's
    own paths are, not ./~/ckpt."""
    from inflight.serving.launch import make_repository
    monkeypatch.setenv("HOME", str(tmp_path))
    make_repository(str(tmp_path / "repo"), "~/ckpt")
    with open(tmp_path / "repo" / "llm" / "1" / "model.json") as f:
        assert json.load(f)["model"] == str(tmp_path / "ckpt")


def test_a_port_that_may_not_be_bound_is_named_with_the_systems_reason(monkeypatch):
    """A port below 1024 for a user who may not bind it is not "in use" (before: "stop what holds
    it" for a free port)."""
    import errno
    import socket

    from inflight.serving.launch import Endpoints, check_ports

    def refused(self, address):
        raise PermissionError(errno.EACCES, "Permission denied")
    monkeypatch.setattr(socket.socket, "bind", refused)
    with pytest.raises(SystemExit, match=r"port 80 \(--http-port\) cannot be listened on \(Permission denied\): "
                                         r"choose another port"):
        check_ports(Endpoints(80, 8001, 8002, None))


def test_after_an_engine_failure_the_launcher_exits_with_a_failure(served_checkpoint):
    """The failed engine shuts tritonserver down cleanly (exit 0); a supervisor that restarts only
    what fails (systemd on-failure, docker on-failure) must still see one."""
    launcher = Launcher("--model", served_checkpoint, "--engine", "dtype=float32", "--engine", "max_num_seqs=2",
                        "--engine", "cpu_threads=1", "--engine", "max_model_len=128",
                        env={"INFLIGHT_FAULT_AFTER_STEPS": "3"})
    try:
        launcher.wait_for("inflight: ready", 120)
        body = json.dumps({"text_input": "x", "max_tokens": 8}).encode()
        request = urllib.request.Request(f"http://localhost:{launcher.http_port}/v2/models/llm/generate", body)
        try:            # the error response, or the connection closing as the server stops
            urllib.request.urlopen(request, timeout=60).read()
            pytest.fail("a request succeeded on an engine that fails after 3 steps")
        except (OSError, http.client.HTTPException):
            pass
        code, _ = launcher.wait(90)
    finally:
        if launcher.process.poll() is None:
            launcher.process.send_signal(signal.SIGINT)
    assert code == 1
    assert any("tritonserver stopped on its own" in line for line in launcher.lines), "\n".join(launcher.lines[-20:])


def test_ctrl_c_stops_the_openai_server_once_and_cleanly(served_checkpoint):
    """A terminal's Ctrl-C signals the whole process group, the launcher forwards it: the OpenAI
    server must not get a second SIGINT, which uvicorn takes as "stop now" (a traceback), and the
    `llm` stub must not leave its metric families to Triton 2.51's stub teardown (a segfault's stack)."""
    launcher = Launcher("--model", served_checkpoint, "--engine", "dtype=float32", "--engine", "max_num_seqs=2",
                        "--engine", "cpu_threads=1", "--engine", "max_model_len=128")
    try:
        launcher.wait_for("inflight: ready", 120)
        os.killpg(launcher.process.pid, signal.SIGINT)
        code, _ = launcher.wait(60)
    finally:
        if launcher.process.poll() is None:
            launcher.process.send_signal(signal.SIGINT)
    assert code == 0
    output = "\n".join(launcher.lines)
    assert "Application shutdown complete" in output and "Traceback" not in output, output[-3000:]
    assert "Segfault" not in output, output[-3000:]


def test_ctrl_c_while_the_openai_server_starts_stops_everything_without_a_traceback(served_checkpoint):
    """Ctrl-C just after tritonserver is ready, while the OpenAI server still imports: it printed a
    KeyboardInterrupt traceback (the terminal's SIGINT reached it before uvicorn handled signals)
    and the launcher then printed its "ready" banner for a server already stopping."""
    launcher = Launcher("--model", served_checkpoint, "--engine", "dtype=float32", "--engine", "max_num_seqs=2",
                        "--engine", "cpu_threads=1", "--engine", "max_model_len=128")
    try:
        launcher.wait_for("Started HTTPService", 120)
        time.sleep(0.5)                 # the OpenAI server is starting: its imports take seconds
        os.killpg(launcher.process.pid, signal.SIGINT)
        code, _ = launcher.wait(60)
    finally:
        if launcher.process.poll() is None:
            launcher.process.send_signal(signal.SIGINT)
    output = "\n".join(launcher.lines)
    assert code == 0 and "Traceback" not in output and "inflight: ready" not in output, output[-3000:]


def _broken(kind: str, good: str, root) -> tuple[list[str], str, str]:
    """(launcher arguments, expected cause, expected path) for one kind of broken checkpoint."""
    copy = str(root / "checkpoint")
    if kind == "missing path":
        return ["--model", str(root / "nowhere")], "does not exist", str(root / "nowhere")
    if kind == "bad model.json key":
        repository = make_repository(str(root / "repository"), good)
        path = os.path.join(repository, "llm", "1", "model.json")
        with open(path) as f:
            settings = json.load(f)
        settings["engine"]["max_num_seq"] = 4
        with open(path, "w") as f:
            json.dump(settings, f)
        return ["--model-repository", repository], "unknown engine config keys ['max_num_seq']; known:", path
    if kind == "KV budget with no block":
        return ["--model", good, "--engine", "kv_cache_gb=1e-9"], "holds no block", "kv_cache_gb"
    shutil.copytree(good, copy)
    if kind == "no config.json":
        os.remove(os.path.join(copy, "config.json"))
        return ["--model", copy], "has no config.json", copy
    if kind == "no safetensors":
        os.remove(os.path.join(copy, "model.safetensors"))
        return ["--model", copy], "has no *.safetensors", copy
    if kind == "no tokenizer":
        for name in TOKENIZER_FILES:
            os.remove(os.path.join(copy, name))
        return ["--model", copy], "has no tokenizer", copy
    if kind == "broken tokenizer":
        with open(os.path.join(copy, "tokenizer.json"), "w") as f:
            json.dump({"version": "1.0", "model": {"type": "Nope"}}, f)
        return ["--model", copy], "does not load: KeyError: 'added_tokens'", copy
    assert kind == "unsupported architecture"
    path = os.path.join(copy, "config.json")
    with open(path) as f:
        config = json.load(f)
    with open(path, "w") as f:
        json.dump({**config, "architectures": ["GPT2LMHeadModel"]}, f)
    return ["--model", copy], "'architectures' is ['GPT2LMHeadModel']; supported: LlamaForCausalLM", path


@pytest.mark.server
@pytest.mark.parametrize("kind", ["missing path", "no config.json", "no safetensors", "unsupported architecture",
                                  "no tokenizer", "broken tokenizer", "bad model.json key",
                                  "KV budget with no block"])
def test_a_broken_checkpoint_ends_the_launcher_with_the_cause_and_the_path(kind, served_checkpoint, tmp_path):
    args, cause, path = _broken(kind, served_checkpoint, tmp_path)
    launcher = Launcher(*args)
    code, elapsed = launcher.wait(30)
    last = "\n".join(launcher.lines[-10:])
    assert code != 0 and elapsed < 30, last
    assert cause in last and path in last, last
    assert "Traceback" not in last and "At:" not in last, last
    if kind == "broken tokenizer":      # llm too, before its weights: not a KeyError of its own
        models = {line: line.split(":")[0].strip().split(", ") for line in launcher.lines[-10:]}
        assert any("llm" in names and cause in line for line, names in models.items()), last


@pytest.mark.server
def test_the_tokenizing_steps_run_without_torch_in_under_150_mib(server):
    stubs = stub_processes(server.model_repository)
    assert sorted(stubs) == ["llm", "postprocessing", "preprocessing"]
    for name in ("preprocessing", "postprocessing"):
        assert rss_mib(stubs[name]) < 150, (name, rss_mib(stubs[name]))
        with open(f"/proc/{stubs[name]}/maps") as f:
            assert "libtorch" not in f.read(), name
    assert rss_mib(stubs["llm"]) > 150            # it does load torch: the measurement sees the stubs


def stub_processes(model_repository: str) -> dict[str, int]:
    """model name -> pid of the Python backend stub running <model_repository>/<name>/1/model.py."""
    stubs = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if argv[0].endswith("triton_python_backend_stub") and argv[1].startswith(model_repository + os.sep):
            stubs[os.path.relpath(argv[1], model_repository).split(os.sep)[0]] = int(pid)
    return stubs


# ---- without a server -------------------------------------------------------------------------------
def run_launcher(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "inflight.serving.launch", *args], env=ENV, capture_output=True,
                          text=True, timeout=60)


def test_engine_overrides_are_json_or_strings_and_unknown_keys_get_the_known_list():
    from inflight.serving.launch import engine_overrides
    assert engine_overrides(["max_num_seqs=128", "dtype=float32", "kv_cache_gb=0.5", "enable_prefix_caching=false",
                             "max_model_len=null"]) == {"max_num_seqs": 128, "dtype": "float32", "kv_cache_gb": 0.5,
                                                        "enable_prefix_caching": False, "max_model_len": None}
    bad = run_launcher("--engine", "max_num_seq=4")
    assert bad.returncode != 0
    assert "--engine: unknown engine config keys ['max_num_seq']; known: [" in bad.stderr
    assert "'max_num_seqs'" in bad.stderr
    assert "'max_num_seqs' must be a positive integer" in run_launcher("--engine", "max_num_seqs=0").stderr
    assert "expected key=value" in run_launcher("--engine", "max_num_seqs").stderr


@pytest.mark.parametrize("flag", ["--http-port", "--grpc-port", "--metrics-port", "--openai-port"])
@pytest.mark.parametrize("value", ["0", "80000", "http"])
def test_a_port_outside_1_to_65535_is_refused_naming_the_flag(flag, value):
    done = run_launcher(flag, value)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"argument {flag}: '{value}' is not a port: give a number from 1 to 65535" in done.stderr


def test_a_listener_on_ipv6_loopback_only_counts_as_in_use():
    """Where localhost resolves to ::1 first, the readiness probe would reach it."""
    import socket

    from inflight.serving.launch import port_problem
    try:
        held = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        held.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        held.bind(("::1", 0))
    except OSError as exc:
        pytest.skip(f"no IPv6 loopback here ({exc})")
    with held:
        held.listen()
        port = held.getsockname()[1]
        assert port_problem(port) == "is in use"
    assert port_problem(port) is None


def test_without_the_shipped_model_json_model_ends_in_one_line_and_leaves_no_temporary_repository(
        tmp_path, monkeypatch):
    """As in an image whose model repository is not beside backend_src/: the path is named, and the
    temporary repository made for --model is removed."""
    from inflight.serving import launch
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(launch, "DEFAULT_REPOSITORY", str(tmp_path / "nowhere"))
    monkeypatch.setattr(launch.tempfile, "tempdir", str(temp))
    monkeypatch.setattr(sys, "argv", ["launch", "--model", str(tmp_path / "checkpoint"), "--engine", "max_num_seqs=2"])
    with pytest.raises(SystemExit) as exited:
        launch.main()
    message = str(exited.value)
    assert "\n" not in message and os.path.join(str(tmp_path / "nowhere"), "llm", "1", "model.json") in message
    assert os.listdir(temp) == []


def test_make_serve_passes_model_and_engine_to_the_launcher():
    if not shutil.which("make"):
        pytest.skip("no make")
    dry = subprocess.run(["make", "-n", "-o", ".venv/.installed", "serve", "MODEL=/checkpoints/x",
                          'ENGINE=max_num_seqs=128 hf_overrides={"method":"from_2_way_softmax"}',
                          "SERVE_ARGS=--http-port=9100"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    command = next(line for line in dry.splitlines() if "inflight.serving.launch" in line)    # make[1]: lines aside
    # each pair quoted: a JSON value keeps its quotes through the shell
    assert shlex.split(command)[1:] == ["-m", "inflight.serving.launch", "--model", "/checkpoints/x", "--engine",
                                        "max_num_seqs=128", "--engine", 'hf_overrides={"method":"from_2_way_softmax"}',
                                        "--http-port=9100"]


def test_a_failed_load_line_gives_the_cause_without_its_frames():
    line = ('E1201 15:11:28.853578 7497 model_lifecycle.cc:642] "failed to load \'llm\' version 1: Internal: '
            'StartupError: checkpoint directory \'/x\' does not exist (\'model\' in /r/llm/1/model.json)\\n\\nAt:\\n'
            '  /src/startup.py(37): wrapper\\n"')
    assert failure_cause(line) == ("llm", "checkpoint directory '/x' does not exist ('model' in /r/llm/1/model.json)")
    assert failure_cause("E1201 model_lifecycle.cc:642] failed to load 'pre' version 1: Internal: OSError: no") == \
        ("pre", "OSError: no")
    assert failure_cause("I1201 model_lifecycle.cc:777] \"failed to load 'llm'\"") is None
    assert failure_summary([("preprocessing", "A"), ("llm", "B"), ("postprocessing", "A")]) == [
        "inflight: the server did not start:", "  preprocessing, postprocessing: A", "  llm: B"]


def test_the_cpu_kv_pool_holds_what_max_num_seqs_full_sequences_use_within_the_budget(tiny_checkpoint, caplog):
    from transformers import AutoConfig

    from inflight import EngineConfig
    from inflight.runner import ModelRunner

    def runner(**engine):
        return ModelRunner(tiny_checkpoint, hf_config, EngineConfig(device="cpu", max_num_seqs=4, max_model_len=100,
                                                                    block_size=16, **engine))

    hf_config = AutoConfig.from_pretrained(tiny_checkpoint)
    with caplog.at_level("INFO", logger="inflight"):
        assert runner().num_blocks == 4 * 7               # 4 sequences of ceil(100 / 16) blocks, far under 1 GiB
    assert "KV pool of 28 blocks" in caplog.text and "max_num_seqs=4 x max_model_len=100 can use" in caplog.text
    block = runner().kv_block_bytes
    assert runner(kv_cache_gb=10.5 * block / 2**30).num_blocks == 10       # the budget is the ceiling
    with pytest.raises(ValueError, match=rf"kv_cache_gb=.*holds no block of {block} bytes; raise 'kv_cache_gb'"):
        runner(kv_cache_gb=0.5 * block / 2**30)


@pytest.mark.parametrize("text, message", [
    ('{"model": "x", "engine": {}', "is not valid JSON"),
    ('["x"]', "must hold a JSON object, got list"),
    ('{"engine": {}}', "'model' must name the checkpoint directory, got None"),
    ('{"model": "x", "lora": {}}', "unknown key(s) ['lora']; known: ['block_size', 'convert', "),
    ('{"model": "x", "tensor_parallel_size": 2}', "'tensor_parallel_size' is 2: inflight runs each engine on one device"),
    ('{"model": "x", "max_num_seqs": 8, "engine": {"max_num_seqs": 4}}',
     "'max_num_seqs' is given both at the top level and in 'engine'"),
    ('{"model": "x", "disable_log_stats": "yes"}', "'disable_log_stats' must be true or false, got 'yes'"),
    ('{"model": "x", "dtype": "fp8"}', "'engine': 'dtype' must be one of"),
    ('{"model": "x", "reasoning_parser": "r1"}', "'reasoning_parser' must be one of ('deepseek_r1', 'qwen3', 'mistral') or None, got 'r1'"),
    ('{"model": "x", "engine": {"max_num_seqs": 0}}', "'engine': 'max_num_seqs' must be a positive integer"),
])
def test_model_json_errors_name_the_file_and_the_key(tmp_path, text, message):
    from inflight.serving.startup import StartupError
    from inflight.serving.triton_models import Settings
    (tmp_path / "model.json").write_text(text)
    with pytest.raises(StartupError) as error:
        Settings.load(str(tmp_path))
    assert message in str(error.value) and str(tmp_path / "model.json") in str(error.value)


@pytest.mark.parametrize("flag", ['"true"', '"True"', "true"])
def test_enable_lora_may_be_a_string_as_the_vllm_backend_reads_it(tmp_path, flag):
    """The vLLM backend's multi-LoRA tutorial writes "enable_lora": "true"."""
    from inflight.serving.triton_models import Settings
    (tmp_path / "model.json").write_text(f'{{"model": "x", "enable_lora": {flag}}}')
    assert Settings.load(str(tmp_path)).engine.enable_lora is True
    (tmp_path / "model.json").write_text('{"model": "x", "enable_lora": "false"}')
    assert Settings.load(str(tmp_path)).engine.enable_lora is False
    # and, as there, the reasoning parser at the top level (or in "engine")
    (tmp_path / "model.json").write_text('{"model": "x", "reasoning_parser": "deepseek_r1"}')
    assert Settings.load(str(tmp_path)).engine.reasoning_parser == "deepseek_r1"


def test_the_vllm_backends_model_json_loads_as_written(tmp_path, caplog):
    """Its sample and its multi-LoRA tutorial's model.json (the checkpoint path aside): vLLM's
    engine arguments at the top level, booleans as strings, arguments without effect logged."""
    from inflight.serving.triton_models import Settings
    (tmp_path / "model.json").write_text('{"model": "x", "gpu_memory_utilization": 0.1, "enforce_eager": true}')
    engine = Settings.load(str(tmp_path)).engine
    assert (engine.gpu_memory_utilization, engine.enforce_eager) == (0.1, True)
    (tmp_path / "model.json").write_text(json.dumps({
        "model": "x", "gpu_memory_utilization": 0.8, "tensor_parallel_size": 1, "block_size": 32,
        "enforce_eager": "true", "enable_lora": "true", "max_lora_rank": 32, "max_loras": 2, "max_cpu_loras": 8,
        "distributed_executor_backend": "ray", "disable_log_requests": True, "disable_log_stats": "True",
        "dtype": "half", "max_model_len": 512, "max_num_seqs": 8, "enable_prefix_caching": "false"}))
    with caplog.at_level("INFO", logger="inflight"):
        settings = Settings.load(str(tmp_path))
    engine = settings.engine
    assert (engine.block_size, engine.enforce_eager, engine.enable_lora, engine.max_lora_rank, engine.max_loras,
            engine.dtype, engine.max_model_len, engine.max_num_seqs, engine.enable_prefix_caching) == \
        (32, True, True, 32, 2, "float16", 512, 8, False)
    assert settings.vllm_metrics is False          # disable_log_stats: no vllm: metrics, as the backend does
    assert engine.max_cpu_loras == 8
    assert "'max_cpu_loras' bounds the adapters loaded at runtime (allow_runtime_lora_updating); those of " \
        "multi_lora.json all stay in host memory" in caplog.text
    assert "'disable_log_requests' has no effect here" in caplog.text
    # an embedding model's: vLLM's runner (auto: the engine looks for a sentence-transformers checkpoint) and
    # convert ("embed" asks for the pooling runner)
    for given, expected in (({"runner": "pooling", "convert": "auto"}, "pooling"), ({"convert": "embed"}, "pooling"),
                            ({"runner": "pooling", "convert": "embed"}, "pooling"), ({"runner": "auto"}, "auto"),
                            ({"runner": "auto", "convert": "embed"}, "pooling")):
        (tmp_path / "model.json").write_text(json.dumps({"model": "x", **given}))
        assert Settings.load(str(tmp_path)).engine.runner == expected
    from inflight.serving.startup import StartupError
    (tmp_path / "model.json").write_text('{"model": "x", "runner": "generate", "convert": "embed"}')
    with pytest.raises(StartupError, match=r"model.json: 'convert' 'embed' makes an embedding model, which runner "
                                           r"'generate' does not serve"):
        Settings.load(str(tmp_path))
    (tmp_path / "model.json").write_text('{"model": "x", "runner": "pooling", "convert": "classify"}')
    with pytest.raises(StartupError, match=r"model.json: 'convert' is 'classify': inflight serves a checkpoint"):
        Settings.load(str(tmp_path))


def test_a_kind_gpu_instance_runs_on_the_gpu_triton_gives_it(tmp_path):
    """KIND_GPU: Triton starts an instance per GPU and names each one's; its engine goes there, as
    the vLLM backend pins its instances ('auto' would put every engine on the first GPU), with its
    part of the cores and its name as a metrics label. One KIND_CPU or KIND_MODEL instance keeps
    model.json's settings."""
    from inflight.serving.startup import StartupError
    from inflight.serving.triton_models import Settings, instance_count
    (tmp_path / "model.json").write_text('{"model": "x"}')
    settings = Settings.load(str(tmp_path))
    four_gpus = {"instance_group": [{"count": 1, "kind": "KIND_GPU", "gpus": [0, 1, 2, 3]}]}
    # Triton names the instances of one count index alike on every GPU
    instance = {"model_instance_kind": "GPU", "model_instance_device_id": "3", "model_instance_name": "llm_0_0",
                "model_config": json.dumps(four_gpus)}
    placed = settings.placed(instance)
    assert placed.engine.device == "cuda:3" and settings.engine.device == "auto"
    assert placed.labels == {"model_instance": "llm_0_0", "gpu": "3"} and placed.instances == 4
    assert placed.engine.cpu_threads == max(len(os.sched_getaffinity(0)) // 4, 1)
    assert placed.engine.engines_per_device == 1, "one per GPU: each takes the whole gpu_memory_utilization"
    for groups, engines in (([{"count": 2, "kind": "KIND_GPU"}], 2), ([{"count": 2, "kind": "KIND_CPU"}], 1),
                            ([{"count": 1, "kind": "KIND_GPU", "gpus": [0]},
                              {"count": 1, "kind": "KIND_GPU", "gpus": [3]},
                              {"count": 2, "kind": "KIND_GPU", "gpus": [1, 3]}], 3)):
        # instance on cuda:3: two per GPU share it; KIND_CPU instances go to the first GPU, not here
        shared = settings.placed({**instance, "model_config": json.dumps({"instance_group": groups})})
        assert shared.engine.engines_per_device == engines, groups
    cpu_two = {"instance_group": [{"count": 2, "kind": "KIND_CPU"}]}
    on_first = settings.placed({**instance, "model_instance_kind": "CPU", "model_config": json.dumps(cpu_two)})
    assert on_first.engine.engines_per_device == 2, "KIND_CPU instances on a GPU host share the first GPU"
    for kind in ("CPU", "MODEL"):
        one = {"instance_group": [{"count": 1, "kind": f"KIND_{kind}"}]}
        assert settings.placed({**instance, "model_instance_kind": kind, "model_config": json.dumps(one)}) == settings
    assert instance_count({"instance_group": [{"count": 2, "kind": "KIND_CPU"}, {"count": 2, "gpus": [0, 1]}]}) == 6
    (tmp_path / "model.json").write_text('{"model": "x", "engine": {"device": "cuda:1", "cpu_threads": 1}}')
    with pytest.raises(StartupError, match=r"model.json: 'device' 'cuda:1' contradicts the KIND_GPU instance llm_0_0 "
                                           r"of config.pbtxt, which Triton placed on cuda:3"):
        Settings.load(str(tmp_path)).placed(instance)
    (tmp_path / "model.json").write_text('{"model": "x", "engine": {"device": "cuda", "cpu_threads": 1}}')
    placed = Settings.load(str(tmp_path)).placed(instance)
    assert (placed.engine.device, placed.engine.cpu_threads) == ("cuda:3", 1)


@pytest.mark.parametrize("change, message", [
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type 'dynamic' is not supported; supported:"),
    ({"rope_parameters": {"rope_type": "longrope", "factor": 2.0}}, "rope_type 'longrope' is not supported"),
    ({"quantization_config": {"quant_method": "awq", "bits": 4}},
     "'quantization_config' (awq): quantized checkpoints are not supported"),
])
def test_unsupported_rope_and_quantized_checkpoints_are_refused_before_loading(served_checkpoint, tmp_path, change,
                                                                                message):
    from inflight.serving.startup import StartupError, check_checkpoint
    copy = shutil.copytree(served_checkpoint, tmp_path / "checkpoint")
    path = copy / "config.json"
    config = json.loads(path.read_text())
    if "rope_scaling" in change:           # a config.json written before transformers 5
        config.pop("rope_parameters", None)
    path.write_text(json.dumps({**config, **change}))
    with pytest.raises(StartupError) as error:
        check_checkpoint(str(copy), "the test")
    assert message in str(error.value) and str(path) in str(error.value)
    check_checkpoint(served_checkpoint, "the test")


def test_the_wheels_server_is_refused_under_numpy_2_with_the_reason(monkeypatch):
    # Triton 2.51's backend stub misreads string inputs under NumPy 2 and dies on the first request
    import numpy

    from inflight.serving import launch
    monkeypatch.setattr(launch.shutil, "which", lambda name: None)
    assert launch.locate_server().binary.endswith("tritonserver")
    monkeypatch.setattr(numpy, "__version__", "2.2.6")
    with pytest.raises(SystemExit, match=r"numpy 2\.2\.6 .* needs numpy<2"):
        launch.locate_server()


def test_a_server_process_runs_in_the_callers_session_in_a_group_of_its_own(tmp_path):
    # one scheduling group with a load client on the same host (Linux autogroup), as `make serve`
    # runs it; its own process group for signals
    repo = make_repository(str(tmp_path / "repository"), DEFAULT_MODEL, {**TEST_ENGINE, "num_kv_blocks": 64},
                           models=("llm",))
    with ServerProcess(repo) as server:
        assert os.getsid(server.process.pid) == os.getsid(0)
        assert os.getpgid(server.process.pid) == server.process.pid != os.getpgid(0)
        out = http_generate(server.http_url, "llm", {"text_input": "The assert statement", "max_tokens": 4,
                                                      "temperature": 0, "exclude_input_in_output": True})
        assert out["text_output"]
    assert server.process.returncode is not None


def test_without_the_client_package_tritonserver_goes_on_without_the_openai_server(monkeypatch, capsys):
    """A backend-only image (docker/Dockerfile copies backend_src/ alone) has no inflight_client."""
    from inflight.serving import launch
    monkeypatch.setitem(sys.modules, "inflight_client.openai_server.process", None)     # import fails
    children = launch.Children()
    endpoints = launch.Endpoints(8000, 8001, 8002, openai_port=9000)
    assert launch.start_openai_server(children, "/nowhere", endpoints) is False
    assert children.processes == []
    assert "the OpenAI server did not start (import of inflight_client.openai_server.process halted" \
        in capsys.readouterr().out
