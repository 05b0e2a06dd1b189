#include "model/core/moh_router.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "model/core/linear.h"

namespace moh {
namespace {

// One-hot mask [N, E] of the first top_k[n] entries of each row's top-k,
// i.e. of the top_k[n] largest scores of row n.
at::Tensor TopKMask(const at::Tensor& scores, const at::Tensor& top_k,
                    int64_t max_top_k) {
  at::Tensor mask = at::zeros_like(scores);
  if (max_top_k == 0) return mask;
  at::Tensor indices = std::get<1>(at::topk(scores, max_top_k, /*dim=*/1));
  at::Tensor rank = at::arange(max_top_k, top_k.options()).unsqueeze(0);
  at::Tensor keep = (rank < top_k.unsqueeze(1)).to(scores.scalar_type());
  return mask.scatter_(1, indices, keep);
}

// For float32 rows on CPU the learned router runs as plain loops
// (LearnedGatesLoop): as ATen ops it was a dozen small dispatches per layer,
// which at decode cost far more than their arithmetic (callgrind: 10% of a
// bench-model decode step) and at prefill ran one after another on one
// thread. Up to this many rows the loops also project each row; beyond,
// the logits come from one matrix product and the rows split on the pool.
constexpr int64_t kMaxLoopRows = 16;

// out[r] = W[r] . x for W [rows, c] (contiguous), accumulated in double in
// order of j. Four rows at a time: four independent chains of adds, where
// one row's chain waited on each add (1.8% of a batch-1 decode token of the
// bench model).
void Project(const at::Tensor& w, const float* x, int64_t c, float* out) {
  const float* rows = w.data_ptr<float>();
  const int64_t n = w.size(0);
  int64_t r = 0;
  for (; r + 4 <= n; r += 4) {
    const float* w0 = rows + r * c;
    double sum[4] = {};
    for (int64_t j = 0; j < c; ++j) {
      const double xj = x[j];
      for (int64_t i = 0; i < 4; ++i) sum[i] += double{w0[i * c + j]} * xj;
    }
    for (int64_t i = 0; i < 4; ++i) out[r + i] = static_cast<float>(sum[i]);
  }
  for (; r < n; ++r) {
    double sum = 0.0;
    for (int64_t j = 0; j < c; ++j) sum += double{rows[r * c + j]} * x[j];
    out[r] = static_cast<float>(sum);
  }
}

// Softmax of v[0, n) in place, times `scale`.
void Softmax(float* v, int64_t n, float scale) {
  const float max = *std::max_element(v, v + n);
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    v[i] = std::exp(v[i] - max);
    sum += v[i];
  }
  for (int64_t i = 0; i < n; ++i) v[i] = v[i] / sum * scale;
}

}  // namespace

absl::StatusOr<MohRouter> MohRouter::Load(RouterKind kind,
                                          const MohLayerConfig& layer,
                                          int64_t hidden_size,
                                          const std::string& prefix,
                                          TensorStore& store,
                                          const at::TensorOptions& options) {
  MohRouter router;
  router.kind_ = kind;
  router.layer_ = layer;
  if (kind != RouterKind::kLearned) return router;
  const int64_t shared = layer.shared_heads;
  const int64_t routed = layer.routed_heads();
  auto take = [&](const char* name, int64_t rows) {
    return store.Take(prefix + name, {rows, hidden_size}, options);
  };
  if (routed > 0) {
    MOH_ASSIGN_OR_RETURN(router.wg_, take("wg.weight", routed));
    if (shared > 0) {
      MOH_ASSIGN_OR_RETURN(router.wg_0_, take("wg_0.weight", 2));
    }
  }
  if (shared > 1) {
    MOH_ASSIGN_OR_RETURN(router.wg_1_, take("wg_1.weight", shared));
  }
  if (routed > 0) {
    std::vector<at::Tensor> parts = {router.wg_};
    for (const at::Tensor* w : {&router.wg_0_, &router.wg_1_}) {
      if (w->defined()) parts.push_back(*w);
    }
    router.stacked_ = at::cat(parts, 0);
  }
  return router;
}

