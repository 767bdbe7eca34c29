import os

import pytest
import torch

from centroidkv import load_model

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session", params=["tiny-llama", "tiny-mistral"])
def tiny_model(request):
    model, _ = load_model(request.param)
    return model


@pytest.fixture(scope="session")
def embedded():
    """The embedded SmolLM2-135M (converted once from the GGUF, then cached)."""
    return load_model("smollm2-135m")
