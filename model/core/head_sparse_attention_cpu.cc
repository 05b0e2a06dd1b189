// The CPU pair kernel: head-sparse attention in float32 on CPU.
//
// Work is laid out per head. A head that every active token selected (the
// shared heads; every head at ratio 1.0) is "full": all such heads share one
// query projection and one output projection over the active tokens, as in
// dense attention. Any other head keeps the list of tokens that selected it
// and gets its own products over just those tokens. Attention itself runs in
// work items of at most kQueryBlock queries of one row and one KV head: one
// scores product over the keys the items' queries can see (causal blocks
// beyond the last query's position are never computed), a softmax, one
// product with the values. Keys and values are never gathered: a decode
// item's products read the cache's rows where they lie (a bfloat16 cache's
// widened as they are loaded); a prefill item's read a float32 cache in place
// (a strided matrix per run of adjacent blocks of the row's block table and
// KV head: one product per run), a bfloat16 cache widened item by item into
// a thread's buffer first.
//
// Matrix products call the BLAS directly (no allocation, no dispatch); work
// items and per-head products run on the intra-op pool, pulled from an atomic
// counter so uneven items (short causal blocks, long ones) balance. Inside the
// pool every product is single-threaded; the full heads' products run outside
// it, threaded by the BLAS itself.
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "model/core/head_sparse_attention.h"
#include "model/core/linear.h"
#include "model/kernels/cpu_attention_products.h"
#include "model/kernels/cpu_blas.h"
#include "model/kernels/cpu_linear.h"
#include "model/kernels/cpu_softmax.h"

namespace moh {
namespace {

// Queries per attention work item: large enough for efficient products,
// small enough that causal key blocks are skipped at a fine grain.
constexpr int64_t kQueryBlock = 64;

// Up to this many queries (a decode step's queries of one KV head) an item
// runs on the decode products over the cache's rows (Float32Scores and
// Bfloat16Scores, ...), or Gemm's matrix-vector products without AVX-512;
// above, the AVX-512 tiles of ScoresProduct and ValuesProduct.
constexpr int64_t kMaxGemvQueries = 4;

// Below this many multiply-adds a parallel region costs more than it saves
// (waking the pool and the barrier take microseconds).
constexpr int64_t kMinParallelWork = 1 << 20;

// Runs fn(i) for i in [0, count) on the intra-op pool, each thread pulling
// the next index (callers order work from the largest item down); inline when
// `work` (multiply-adds in all) is too small to share.
template <typename Fn>
void ParallelPull(int64_t count, int64_t work, const Fn &fn) {
  if (count == 0) return;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), count);
  if (threads < 2 || work < kMinParallelWork) {
    for (int64_t i = 0; i < count; ++i) fn(i);
    return;
  }
  std::atomic<int64_t> next{0};
  // The caller's LibTorch thread state (inference mode above all: the pool's
  // threads would otherwise refuse in-place updates of inference tensors).
  const at::ThreadLocalState state;
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    const at::ThreadLocalStateGuard guard(state);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t i = next++; i < count; i = next++) fn(i);
    }
  });
}

// One head's queries (later its attention outputs, in place): rows of a
// row-major matrix with leading dimension `ld`, for tokens tokens[0..count).
struct HeadRows {
  float *data = nullptr;
  int64_t ld = 0;
  const int64_t *tokens = nullptr;
  int64_t count = 0;
};

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

// t as `type` (t itself when it is: .to() would still be a dispatch).
at::Tensor AsType(const at::Tensor &t, at::ScalarType type) {
  return t.scalar_type() == type ? t : t.to(type);
}

std::vector<int64_t> ToVector(const at::Tensor &t) {
  const at::Tensor c = AsType(t, at::kLong).contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(),
                              c.data_ptr<int64_t>() + c.numel());
}

// Contiguous [first, last] ranges of sorted `heads`, as (first, count).
std::vector<std::pair<int64_t, int64_t>> Runs(
    const std::vector<int64_t> &heads) {
  std::vector<std::pair<int64_t, int64_t>> runs;
  for (int64_t h : heads) {
    if (!runs.empty() && runs.back().first + runs.back().second == h) {
      ++runs.back().second;
    } else {
      runs.push_back({h, 1});
    }
  }
  return runs;
}

