// softmax(scale q.k + log n) v for one decoding query per request, read in place from vLLM's paged
// CPU cache (bf16 or float32, the `vec` layout of centroidkv_vllm/paged.py): the loop
// `batched_degree_attention` runs in PyTorch, without gathering the blocks or converting them to
// float32 first. float32 inside. `Entry` is the cache's element: uint16_t holding a bf16, or float.
//
// 16 floats at a time in GCC/Clang vector types (one AVX-512 register; the compiler splits them where
// the machine's registers are narrower), the query heads that share a KV head up to 8 at a time, so
// that their sums stay in registers while each key or value is loaded once.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

constexpr int64_t kLanes = 16;
constexpr int64_t kMaxGroup = 8;
typedef float Floats __attribute__((vector_size(kLanes * sizeof(float))));
typedef uint16_t Halves __attribute__((vector_size(kLanes * sizeof(uint16_t))));
typedef uint32_t Words __attribute__((vector_size(kLanes * sizeof(uint32_t))));

static inline Floats load(const uint16_t* source) {  // a bf16 is the upper half of a float32
  Halves bits;
  std::memcpy(&bits, source, sizeof bits);
  const Words widened = __builtin_convertvector(bits, Words) << 16;
  Floats value;
  std::memcpy(&value, &widened, sizeof value);
  return value;
}

static inline Floats load(const float* source) {
  Floats value;
  std::memcpy(&value, source, sizeof value);
  return value;
}

// Ask for `count` entries (into L2) ahead of their use. A request's blocks lie anywhere in the pool and a
// step's layers do not fit in the caches, so without it each block starts cold: every pass over a
// block asks, a slice per chunk, for the next block its caller will read (the loop then runs about
// 1.7x faster over a pool that is not cache-resident: scripts/bench_plugin_attention.py).
template <typename Entry>
static inline void prefetch(const Entry* start, int64_t count) {
  const char* bytes = reinterpret_cast<const char*>(start);
  for (int64_t at = 0; at < count * int64_t{sizeof(Entry)}; at += 64) __builtin_prefetch(bytes + at, 0, 1);
}

// logits[g][t] = q_g . k_t for one block's keys, stored [D, block_size]; `next`: the block read next
template <int G, typename Entry>
static void key_logits(const Entry* keys, const float* queries, int64_t dim, int64_t block_size,
                       float* logits, int64_t stride, const Entry* next) {
  const int64_t slice = dim * kLanes;  // entries of the next block to prefetch per chunk of 16 keys
  for (int64_t t = 0; t < block_size; t += kLanes) {
    prefetch(next + t * dim, slice);
    Floats sums[G] = {};
    for (int64_t d = 0; d < dim; ++d) {
      const Floats key = load(keys + d * block_size + t);
      for (int g = 0; g < G; ++g) sums[g] += queries[g * dim + d] * key;
    }
    for (int g = 0; g < G; ++g) std::memcpy(logits + g * stride + t, &sums[g], sizeof(Floats));
  }
}

// out[g] += sum over t in [lo, hi) of probs[g][t] v_t for one block's values, stored [block_size, D];
// `next`: the block read next
template <int G, typename Entry>
static void add_values(const Entry* values, const float* probs, int64_t stride, int64_t lo,
                       int64_t hi, int64_t dim, float* out, const Entry* next, int64_t block_size) {
  for (int64_t d = 0; d < dim; d += kLanes) {
    prefetch(next + d * block_size, kLanes * block_size);
    Floats sums[G];
    for (int g = 0; g < G; ++g) std::memcpy(&sums[g], out + g * dim + d, sizeof(Floats));
    for (int64_t t = lo; t < hi; ++t) {
      const Floats value = load(values + t * dim + d);
      for (int g = 0; g < G; ++g) sums[g] += probs[g * stride + t] * value;
    }
    for (int g = 0; g < G; ++g) std::memcpy(out + g * dim + d, &sums[g], sizeof(Floats));
  }
}

// the group-size instances, indexed by group - 1
template <typename Entry>
struct Kernels {
  using KeyLogits = void (*)(const Entry*, const float*, int64_t, int64_t, float*, int64_t, const Entry*);
  using AddValues = void (*)(const Entry*, const float*, int64_t, int64_t, int64_t, int64_t, float*,
                             const Entry*, int64_t);
  static constexpr KeyLogits key_logits_of[kMaxGroup] = {
      key_logits<1, Entry>, key_logits<2, Entry>, key_logits<3, Entry>, key_logits<4, Entry>,
      key_logits<5, Entry>, key_logits<6, Entry>, key_logits<7, Entry>, key_logits<8, Entry>};
  static constexpr AddValues add_values_of[kMaxGroup] = {
      add_values<1, Entry>, add_values<2, Entry>, add_values<3, Entry>, add_values<4, Entry>,
      add_values<5, Entry>, add_values<6, Entry>, add_values<7, Entry>, add_values<8, Entry>};
};