at::Tensor MohRouter::Gates(const at::Tensor& x, const at::Tensor& query,
                            const at::Tensor& top_k, int64_t max_top_k) const {
  switch (kind_) {
    case RouterKind::kLearned:
      return LearnedGates(x, top_k, max_top_k);
    case RouterKind::kQueryNorm:
      return QueryNormGates(query, top_k, max_top_k);
    case RouterKind::kDense:
      break;
  }
  return at::ones({x.size(0), layer_.num_heads}, x.options());
}

at::Tensor MohRouter::LearnedGates(const at::Tensor& x, const at::Tensor& top_k,
                                   int64_t max_top_k) const {
  const int64_t shared = layer_.shared_heads;
  if (layer_.routed_heads() == 0) {
    // A layer without routing: softmax over all (shared) heads, times S.
    if (shared == 1) return at::ones({x.size(0), 1}, x.options());
    return at::softmax(at::matmul(x, wg_1_.t()), 1) *
           static_cast<double>(shared);
  }
  if (x.is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
      stacked_.scalar_type() == at::kFloat) {
    return LearnedGatesLoop(x.contiguous(), top_k);
  }
  // Every gate's logits in one product: [N, R (+ 2 (+ S))].
  const at::Tensor logits = Linear(x, stacked_);
  const int64_t routed_heads = layer_.routed_heads();
  at::Tensor gates = at::softmax(logits.narrow(1, 0, routed_heads), 1);
  at::Tensor routed = gates * TopKMask(gates, top_k, max_top_k);
  at::Tensor denom = at::clamp_min(routed.sum(1, /*keepdim=*/true),
                                   std::numeric_limits<float>::epsilon());
  routed = routed / denom * top_k.unsqueeze(1).to(routed.scalar_type());
  if (shared == 0) return routed;
  at::Tensor weight_0 = at::softmax(logits.narrow(1, routed_heads, 2), 1) * 2.0;
  at::Tensor shared_gates =
      shared > 1 ? at::softmax(logits.narrow(1, routed_heads + 2, shared), 1) *
                       static_cast<double>(shared)
                 : at::ones({x.size(0), 1}, x.options());
  shared_gates = shared_gates * weight_0.narrow(1, 0, 1);
  routed = routed * weight_0.narrow(1, 1, 1);
  return at::cat({shared_gates, routed}, 1);
}

