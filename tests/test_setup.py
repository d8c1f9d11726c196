"""Setting up on a fresh machine, without a network: `make venv` with the wrong Python says which one
it found and how to choose another, and remakes a .venv whose python is missing, has no pip or is
another version; scripts/build_default_model.py replaces only its own files in --out."""
import importlib.util
import os
import shutil
import stat
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")

# A stand-in python: reports VERSION, imports pip or not, makes a venv by copying the stand-in for
# its version, and logs pip's arguments instead of installing anything.
FAKE = """#!/bin/sh
case "$1" in
  -c) exec "{real}" -c "import sys; {no_pip}sys.version_info = ({major}, {minor}, 0, 'final', 0); exec(sys.argv[1])" "$2" ;;
  -m) case "$2" in
        venv) mkdir -p "$3/bin" && cp "{venv_python}" "$3/bin/python" && echo "venv $3" >> "{log}" ;;
        pip) shift 2; echo "pip $*" >> "{log}" ;;
        *) exit 9 ;;
      esac ;;
  *) exit 9 ;;
esac
"""


def fake_python(path, version: str, log, pip: bool = True, venv_python=None) -> str:
    major, minor = version.split(".")
    with open(path, "w") as f:
        f.write(FAKE.format(real=sys.executable, no_pip="" if pip else "sys.modules['pip'] = None; ",
                            major=major, minor=minor, venv_python=venv_python or path, log=log))
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR)
    return str(path)


@pytest.fixture
def project(tmp_path):
    """The Makefile in a directory of its own, with stand-ins for 3.10, 3.11 and 3.13."""
    for name in ("Makefile", "requirements.txt", "pyproject.toml"):
        shutil.copy(os.path.join(REPO, name), tmp_path / name)
    log = tmp_path / "calls.log"
    pythons = tmp_path / "pythons"
    pythons.mkdir()
    fakes = {"3.11": fake_python(pythons / "python3.11", "3.11", log)}
    for version in ("3.10", "3.12", "3.13"):
        fakes[version] = fake_python(pythons / f"python{version}", version, log, venv_python=fakes["3.11"])
    fakes["3.11-no-pip"] = fake_python(pythons / "python3.11-no-pip", "3.11", log, pip=False)
    return tmp_path, fakes, log


def make_venv(directory, python: str) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "venv", f"PYTHON={python}"], cwd=directory, capture_output=True, text=True,
                          timeout=60)


def calls(log) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


@needs_make
@pytest.mark.parametrize("version", ["3.10", "3.13"])
def test_a_python_outside_3_11_and_3_12_is_refused_in_one_line_before_any_venv(project, version):
    directory, fakes, log = project
    done = make_venv(directory, fakes[version])
    assert done.returncode != 0
    (line,) = [line for line in done.stderr.splitlines() if not line.startswith("make")]
    assert f"inflight needs Python 3.11 or 3.12, and {fakes[version]} is {version}" in line
    assert "make serve PYTHON=python3.11" in line
    assert not (directory / ".venv").exists() and calls(log) == []


@needs_make
def test_a_python_that_is_not_installed_is_named(project):
    directory, _, log = project
    done = make_venv(directory, "python3.99-nowhere")
    assert done.returncode != 0
    assert "python3.99-nowhere is not installed" in done.stderr and "PYTHON=python3.11" in done.stderr
    assert not (directory / ".venv").exists()


@needs_make
@pytest.mark.parametrize("left", ["3.10", "3.13", "3.11-no-pip"])
def test_a_venv_of_another_version_or_without_pip_is_made_again(project, left):
    """What a failed first try leaves behind (a venv made by 3.10, or by a python without ensurepip)
    no longer blocks the next try."""
    directory, fakes, log = project
    (directory / ".venv" / "bin").mkdir(parents=True)
    shutil.copy(fakes[left], directory / ".venv" / "bin" / "python")
    (directory / ".venv" / "stale").write_text("")
    done = make_venv(directory, fakes["3.12"])
    assert done.returncode == 0, done.stderr
    assert not (directory / ".venv" / "stale").exists()
    assert calls(log)[0] == "venv .venv" and calls(log)[1].startswith("pip install")
    assert (directory / ".venv" / ".installed").exists()


@needs_make
def test_a_working_venv_is_kept_whatever_python_is_on_path(project):
    """PYTHON is checked only when the venv is made: after `make serve PYTHON=python3.11`, a later
    `make serve` (requirements.txt changed) reinstalls into the same venv."""
    directory, fakes, log = project
    (directory / ".venv" / "bin").mkdir(parents=True)
    shutil.copy(fakes["3.11"], directory / ".venv" / "bin" / "python")
    (directory / ".venv" / "kept").write_text("")
    done = make_venv(directory, fakes["3.10"])
    assert done.returncode == 0, done.stderr
    assert (directory / ".venv" / "kept").exists()
    assert [c.split()[0] for c in calls(log)] == ["pip", "pip"]


# ---- scripts/build_default_model.py --out ----------------------------------------------------------

@pytest.fixture(scope="module")
def script():
    """scripts/build_default_model.py as a module (it is not in a package)."""
    spec = importlib.util.spec_from_file_location("build_default_model",
                                                  os.path.join(REPO, "scripts", "build_default_model.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_build_default_model_replaces_only_its_own_files_in_out(script, tmp_path):
    new, out = tmp_path / "new", tmp_path / "out"
    new.mkdir()
    (out / "mydata").mkdir(parents=True)
    for name in script.EXPECTED_FILES:
        (new / name).write_text("new")
    (out / "config.json").write_text("old")
    (out / "precious.txt").write_text("keep")
    (out / "mydata" / "notes.txt").write_text("keep")
    left = script.replace_output(new, out)
    assert left == ["mydata", "precious.txt"]
    assert (out / "precious.txt").read_text() == "keep" and (out / "mydata" / "notes.txt").read_text() == "keep"
    assert all((out / name).read_text() == "new" for name in script.EXPECTED_FILES)


def test_build_default_model_refuses_an_out_holding_files_of_its_names_from_elsewhere(script, tmp_path):
    """`--out .` from the repository root would replace the project's README.md with the model card."""
    script.check_output(tmp_path / "new")           # a new directory
    (tmp_path / "README.md").write_text("# my project\n")
    (tmp_path / "Makefile").write_text("all:\n")
    with pytest.raises(SystemExit, match="already holds README.md, not from an earlier build"):
        script.check_output(tmp_path)
    (tmp_path / "README.md").write_text("# inflight-tiny\n\nA deliberately tiny ...\n")
    script.check_output(tmp_path)                   # an earlier build: replaced