// softmax over [begin, end) of scale * logits + log n, in place
static void softmax(float* logits, const float* log_n, int64_t begin, int64_t end, float scale) {
  float largest = logits[begin] * scale + log_n[begin];
  for (int64_t j = begin; j < end; ++j) largest = std::max(largest, logits[j] = logits[j] * scale + log_n[j]);
  float total = 0.f;
  for (int64_t j = begin; j < end; ++j) total += (logits[j] = std::exp(logits[j] - largest));
  const float inverse = 1.f / total;
  for (int64_t j = begin; j < end; ++j) logits[j] *= inverse;
}

template <typename Entry>
struct Layout {
  const Entry* kv;         // [num_blocks, H, 2, block_size * D]: a block's keys [D, bs], then values [bs, D]
  const float* degree;     // [num_blocks * block_size, H]
  int64_t heads, group, dim, block_size;

  const Entry* keys(int64_t block, int64_t h) const { return kv + (block * heads + h) * 2 * block_size * dim; }
  const Entry* values(int64_t block, int64_t h) const { return keys(block, h) + block_size * dim; }
};

// one KV head of one request: its `group` query heads over the entries [begin, end) of `row_blocks`;
// `after`: the keys the thread reads after these (prefetched during the last values)
template <typename Entry>
static void attend(const Layout<Entry>& at, const int64_t* row_blocks, int64_t begin, int64_t end, int64_t h,
                   const float* queries, float scale, float* out, std::vector<float>& logits,
                   std::vector<float>& log_n, const Entry* after) {
  const int64_t bs = at.block_size, used = (end + bs - 1) / bs, span = used * bs;
  for (int64_t b = 0; b < used; ++b) {
    const int64_t block = row_blocks[b];
    const Entry* keys = at.keys(block, h);
    const Entry* next = b + 1 < used ? at.keys(row_blocks[b + 1], h) : at.values(row_blocks[0], h);
    for (int64_t t = 0; t < bs; ++t) log_n[b * bs + t] = at.degree[(block * bs + t) * at.heads + h];
    for (int64_t g = 0; g < at.group; g += kMaxGroup)
      Kernels<Entry>::key_logits_of[std::min(at.group - g, kMaxGroup) - 1](keys, queries + g * at.dim, at.dim, bs,
                                                         logits.data() + g * span + b * bs, span, next);
  }
  for (int64_t g = 0; g < at.group; ++g) softmax(logits.data() + g * span, log_n.data(), begin, end, scale);
  for (int64_t b = 0; b < used; ++b) {
    const Entry* values = at.values(row_blocks[b], h);
    const Entry* next = b + 1 < used ? at.values(row_blocks[b + 1], h) : after;
    const int64_t lo = std::max(begin - b * bs, int64_t{0}), hi = std::min(end - b * bs, bs);
    for (int64_t g = 0; g < at.group; g += kMaxGroup)
      Kernels<Entry>::add_values_of[std::min(at.group - g, kMaxGroup) - 1](values, logits.data() + g * span + b * bs, span,
                                                         lo, hi, at.dim, out + g * at.dim, next, bs);
  }
}

// Every shape and index the loop trusts, checked before any pointer is formed: the loop itself
// reads the pool and the tables without bounds checks.
static void check_arguments(const torch::Tensor& query, const torch::Tensor& cache, const torch::Tensor& log_degree,
                            const torch::Tensor& blocks, const torch::Tensor& first, const torch::Tensor& held) {
  TORCH_CHECK(query.scalar_type() == torch::kFloat32 && log_degree.scalar_type() == torch::kFloat32 &&
                  (cache.scalar_type() == torch::kBFloat16 || cache.scalar_type() == torch::kFloat32),
              "query and log_degree float32, cache bfloat16 or float32");
  TORCH_CHECK(blocks.scalar_type() == torch::kLong && first.scalar_type() == torch::kLong &&
                  held.scalar_type() == torch::kLong,
              "blocks, first and held: int64");
  TORCH_CHECK(query.is_contiguous() && cache.is_contiguous() && log_degree.is_contiguous(),
              "query, cache and log_degree: contiguous");
  TORCH_CHECK(query.dim() == 3 && cache.dim() == 4 && log_degree.dim() == 2 && blocks.dim() == 2 &&
                  first.dim() == 1 && held.dim() == 1,
              "query [M, Hq, D], cache [num_blocks, H, 2, block_size * D], log_degree [num_blocks * "
              "block_size, H], blocks [M, nb], first [M], held [M]");
  const int64_t rows = query.size(0), q_heads = query.size(1), dim = query.size(2);
  const int64_t num_blocks = cache.size(0), heads = cache.size(1), width = blocks.size(1);
  TORCH_CHECK(dim > 0 && dim % kLanes == 0, "head dim: a positive multiple of 16, got ", dim);
  TORCH_CHECK(cache.size(2) == 2 && cache.size(3) % dim == 0, "cache [num_blocks, H, 2, block_size * D]");
  const int64_t block_size = cache.size(3) / dim;
  TORCH_CHECK(block_size > 0 && block_size % kLanes == 0, "block size: a positive multiple of 16, got ", block_size);
  TORCH_CHECK(heads > 0 && q_heads > 0 && q_heads % heads == 0, "query heads (", q_heads,
              ") must be a multiple of the KV heads (", heads, ")");
  TORCH_CHECK(log_degree.size(0) == num_blocks * block_size && log_degree.size(1) == heads,
              "log_degree must be [num_blocks * block_size, H] = [", num_blocks * block_size, ", ", heads,
              "], got ", log_degree.sizes());
  TORCH_CHECK(blocks.size(0) == rows && first.size(0) == rows && held.size(0) == rows,
              "blocks, first and held must have one row per query row (", rows, ")");
  if (rows == 0) return;
  TORCH_CHECK(width > 0, "blocks: at least one block per row");
  TORCH_CHECK(blocks.min().item<int64_t>() >= 0 && blocks.max().item<int64_t>() < num_blocks,
              "block ids must be in [0, ", num_blocks, ")");
  TORCH_CHECK(first.min().item<int64_t>() >= 0 && held.min().item<int64_t>() > 0,
              "first must be >= 0 and held > 0");
  TORCH_CHECK((first + held).max().item<int64_t>() <= width * block_size,
              "first + held must not exceed a row's blocks (", width * block_size, " entries)");
}