// The full heads' queries, x [A, C] -> [A, F * D]: one product per run of
// consecutive heads over its rows of q_weight [H * D, C], read in place
// (gathering the rows of heads that are not consecutive would copy that
// part of the weight every step, as many bytes as the product reads).
at::Tensor FullHeadQueries(const at::Tensor &x, const at::Tensor &weight,
                           const at::Tensor &bias,
                           const std::vector<int64_t> &heads, int64_t d) {
  std::vector<at::Tensor> parts;
  for (const auto &[first, count] : Runs(heads)) {
    parts.push_back(Linear(
        x, weight.narrow(0, first * d, count * d),
        bias.defined() ? bias.narrow(0, first * d, count * d) : at::Tensor()));
  }
  return parts.size() == 1 ? parts[0] : at::cat(parts, 1);
}

// a [A, F * D] (the full heads' attention) through their columns of
// o_weight [C, H * D]: a sum of one product per run of consecutive heads,
// each reading its columns in place.
at::Tensor FullHeadOutputs(const at::Tensor &a, const at::Tensor &weight,
                           const std::vector<int64_t> &heads, int64_t d) {
  at::Tensor y;
  int64_t column = 0;
  for (const auto &[first, count] : Runs(heads)) {
    at::Tensor part = Linear(a.narrow(1, column, count * d),
                             weight.narrow(1, first * d, count * d));
    column += count * d;
    y = y.defined() ? y.add_(part) : part;
  }
  return y;
}

// Whether IndexedLinear can read `t`'s rows in place (float32 on the CPU,
// each row contiguous).
bool RowsInPlace(const at::Tensor &t) {
  return t.is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 2 &&
         t.stride(1) == 1;
}

