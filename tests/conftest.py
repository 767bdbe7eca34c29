import os
from pathlib import Path

import pytest
import torch

from centroidkv import load_model

# At most two threads, and under pytest-xdist (`make test`) each worker's share of the cores: two workers
# on two cores take one thread each instead of spinning against each other.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _WORKERS)))


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "slow: a minute or more of one test; `make test-harness` runs it, `make test` leaves it out",
    )


@pytest.fixture(scope="module")
def one_thread():
    """Small tensors: one thread is as fast and does not spin against other jobs on a shared CPU.
    Modules opt in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session", params=["tiny-llama", "tiny-mistral"])
def tiny_model(request):
    model, _ = load_model(request.param)
    return model


@pytest.fixture(scope="session")
def embedded():
    """The embedded SmolLM2-135M (converted once from the GGUF, then cached)."""
    return load_model("smollm2-135m")


@pytest.fixture
def own_cache(tmp_path, monkeypatch) -> Path:
    """A cache folder of the test's own (`$CENTROIDKV_CACHE`, subprocesses included), so that no
    calibration or conversion in the user's shared cache changes what the test sees; the embedded
    model's conversion (its tokenizer, the tiny models' too) is linked in from the shared cache,
    converted there first when it is not yet."""
    from centroidkv.models.loading import converted_dir
    from centroidkv.models.model_names import EMBEDDED_MODEL

    converted = converted_dir(EMBEDDED_MODEL)  # in the shared cache, before the variable changes
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / EMBEDDED_MODEL).symlink_to(converted, target_is_directory=True)
    monkeypatch.setenv("CENTROIDKV_CACHE", str(cache))
    return cache


@pytest.fixture
def no_model_loading(monkeypatch):
    """`centroidkv.models.loading.load_model` fails the test if anything calls it."""
    import centroidkv.models.loading

    def no_loading(*args, **kwargs):
        raise AssertionError("the model must not load")

    monkeypatch.setattr(centroidkv.models.loading, "load_model", no_loading)
