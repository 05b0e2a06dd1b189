#include "model/core/llama_model.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <c10/core/InferenceMode.h>
#include <torch/version.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "base/status_macros.h"
#include "model/core/best_logits.h"
#include "model/core/dense_attention.h"
#include "model/core/fused_layer_ops.h"
#include "model/core/head_sparse_attention.h"
#include "model/core/linear.h"
#include "model/core/llama_model_step.h"
#include "model/core/paged_decode_attention.h"
#include "model/core/rope.h"
#include "model/kernels/cpu_softmax.h"

namespace moh {
namespace {

at::Tensor RotateHalf(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

// The small per-token operations of a layer run as plain loops on CpuFloat
// tensors: as ATen ops they are several dispatches, allocations and passes
// each, which at decode (a few tokens per step) cost more than the
// arithmetic. Rows of `width` floats per task of those loops (RoPE, RMSNorm):
// below 2^16 floats a loop runs on one thread, since waking the pool costs
// microseconds.
int64_t RowsPerTask(int64_t width) {
  constexpr int64_t kMinParallelFloats = 1 << 16;
  return std::max<int64_t>(1, kMinParallelFloats / std::max<int64_t>(width, 1));
}

// RoPE of x [n, D] (contiguous) at positions [n / repeat] (int64,
// contiguous), each shared by `repeat` consecutive vectors, with tables
// [P, D]: x * cos + RotateHalf(x) * sin, in the same order of operations,
// rows split on the intra-op pool when there are many.
at::Tensor RotateLoop(const at::Tensor& x, const at::Tensor& positions,
                      int64_t repeat, const at::Tensor& cos,
                      const at::Tensor& sin) {
  const int64_t n = x.size(0), d = x.size(1);
  at::Tensor out = at::empty({n, d}, x.options());
  const float* in = x.data_ptr<float>();
  const int64_t* where = positions.data_ptr<int64_t>();
  const float* cos_table = cos.data_ptr<float>();
  const float* sin_table = sin.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, n, RowsPerTask(d), [&](int64_t begin, int64_t end) {
    std::copy(in + begin * d, in + end * d, o + begin * d);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t pos = where[i / repeat];
      RotateInPlace(o + i * d, cos_table + pos * d, sin_table + pos * d, d);
    }
  });
  return out;
}

// Sum of squares of x[0, c): 16 partial sums, so that the adds do not wait
// on each other (one running sum is a chain of c dependent adds, which made
// a 2048-token prefill's norms take as long as a projection).
float SumOfSquares(const float* x, int64_t c) {
  constexpr int64_t kLanes = 16;
  float partial[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= c; j += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) partial[l] += x[j + l] * x[j + l];
  }
  for (; j < c; ++j) partial[0] += x[j] * x[j];
  float sum = 0.0f;
  for (float p : partial) sum += p;
  return sum;
}

// RMSNorm of x [n, C] (contiguous) with weight [C], rows split on the
// intra-op pool when there are many; with `residual` (x's shape,
// contiguous), x += residual first, in place, row by row (one pass: the
// residual stream's add and the next norm).
at::Tensor RmsNormLoop(const at::Tensor& x, const at::Tensor& weight,
                       double eps, const at::Tensor& residual = {}) {
  const int64_t n = x.size(0), c = x.size(1);
  at::Tensor out = at::empty({n, c}, x.options());
  float* in = x.data_ptr<float>();
  const float* add = residual.defined() ? residual.data_ptr<float>() : nullptr;
  const float* w = weight.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(
      0, n, RowsPerTask(c), [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          float* xi = in + i * c;
          float* oi = o + i * c;
          if (add != nullptr) {
            for (int64_t j = 0; j < c; ++j) xi[j] += add[i * c + j];
          }
          const float scale =
              1.0f / std::sqrt(SumOfSquares(xi, c) / static_cast<float>(c) +
                               static_cast<float>(eps));
          for (int64_t j = 0; j < c; ++j) oi[j] = w[j] * (xi[j] * scale);
        }
      });
  return out;
}

// Ragged values [N, ...] at their places in a padded [B, T, ...] tensor
// (`flat`: each one's index in [B * T]); zeros at padding.
at::Tensor Padded(const at::Tensor& ragged, const at::Tensor& flat,
                  int64_t rows, int64_t width) {
  std::vector<int64_t> shape = ragged.sizes().vec();
  shape[0] = rows * width;
  at::Tensor padded =
      at::zeros(shape, ragged.options()).index_copy_(0, flat, ragged);
  shape[0] = width;
  shape.insert(shape.begin(), rows);
  return padded.view(shape);
}

// The step's narrow rows over one layer's caches, of whose KV heads
// attention reads the first `kv_read` (all of a narrow row's when more).
NarrowRows LayerNarrow(const NarrowRows& step_rows, const at::Tensor& keys,
                       const at::Tensor& values, int64_t kv_read) {
  NarrowRows narrow = step_rows;
  if (narrow.any()) {
    const int64_t read = std::min(kv_read, narrow.kv_heads);
    narrow.key_cache = NarrowView(keys, narrow.kv_heads).narrow(2, 0, read);
    narrow.value_cache = NarrowView(values, narrow.kv_heads).narrow(2, 0, read);
  }
  return narrow;
}

}  // namespace

int64_t GraphKvLen(int64_t kv_len) {
  int64_t step = 64;
  while (step * 16 < kv_len) step *= 2;
  return (kv_len + step - 1) / step * step;
}

