// The CPU pair kernel: head-sparse attention in float32 on CPU.
//
// Work is laid out per head. A head that every active token selected (the
// shared heads; every head at ratio 1.0) is "full": all such heads share one
// query projection and one output projection over the active tokens, as in
// dense attention. Any other head keeps the list of tokens that selected it
// and gets its own products over just those tokens. Attention itself, over
// the KV cache, is paged_attention_cpu.cc.
//
// Matrix products call this project's kernels (model/kernels/) or the BLAS
// directly (no allocation, no dispatch); per-head products run on the
// intra-op pool, pulled from an atomic counter. Inside the pool every product
// is single-threaded; the full heads' products run outside it, threaded by
// the kernels or the BLAS themselves.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include "model/core/head_sparse_attention.h"
#include "model/core/linear.h"
#include "model/core/paged_attention_cpu.h"
#include "model/core/parallel_pull.h"
#include "model/core/rope.h"
#include "model/kernels/cpu_linear.h"
#include "model/kernels/cpu_lowp_linear.h"

namespace moh {
namespace {

using head_sparse_internal::AsType;
using head_sparse_internal::HeadRows;

// Whether `t` is a contiguous float32 CPU tensor: rows a pointer walks.
bool PlainRows(const at::Tensor &t) { return CpuFloat(t) && t.is_contiguous(); }

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

// Output rows of one token's product per task of OneRowBlocks: 16 (a whole
// number of every kernel's row tiles), at least 2^15 multiply-adds a task.
constexpr int64_t kBlockRowUnit = 16;
int64_t BlockRowGrain(int64_t depth) {
  constexpr int64_t kMinTaskMacs = 1 << 15;
  return std::max<int64_t>(
      1, kMinTaskMacs / (kBlockRowUnit * std::max<int64_t>(depth, 1)));
}

// One token's product over several blocks of W, in one parallel region
// (one region a product, where a region a block cost a wake-up and two
// barriers each): block(row0, rows) for the output rows [row0, row0 +
// rows) of [0, n), split in tasks of whole kBlockRowUnit rows. The kernels
// it calls run inline inside the region. False when a block was not
// computed (LinearBlockInto had no kernel for W).
template <typename Block>
bool OneRowBlocks(int64_t n, int64_t depth, const Block &block) {
  std::atomic<bool> done{true};
  const int64_t units = (n + kBlockRowUnit - 1) / kBlockRowUnit;
  at::parallel_for(0, units, BlockRowGrain(depth), [&](int64_t u0, int64_t u1) {
    const int64_t row0 = u0 * kBlockRowUnit;
    const int64_t rows = std::min(n, u1 * kBlockRowUnit) - row0;
    if (!block(row0, rows)) done = false;
  });
  return done;
}

// The full heads' queries, x [A, C] -> [A, F * D]: one product per run of
// consecutive heads over its rows of q_weight [H * D, C], read in place
// (gathering the rows of heads that are not consecutive would copy that
// part of the weight every step, as many bytes as the product reads).
at::Tensor FullHeadQueries(const at::Tensor &x, const LinearWeight &weight,
                           const at::Tensor &bias,
                           const std::vector<int64_t> &heads, int64_t d) {
  const std::vector<std::pair<int64_t, int64_t>> runs = Runs(heads);
  // From pointers, each run's product written at its columns, where its
  // rows of the result are contiguous there: one row (a batch-1 step: every
  // run in one parallel region), or one run.
  const int64_t m = x.size(0), c = x.size(1);
  const int64_t width = static_cast<int64_t>(heads.size()) * d;
  if ((m == 1 || runs.size() == 1) && PlainRows(x) &&
      (!bias.defined() || PlainRows(bias))) {
    at::Tensor out = at::empty({m, width}, x.options());
    float *y = out.data_ptr<float>();
    const float *b = bias.defined() ? bias.data_ptr<float>() : nullptr;
    // Columns [begin, begin + count) of the result: rows of W run by run.
    auto columns = [&](int64_t begin, int64_t count) {
      int64_t column = 0;
      for (const auto &[first, heads_in_run] : runs) {
        const int64_t from = std::max(begin, column);
        const int64_t to = std::min(begin + count, column + heads_in_run * d);
        if (from < to) {
          const int64_t row = first * d + from - column;
          if (!LinearBlockInto(x.data_ptr<float>(), m, c, weight, row,
                               to - from, 0, b != nullptr ? b + row : nullptr,
                               y + from)) {
            return false;
          }
        }
        column += heads_in_run * d;
      }
      return true;
    };
    if (m == 1 ? OneRowBlocks(width, c, columns) : columns(0, width)) {
      return out;
    }
  }
  std::vector<at::Tensor> parts;
  for (const auto &[first, count] : runs) {
    parts.push_back(Linear(
        x, weight.Rows(first * d, count * d),
        bias.defined() ? bias.narrow(0, first * d, count * d) : at::Tensor()));
  }
  return parts.size() == 1 ? parts[0] : at::cat(parts, 1);
}

// a [A, F * D] (the full heads' attention) through their columns of
// o_weight [C, H * D]: a sum of one product per run of consecutive heads,
// each reading its columns in place.
at::Tensor FullHeadOutputs(const at::Tensor &a, const LinearWeight &weight,
                           const std::vector<int64_t> &heads, int64_t d) {
  const std::vector<std::pair<int64_t, int64_t>> runs = Runs(heads);
  const int64_t m = a.size(0), out_cols = weight.size(0);
  // From pointers where each run's columns of `a` are contiguous rows: one
  // row (a batch-1 step: every run in one parallel region, each task's
  // output rows summed over the runs), or one run.
  if ((m == 1 || runs.size() == 1) && PlainRows(a)) {
    at::Tensor y = at::empty({m, out_cols}, a.options());
    float *sum = y.data_ptr<float>();
    // Output rows [row0, row0 + rows) of the one row: the first run's
    // product written there, each later run's added to it.
    auto sum_runs = [&](int64_t row0, int64_t rows) {
      std::vector<float> part(rows);
      int64_t column = 0;
      for (size_t r = 0; r < runs.size(); ++r) {
        const auto &[first, count] = runs[r];
        float *into = r == 0 ? sum + row0 : part.data();
        if (!LinearBlockInto(a.data_ptr<float>() + column, 1, count * d, weight,
                             row0, rows, first * d, nullptr, into)) {
          return false;
        }
        if (r > 0) {
          for (int64_t j = 0; j < rows; ++j) sum[row0 + j] += part[j];
        }
        column += count * d;
      }
      return true;
    };
    if (runs.size() == 1) {
      if (LinearBlockInto(a.data_ptr<float>(), m, runs[0].second * d, weight, 0,
                          out_cols, runs[0].first * d, nullptr, sum)) {
        return y;
      }
    } else if (OneRowBlocks(out_cols, static_cast<int64_t>(heads.size()) * d,
                            sum_runs)) {
      return y;
    }
  }
  at::Tensor y;
  int64_t column = 0;
  for (const auto &[first, count] : runs) {
    at::Tensor part = Linear(a.narrow(1, column, count * d),
                             weight.Columns(first * d, count * d));
    column += count * d;
    y = y.defined() ? y.add_(part) : part;
  }
  return y;
}

// Whether IndexedLinear can read `t`'s rows in place (float32 on the CPU,
// each row contiguous).
bool RowsInPlace(const at::Tensor &t) {
  return CpuFloat(t) && t.dim() == 2 && t.stride(1) == 1;
}

// Head h's queries over its tokens (`count` rows of x, `tokens`) into q
// [count, D] (contiguous, at `q`): x's rows gathered while the product packs
// them, from pointers (no ATen view per head), where possible.
void HeadQueries(const HeadSparseAttentionInputs &in, int64_t h, int64_t d,
                 const int64_t *tokens, int64_t count, float *q) {
  const int64_t c = in.x.size(1);
  const bool bias_in_place =
      !in.q_bias.defined() ||
      (in.q_bias.is_contiguous() && in.q_bias.scalar_type() == at::kFloat);
  auto add_bias = [&] {
    if (!in.q_bias.defined()) return;
    const float *bias = in.q_bias.data_ptr<float>() + h * d;
    for (int64_t i = 0; i < count; ++i) {
      for (int64_t j = 0; j < d; ++j) q[i * d + j] += bias[j];
    }
  };
  const at::Tensor &w = in.q_weight.values;
  if (RowsInPlace(in.x) && !in.q_weight.quantized() && RowsInPlace(w) &&
      bias_in_place &&
      IndexedLinear({in.x.data_ptr<float>(), in.x.stride(0), tokens}, count, c,
                    w.data_ptr<float>() + h * d * w.stride(0), w.stride(0), d,
                    {q, d})) {
    add_bias();
    return;
  }
  // A bfloat16 or int8 q_proj (DeviceOptions::weights): the head's d rows
  // widened into a buffer (d * C floats, L2-sized), then the same gathered
  // product.
  if (RowsInPlace(in.x) && bias_in_place) {
    std::vector<float> wide(static_cast<size_t>(d * c));
    if (WidenWeightRows(in.q_weight, h * d, d, wide.data()) &&
        IndexedLinear({in.x.data_ptr<float>(), in.x.stride(0), tokens}, count,
                      c, wide.data(), c, d, {q, d})) {
      add_bias();
      return;
    }
  }
  const at::TensorOptions longs = at::TensorOptions().dtype(at::kLong);
  at::Tensor x = in.x.index_select(
      0, at::from_blob(const_cast<int64_t *>(tokens), {count}, longs));
  at::Tensor out = at::from_blob(q, {count, d}, in.x.options());
  LinearInto(x, in.q_weight.Rows(h * d, d),
             in.q_bias.defined() ? in.q_bias.narrow(0, h * d, d) : at::Tensor(),
             out);
}

// Rotates `count` query vectors in place, the i-th (at q + i * ld, `heads`
// heads of d) at the position of token tokens[i] (or i when null), with
// in's tables; false (nothing done) when `in` has none or its positions
// are not plain int64.
bool RotateQueriesInPlace(const HeadSparseAttentionInputs &in, float *q,
                          int64_t ld, int64_t count, int64_t heads, int64_t d,
                          const int64_t *tokens) {
  const at::Tensor &pos = in.token_pos;
  if (!in.rope_cos.defined() || !in.rope_sin.defined() || !pos.is_cpu() ||
      pos.scalar_type() != at::kLong || !pos.is_contiguous()) {
    return false;
  }
  const int64_t *where = pos.data_ptr<int64_t>();
  const float *cos = in.rope_cos.data_ptr<float>();
  const float *sin = in.rope_sin.data_ptr<float>();
  for (int64_t i = 0; i < count; ++i) {
    const int64_t p = where[tokens == nullptr ? i : tokens[i]];
    for (int64_t h = 0; h < heads; ++h) {
      RotateInPlace(q + i * ld + h * d, cos + p * d, sin + p * d, d);
    }
  }
  return true;
}

// The layer's output before any product: zeros [N, C].
at::Tensor ZeroOutput(const HeadSparseAttentionInputs &in) {
  return at::zeros({in.x.size(0), in.o_weight.size(0)}, in.x.options());
}

// Which heads each token selected, as the steps below share it.
struct Routing {
  std::vector<std::vector<int64_t>> head_tokens;  // the tokens of each head
  std::vector<int64_t> active;  // tokens that selected any head
  // Heads every active token selected, and the others some token selected.
  std::vector<int64_t> full, routed;
  at::Tensor active_index;  // [A] int64 over `active`
  bool all_active = false;  // every token is active
};

Routing RouteHeads(const float *gate, int64_t n, int64_t heads) {
  Routing routing;
  routing.head_tokens.resize(heads);
  for (int64_t t = 0; t < n; ++t) {
    bool any = false;
    for (int64_t h = 0; h < heads; ++h) {
      if (gate[t * heads + h] != 0.0f) {
        routing.head_tokens[h].push_back(t);
        any = true;
      }
    }
    if (any) routing.active.push_back(t);
  }
  for (int64_t h = 0; h < heads; ++h) {
    if (routing.head_tokens[h].empty()) continue;
    (routing.head_tokens[h].size() == routing.active.size() ? routing.full
                                                            : routing.routed)
        .push_back(h);
  }
  const int64_t num_active = static_cast<int64_t>(routing.active.size());
  routing.all_active = num_active == n;
  if (routing.active.empty()) return routing;
  routing.active_index = at::from_blob(routing.active.data(), {num_active},
                                       at::TensorOptions().dtype(at::kLong));
  return routing;
}

// The full heads' queries: one product over the active tokens, rotated,
// [A, F * D] contiguous (undefined without full heads); their rows of it in
// rows_of.
at::Tensor FullQueries(const HeadSparseAttentionInputs &in,
                       const Routing &routing, int64_t d,
                       std::vector<HeadRows> &rows_of) {
  if (routing.full.empty()) return {};
  const int64_t heads = static_cast<int64_t>(rows_of.size());
  const int64_t num_active = static_cast<int64_t>(routing.active.size());
  const int64_t f = static_cast<int64_t>(routing.full.size());
  at::Tensor q_full;
  bool rotated = false;
  if (in.q_full.defined()) {
    const at::Tensor full_index =
        at::from_blob(const_cast<int64_t *>(routing.full.data()), {f},
                      at::TensorOptions().dtype(at::kLong));
    at::Tensor q =
        f == heads ? in.q_full : in.q_full.index_select(1, full_index);
    q_full = routing.all_active ? q : q.index_select(0, routing.active_index);
  } else {
    at::Tensor x =
        routing.all_active ? in.x : in.x.index_select(0, routing.active_index);
    q_full = FullHeadQueries(x, in.q_weight, in.q_bias, routing.full, d);
    // A fresh [A, F * D] product: rotated where it lies.
    rotated = q_full.is_contiguous() &&
              RotateQueriesInPlace(
                  in, q_full.data_ptr<float>(), f * d, num_active, f, d,
                  routing.all_active ? nullptr : routing.active.data());
  }
  if (!rotated) {
    q_full = q_full.view({num_active, f, d});
    if (in.rotate) {
      const at::Tensor active_pos =
          routing.all_active
              ? in.token_pos
              : in.token_pos.index_select(0, routing.active_index);
      q_full = in.rotate(q_full, active_pos.unsqueeze(1).expand({-1, f}));
    }
    q_full = q_full.reshape({num_active, f * d}).contiguous();
  }
  for (int64_t i = 0; i < f; ++i) {
    rows_of[routing.full[i]] = {q_full.data_ptr<float>() + i * d, f * d,
                                routing.active.data(), num_active};
  }
  return q_full;
}

// The routed heads' queries, head after head, each over its own tokens.
struct RoutedPairs {
  std::vector<int64_t> pair_token;  // [P]: the token of each pair
  std::vector<int64_t> first_pair;  // [H]: head h's first pair
  at::Tensor pair_index;            // [P] int64 over pair_token
  at::Tensor queries;               // [P, D]
};

// The routed heads' queries, projected and rotated; their rows in rows_of.
RoutedPairs RoutedQueries(const HeadSparseAttentionInputs &in,
                          const Routing &routing, int64_t d,
                          std::vector<HeadRows> &rows_of) {
  const int64_t heads = static_cast<int64_t>(rows_of.size());
  RoutedPairs pairs;
  pairs.first_pair.assign(heads, 0);
  for (int64_t h : routing.routed) {
    pairs.first_pair[h] = static_cast<int64_t>(pairs.pair_token.size());
    pairs.pair_token.insert(pairs.pair_token.end(),
                            routing.head_tokens[h].begin(),
                            routing.head_tokens[h].end());
  }
  const int64_t num_pairs = static_cast<int64_t>(pairs.pair_token.size());
  pairs.pair_index = at::from_blob(pairs.pair_token.data(), {num_pairs},
                                   at::TensorOptions().dtype(at::kLong));
  pairs.queries = at::empty({num_pairs, d}, in.x.options());
  ParallelPull(static_cast<int64_t>(routing.routed.size()),
               num_pairs * d * in.x.size(1), [&](int64_t i) {
                 const int64_t h = routing.routed[i];
                 const int64_t first = pairs.first_pair[h];
                 const int64_t count =
                     static_cast<int64_t>(routing.head_tokens[h].size());
                 if (in.q_full.defined()) {
                   at::Tensor tokens = pairs.pair_index.narrow(0, first, count);
                   pairs.queries.narrow(0, first, count)
                       .copy_(in.q_full.select(1, h).index_select(0, tokens));
                   return;
                 }
                 HeadQueries(in, h, d, pairs.pair_token.data() + first, count,
                             pairs.queries.data_ptr<float>() + first * d);
               });
  if (in.rotate && num_pairs > 0 &&
      !RotateQueriesInPlace(in, pairs.queries.data_ptr<float>(), d, num_pairs,
                            1, d, pairs.pair_token.data())) {
    pairs.queries.copy_(in.rotate(
        pairs.queries, in.token_pos.index_select(0, pairs.pair_index)));
  }
  for (int64_t h : routing.routed) {
    rows_of[h] = {pairs.queries.data_ptr<float>() + pairs.first_pair[h] * d, d,
                  pairs.pair_token.data() + pairs.first_pair[h],
                  static_cast<int64_t>(routing.head_tokens[h].size())};
  }
  return pairs;
}

// Routed heads' output projections added into `out`: each thread owns a
// block of output columns, so their scatter-adds never overlap.
void AddRoutedOutputs(const HeadSparseAttentionInputs &in,
                      const Routing &routing, const RoutedPairs &pairs,
                      at::Tensor &out) {
  const at::Tensor &q_routed = pairs.queries;
  const std::vector<int64_t> &first_pair = pairs.first_pair;
  const int64_t d = in.key_cache.size(3);
  const int64_t num_pairs = q_routed.size(0);
  const int64_t out_cols = in.o_weight.size(0);
  // Blocks of 64 columns (read by IndexedLinear without packing): one
  // block of `out` for every token stays in L2 while every head adds to it.
  const int64_t width = 64;
  const int64_t blocks = (out_cols + width - 1) / width;
  const at::Tensor &ow = in.o_weight.values;
  // A bfloat16 or int8 o_proj (DeviceOptions::weights): each block's rows
  // widened into a buffer (width * H * D floats) read as the float32 one.
  const bool widened = WidenableWeight(in.o_weight);
  const bool in_place =
      RowsInPlace(out) &&
      (widened || (!in.o_weight.quantized() && RowsInPlace(ow)));
  const float *queries = q_routed.data_ptr<float>();
  float *outputs = in_place ? out.data_ptr<float>() : nullptr;
  ParallelPull(blocks, num_pairs * d * out_cols, [&](int64_t block) {
    const int64_t c0 = block * width;
    const int64_t cols = std::min(width, out_cols - c0);
    if (cols <= 0) return;
    std::vector<float> wide;
    const float *o_weight = nullptr;  // row c0 of o_proj in float32
    int64_t ldo = ow.stride(0);
    if (in_place && widened) {
      ldo = ow.size(1);
      wide.resize(static_cast<size_t>(cols * ldo));
      WidenWeightRows(in.o_weight, c0, cols, wide.data());
      o_weight = wide.data();
    } else if (in_place) {
      o_weight = ow.data_ptr<float>() + c0 * ldo;
    }
    for (int64_t h : routing.routed) {
      const int64_t count = static_cast<int64_t>(routing.head_tokens[h].size());
      // Added straight into the tokens' rows of `out`, where possible.
      if (in_place && IndexedLinear({queries + first_pair[h] * d, d}, count, d,
                                    o_weight + h * d, ldo, cols,
                                    {outputs + c0, out.stride(0),
                                     pairs.pair_token.data() + first_pair[h],
                                     /*accumulate=*/true})) {
        continue;
      }
      out.narrow(1, c0, cols)
          .index_add_(0, pairs.pair_index.narrow(0, first_pair[h], count),
                      Linear(q_routed.narrow(0, first_pair[h], count),
                             in.o_weight.Rows(c0, cols).Columns(h * d, d)));
    }
  });
}

// The layer's output [N, C], zeros only where not every token's full-head
// product writes it whole: the full heads' projection (one product), the
// routed heads' added into it, plus o_bias.
at::Tensor ProjectOutputs(const HeadSparseAttentionInputs &in,
                          const Routing &routing, const at::Tensor &q_full,
                          const RoutedPairs &pairs, int64_t d) {
  at::Tensor out;
  if (!routing.full.empty()) {
    at::Tensor y = FullHeadOutputs(q_full, in.o_weight, routing.full, d);
    if (routing.all_active) {
      out = y;
    } else {
      out = ZeroOutput(in);
      out.index_add_(0, routing.active_index, y);
    }
  } else {
    out = ZeroOutput(in);
  }
  if (!pairs.pair_token.empty()) AddRoutedOutputs(in, routing, pairs, out);
  if (in.o_bias.defined()) out += in.o_bias;
  return out;
}

}  // namespace

at::Tensor HeadSparseAttentionCpu(const HeadSparseAttentionInputs &in) {
  const int64_t n = in.x.size(0);
  const int64_t heads = in.gates.size(1);
  const int64_t d = in.key_cache.size(3);
  TORCH_CHECK(in.key_cache.stride(3) == 1 && in.value_cache.stride(3) == 1,
              "key/value cache: the head dimension must be contiguous");
  const at::Tensor gates = AsType(in.gates, at::kFloat).contiguous();
  const float *gate = gates.data_ptr<float>();
  const Routing routing = RouteHeads(gate, n, heads);
  if (routing.active.empty()) {
    at::Tensor out = ZeroOutput(in);
    if (in.o_bias.defined()) out += in.o_bias;
    return out;
  }
  std::vector<HeadRows> rows_of(heads);
  const at::Tensor q_full = FullQueries(in, routing, d, rows_of);
  const RoutedPairs pairs = RoutedQueries(in, routing, d, rows_of);
  // Attention times the gates, written over each head's queries in place.
  head_sparse_internal::PagedAttentionCpu(in, rows_of, gate);
  return ProjectOutputs(in, routing, q_full, pairs, d);
}

}  // namespace moh