// The loop over (request, KV head) pairs, on torch's intra-op threads (the engine's); each pair writes
// its own rows of `out`.
template <typename Entry>
static void run_pairs(const Layout<Entry>& layout, const int64_t* table, const int64_t* offsets,
                      const int64_t* counts, const float* queries, int64_t rows, int64_t width, float scale,
                      float* out) {
  const int64_t heads = layout.heads, dim = layout.dim, q_heads = heads * layout.group;
  at::parallel_for(0, rows * heads, 1, [&](int64_t first_pair, int64_t end_pair) {
    std::vector<float> logits(layout.group * width * layout.block_size), log_n(width * layout.block_size);
    for (int64_t pair = first_pair; pair < end_pair; ++pair) {
      const int64_t m = pair / heads, h = pair % heads, head_row = m * q_heads + h * layout.group;
      const int64_t next = std::min(pair + 1, end_pair - 1);
      const Entry* after = layout.keys(table[next / heads * width], next % heads);
      attend(layout, table + m * width, offsets[m], offsets[m] + counts[m], h, queries + head_row * dim, scale,
             out + head_row * dim, logits, log_n, after);
    }
  });
}

// query [M, Hq, D] float32; cache [num_blocks, H, 2, block_size * D] bf16 or float32; log_degree
// [num_blocks * block_size, H] float32; blocks [M, nb] int64; first [M]: the offset of a row's first
// entry in its first block; held [M]: its entries. D and block_size: multiples of 16.
torch::Tensor degree_decode(torch::Tensor query, torch::Tensor cache, torch::Tensor log_degree,
                            torch::Tensor blocks, torch::Tensor first, torch::Tensor held, double scale) {
  check_arguments(query, cache, log_degree, blocks, first, held);
  // held here: a non-contiguous argument's contiguous copy must outlive the pointers into it
  const torch::Tensor table_rows = blocks.contiguous(), first_rows = first.contiguous(),
                      held_rows = held.contiguous();
  const int64_t rows = query.size(0), q_heads = query.size(1), dim = query.size(2);
  const int64_t heads = cache.size(1), block_size = cache.size(3) / dim, width = blocks.size(1);
  auto output = torch::zeros({rows, q_heads, dim}, torch::kFloat32);
  const int64_t *table = table_rows.data_ptr<int64_t>(), *offsets = first_rows.data_ptr<int64_t>(),
                *counts = held_rows.data_ptr<int64_t>();
  const float* degree = log_degree.data_ptr<float>();
  const float* queries = query.data_ptr<float>();
  float* out = output.data_ptr<float>();
  const float step_scale = static_cast<float>(scale);
  if (cache.scalar_type() == torch::kBFloat16) {
    const Layout<uint16_t> layout{reinterpret_cast<const uint16_t*>(cache.data_ptr<at::BFloat16>()), degree,
                                  heads, q_heads / heads, dim, block_size};
    run_pairs(layout, table, offsets, counts, queries, rows, width, step_scale, out);
  } else {
    const Layout<float> layout{cache.data_ptr<float>(), degree, heads, q_heads / heads, dim, block_size};
    run_pairs(layout, table, offsets, counts, queries, rows, width, step_scale, out);
  }
  return output;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("degree_decode", &degree_decode);
  m.attr("LANES") = kLanes;  // decode_attention sends other head dims and block sizes to PyTorch
}