LlamaModel::StepIndices::StepIndices(const DecoderBatch& batch,
                                     const MohConfig& moh, int64_t block_size,
                                     int64_t fold, int64_t num_layers,
                                     int64_t n, int64_t tail, bool graph)
    : tokens(n) {
  const int64_t rows = batch.token_ids.size(0);
  const int64_t width = batch.token_ids.size(1);
  const bool paged = !batch.block_tables.empty();
  for (int64_t b = 0; b < rows; ++b) {
    kv_len = std::max<int64_t>(kv_len,
                               batch.start_positions[b] + batch.num_tokens[b]);
    if (!batch.narrow.empty() && batch.narrow[b]) {
      is_narrow.resize(rows, 0);
      is_narrow[b] = 1;
      ++narrow_rows;
      narrow_tokens += batch.num_tokens[b];
    }
  }
  for (const std::vector<int32_t>& table : batch.block_tables) {
    table_width = std::max<int64_t>(table_width, table.size());
  }
  // A narrow row's table is shorter than its positions over block_size:
  // the gathering attention paths read every row through the wide view
  // first (kv_cache.h GatherRows), so every row gets enough entries.
  if (graph) {
    kv_len =
        paged ? GraphKvLen(kv_len) : std::min(GraphKvLen(kv_len), block_size);
  }
  if (paged && (narrow_rows > 0 || graph)) {
    table_width = std::max(table_width, (kv_len + block_size - 1) / block_size);
  }
  const int64_t narrow_size =
      narrow_rows > 0 ? narrow_rows + n : 0;  // [Bn] + [Nn] + [Nw]
  host.resize(rows * width + rows + rows * table_width + 5 * n +
              num_layers * n + rows * tail + narrow_size);
  int64_t* positions_host = host.data();
  int64_t* row_len_host = positions_host + rows * width;
  int64_t* table_host = row_len_host + rows;
  int64_t* token_row_host = table_host + rows * table_width;
  int64_t* token_pos_host = token_row_host + n;
  int64_t* token_flat_host = token_pos_host + n;
  int64_t* token_block_host = token_flat_host + n;
  int64_t* token_offset_host = token_block_host + n;
  int64_t* top_k_host = token_offset_host + n;
  int64_t* out_host = top_k_host + num_layers * n;
  int64_t* narrow_row_host = out_host + rows * tail;
  int64_t* narrow_token_host = narrow_row_host + narrow_rows;
  int64_t* wide_token_host = narrow_token_host + narrow_tokens;
  int64_t token = 0;
  for (int64_t b = 0; b < rows; ++b) {
    const int64_t start = batch.start_positions[b];
    const int64_t count = batch.num_tokens[b];
    int64_t* table = table_host + b * table_width;
    if (paged) {
      const std::vector<int32_t>& blocks = batch.block_tables[b];
      // Unused entries repeat block 0 of the row: never read.
      std::fill(table, table + table_width, blocks[0]);
      std::copy(blocks.begin(), blocks.end(), table);
    } else {
      table[0] = batch.slots[b];
    }
    for (int64_t t = 0; t < width; ++t) {
      // Padding positions repeat the last valid one: in range, never read.
      positions_host[b * width + t] = start + std::min(t, count - 1);
    }
    const bool narrow = !is_narrow.empty() && is_narrow[b] != 0;
    if (narrow) *narrow_row_host++ = b;
    // A narrow row's block holds fold times as many of its positions.
    const int64_t span = narrow ? block_size * fold : block_size;
    const int64_t first = token;
    for (int64_t t = 0; t < count; ++t, ++token) {
      token_row_host[token] = b;
      token_pos_host[token] = start + t;
      token_flat_host[token] = b * width + t;
      token_block_host[token] = table[(start + t) / span];
      token_offset_host[token] = (start + t) % span;
      if (narrow_rows > 0) {
        *(narrow ? narrow_token_host : wide_token_host)++ = token;
      }
    }
    for (int64_t i = 0; i < tail; ++i) {
      // The last `tail` tokens; a shorter row repeats its first in front.
      out_host[b * tail + i] = first + std::max<int64_t>(count - tail + i, 0);
    }
    row_len_host[b] = start + count;
  }
  const std::vector<LayerTopK> from_ratios =
      batch.top_k.empty() ? TopKForRatios(moh, batch.ratios)
                          : std::vector<LayerTopK>();
  const std::vector<LayerTopK>& row_top_k =
      batch.top_k.empty() ? from_ratios : batch.top_k;
  std::vector<int64_t> layer_top_k(rows);
  for (int64_t l = 0; l < num_layers; ++l) {
    const TopKBounds bounds =
        PackLayerTopK(row_top_k, l, 1, layer_top_k.data());
    max_top_k.push_back(bounds.max);
    min_top_k.push_back(bounds.min);
    for (int64_t i = 0; i < n; ++i) {
      top_k_host[l * n + i] = layer_top_k[token_row_host[i]];
    }
  }
}

absl::StatusOr<DecoderOutput> LlamaModel::Forward(const DecoderBatch& batch,
                                                  KvCache& cache) const {
  MOH_RETURN_IF_ERROR(Validate(batch, cache));
  // No autograd: every op skips its autograd and view-tracking layers.
  const c10::InferenceMode inference;
  return CatchTorchErrors("LlamaModel::Forward",
                          [&]() { return ForwardUnchecked(batch, cache); });
}

