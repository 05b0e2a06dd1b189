// The CPU pair kernel's attention, in work items of at most kQueryBlock
// queries of one row and one KV head: one scores product over the keys the
// items' queries can see (causal blocks beyond the last query's position are
// never computed), a softmax, one product with the values. Keys and values
// are never gathered: a decode item's products read the cache's rows where
// they lie (a bfloat16 cache's widened as they are loaded); a prefill item's
// read a float32 cache in place (a strided matrix per run of adjacent blocks
// of the row's block table and KV head: one product per run), a bfloat16
// cache widened item by item into a thread's buffer first. Items run on the
// intra-op pool, pulled from an atomic counter so uneven items (short causal
// blocks, long ones) balance; inside the pool every product is
// single-threaded.
#include "model/core/paged_attention_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "model/core/parallel_pull.h"
#include "model/kernels/cpu_attention_products.h"
#include "model/kernels/cpu_blas.h"
#include "model/kernels/cpu_softmax.h"

namespace moh::head_sparse_internal {
namespace {

// Queries per attention work item: large enough for efficient products,
// small enough that causal key blocks are skipped at a fine grain.
constexpr int64_t kQueryBlock = 64;

// Up to this many queries (a decode step's queries of one KV head) an item
// runs on the decode products over the cache's rows (Float32Scores and
// Bfloat16Scores, ...), or Gemm's matrix-vector products without the
// kernels (MOH_CPU_ISA=portable, or a CPU without AVX2); above, the tiles of
// ScoresProduct and ValuesProduct (AVX-512 or AVX2).
constexpr int64_t kMaxGemvQueries = 4;

// A run of one head's queries, all in one row.
struct Segment {
  int64_t head, first, count;
};

// Up to kQueryBlock queries of one row that read one KV head.
struct WorkItem {
  int64_t row, kv_head;
  int64_t keys;  // keys [0, keys) cover every query of the item
  std::vector<Segment> segments;
  int64_t queries = 0;
};

std::vector<int64_t> ToVector(const at::Tensor &t) {
  const at::Tensor c = AsType(t, at::kLong).contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(),
                              c.data_ptr<int64_t>() + c.numel());
}

// Rows [first, first + count) of a row's keys (or values) for one KV head:
// a strided [count, D] float32 matrix with leading dimension `ld`.
struct CacheRun {
  const float *data;
  int64_t ld, first, count;
};

// Positions [0, len) of a row of a KV cache for one KV head, through the row's
// block table (`blocks`), as runs of rows stored one after another: read where
// they lie (float32; consecutive blocks make one run), or widened into
// `buffer` (bfloat16) as one run.
void CacheRuns(const at::Tensor &cache, const int64_t *blocks, int64_t kv_head,
               int64_t len, std::vector<float> &buffer,
               std::vector<CacheRun> &runs) {
  runs.clear();
  const int64_t block_size = cache.size(1), d = cache.size(3);
  const int64_t ld = cache.stride(1);
  // Whether block b + 1 starts where block b ends.
  const bool adjacent = cache.stride(0) == block_size * ld;
  if (cache.scalar_type() == at::kFloat) {
    const float *base = cache.data_ptr<float>() + kv_head * cache.stride(2);
    for (int64_t p = 0; p < len; p += block_size) {
      const int64_t block = blocks[p / block_size];
      const int64_t count = std::min(block_size, len - p);
      if (adjacent && !runs.empty() &&
          blocks[p / block_size - 1] + 1 == block) {
        runs.back().count += count;
      } else {
        runs.push_back({base + block * cache.stride(0), ld, p, count});
      }
    }
    return;
  }
  const uint16_t *base =
      reinterpret_cast<const uint16_t *>(cache.data_ptr<at::BFloat16>()) +
      kv_head * cache.stride(2);
  buffer.resize(len * d);
  for (int64_t i = 0; i < len; ++i) {
    const uint16_t *row =
        base + blocks[i / block_size] * cache.stride(0) + (i % block_size) * ld;
    float *to = buffer.data() + i * d;
    if (WidenBfloat16(row, d, to)) continue;
    for (int64_t j = 0; j < d; ++j) to[j] = c10::detail::f32_from_bits(row[j]);
  }
  runs.push_back({buffer.data(), d, 0, len});
}

// Addresses of positions [0, len) of a row of a KV cache (float32, or
// bfloat16 as its elements' bits) for one KV head, through the row's block
// table.
template <typename T>
void CacheRows(const at::Tensor &cache, const int64_t *blocks, int64_t kv_head,
               int64_t len, std::vector<const T *> &rows) {
  const int64_t block_size = cache.size(1);
  const T *base =
      static_cast<const T *>(cache.data_ptr()) + kv_head * cache.stride(2);
  rows.resize(len);
  const int64_t ld = cache.stride(1);
  for (int64_t p = 0; p < len; p += block_size) {
    const T *block = base + blocks[p / block_size] * cache.stride(0);
    const int64_t count = std::min(block_size, len - p);
    for (int64_t i = 0; i < count; ++i) rows[p + i] = block + i * ld;
  }
}

// SoftmaxRows over the scores in place (unnormalized, 1 / each row's sum
// in inverse_sums), in portable code where its kernels do not run.
void MaskedSoftmax(float *scores, int64_t rows, int64_t cols,
                   const int64_t *visible, float *inverse_sums) {
  if (SoftmaxRows(scores, scores, rows, cols, visible, inverse_sums)) return;
  for (int64_t i = 0; i < rows; ++i) {
    float *p = scores + i * cols;
    const int64_t n = visible[i];
    float max = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < n; ++j) max = std::max(max, p[j]);
    float sum = 0;
    for (int64_t j = 0; j < n; ++j) {
      p[j] = std::exp(p[j] - max);
      sum += p[j];
    }
    inverse_sums[i] = 1.0f / sum;
    std::fill(p + n, p + cols, 0.0f);
  }
}