at::Tensor MohRouter::LearnedGatesLoop(const at::Tensor& x,
                                       const at::Tensor& top_k) const {
  const int64_t n = x.size(0), c = x.size(1);
  const int64_t shared = layer_.shared_heads, routed = layer_.routed_heads();
  const int64_t width = shared > 0 ? shared + routed : routed;
  at::Tensor out = at::empty({n, width}, x.options());
  const at::Tensor k = top_k.to(at::kLong).contiguous();
  const int64_t* top = k.data_ptr<int64_t>();
  // Each row's logits (wg_, then wg_0_ and wg_1_ where defined, as
  // stacked_): projected row by row in double for a few rows (decode), in
  // one product for more (prefill), whose rows the loop below copies.
  const int64_t num_logits = stacked_.size(0);
  const at::Tensor logits =
      n > kMaxLoopRows ? Linear(x, stacked_).contiguous() : at::Tensor();
  auto gate_rows = [&](int64_t begin, int64_t end) {
    // Room for wg_0_'s 2 and one shared gate even where they are not
    // projected.
    std::vector<float> row_logits(routed + 2 + std::max<int64_t>(shared, 1));
    std::vector<int64_t> order(routed);
    float* gates = row_logits.data();
    float* weight_0 = gates + routed;
    float* shared_gates = weight_0 + 2;
    for (int64_t i = begin; i < end; ++i) {
      const float* xi = x.data_ptr<float>() + i * c;
      if (logits.defined()) {
        const float* from = logits.data_ptr<float>() + i * num_logits;
        std::copy(from, from + num_logits, gates);
      } else {
        Project(wg_, xi, c, gates);
        if (shared > 0) Project(wg_0_, xi, c, weight_0);
        if (shared > 1) Project(wg_1_, xi, c, shared_gates);
      }
      float* row = out.data_ptr<float>() + i * width;
      float* routed_out = row + (shared > 0 ? shared : 0);
      // The top_k[i] largest routed gates (ties to the lower head), kept
      // and renormalized to sum to top_k[i].
      Softmax(gates, routed, 1.0f);
      for (int64_t r = 0; r < routed; ++r) order[r] = r;
      const int64_t keep = std::clamp<int64_t>(top[i], 0, routed);
      std::partial_sort(order.begin(), order.begin() + keep, order.end(),
                        [&](int64_t a, int64_t b) {
                          return gates[a] > gates[b] ||
                                 (gates[a] == gates[b] && a < b);
                        });
      std::fill(routed_out, routed_out + routed, 0.0f);
      float sum = 0.0f;
      for (int64_t j = 0; j < keep; ++j) sum += gates[order[j]];
      const float denom = std::max(sum, std::numeric_limits<float>::epsilon());
      for (int64_t j = 0; j < keep; ++j) {
        routed_out[order[j]] =
            gates[order[j]] / denom * static_cast<float>(top[i]);
      }
      if (shared == 0) continue;
      Softmax(weight_0, 2, 2.0f);
      if (shared > 1) {
        Softmax(shared_gates, shared, static_cast<float>(shared));
      } else {
        shared_gates[0] = 1.0f;
      }
      for (int64_t h = 0; h < shared; ++h) {
        row[h] = shared_gates[h] * weight_0[0];
      }
      for (int64_t r = 0; r < routed; ++r) routed_out[r] *= weight_0[1];
    }
  };
  if (n > kMaxLoopRows) {
    at::parallel_for(0, n, kMaxLoopRows, gate_rows);
  } else {
    gate_rows(0, n);
  }
  return out;
}

at::Tensor MohRouter::QueryNormGates(const at::Tensor& query,
                                     const at::Tensor& top_k,
                                     int64_t max_top_k) const {
  const int64_t shared = layer_.shared_heads;
  const int64_t n = query.size(0);
  if (layer_.routed_heads() == 0) {
    return at::ones({n, layer_.num_heads}, query.options());
  }
  at::Tensor logits = at::linalg_vector_norm(
      query.narrow(1, shared, layer_.routed_heads()).to(at::kFloat), 2, {-1},
      false, c10::nullopt);  // [N, R], float32
  at::Tensor std = at::std(logits, {1}, /*unbiased=*/true, /*keepdim=*/true);
  at::Tensor gates = at::softmax(logits / std, 1);
  at::Tensor mask = TopKMask(gates, top_k, max_top_k).to(query.scalar_type());
  return at::cat({at::ones({n, shared}, query.options()), mask}, 1);
}

TopKBounds PackLayerTopK(const std::vector<LayerTopK>& rows, size_t layer,
                         int64_t tokens_per_row, int64_t* out) {
  TopKBounds bounds;
  for (size_t b = 0; b < rows.size(); ++b) {
    const int64_t k = rows[b][layer];
    out = std::fill_n(out, tokens_per_row, k);
    bounds.max = b == 0 ? k : std::max(bounds.max, k);
    bounds.min = b == 0 ? k : std::min(bounds.min, k);
  }
  return bounds;
}

at::Tensor HeadTokenCounts(const at::Tensor& gates, const at::Tensor& valid) {
  return ((gates != 0) & valid.unsqueeze(-1)).sum(1).to(at::kLong);
}

}  // namespace moh