at::Tensor LlamaModel::AddRmsNorm(at::Tensor& h, const at::Tensor& residual,
                                  const at::Tensor& weight) const {
  if (CpuFloat(h) && CpuFloat(residual) && CpuFloat(weight) && h.dim() == 2 &&
      h.is_contiguous() && residual.is_contiguous() &&
      residual.sizes() == h.sizes() && weight.is_contiguous()) {
    return RmsNormLoop(h, weight, config_.rms_norm_eps, residual);
  }
  if (cuda_fused_ops_) {
    at::Tensor out = FusedAddRmsNorm(h, residual, weight, config_.rms_norm_eps);
    if (out.defined()) return out;
  }
  h.add_(residual);
  return RmsNorm(h, weight);
}

at::Tensor LlamaModel::RmsNorm(const at::Tensor& x,
                               const at::Tensor& weight) const {
  if (CpuFloat(x) && CpuFloat(weight) && x.dim() == 2 && x.is_contiguous() &&
      weight.is_contiguous()) {
    return RmsNormLoop(x, weight, config_.rms_norm_eps);  // no views
  }
  if (CpuFloat(x) && CpuFloat(weight)) {
    const int64_t c = x.size(-1);
    return RmsNormLoop(x.reshape({-1, c}).contiguous(), weight.contiguous(),
                       config_.rms_norm_eps)
        .view(x.sizes());
  }
#if TORCH_VERSION_MAJOR > 2 || \
    (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 8)
  // One fused kernel on CUDA instead of eight: it scales in float32 and
  // rounds once, where the official code rounds x * rsqrt to the model's
  // dtype before the weight (a last-bit difference in bfloat16).
  if (x.is_cuda() && weight.scalar_type() == x.scalar_type()) {
    return at::rms_norm(x, {x.size(-1)}, weight, config_.rms_norm_eps);
  }
#endif
  at::Tensor h = x.to(at::kFloat);
  at::Tensor variance = h.pow(2).mean(-1, /*keepdim=*/true);
  h = h * at::rsqrt(variance + config_.rms_norm_eps);
  return weight * h.to(x.scalar_type());
}

absl::StatusOr<DecoderOutput> LlamaModel::ForwardUnchecked(
    const DecoderBatch& batch, KvCache& cache) const {
  // A step recorded as a graph runs with its rows bucketed (GraphRows);
  // the copies it is padded with leave it eligible.
  const int64_t rows = batch.token_ids.size(0);
  const bool graph = GraphEligible(batch);
  const bool bucketed =
      graph || (graph_rows_everywhere_ && OneTokenRows(batch));
  if (bucketed && GraphRows(rows) > rows) {
    absl::StatusOr<DecoderOutput> out =
        ForwardRows(PadRows(batch, GraphRows(rows)), cache, graph);
    if (!out.ok()) return out;
    return FirstRows(*std::move(out), rows);
  }
  return ForwardRows(batch, cache, graph);
}

absl::StatusOr<DecoderOutput> LlamaModel::ForwardRows(const DecoderBatch& batch,
                                                      KvCache& cache,
                                                      bool graph) const {
  // The model's device and stream (CUDA) for everything below, one step at
  // a time on CUDA.
  const std::unique_lock<std::mutex> lock = LockDevice();
  const std::unique_ptr<DeviceContext::Scope> scope = context_->Enter();
  const int64_t rows = batch.token_ids.size(0);
  const int64_t num_layers = static_cast<int64_t>(layers_.size());
  // The step runs ragged: the valid tokens of every row one after another
  // ([N, C]), never padding (a decode row beside a prompt chunk costs one
  // token, not the chunk's width). Only dense attention and the outputs
  // see rows again.
  int64_t n = 0;
  for (int64_t b = 0; b < rows; ++b) n += batch.num_tokens[b];
  const int64_t tail = batch.all_logits ? 0 : std::max(batch.logits_tail, 1);
  // The host's phases of a step are named for LibTorch's profiler (user
  // scopes "moh::...", a flag test when none runs): bench/trace_summary.py
  // sets the device's idle time against them.
  const StepIndices indices = [&] {
    RECORD_USER_SCOPE("moh::step_indices");
    return StepIndices(batch, config_.moh, cache.block_size(), narrow_fold(),
                       num_layers, n, tail, graph);
  }();
  std::optional<std::vector<at::Tensor>> results;
  {
    // On CUDA the step's launches (a graph's replay), on the CPU its work.
    RECORD_USER_SCOPE("moh::layers");
    if (graph) results = RunGraph(batch, indices, cache);
    if (!results) {
      // On CPU the step's index tensors alias `indices.host`, which outlives
      // them.
      const std::vector<int64_t>& host = indices.host;
      results = RunLayers(batch, indices,
                          context_->Upload(at::from_blob(
                              const_cast<int64_t*>(host.data()),
                              {static_cast<int64_t>(host.size())}, at::kLong)),
                          context_->Upload(batch.token_ids), cache);
    }
  }
  const bool top = batch.top_logits > 0 && !batch.all_logits;
  const bool stats = top && !batch.row_reductions.empty();
  DecoderOutput out;
  if (top) {
    RECORD_USER_SCOPE("moh::reduce_logits");
    // The best logits, the rows' stats and the rows wanted whole, in place
    // of every row.
    const at::Tensor logits = (*results)[0];
    out.resident_logits = logits;
    ReducedLogits reduced = ReduceLogits(
        logits, batch.top_logits_limit, batch.top_logits,
        stats ? context_->Upload(RowReductionParams(batch.row_reductions))
              : at::Tensor());
    if (stats) results->push_back(reduced.stats);
    std::vector<int64_t> whole;
    for (size_t b = 0; b < batch.whole_logits.size(); ++b) {
      if (batch.whole_logits[b]) whole.push_back(static_cast<int64_t>(b));
    }
    if (whole.size() != static_cast<size_t>(rows)) {
      (*results)[0] = logits.index_select(
          0, context_->Upload(at::tensor(whole, at::kLong)));
    }
    results->push_back(reduced.values);
    results->push_back(reduced.ids);
  }
  {
    // One copy to the host and one wait for the whole step's results.
    RECORD_USER_SCOPE("moh::download");
    results = context_->Download(*results);
  }
  if (top) {
    out.top_ids = results->back();
    results->pop_back();
    out.top_values = results->back();
    results->pop_back();
    if (stats) {
      out.row_stats = results->back();
      results->pop_back();
    }
  }
  out.logits = (*results)[0];
  out.head_token_counts = (*results)[1];
  out.gates.assign(results->begin() + 2, results->end());
  return out;
}

