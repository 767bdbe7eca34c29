"""The decode attention of compressed requests compiled from C++ (`degree_decode.cpp`), PyTorch's as
the fallback.

`batched_degree_attention` gathers a batch's blocks into float32 tensors before two matmuls; on a CPU
that copy costs about as much as the attention (scripts/bench_plugin_attention.py). The C++ loop
computes the same softmax(scale q.k + log n) v in float32, reading the bf16 or float32 blocks where
vLLM keeps them, 16 lanes at a time, its (request, KV head) pairs over torch's threads. It is built once per
checkout by torch's extension loader (about 40 s, cached under ~/.cache/torch_extensions); where no
compiler is found the plugin logs one warning and keeps the PyTorch path. Other cache dtypes
(float16), and head dims or block sizes that are not multiples of 16, always take the PyTorch path.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor

from centroidkv.errors import first_line
from centroidkv_vllm.paged import DecodeBatch, batched_degree_attention

logger = logging.getLogger("vllm.centroidkv")
SOURCE = Path(__file__).with_name("degree_decode.cpp")
COMPILED_DTYPES = (torch.bfloat16, torch.float32)  # the cache dtypes the loop reads


@functools.cache
def compiled() -> ModuleType | None:
    """The built extension, None (after one warning) when it cannot be built here."""
    from torch.utils.cpp_extension import load

    # one build folder per checkout: torch rebuilds a name whose source path changed
    name = "centroidkv_degree_decode_" + hashlib.sha1(str(SOURCE).encode()).hexdigest()[:10]
    try:
        # -ffast-math for the compile only (so no process-wide float mode is linked in): it lets the
        # softmax's exp run vectorised (glibc's libmvec); the loop relies on no infinity or NaN.
        # -fopenmp: at::parallel_for is OpenMP inline; libgomp.so.1 resolves to the one torch loaded
        flags = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]
        return load(name, [str(SOURCE)], extra_cflags=flags, extra_ldflags=["-fopenmp"])
    except Exception as error:  # no compiler, no ninja, a build error: the PyTorch path still works
        logger.warning(
            "centroidkv: the C++ decode attention was not built (%s); using PyTorch's", first_line(error)
        )
        return None


def decode_attention(
    query: Tensor, kv_cache: Tensor, log_degree: Tensor, batch: DecodeBatch, scale: float, use_compiled: bool
) -> Tensor:
    """`batched_degree_attention`'s result, by the C++ loop for a bf16 or float32 cache when
    `use_compiled` and it is built, else by PyTorch."""
    num_blocks, heads, block_size, two_dim = kv_cache.shape
    module = compiled() if use_compiled and kv_cache.dtype in COMPILED_DTYPES else None
    if module is None or block_size % module.LANES or (two_dim // 2) % module.LANES:
        return batched_degree_attention(query, kv_cache, log_degree, batch, scale)
    blocks = kv_cache.view(num_blocks, heads, 2, block_size * (two_dim // 2))
    out = module.degree_decode(
        query.float().contiguous(), blocks, log_degree, batch.blocks, batch.first, batch.held, scale
    )
    return out.to(query.dtype)