// The decode products over rows of either cache type
// (cpu_attention_products.h).
bool ScoresOverRows(const float *q, int64_t m, int64_t d, float scale,
                    const uint16_t *const *keys, int64_t n, float *y) {
  return Bfloat16Scores(q, m, d, scale, keys, n, y, n);
}
bool ScoresOverRows(const float *q, int64_t m, int64_t d, float scale,
                    const float *const *keys, int64_t n, float *y) {
  return Float32Scores(q, m, d, scale, keys, n, y, n);
}
void ValuesOverRows(const float *p, int64_t m, const uint16_t *const *values,
                    int64_t n, int64_t d, float *y) {
  Bfloat16Values(p, n, m, values, n, d, y, d);
}
void ValuesOverRows(const float *p, int64_t m, const float *const *values,
                    int64_t n, int64_t d, float *y) {
  Float32Values(p, n, m, values, n, d, y, d);
}

// A decode item (m queries [m, D] of one row and KV head over its first len
// cached positions) from the cache's rows where they lie: scores [m, len]
// (the unnormalized probabilities after), inverse_sums [m], outputs [m, D]
// (unnormalized). False (nothing done) where the products do not apply (no
// AVX-512 or AVX2 kernels, D not a multiple of 16).
template <typename T>
bool DecodeOverRows(const at::Tensor &key_cache, const at::Tensor &value_cache,
                    const int64_t *blocks, int64_t kv_head, int64_t len,
                    const float *queries, int64_t m, float scale,
                    const int64_t *visible, float *scores, float *inverse_sums,
                    float *outputs) {
  thread_local std::vector<const T *> key_rows, value_rows;
  const int64_t d = key_cache.size(3);
  CacheRows(key_cache, blocks, kv_head, len, key_rows);
  if (!ScoresOverRows(queries, m, d, scale, key_rows.data(), len, scores)) {
    return false;
  }
  CacheRows(value_cache, blocks, kv_head, len, value_rows);
  MaskedSoftmax(scores, m, len, visible, inverse_sums);
  ValuesOverRows(scores, m, value_rows.data(), len, d, outputs);
  return true;
}