std::vector<at::Tensor> LlamaModel::RunLayers(const DecoderBatch& batch,
                                              const StepIndices& indices,
                                              const at::Tensor& ints,
                                              const at::Tensor& token_ids,
                                              KvCache& cache) const {
  const int64_t rows = batch.token_ids.size(0);
  const int64_t width = batch.token_ids.size(1);
  const int64_t num_layers = static_cast<int64_t>(layers_.size());
  const int64_t tail = batch.all_logits ? 0 : std::max(batch.logits_tail, 1);
  const int64_t n = indices.tokens;
  const int64_t table_width = indices.table_width;
  int64_t offset = 0;
  auto next = [&](std::vector<int64_t> shape) {
    int64_t size = 1;
    for (int64_t dim : shape) size *= dim;
    at::Tensor part = ints.narrow(0, offset, size).view(shape);
    offset += size;
    return part;
  };
  Step step{batch, rows, width};
  step.positions = next({rows, width});
  step.row_len = next({rows});
  step.block_table = next({rows, table_width});
  step.token_row = next({n});
  step.token_pos = next({n});
  step.token_flat = next({n});
  step.token_block = next({n});
  step.token_offset = next({n});
  step.top_k = next({num_layers, n});
  step.max_top_k = indices.max_top_k;
  step.min_top_k = indices.min_top_k;
  step.kv_len = indices.kv_len;
  const at::Tensor out_tokens = next({rows * tail});
  if (indices.narrow_rows > 0) {
    step.narrow.kv_heads = narrow_kv_heads_;
    step.narrow.rows = next({indices.narrow_rows});
    step.narrow.is_narrow = indices.is_narrow;
    step.narrow_tokens = next({indices.narrow_tokens});
    step.wide_tokens = next({n - indices.narrow_tokens});
  }
  const at::Tensor ids =
      token_ids.reshape({-1}).index_select(0, step.token_flat);

  std::vector<at::Tensor> gates, gates_per_layer;
  gates.reserve(num_layers);
  // [N, C]; a bf16 or int8 embedding (tied to such linear weights) widened.
  at::Tensor h = EmbeddingRows(embed_tokens_, ids,
                               at::typeMetaToScalarType(options_.dtype()));
  // The residual stream h takes each block's output in place, in the same
  // pass as the norm that reads it next.
  at::Tensor x = num_layers > 0 ? RmsNorm(h, layers_[0].input_norm) : h;
  for (int64_t l = 0; l < num_layers; ++l) {
    const Layer& layer = layers_[l];
    gates.emplace_back();  // [N, H]
    x = AddRmsNorm(h, Attention(l, layer, x, step, cache, &gates.back()),
                   layer.post_norm);
    const at::Tensor mlp = MlpDown(x, layer);
    if (l + 1 < num_layers) {
      x = AddRmsNorm(h, mlp, layers_[l + 1].input_norm);
    } else {
      h.add_(mlp);
    }
    if (batch.record_gates) {
      gates_per_layer.push_back(
          Padded(gates.back().to(at::kFloat), step.token_flat, rows, width));
    }
  }
  at::Tensor logits;
  if (batch.all_logits) {
    logits = Padded(Linear(RmsNorm(h, final_norm_), lm_head_).to(at::kFloat),
                    step.token_flat, rows, width);
  } else {
    logits =
        Linear(RmsNorm(h.index_select(0, out_tokens), final_norm_), lm_head_)
            .to(at::kFloat);
    logits = batch.logits_tail > 0 ? logits.view({rows, tail, -1})
                                   : logits.view({rows, -1});
  }
  std::vector<at::Tensor> results = {logits, HeadCounts(gates, step, rows)};
  results.insert(results.end(), gates_per_layer.begin(), gates_per_layer.end());
  return results;
}

at::Tensor LlamaModel::Product(const at::Tensor& x, const LinearWeight& weight,
                               const at::Tensor& bias) const {
  if (cuda_skinny_linear_ && x.is_cuda() && !weight.quantized()) {
    at::Tensor out = FusedSkinnyLinear(x, weight.values, bias);
    if (out.defined()) return out;
  }
  return Linear(x, weight, bias);
}

at::Tensor LlamaModel::SwiGlu(const at::Tensor& both) const {
  const int64_t inter = both.size(-1) / 2;
  if (cuda_fused_ops_) {
    at::Tensor out = FusedSiluMul(both);
    if (out.defined()) return out;
  }
  if (CpuFloat(both) && both.dim() == 2 && both.is_contiguous()) {
    at::Tensor out = at::empty({both.size(0), inter}, both.options());
    if (SiluMulRows(both.data_ptr<float>(), 2 * inter, both.size(0), inter,
                    out.data_ptr<float>())) {
      return out;
    }
  }
  at::Tensor gate = both.narrow(-1, 0, inter);
  return at::silu_(gate).mul_(both.narrow(-1, inter, inter));
}

