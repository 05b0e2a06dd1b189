// LlamaModel::Validate: a step's batch checked against the config and the
// KV cache before Forward runs it.
#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "model/core/llama_model.h"

namespace moh {

absl::Status LlamaModel::Validate(const DecoderBatch& batch,
                                  const KvCache& cache) const {
  const at::Tensor& ids = batch.token_ids;
  if (!ids.defined() || ids.dim() != 2 || ids.size(0) < 1 || ids.size(1) < 1) {
    return absl::InvalidArgumentError(
        "token_ids must be a [B, T] tensor, B, T >= 1");
  }
  if (ids.scalar_type() != at::kLong) {
    return absl::InvalidArgumentError("token_ids must be int64");
  }
  const size_t rows = ids.size(0);
  const int64_t width = ids.size(1);
  const bool paged = !batch.block_tables.empty();
  if (batch.num_tokens.size() != rows ||
      (paged ? batch.block_tables.size() : batch.slots.size()) != rows ||
      batch.start_positions.size() != rows ||
      (batch.top_k.empty() && batch.ratios.size() != rows)) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_tokens, slots (or block_tables), start_positions "
                     "and ratios (or top_k) need one entry per row (",
                     rows, ")"));
  }
  if (!batch.top_k.empty()) {
    MOH_RETURN_IF_ERROR(ValidateTopK(config_.moh, batch.top_k, rows, "top_k"));
  }
  if (!batch.narrow.empty()) {
    if (batch.narrow.size() != rows) {
      return absl::InvalidArgumentError(
          absl::StrCat("narrow needs one entry per row (", rows, ") or none"));
    }
    const std::vector<LayerTopK> row_top_k =
        batch.top_k.empty() ? TopKForRatios(config_.moh, batch.ratios)
                            : batch.top_k;
    for (size_t b = 0; b < rows; ++b) {
      if (!batch.narrow[b]) continue;
      if (!paged || narrow_kv_heads_ == 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "narrow[", b, "]: ",
            paged ? "the model has no narrow KV width (its shared heads do "
                    "not end at a KV group, or a layer has no routed heads)"
                  : "a narrow row needs a paged cache (block_tables)"));
      }
      for (int32_t k : row_top_k[b]) {
        if (k != 0) {
          return absl::InvalidArgumentError(
              absl::StrCat("narrow[", b,
                           "]: a narrow row reads no routed head: its "
                           "routed K must be 0 in every layer"));
        }
      }
    }
  }
  if (batch.logits_tail < 0 || batch.logits_tail > width) {
    return absl::InvalidArgumentError(absl::StrCat(
        "logits_tail must be in [0, ", width, "], got ", batch.logits_tail));
  }
  if (batch.top_logits != 0 && !batch.all_logits) {
    const int64_t vocab = config_.vocab_size;
    if (batch.logits_tail > 1) {
      return absl::InvalidArgumentError(
          "top_logits needs one position's logits per row (logits_tail <= 1)");
    }
    if (batch.top_logits_limit < 1 || batch.top_logits_limit > vocab) {
      return absl::InvalidArgumentError(
          absl::StrCat("top_logits_limit must be in [1, ", vocab, "], got ",
                       batch.top_logits_limit));
    }
    if (batch.top_logits < 0 || batch.top_logits > batch.top_logits_limit) {
      return absl::InvalidArgumentError(
          absl::StrCat("top_logits must be in [0, ", batch.top_logits_limit,
                       "], got ", batch.top_logits));
    }
    if (!batch.whole_logits.empty() && batch.whole_logits.size() != rows) {
      return absl::InvalidArgumentError(
          absl::StrCat("whole_logits must have ", rows, " entries, got ",
                       batch.whole_logits.size()));
    }
    if (!batch.row_reductions.empty() && batch.row_reductions.size() != rows) {
      return absl::InvalidArgumentError(
          absl::StrCat("row_reductions must have ", rows, " entries, got ",
                       batch.row_reductions.size()));
    }
    for (size_t b = 0; b < batch.row_reductions.size(); ++b) {
      const RowReduction& r = batch.row_reductions[b];
      if (!(r.temperature > 0.0f) || std::isinf(r.temperature)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "row_reductions[", b, "].temperature must be finite and > 0, got ",
            r.temperature));
      }
      if (std::isnan(r.min_p_offset) || r.min_p_offset > 0.0f) {
        return absl::InvalidArgumentError(absl::StrCat(
            "row_reductions[", b,
            "].min_p_offset must be <= 0 (-inf: none), got ", r.min_p_offset));
      }
      if (!(r.uniform < 1.0)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "row_reductions[", b, "].uniform must be < 1 (< 0: no draw), got ",
            r.uniform));
      }
    }
  }
  const int64_t block_size = cache.block_size();
  std::set<int32_t> seen_slots;
  std::map<int32_t, size_t> writer;  // block -> the row writing it
  for (size_t b = 0; b < rows; ++b) {
    if (batch.num_tokens[b] < 1 || batch.num_tokens[b] > width) {
      return absl::InvalidArgumentError(
          absl::StrCat("num_tokens[", b, "] must be in [1, ", width, "], got ",
                       batch.num_tokens[b]));
    }
    // A narrow row's block holds narrow_fold() times as many positions.
    const int64_t span = !batch.narrow.empty() && batch.narrow[b]
                             ? block_size * narrow_fold()
                             : block_size;
    const int64_t start = batch.start_positions[b];
    const int64_t end = start + batch.num_tokens[b];
    const int64_t capacity = std::min<int64_t>(
        paged ? int64_t(batch.block_tables[b].size()) * span : block_size,
        config_.max_position_embeddings);
    if (start < 0 || end > capacity) {
      return absl::InvalidArgumentError(
          absl::StrCat("row ", b, ": positions [", start, ", ", end,
                       ") must lie in [0, ", capacity, ") (",
                       paged ? "its block table" : "max sequence length", ")"));
    }
    if (!paged) {
      if (batch.slots[b] < 0 || batch.slots[b] >= cache.num_blocks()) {
        return absl::InvalidArgumentError(
            absl::StrCat("slots[", b, "] must be in [0, ", cache.num_blocks(),
                         "), got ", batch.slots[b]));
      }
      if (!seen_slots.insert(batch.slots[b]).second) {
        return absl::InvalidArgumentError(absl::StrCat(
            "slots[", b, "] = ", batch.slots[b], " is used twice"));
      }
    } else {
      const std::vector<int32_t>& table = batch.block_tables[b];
      for (size_t i = 0; i < table.size(); ++i) {
        if (table[i] < 0 || table[i] >= cache.num_blocks()) {
          return absl::InvalidArgumentError(
              absl::StrCat("block_tables[", b, "][", i, "] must be in [0, ",
                           cache.num_blocks(), "), got ", table[i]));
        }
      }
      for (int64_t i = start / span; i <= (end - 1) / span; ++i) {
        const auto [it, fresh] = writer.emplace(table[i], b);
        if (!fresh) {
          return absl::InvalidArgumentError(
              absl::StrCat("block_tables: rows ", it->second, " and ", b,
                           " both write block ", table[i]));
        }
      }
    }
    const float r = batch.top_k.empty() ? batch.ratios[b] : 0.0f;
    if (!(r <= 1.0f)) {  // also rejects NaN
      return absl::InvalidArgumentError(
          absl::StrCat("ratios[", b,
                       "] must be in (0, 1] or <= 0 for the default, got ", r));
    }
  }
  const int64_t lo = ids.min().item<int64_t>();
  const int64_t hi = ids.max().item<int64_t>();
  if (lo < 0 || hi >= config_.vocab_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("token_ids must be in [0, ", config_.vocab_size, "), got ",
                     lo < 0 ? lo : hi));
  }
  return absl::OkStatus();
}

}  // namespace moh
