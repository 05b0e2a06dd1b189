#include "model/core/moh_router.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

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
  at::Tensor gates = at::softmax(at::matmul(x, wg_.t()), 1);
  at::Tensor routed = gates * TopKMask(gates, top_k, max_top_k);
  at::Tensor denom = at::clamp_min(routed.sum(1, /*keepdim=*/true),
                                   std::numeric_limits<float>::epsilon());
  routed = routed / denom * top_k.unsqueeze(1).to(routed.scalar_type());
  if (shared == 0) return routed;
  at::Tensor weight_0 = at::softmax(at::matmul(x, wg_0_.t()), 1) * 2.0;
  at::Tensor shared_gates = shared > 1
                                ? at::softmax(at::matmul(x, wg_1_.t()), 1) *
                                      static_cast<double>(shared)
                                : at::ones({x.size(0), 1}, x.options());
  shared_gates = shared_gates * weight_0.narrow(1, 0, 1);
  routed = routed * weight_0.narrow(1, 1, 1);
  return at::cat({shared_gates, routed}, 1);
}

at::Tensor MohRouter::QueryNormGates(const at::Tensor& query,
                                     const at::Tensor& top_k,
                                     int64_t max_top_k) const {
  const int64_t shared = layer_.shared_heads;
  const int64_t n = query.size(0);
  if (layer_.routed_heads() == 0) {
    return at::ones({n, layer_.num_heads}, query.options());
  }
  at::Tensor logits =
      at::linalg_vector_norm(query.narrow(1, shared, layer_.routed_heads()), 2,
                             {-1}, false, c10::nullopt);  // [N, R]
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
