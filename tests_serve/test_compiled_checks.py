"""The compiled decode attention (`centroidkv_vllm/degree_decode.cpp`) checks every shape and index
it trusts at its boundary (issue 53, defect 11): an inconsistent tensor is a RuntimeError naming what
is wrong, never a read outside the pool (run in .venv-serve: `make serve-test`)."""

from __future__ import annotations

import shutil

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm._custom_ops")

BLOCK, HEADS, Q_HEADS, DIM, NUM_BLOCKS = 16, 2, 4, 16, 6


@pytest.fixture(scope="module")
def module():
    from centroidkv_vllm.compiled import compiled

    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler on this machine: the plugin keeps the PyTorch path")
    built = compiled()
    assert built is not None
    return built


def consistent() -> dict:
    """Two rows over three blocks each of a six-block pool: what the plugin's caller builds."""
    gen = torch.Generator().manual_seed(0)
    return dict(
        query=torch.randn(2, Q_HEADS, DIM, generator=gen),
        cache=torch.randn(NUM_BLOCKS, HEADS, 2, BLOCK * DIM, generator=gen).bfloat16(),
        log_degree=torch.zeros(NUM_BLOCKS * BLOCK, HEADS),
        blocks=torch.tensor([[1, 2, 3], [4, 5, 0]]),
        first=torch.tensor([0, 3]),
        held=torch.tensor([40, 20]),
    )


def call(module, arguments: dict):
    names = ("query", "cache", "log_degree", "blocks", "first", "held")
    return module.degree_decode(*(arguments[name] for name in names), DIM**-0.5)


def test_consistent_tensors_are_attended(module):
    out = call(module, consistent())
    assert out.shape == (2, Q_HEADS, DIM) and torch.isfinite(out).all()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        pytest.param(
            {"held": torch.tensor([40, 46])}, "first + held must not exceed", id="held-past-the-blocks"
        ),  # 3 + 46 > 3 blocks of 16
        pytest.param(
            {"first": torch.tensor([0, 40]), "held": torch.tensor([40, 9])},
            "first + held must not exceed",
            id="first-past-the-blocks",
        ),
        pytest.param(
            {"blocks": torch.tensor([[1, 2, 3], [4, 5, 6]])},
            "block ids must be in [0, 6)",
            id="block-beyond-the-pool",
        ),
        pytest.param(
            {"blocks": torch.tensor([[1, 2, 3], [4, -1, 0]])},
            "block ids must be in [0, 6)",
            id="negative-block",
        ),
        pytest.param({"first": torch.tensor([0])}, "one row per query row", id="first-short"),
        pytest.param({"held": torch.tensor([40, 20, 5])}, "one row per query row", id="held-long"),
        pytest.param({"blocks": torch.tensor([[1, 2, 3]])}, "one row per query row", id="blocks-short"),
        pytest.param(
            {"first": torch.tensor([-1, 3])}, "first must be >= 0 and held > 0", id="negative-first"
        ),
        pytest.param({"held": torch.tensor([40, 0])}, "first must be >= 0 and held > 0", id="no-entry"),
        pytest.param(
            {"log_degree": torch.zeros(NUM_BLOCKS * BLOCK - 1, HEADS)},
            "log_degree must be",
            id="log-degree-short",
        ),
        pytest.param(
            {"log_degree": torch.zeros(NUM_BLOCKS * BLOCK, 1)}, "log_degree must be", id="log-degree-heads"
        ),
        pytest.param(
            {"query": torch.zeros(2, 3, DIM)},
            "query heads (3) must be a multiple of the KV heads (2)",
            id="query-heads-not-a-multiple",
        ),
        pytest.param(
            {"query": torch.zeros(2, Q_HEADS, 0)}, "head dim: a positive multiple of 16, got 0", id="dim-zero"
        ),
        pytest.param(
            {"query": torch.zeros(2, Q_HEADS, 8)},
            "head dim: a positive multiple of 16, got 8",
            id="dim-not-16",
        ),
        pytest.param(
            {"blocks": torch.tensor([[1, 2, 3], [4, 5, 0]], dtype=torch.int32)}, "int64", id="int32-blocks"
        ),
        pytest.param(
            {"cache": torch.zeros(NUM_BLOCKS, HEADS, 2, BLOCK * DIM, dtype=torch.float16)},
            "cache bfloat16 or float32",
            id="float16-cache",
        ),
    ],
)
def test_an_inconsistent_tensor_is_refused(module, change, message):
    with pytest.raises(RuntimeError) as refused:
        call(module, {**consistent(), **change})
    assert message in str(refused.value)