// Head h's queries over its tokens (`count` rows of x, `tokens`) into q
// [count, D] (contiguous, at `q`): x's rows gathered while the product packs
// them, from pointers (no ATen view per head), where possible.
void RoutedQueries(const HeadSparseAttentionInputs &in, int64_t h, int64_t d,
                   const int64_t *tokens, int64_t count, float *q) {
  const int64_t c = in.x.size(1);
  if (RowsInPlace(in.x) && RowsInPlace(in.q_weight) &&
      (!in.q_bias.defined() ||
       (in.q_bias.is_contiguous() && in.q_bias.scalar_type() == at::kFloat)) &&
      IndexedLinear(
          {in.x.data_ptr<float>(), in.x.stride(0), tokens}, count, c,
          in.q_weight.data_ptr<float>() + h * d * in.q_weight.stride(0),
          in.q_weight.stride(0), d, {q, d})) {
    if (in.q_bias.defined()) {
      const float *bias = in.q_bias.data_ptr<float>() + h * d;
      for (int64_t i = 0; i < count; ++i) {
        for (int64_t j = 0; j < d; ++j) q[i * d + j] += bias[j];
      }
    }
    return;
  }
  const at::TensorOptions longs = at::TensorOptions().dtype(at::kLong);
  at::Tensor x = in.x.index_select(
      0, at::from_blob(const_cast<int64_t *>(tokens), {count}, longs));
  at::Tensor out = at::from_blob(q, {count, d}, in.x.options());
  LinearInto(x, in.q_weight.narrow(0, h * d, d),
             in.q_bias.defined() ? in.q_bias.narrow(0, h * d, d) : at::Tensor(),
             out);
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

// Softmax of scores[i, 0..visible[i]) into probs[i]; entries beyond are 0.
void MaskedSoftmax(const float *scores, float *probs, int64_t rows,
                   int64_t cols, const int64_t *visible) {
  if (SoftmaxRows(scores, probs, rows, cols, visible)) return;
  for (int64_t i = 0; i < rows; ++i) {
    const float *s = scores + i * cols;
    float *p = probs + i * cols;
    const int64_t n = visible[i];
    float max = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < n; ++j) max = std::max(max, s[j]);
    float sum = 0;
    for (int64_t j = 0; j < n; ++j) {
      p[j] = std::exp(s[j] - max);
      sum += p[j];
    }
    const float inv = 1.0f / sum;
    for (int64_t j = 0; j < n; ++j) p[j] *= inv;
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
// cached positions) from the cache's rows where they lie: scores [m, len],
// probs [m, len], outputs [m, D]. False (nothing done) where the products
// do not apply (no AVX-512, D not a multiple of 16).
template <typename T>
bool DecodeOverRows(const HeadSparseAttentionInputs &in, const int64_t *blocks,
                    int64_t kv_head, int64_t len, const float *queries,
                    int64_t m, float scale, const int64_t *visible,
                    float *scores, float *probs, float *outputs) {
  thread_local std::vector<const T *> key_rows, value_rows;
  const int64_t d = in.key_cache.size(3);
  CacheRows(in.key_cache, blocks, kv_head, len, key_rows);
  if (!ScoresOverRows(queries, m, d, scale, key_rows.data(), len, scores)) {
    return false;
  }
  CacheRows(in.value_cache, blocks, kv_head, len, value_rows);
  MaskedSoftmax(scores, probs, m, len, visible);
  ValuesOverRows(probs, m, value_rows.data(), len, d, outputs);
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
                 const std::vector<HeadRows> &rows_of,
                 const std::vector<int64_t> &token_pos,
                 const std::vector<int64_t> &row_len, const int64_t *blocks,
                 float scale) {
  const int64_t d = in.key_cache.size(3);
  thread_local std::vector<float> queries, scores, probs, outputs, wide_keys,
      wide_values;
  thread_local std::vector<int64_t> visible;
  thread_local std::vector<CacheRun> key_runs, value_runs;
  const int64_t m = item.queries, len = item.keys;
  queries.resize(m * d);
  outputs.resize(m * d);
  scores.resize(m * len);
  probs.resize(m * len);
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
  // The item's outputs, over its queries in place.
  auto write_outputs = [&] {
    int64_t query = 0;
    for (const Segment &s : item.segments) {
      const HeadRows &r = rows_of[s.head];
      for (int64_t i = 0; i < s.count; ++i, ++query) {
        std::memcpy(r.data + (s.first + i) * r.ld, outputs.data() + query * d,
                    d * sizeof(float));
      }
    }
  };
  // A decode item: products over the cache's rows where they lie
  // (bfloat16 rows widened as they are loaded).
  const at::ScalarType cached = in.key_cache.scalar_type();
  if (m <= kMaxGemvQueries && in.value_cache.scalar_type() == cached &&
      (cached == at::kBFloat16
           ? DecodeOverRows<uint16_t>(
                 in, blocks, item.kv_head, len, queries.data(), m, scale,
                 visible.data(), scores.data(), probs.data(), outputs.data())
           : cached == at::kFloat &&
                 DecodeOverRows<float>(in, blocks, item.kv_head, len,
                                       queries.data(), m, scale, visible.data(),
                                       scores.data(), probs.data(),
                                       outputs.data()))) {
    write_outputs();
    return;
  }
  CacheRuns(in.key_cache, blocks, item.kv_head, len, wide_keys, key_runs);
  CacheRuns(in.value_cache, blocks, item.kv_head, len, wide_values, value_runs);
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
  MaskedSoftmax(scores.data(), probs.data(), m, len, visible.data());
  // outputs^T [D, m] = V^T [D, len] . probs^T [len, m], summed over
  // the runs of values.
  for (size_t i = 0; i < value_runs.size(); ++i) {
    const CacheRun &v = value_runs[i];
    if (m <= kMaxGemvQueries ||
        !ValuesProduct(probs.data() + v.first, len, m, v.count, v.data, v.ld, d,
                       outputs.data(), d, i > 0)) {
      Gemm(/*transpose_a=*/false, d, m, v.count, 1.0f, v.data, v.ld,
           probs.data() + v.first, len, i == 0 ? 0.0f : 1.0f, outputs.data(),
           d);
    }
  }
  write_outputs();
}

// Each head's attention output (over its queries, in place) times its
// gate.
void ApplyGates(const std::vector<HeadRows> &rows_of, const float *gate,
                int64_t d) {
  const int64_t heads = static_cast<int64_t>(rows_of.size());
  for (int64_t h = 0; h < heads; ++h) {
    const HeadRows &r = rows_of[h];
    for (int64_t i = 0; i < r.count; ++i) {
      const float g = gate[r.tokens[i] * heads + h];
      float *row = r.data + i * r.ld;
      for (int64_t j = 0; j < d; ++j) row[j] *= g;
    }
  }
}

// Routed heads' output projections added into `out`: each thread owns a
// block of output columns, so their scatter-adds never overlap.
void AddRoutedOutputs(const HeadSparseAttentionInputs &in,
                      const at::Tensor &q_routed,
                      const std::vector<int64_t> &routed,
                      const std::vector<std::vector<int64_t>> &head_tokens,
                      const std::vector<int64_t> &first_pair,
                      const std::vector<int64_t> &pair_token,
                      const at::Tensor &pair_index, at::Tensor &out) {
  const int64_t d = in.key_cache.size(3);
  const int64_t num_pairs = q_routed.size(0);
  const int64_t out_cols = in.o_weight.size(0);
  // Blocks of 64 columns (read by IndexedLinear without packing): one
  // block of `out` for every token stays in L2 while every head adds to it.
  const int64_t width = 64;
  const int64_t blocks = (out_cols + width - 1) / width;
  const bool in_place = RowsInPlace(out) && RowsInPlace(in.o_weight);
  const float *queries = q_routed.data_ptr<float>();
  const float *o_weight = in_place ? in.o_weight.data_ptr<float>() : nullptr;
  const int64_t ldo = in.o_weight.stride(0);
  float *outputs = in_place ? out.data_ptr<float>() : nullptr;
  ParallelPull(blocks, num_pairs * d * out_cols, [&](int64_t block) {
    const int64_t c0 = block * width;
    const int64_t cols = std::min(width, out_cols - c0);
    if (cols <= 0) return;
    for (int64_t h : routed) {
      const int64_t count = static_cast<int64_t>(head_tokens[h].size());
      // Added straight into the tokens' rows of `out`, where possible.
      if (in_place && IndexedLinear({queries + first_pair[h] * d, d}, count, d,
                                    o_weight + c0 * ldo + h * d, ldo, cols,
                                    {outputs + c0, out.stride(0),
                                     pair_token.data() + first_pair[h],
                                     /*accumulate=*/true})) {
        continue;
      }
      out.narrow(1, c0, cols)
          .index_add_(
              0, pair_index.narrow(0, first_pair[h], count),
              Linear(q_routed.narrow(0, first_pair[h], count),
                     in.o_weight.narrow(0, c0, cols).narrow(1, h * d, d)));
    }
  });
}

}  // namespace

at::Tensor HeadSparseAttentionCpu(const HeadSparseAttentionInputs &in) {
  const int64_t n = in.x.size(0);
  const int64_t heads = in.gates.size(1);
  const int64_t kv_heads = in.key_cache.size(2);
  const int64_t d = in.key_cache.size(3);
  const int64_t group = heads / kv_heads;
  TORCH_CHECK(in.key_cache.stride(3) == 1 && in.value_cache.stride(3) == 1,
              "key/value cache: the head dimension must be contiguous");

  const std::vector<int64_t> token_row = ToVector(in.token_row);
  const std::vector<int64_t> token_pos = ToVector(in.token_pos);
  const std::vector<int64_t> row_len = ToVector(in.row_len);
  const at::Tensor block_table = AsType(in.block_table, at::kLong).contiguous();
  const int64_t *table = block_table.data_ptr<int64_t>();
  const int64_t table_width = block_table.size(1);
  const at::Tensor gates = AsType(in.gates, at::kFloat).contiguous();
  const float *gate = gates.data_ptr<float>();

  // Which tokens each head serves; `active`: tokens that selected any head.
  std::vector<std::vector<int64_t>> head_tokens(heads);
  std::vector<int64_t> active;
  for (int64_t t = 0; t < n; ++t) {
    bool any = false;
    for (int64_t h = 0; h < heads; ++h) {
      if (gate[t * heads + h] != 0.0f) {
        head_tokens[h].push_back(t);
        any = true;
      }
    }
    if (any) active.push_back(t);
  }
  // The layer's output; zeros only where not every token's full-head product
  // writes it whole.
  at::Tensor out;
  const auto zeros = [&] {
    return at::zeros({n, in.o_weight.size(0)}, in.x.options());
  };
  if (active.empty()) {
    out = zeros();
    if (in.o_bias.defined()) out += in.o_bias;
    return out;
  }
  std::vector<int64_t> full, routed;
  for (int64_t h = 0; h < heads; ++h) {
    if (head_tokens[h].empty()) continue;
    (head_tokens[h].size() == active.size() ? full : routed).push_back(h);
  }
  const at::TensorOptions longs = at::TensorOptions().dtype(at::kLong);
  const int64_t num_active = static_cast<int64_t>(active.size());
  const bool all_active = num_active == n;
  at::Tensor active_index = at::from_blob(active.data(), {num_active}, longs);
  const at::Tensor active_pos =
      all_active ? in.token_pos : in.token_pos.index_select(0, active_index);
  const int64_t f = static_cast<int64_t>(full.size());
  at::Tensor full_index = at::from_blob(full.data(), {f}, longs);

  // Queries. Full heads: one product over the active tokens, [A, F * D].
  std::vector<HeadRows> rows_of(heads);
  at::Tensor q_full;
  if (!full.empty()) {
    if (in.q_full.defined()) {
      at::Tensor q =
          f == heads ? in.q_full : in.q_full.index_select(1, full_index);
      q_full = all_active ? q : q.index_select(0, active_index);
    } else {
      at::Tensor x = all_active ? in.x : in.x.index_select(0, active_index);
      q_full = FullHeadQueries(x, in.q_weight, in.q_bias, full, d);
    }
    q_full = q_full.view({num_active, f, d});
    if (in.rotate) {
      q_full = in.rotate(q_full, active_pos.unsqueeze(1).expand({-1, f}));
    }
    q_full = q_full.reshape({num_active, f * d}).contiguous();
    for (int64_t i = 0; i < f; ++i) {
      rows_of[full[i]] = {q_full.data_ptr<float>() + i * d, f * d,
                          active.data(), num_active};
    }
  }
  // Routed heads: [P, D], head after head, each over its own tokens.
  std::vector<int64_t> pair_token;
  std::vector<int64_t> first_pair(heads, 0);
  for (int64_t h : routed) {
    first_pair[h] = static_cast<int64_t>(pair_token.size());
    pair_token.insert(pair_token.end(), head_tokens[h].begin(),
                      head_tokens[h].end());
  }
  const int64_t num_pairs = static_cast<int64_t>(pair_token.size());
  at::Tensor pair_index = at::from_blob(pair_token.data(), {num_pairs}, longs);
  at::Tensor q_routed = at::empty({num_pairs, d}, in.x.options());
  ParallelPull(
      static_cast<int64_t>(routed.size()), num_pairs * d * in.x.size(1),
      [&](int64_t i) {
        const int64_t h = routed[i];
        const int64_t count = static_cast<int64_t>(head_tokens[h].size());
        if (in.q_full.defined()) {
          at::Tensor tokens = pair_index.narrow(0, first_pair[h], count);
          q_routed.narrow(0, first_pair[h], count)
              .copy_(in.q_full.select(1, h).index_select(0, tokens));
          return;
        }
        RoutedQueries(in, h, d, pair_token.data() + first_pair[h], count,
                      q_routed.data_ptr<float>() + first_pair[h] * d);
      });
  if (in.rotate && num_pairs > 0) {
    q_routed.copy_(
        in.rotate(q_routed, in.token_pos.index_select(0, pair_index)));
  }
  for (int64_t h : routed) {
    rows_of[h] = {q_routed.data_ptr<float>() + first_pair[h] * d, d,
                  pair_token.data() + first_pair[h],
                  static_cast<int64_t>(head_tokens[h].size())};
  }

  const std::vector<WorkItem> items =
      BuildWorkItems(rows_of, token_row, token_pos, row_len, kv_heads, group);

  // Attention, written over each head's queries in place.
  const float scale = static_cast<float>(in.scale);
  int64_t attention_work = 0;
  for (const WorkItem &item : items) {
    attention_work += 2 * item.queries * item.keys * d;
  }
  ParallelPull(static_cast<int64_t>(items.size()), attention_work,
               [&](int64_t index) {
                 RunWorkItem(in, items[index], rows_of, token_pos, row_len,
                             table + items[index].row * table_width, scale);
               });

  ApplyGates(rows_of, gate, d);
  // Output projection. Full heads: one product.
  if (!full.empty()) {
    at::Tensor y = FullHeadOutputs(q_full, in.o_weight, full, d);
    if (all_active) {
      out = y;
    } else {
      out = zeros();
      out.index_add_(0, active_index, y);
    }
  } else {
    out = zeros();
  }
  if (num_pairs > 0) {
    AddRoutedOutputs(in, q_routed, routed, head_tokens, first_pair, pair_token,
                     pair_index, out);
  }
  if (in.o_bias.defined()) out += in.o_bias;
  return out;
}

}  // namespace moh
