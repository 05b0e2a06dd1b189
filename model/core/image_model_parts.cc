#include "model/core/image_model_parts.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace moh {

absl::Status CheckImageBatch(const at::Tensor& images, int64_t channels,
                             int64_t size, const char* name) {
  if (!images.defined() || images.dim() != 4 || images.size(0) < 1 ||
      images.size(1) != channels || images.size(2) != size ||
      images.size(3) != size) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " must have shape [B, ", channels, ", ", size, ", ",
                     size, "], B >= 1"));
  }
  return absl::OkStatus();
}

UploadedTopK::UploadedTopK(const DeviceContext& context,
                           const std::vector<LayerTopK>& row_top_k,
                           const std::vector<int64_t>& layer_tokens) {
  const int64_t rows = row_top_k.size();
  int64_t total = 0;
  for (int64_t n : layer_tokens) {
    offsets_.push_back(total);
    sizes_.push_back(rows * n);
    total += rows * n;
  }
  host_.resize(total);
  for (size_t l = 0; l < layer_tokens.size(); ++l) {
    bounds_.push_back(PackLayerTopK(row_top_k, l, layer_tokens[l],
                                    host_.data() + offsets_[l]));
  }
  device_ = context.Upload(at::from_blob(host_.data(), {total}, at::kLong));
}

int64_t MaxHeads(const MohConfig& moh) {
  int64_t max_heads = 0;
  for (const MohLayerConfig& l : moh.layers) {
    max_heads = std::max<int64_t>(max_heads, l.num_heads);
  }
  return max_heads;
}

at::Tensor PaddedHeadTokenCounts(const at::Tensor& gates,
                                 const at::Tensor& valid, int64_t max_heads) {
  at::Tensor counts = HeadTokenCounts(gates, valid);  // [B, H]
  return at::constant_pad_nd(counts, {0, max_heads - counts.size(1)});
}

ClassifierOutput DownloadClassifierOutput(
    const DeviceContext& context, const at::Tensor& logits,
    const at::Tensor& counts, const std::vector<at::Tensor>& gates) {
  std::vector<at::Tensor> results = {logits, counts};
  results.insert(results.end(), gates.begin(), gates.end());
  results = context.Download(results);
  ClassifierOutput out;
  out.logits = results[0];
  out.head_token_counts = results[1];
  out.gates.assign(results.begin() + 2, results.end());
  return out;
}

}  // namespace moh
