// softmax(scale q.k + log n) v for one decoding query per request, read in place from vLLM's paged
// CPU cache (bf16, the `vec` layout of centroidkv_vllm/paged.py): the loop `batched_degree_attention`
// runs in PyTorch, without gathering the blocks or converting them to float32 first. float32 inside.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

static inline float bf16_to_float(uint16_t bits) {
  const uint32_t widened = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &widened, sizeof value);
  return value;
}

// query [M, Hq, D] float32; cache [num_blocks, H, 2, block_size * D] bf16 (a block's keys [D, bs],
// then its values [bs, D]); log_degree [num_blocks * block_size, H] float32; blocks [M, nb] int64;
// first [M]: the offset of a row's first entry in its first block; held [M]: its entries.
torch::Tensor degree_decode(torch::Tensor query, torch::Tensor cache, torch::Tensor log_degree,
                            torch::Tensor blocks, torch::Tensor first, torch::Tensor held, double scale) {
  TORCH_CHECK(query.scalar_type() == torch::kFloat32 && cache.scalar_type() == torch::kBFloat16);
  TORCH_CHECK(blocks.scalar_type() == torch::kLong && first.scalar_type() == torch::kLong &&
              held.scalar_type() == torch::kLong);
  TORCH_CHECK(query.is_contiguous() && cache.is_contiguous() && log_degree.is_contiguous());
  // held here: a non-contiguous argument's contiguous copy must outlive the pointers into it
  const torch::Tensor table_rows = blocks.contiguous(), first_rows = first.contiguous(),
                      held_rows = held.contiguous();
  const int64_t rows = query.size(0), q_heads = query.size(1), dim = query.size(2);
  const int64_t heads = cache.size(1), block_size = cache.size(3) / dim, width = blocks.size(1);
  const int64_t group = q_heads / heads;
  auto output = torch::zeros({rows, q_heads, dim}, torch::kFloat32);
  const float* q = query.data_ptr<float>();
  const auto* kv = reinterpret_cast<const uint16_t*>(cache.data_ptr<at::BFloat16>());
  const float* degree = log_degree.data_ptr<float>();
  const int64_t* table = table_rows.data_ptr<int64_t>();
  const int64_t* offsets = first_rows.data_ptr<int64_t>();
  const int64_t* counts = held_rows.data_ptr<int64_t>();
  float* out = output.data_ptr<float>();
  std::vector<float> logits(group * width * block_size), key_row(block_size), value_row(dim);
  for (int64_t m = 0; m < rows; ++m) {
    const int64_t begin = offsets[m], end = offsets[m] + counts[m];
    const int64_t used = (end + block_size - 1) / block_size;
    const int64_t* row_blocks = table + m * width;
    for (int64_t h = 0; h < heads; ++h) {
      const float* q_group = q + (m * q_heads + h * group) * dim;
      std::fill(logits.begin(), logits.end(), 0.f);
      for (int64_t b = 0; b < used; ++b) {  // q.k, block by block, in the keys' stored [D, bs] layout
        const uint16_t* keys = kv + (row_blocks[b] * heads + h) * 2 * block_size * dim;
        for (int64_t d = 0; d < dim; ++d) {
          for (int64_t t = 0; t < block_size; ++t) key_row[t] = bf16_to_float(keys[d * block_size + t]);
          for (int64_t g = 0; g < group; ++g) {
            const float q_d = q_group[g * dim + d];
            float* target = logits.data() + (g * width + b) * block_size;
            for (int64_t t = 0; t < block_size; ++t) target[t] += q_d * key_row[t];
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {  // + log n, softmax over the row's entries only
        float* row_logits = logits.data() + g * width * block_size;
        float largest = -INFINITY;
        for (int64_t j = begin; j < end; ++j) {
          const int64_t slot = row_blocks[j / block_size] * block_size + j % block_size;
          row_logits[j] = row_logits[j] * static_cast<float>(scale) + degree[slot * heads + h];
          largest = std::max(largest, row_logits[j]);
        }
        float total = 0.f;
        for (int64_t j = begin; j < end; ++j) total += (row_logits[j] = std::exp(row_logits[j] - largest));
        for (int64_t j = begin; j < end; ++j) row_logits[j] /= total;
      }
      for (int64_t j = begin; j < end; ++j) {  // probabilities times values
        const uint16_t* values =
            kv + ((row_blocks[j / block_size] * heads + h) * 2 + 1) * block_size * dim + (j % block_size) * dim;
        for (int64_t d = 0; d < dim; ++d) value_row[d] = bf16_to_float(values[d]);
        for (int64_t g = 0; g < group; ++g) {
          const float p = logits[g * width * block_size + j];
          float* target = out + (m * q_heads + h * group + g) * dim;
          for (int64_t d = 0; d < dim; ++d) target[d] += p * value_row[d];
        }
      }
    }
  }
  return output;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("degree_decode", &degree_decode); }