// Work items: per row and KV head, the heads' runs of queries in that row,
// cut into blocks of kQueryBlock; small runs (decode) share an item. Largest
// first, so that the threads pulling them finish together.
std::vector<WorkItem> BuildWorkItems(const std::vector<HeadRows> &rows_of,
                                     const std::vector<int64_t> &token_row,
                                     const std::vector<int64_t> &token_pos,
                                     const std::vector<int64_t> &row_len,
                                     int64_t kv_heads, int64_t group) {
  const int64_t num_rows = static_cast<int64_t>(row_len.size());
  std::vector<WorkItem> items;
  for (int64_t b = 0; b < num_rows; ++b) {
    for (int64_t kv = 0; kv < kv_heads; ++kv) {
      WorkItem item{b, kv, 0, {}, 0};
      for (int64_t h = kv * group; h < (kv + 1) * group; ++h) {
        const HeadRows &r = rows_of[h];
        if (r.count == 0) continue;
        const int64_t *begin = std::lower_bound(
            r.tokens, r.tokens + r.count, b,
            [&](int64_t t, int64_t row) { return token_row[t] < row; });
        const int64_t *end = std::upper_bound(
            begin, r.tokens + r.count, b,
            [&](int64_t row, int64_t t) { return row < token_row[t]; });
        for (int64_t i = begin - r.tokens; i < end - r.tokens;) {
          const int64_t take =
              std::min(kQueryBlock - item.queries, (end - r.tokens) - i);
          item.segments.push_back({h, i, take});
          item.queries += take;
          const int64_t last = token_pos[r.tokens[i + take - 1]];
          item.keys = std::max(item.keys, std::min(last + 1, row_len[b]));
          i += take;
          if (item.queries == kQueryBlock) {
            items.push_back(std::move(item));
            item = WorkItem{b, kv, 0, {}, 0};
          }
        }
      }
      if (item.queries > 0) items.push_back(std::move(item));
    }
  }
  std::sort(items.begin(), items.end(),
            [](const WorkItem &a, const WorkItem &b) {
              return a.queries * a.keys > b.queries * b.keys;
            });
  return items;
}