at::Tensor LlamaModel::Mlp(const at::Tensor& x, const Layer& layer) const {
  if (layer.gate_up_proj.defined()) {  // gate and up in one product
    return SwiGlu(Product(x, layer.gate_up_proj));  // of [N, 2I]
  }
  // In place on the gate's fresh product: two dispatches, no allocation
  // (ATen's silu is vectorized; a scalar loop's exp cost more than that).
  at::Tensor gate = Product(x, layer.gate_proj);
  return at::silu_(gate).mul_(Product(x, layer.up_proj));
}

at::Tensor LlamaModel::MlpDown(const at::Tensor& x, const Layer& layer) const {
  // A long step on CPU (a prefill of several prompts) runs the MLP over
  // chunks of rows: the intermediate [rows, 2 * I] of the whole step (90 MB
  // for 8,192 tokens of the bench model) is past glibc's largest mmap
  // threshold (32 MiB), so each layer mapped it afresh and faulted it in
  // page by page; a chunk's stays in the heap and in the cache. The chunk is
  // sized by that [rows, 2 * I] product alone (at most 16 MiB of float32,
  // and 1,024 rows); Mlp's SwiGLU output [rows, I] beside it makes the
  // chunk's working set 1.5 times that (at most 24 MiB). Each row's sums are
  // the same in any chunk.
  const int64_t width = 2 * layer.down_proj.size(1);  // gate and up: 2 * I
  const int64_t chunk = std::clamp<int64_t>(
      (int64_t{16} << 20) / (width * int64_t{sizeof(float)}), 128, 1024);
  const int64_t rows = x.dim() == 2 ? x.size(0) : 0;
  if (!x.is_cpu() || rows <= chunk || !x.is_contiguous()) {
    // SwiGLU inside the down projection (a fused op: with the chains, not).
    if (cuda_skinny_linear_ && cuda_fused_ops_ && x.is_cuda() &&
        layer.gate_up_proj.defined() && !layer.down_proj.quantized()) {
      const at::Tensor both = Product(x, layer.gate_up_proj);
      at::Tensor out = FusedSiluMulLinear(both, layer.down_proj.values);
      return out.defined() ? out : Product(SwiGlu(both), layer.down_proj);
    }
    return Product(Mlp(x, layer), layer.down_proj);
  }
  at::Tensor out = at::empty({rows, layer.down_proj.size(0)}, x.options());
  for (int64_t r = 0; r < rows; r += chunk) {
    const int64_t count = std::min(chunk, rows - r);
    at::Tensor part = out.narrow(0, r, count);
    LinearInto(Mlp(x.narrow(0, r, count), layer), layer.down_proj, {}, part);
  }
  return out;
}

at::Tensor LlamaModel::HeadCounts(const std::vector<at::Tensor>& gates,
                                  const Step& step, int64_t rows) const {
  const int64_t heads = config_.num_heads;
  const int64_t layers = static_cast<int64_t>(gates.size());
  const bool loops = std::all_of(gates.begin(), gates.end(),
                                 [](const at::Tensor& g) {
                                   return CpuFloat(g) && g.is_contiguous();
                                 }) &&
                     step.token_row.is_cpu() &&
                     step.token_row.scalar_type() == at::kLong &&
                     step.token_row.is_contiguous();
  if (loops) {
    at::Tensor counts = at::zeros({rows, layers, heads}, at::kLong);
    int64_t* c = counts.data_ptr<int64_t>();
    const int64_t* row = step.token_row.data_ptr<int64_t>();
    for (int64_t l = 0; l < layers; ++l) {
      const float* g = gates[l].data_ptr<float>();
      for (int64_t t = 0; t < gates[l].size(0); ++t) {
        int64_t* out = c + (row[t] * layers + l) * heads;
        for (int64_t h = 0; h < heads; ++h) {
          out[h] += g[t * heads + h] != 0.0f;
        }
      }
    }
    return counts;
  }
  // Every layer at once: a handful of kernels per step, not per layer.
  return at::zeros({layers, rows, heads}, step.token_row.options())
      .index_add_(1, step.token_row, (at::stack(gates) != 0).to(at::kLong))
      .permute({1, 0, 2})
      .contiguous();
}

at::Tensor LlamaModel::Rotate(const at::Tensor& x,
                              const at::Tensor& positions) const {
  // x [..., D] at positions [...] (one position per vector).
  if (CpuFloat(x) && CpuFloat(rope_cos_)) {
    const int64_t d = config_.head_dim;
    // Positions expanded over heads ([n, H], stride 0) are read once per
    // token instead of copied out H times.
    at::Tensor where = positions;
    int64_t repeat = 1;
    if (where.dim() == 2 && where.stride(1) == 0) {
      repeat = where.size(1);
      where = where.select(1, 0);
    }
    if (where.dim() != 1) where = where.reshape({-1});
    if (where.scalar_type() != at::kLong) where = where.to(at::kLong);
    return RotateLoop(x.reshape({-1, d}).contiguous(), where.contiguous(),
                      repeat, rope_cos_, rope_sin_)
        .view(x.sizes());
  }
  // The tables are in the model's dtype (as the official code rounds them).
  // Positions expanded over heads ([n, H], stride 0) gather one row per
  // token, which broadcasts over the heads.
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  at::Tensor where = positions;
  if (where.dim() == 2 && where.stride(1) == 0) {
    where = where.select(1, 0);
    shape.back() = 1;
  }
  shape.push_back(config_.head_dim);
  const at::Tensor flat = where.reshape({-1});
  const at::Tensor cos = rope_cos_.index_select(0, flat).view(shape);
  const at::Tensor sin = rope_sin_.index_select(0, flat).view(shape);
  return x * cos.to(x.scalar_type()) + RotateHalf(x) * sin.to(x.scalar_type());
}

at::Tensor LlamaModel::RotateTokens(const at::Tensor& x,
                                    const Step& step) const {
  if (CpuFloat(x) && CpuFloat(rope_cos_)) {
    return Rotate(x,
                  step.token_pos.unsqueeze(1).expand({x.size(0), x.size(1)}));
  }
  if (cuda_fused_ops_) {
    at::Tensor out = FusedRope(x, step.token_pos, rope_cos_, rope_sin_);
    if (out.defined()) return out;
  }
  if (!step.rope_cos.defined()) {  // [N, 1, D]: broadcast over the heads
    step.rope_cos = rope_cos_.index_select(0, step.token_pos)
                        .unsqueeze(1)
                        .to(x.scalar_type());
    step.rope_sin = rope_sin_.index_select(0, step.token_pos)
                        .unsqueeze(1)
                        .to(x.scalar_type());
  }
  return x * step.rope_cos + RotateHalf(x) * step.rope_sin;
}

at::Tensor LlamaModel::Attention(int64_t layer_index, const Layer& layer,
                                 const at::Tensor& x, const Step& step,
                                 KvCache& cache, at::Tensor* gates) const {
  const int64_t n = x.size(0);  // [N, C]: the step's tokens, ragged
  const int64_t heads = config_.num_heads;
  const int64_t d = config_.head_dim;
  const bool sparse = UseHeadSparse(attention_mode_, layer.router,
                                    step.min_top_k[layer_index], options_);
  // Dense attention with every row at K = 0 in this layer: only the shared
  // heads have gates, and when they fill whole KV groups only those groups
  // are read (on the 8B layout at ratio <= 0.5, half the KV bytes).
  const int64_t shared = SharedOnlyHeads(layer, step.max_top_k[layer_index]);
  if (!sparse && shared > 0) {
    return SharedHeadsAttention(layer_index, layer, x, step, cache, shared,
                                gates);
  }
  // The query-norm router reads every query; the learned one only x.
  // Queries, keys and values in one product where every row is wide.
  at::Tensor q, kv;
  if (!sparse || layer.router.kind() == RouterKind::kQueryNorm) {
    if (layer.kvq_proj.defined() && !step.narrow.any()) {
      const at::Tensor kvq = Product(x, layer.kvq_proj, layer.kvq_bias);
      const int64_t kv_width = kvq.size(1) - heads * d;
      kv = kvq.narrow(1, 0, kv_width);
      q = kvq.narrow(1, kv_width, heads * d);
    } else {
      q = Product(x, layer.q_proj, layer.q_bias);
    }
    q = q.view({n, heads, d});
  }
  at::Tensor rotated;
  if (sparse) {  // rotates the queries of the heads each row keeps
    *gates = RouterGates(layer, x, q, step.top_k[layer_index],
                         step.max_top_k[layer_index]);  // [N, H]
    WriteKeysValues(layer_index, layer, x, step, cache, kv);
  } else {
    rotated =
        PrepareAttention(layer_index, layer, x, q, kv, step, cache, gates);
  }
  at::Tensor& key_cache = cache.keys(layer_index);
  at::Tensor& value_cache = cache.values(layer_index);
  NarrowRows narrow =
      LayerNarrow(step.narrow, key_cache, value_cache, config_.num_kv_heads);

  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  if (sparse) {
    HeadSparseAttentionInputs in;
    in.x = x;
    in.gates = *gates;
    in.q_weight = layer.q_proj;
    in.q_bias = layer.q_bias;
    if (q.defined()) in.q_full = q;
    in.rotate = [this](const at::Tensor& queries, const at::Tensor& positions) {
      return Rotate(queries, positions);
    };
    if (CpuFloat(x) && CpuFloat(rope_cos_)) {
      in.rope_cos = rope_cos_;
      in.rope_sin = rope_sin_;
    }
    in.key_cache = key_cache;
    in.value_cache = value_cache;
    in.block_table = step.block_table;
    in.narrow = std::move(narrow);
    in.token_row = step.token_row;
    in.token_pos = step.token_pos;
    in.row_len = step.row_len;
    in.o_weight = layer.o_proj;
    in.o_bias = layer.o_bias;
    in.scale = scale;
    return HeadSparseAttention(
        in, attention_mode_ == AttentionMode::kHeadSparseAten);
  }

  // Dense attention reads rows: the queries go to their padded places
  // (padding queries are zeros at a valid position; their results are
  // dropped).
  const at::Tensor attn =
      DenseHeads(rotated, key_cache, value_cache, narrow, step, *gates);
  return Product(attn.reshape({n, heads * d}), layer.o_proj, layer.o_bias);
}