// One work item's attention: its queries (packed from rows_of), the scores
// against its row's cached keys (`blocks`, its block table row), the masked
// softmax and the values, written back over its queries in place.
void RunWorkItem(const HeadSparseAttentionInputs &in, const WorkItem &item,
                 const std::vector<HeadRows> &rows_of, const float *gate,
                 const std::vector<int64_t> &token_pos,
                 const std::vector<int64_t> &row_len, const int64_t *blocks,
                 float scale) {
  const int64_t d = in.key_cache.size(3);
  thread_local std::vector<float> queries, scores, inverse_sums, outputs,
      wide_keys, wide_values;
  thread_local std::vector<int64_t> visible;
  thread_local std::vector<CacheRun> key_runs, value_runs;
  const int64_t m = item.queries, len = item.keys;
  queries.resize(m * d);
  outputs.resize(m * d);
  scores.resize(m * len);
  inverse_sums.resize(m);
  visible.resize(m);
  // This item's queries, packed [m, D].
  int64_t at = 0;
  for (const Segment &s : item.segments) {
    const HeadRows &r = rows_of[s.head];
    for (int64_t i = 0; i < s.count; ++i, ++at) {
      std::memcpy(queries.data() + at * d, r.data + (s.first + i) * r.ld,
                  d * sizeof(float));
      visible[at] =
          std::min(token_pos[r.tokens[s.first + i]] + 1, row_len[item.row]);
    }
  }
  // The item's outputs, over its queries in place, times each query's
  // gate. The softmax below leaves its probabilities unnormalized
  // (MaskedSoftmax's inverse_sums): each output row is scaled here, D floats
  // instead of len.
  const int64_t heads = static_cast<int64_t>(rows_of.size());
  auto write_outputs = [&] {
    int64_t query = 0;
    for (const Segment &s : item.segments) {
      const HeadRows &r = rows_of[s.head];
      for (int64_t i = 0; i < s.count; ++i, ++query) {
        float *to = r.data + (s.first + i) * r.ld;
        const float *from = outputs.data() + query * d;
        const float factor =
            inverse_sums[query] * gate[r.tokens[s.first + i] * heads + s.head];
        for (int64_t j = 0; j < d; ++j) to[j] = from[j] * factor;
      }
    }
  };
  // A decode item: products over the cache's rows where they lie
  // (bfloat16 rows widened as they are loaded).
  // A narrow row (the ratio ceiling) reads its positions through the narrow
  // views; its items are of shared heads only, whose KV heads they hold.
  const bool narrow = in.narrow.any() && in.narrow.is_narrow[item.row] != 0;
  const at::Tensor &key_cache = narrow ? in.narrow.key_cache : in.key_cache;
  const at::Tensor &value_cache =
      narrow ? in.narrow.value_cache : in.value_cache;
  TORCH_CHECK(item.kv_head < key_cache.size(2),
              "a narrow row selected a routed KV head");
  const at::ScalarType cached = key_cache.scalar_type();
  if (m <= kMaxGemvQueries && value_cache.scalar_type() == cached &&
      (cached == at::kBFloat16
           ? DecodeOverRows<uint16_t>(key_cache, value_cache, blocks,
                                      item.kv_head, len, queries.data(), m,
                                      scale, visible.data(), scores.data(),
                                      inverse_sums.data(), outputs.data())
           : cached == at::kFloat &&
                 DecodeOverRows<float>(key_cache, value_cache, blocks,
                                       item.kv_head, len, queries.data(), m,
                                       scale, visible.data(), scores.data(),
                                       inverse_sums.data(), outputs.data()))) {
    write_outputs();
    return;
  }
  CacheRuns(key_cache, blocks, item.kv_head, len, wide_keys, key_runs);
  CacheRuns(value_cache, blocks, item.kv_head, len, wide_values, value_runs);
  // Column-major view: scores^T [len, m] = K [len, D] . queries^T, a
  // run of keys at a time.
  for (const CacheRun &k : key_runs) {
    if (m <= kMaxGemvQueries ||
        !ScoresProduct(queries.data(), m, d, scale, k.data, k.ld, k.count,
                       scores.data() + k.first, len)) {
      Gemm(/*transpose_a=*/true, k.count, m, d, scale, k.data, k.ld,
           queries.data(), d, 0.0f, scores.data() + k.first, len);
    }
  }
  MaskedSoftmax(scores.data(), m, len, visible.data(), inverse_sums.data());
  // outputs^T [D, m] = V^T [D, len] . probs^T [len, m], summed over
  // the runs of values.
  for (size_t i = 0; i < value_runs.size(); ++i) {
    const CacheRun &v = value_runs[i];
    if (m <= kMaxGemvQueries ||
        !ValuesProduct(scores.data() + v.first, len, m, v.count, v.data, v.ld,
                       d, outputs.data(), d, i > 0)) {
      Gemm(/*transpose_a=*/false, d, m, v.count, 1.0f, v.data, v.ld,
           scores.data() + v.first, len, i == 0 ? 0.0f : 1.0f, outputs.data(),
           d);
    }
  }
  write_outputs();
}

}  // namespace

void PagedAttentionCpu(const HeadSparseAttentionInputs &in,
                       const std::vector<HeadRows> &rows_of,
                       const float *gate) {
  const int64_t kv_heads = in.key_cache.size(2);
  const int64_t d = in.key_cache.size(3);
  const int64_t group = static_cast<int64_t>(rows_of.size()) / kv_heads;
  const std::vector<int64_t> token_row = ToVector(in.token_row);
  const std::vector<int64_t> token_pos = ToVector(in.token_pos);
  const std::vector<int64_t> row_len = ToVector(in.row_len);
  const at::Tensor block_table = AsType(in.block_table, at::kLong).contiguous();
  const int64_t *table = block_table.data_ptr<int64_t>();
  const int64_t table_width = block_table.size(1);
  const std::vector<WorkItem> items =
      BuildWorkItems(rows_of, token_row, token_pos, row_len, kv_heads, group);
  const float scale = static_cast<float>(in.scale);
  int64_t attention_work = 0;
  for (const WorkItem &item : items) {
    attention_work += 2 * item.queries * item.keys * d;
  }
  ParallelPull(
      static_cast<int64_t>(items.size()), attention_work, [&](int64_t index) {
        RunWorkItem(in, items[index], rows_of, gate, token_pos, row_len,
                    table + items[index].row * table_width, scale);
      });
}

}  // namespace moh::head_sparse_internal