at::Tensor LlamaModel::PrepareAttention(int64_t layer_index, const Layer& layer,
                                        const at::Tensor& x,
                                        const at::Tensor& q,
                                        const at::Tensor& kv, const Step& step,
                                        KvCache& cache,
                                        at::Tensor* gates) const {
  const at::Tensor& top_k = step.top_k[layer_index];
  const int64_t max_top_k = step.max_top_k[layer_index];
  if (cuda_fused_ops_ && kv.defined() && q.is_cuda()) {
    const MohLayerConfig& moh = layer.router.layer();
    const bool route = !gates->defined() &&
                       layer.router.kind() == RouterKind::kQueryNorm &&
                       moh.routed_heads() > 0;
    if (!gates->defined() && !route) {
      *gates = RouterGates(layer, x, q, top_k, max_top_k);
    }
    const int64_t n = q.size(0), kv_heads = config_.num_kv_heads;
    const int64_t d = config_.head_dim;
    AttentionPrologueInputs in;
    in.queries = q;
    in.keys = kv.narrow(1, 0, kv_heads * d).view({n, kv_heads, d});
    in.values = kv.narrow(1, kv_heads * d, kv_heads * d).view({n, kv_heads, d});
    in.positions = step.token_pos;
    in.cos = rope_cos_;
    in.sin = rope_sin_;
    in.block = step.token_block;
    in.offset = step.token_offset;
    in.key_cache = cache.keys(layer_index);
    in.value_cache = cache.values(layer_index);
    if (route) {
      in.top_k = top_k;
      in.shared = moh.shared_heads;
      in.routed = moh.routed_heads();
    }
    AttentionPrologue out = FusedAttentionPrologue(in);
    if (out.rotated.defined()) {
      if (route) *gates = std::move(out.gates);
      return out.rotated;
    }
  }
  if (!gates->defined()) *gates = RouterGates(layer, x, q, top_k, max_top_k);
  WriteKeysValues(layer_index, layer, x, step, cache, kv);
  return RotateTokens(q, step);
}

at::Tensor LlamaModel::RouterGates(const Layer& layer, const at::Tensor& x,
                                   const at::Tensor& q, const at::Tensor& top_k,
                                   int64_t max_top_k) const {
  const MohLayerConfig& moh = layer.router.layer();
  if (cuda_fused_ops_ && layer.router.kind() == RouterKind::kQueryNorm &&
      q.defined() && moh.routed_heads() > 0) {
    at::Tensor gates =
        FusedQueryNormGates(q, top_k, moh.shared_heads, moh.routed_heads());
    if (gates.defined()) return gates;
  }
  return layer.router.Gates(x, q, top_k, max_top_k);
}

int64_t LlamaModel::SharedOnlyHeads(const Layer& layer,
                                    int64_t max_top_k) const {
  const MohLayerConfig& moh = layer.router.layer();
  const int64_t group = config_.num_heads / config_.num_kv_heads;
  if (max_top_k != 0 || layer.router.kind() == RouterKind::kDense ||
      moh.routed_heads() <= 0 || moh.shared_heads <= 0 ||
      moh.shared_heads % group != 0) {
    return 0;
  }
  return moh.shared_heads;
}

at::Tensor LlamaModel::SharedHeadsAttention(
    int64_t layer_index, const Layer& layer, const at::Tensor& x,
    const Step& step, KvCache& cache, int64_t shared, at::Tensor* gates) const {
  const int64_t n = x.size(0);
  const int64_t heads = config_.num_heads, d = config_.head_dim;
  const int64_t kv = shared / (heads / config_.num_kv_heads);  // KV read
  if (layer.router.kind() == RouterKind::kQueryNorm) {
    // Its gates at K = 0: 1 for the shared heads, 0 for the routed ones
    // (MohRouter::QueryNormGates), whatever the queries: made once a step.
    if (step.shared_gates_heads != shared) {
      step.shared_gates = at::zeros({n, heads}, x.options());
      step.shared_gates.narrow(1, 0, shared).fill_(1);
      step.shared_gates_heads = shared;
    }
    *gates = step.shared_gates;
  } else {
    *gates = layer.router.Gates(x, at::Tensor(), step.top_k[layer_index], 0);
  }
  // The keys and values with the shared heads' queries: one product where
  // every row is wide (kvq_proj's first rows).
  at::Tensor q, projected;
  const int64_t kv_width = 2 * config_.num_kv_heads * d;
  if (layer.kvq_proj.defined() && !step.narrow.any()) {
    const int64_t width = kv_width + shared * d;
    const at::Tensor kvq =
        Product(x, layer.kvq_proj.Rows(0, width),
                layer.kvq_bias.defined() ? layer.kvq_bias.narrow(0, 0, width)
                                         : at::Tensor());
    projected = kvq.narrow(1, 0, kv_width);
    q = kvq.narrow(1, kv_width, shared * d);
  } else {
    q = Product(x, layer.q_proj.Rows(0, shared * d),
                layer.q_bias.defined() ? layer.q_bias.narrow(0, 0, shared * d)
                                       : at::Tensor());
  }
  // Every KV head is still stored: a later step may read them.
  const at::Tensor rotated =
      PrepareAttention(layer_index, layer, x, q.view({n, shared, d}), projected,
                       step, cache, gates);
  const NarrowRows narrow = LayerNarrow(step.narrow, cache.keys(layer_index),
                                        cache.values(layer_index), kv);
  const at::Tensor attn =
      DenseHeads(rotated, cache.keys(layer_index).narrow(2, 0, kv),
                 cache.values(layer_index).narrow(2, 0, kv), narrow, step,
                 gates->narrow(1, 0, shared));
  // The routed heads' outputs are 0: only the shared heads' columns of W_o.
  return Product(attn.reshape({n, shared * d}),
                 layer.o_proj.Columns(0, shared * d), layer.o_bias);
}

at::Tensor LlamaModel::PagedDecodeRows(const at::Tensor& queries,
                                       const at::Tensor& key_cache,
                                       const at::Tensor& value_cache,
                                       const NarrowRows& narrow,
                                       const Step& step,
                                       const at::Tensor& gates) const {
  const double scale = 1.0 / std::sqrt(static_cast<double>(queries.size(2)));
  auto inputs = [&](const at::Tensor& q, const at::Tensor& keys,
                    const at::Tensor& values, const at::Tensor& rows,
                    int64_t heads) {
    auto pick = [&](const at::Tensor& t) {
      return rows.defined() ? t.index_select(0, rows) : t;
    };
    return PagedDecodeInputs{pick(q),
                             keys,
                             values,
                             pick(step.block_table),
                             pick(step.positions),
                             pick(step.row_len),
                             step.kv_len,
                             scale,
                             pick(gates).narrow(1, 0, heads)};
  };
  const int64_t heads = queries.size(1);
  if (!narrow.any()) {
    const PagedDecodeInputs all =
        inputs(queries, key_cache, value_cache, at::Tensor(), heads);
    return PagedDecodeServes(all) ? PagedDecode(all) : at::Tensor();
  }
  // Narrow rows read their blocks through the narrow view: its KV heads
  // keep the model's grouping, so its queries are the first read * G heads
  // (the shared ones); their other heads' outputs are 0 (gated out).
  const int64_t read = narrow.key_cache.size(2);
  const int64_t narrow_heads =
      read * (config_.num_heads / config_.num_kv_heads);
  if (narrow_heads > heads ||
      heads * config_.num_kv_heads != key_cache.size(2) * config_.num_heads) {
    return at::Tensor();
  }
  // A decode step's token t is row t: the narrow and wide tokens are rows.
  const bool all_narrow = step.wide_tokens.numel() == 0;
  const PagedDecodeInputs thin = inputs(
      queries.narrow(1, 0, narrow_heads), narrow.key_cache, narrow.value_cache,
      all_narrow ? at::Tensor() : narrow.rows, narrow_heads);
  if (!PagedDecodeServes(thin)) return at::Tensor();
  if (all_narrow && narrow_heads == heads) return PagedDecode(thin);
  at::Tensor out = at::zeros_like(queries);
  if (all_narrow) {
    out.narrow(1, 0, narrow_heads).copy_(PagedDecode(thin));
    return out;
  }
  const PagedDecodeInputs wide =
      inputs(queries, key_cache, value_cache, step.wide_tokens, heads);
  if (!PagedDecodeServes(wide)) return at::Tensor();
  out.index_copy_(0, step.wide_tokens, PagedDecode(wide));
  out.narrow(1, 0, narrow_heads).index_copy_(0, narrow.rows, PagedDecode(thin));
  return out;
}

at::Tensor LlamaModel::DenseHeads(const at::Tensor& rotated,
                                  const at::Tensor& key_cache,
                                  const at::Tensor& value_cache,
                                  const NarrowRows& narrow, const Step& step,
                                  const at::Tensor& gates) const {
  const int64_t n = rotated.size(0), heads = rotated.size(1);
  const int64_t d = rotated.size(2);
  const int64_t rows = step.rows, width = step.width;
  // Every row full (decode, a lone prompt): the ragged tokens are the
  // padded layout already.
  const bool full = n == rows * width;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  if (cuda_paged_decode_ && full && width == 1) {
    const at::Tensor out =
        PagedDecodeRows(rotated.view({rows, heads, d}), key_cache, value_cache,
                        narrow, step, gates);
    if (out.defined()) return out;  // gated
  }
  // Prompt chunks: the rows' keys packed, no padding, no mask.
  if (cuda_varlen_prefill_ && width > 1 && !narrow.any() &&
      VarlenAttentionServes(rotated, key_cache)) {
    if (!step.packed_keys.index.defined()) {
      const DecoderBatch& b = step.batch;
      step.packed_keys =
          ToDevice(PackKeyLayout(b.num_tokens, b.start_positions,
                                 b.block_tables, b.slots, key_cache.size(1)),
                   rotated.device());
    }
    return VarlenAttention(
               {rotated, key_cache, value_cache, step.packed_keys, scale})
        .mul_(gates.unsqueeze(-1));
  }
  DenseAttentionInputs dense;
  dense.queries = full ? rotated.view({rows, width, heads, d})
                       : Padded(rotated, step.token_flat, rows, width);
  dense.key_cache = key_cache;
  dense.value_cache = value_cache;
  dense.block_table = step.block_table;
  dense.narrow = narrow;
  dense.positions = step.positions;
  dense.row_len = step.row_len;
  dense.kv_len = step.kv_len;
  dense.scale = scale;
  dense.workspace_bytes = attention_workspace_bytes_;
  // The mask is the same in every layer: made once per step when one chunk
  // takes every query (else chunk by chunk, within the workspace bound).
  if (!step.visible.defined() &&
      DenseAttentionQueryChunk(rows, config_.num_heads, width, step.kv_len,
                               attention_workspace_bytes_) >= width) {
    step.visible = DenseVisible(step.positions, step.row_len, step.kv_len);
  }
  dense.visible = step.visible;
  at::Tensor attn = DenseAttention(dense).view({rows * width, heads, d});
  return (full ? attn : attn.index_select(0, step.token_flat))
      .mul_(gates.unsqueeze(-1));
}

}  // namespace moh
