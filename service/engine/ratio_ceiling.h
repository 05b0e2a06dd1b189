// The ratio ceiling (issue 30, ARCHITECTURE.md step 3): a request whose own
// activation gives routed K = 0 in every layer can never read the routed
// heads (adaptive activation only lowers), so on a model whose shared heads
// fill whole KV groups it stores only their KV heads: a block holds
// `kv_fold` times as many of its positions (PlannedWork::kv_fold), admission
// counts that, and its blocks are cached under a key of their own.
//
// Pure: plain values, no model, no tensors.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/hash/hash.h"

namespace moh {

// The fold a request's KV is stored at: the model's (> 1 when it has a
// narrow width) when the request is narrow, else 1 (full width).
inline int32_t KvFold(bool narrow, int64_t model_fold) {
  return narrow && model_fold > 1 ? static_cast<int32_t>(model_fold) : 1;
}

// The prefix-cache key of KV computed at routed K `top_k` (one per layer)
// and stored at `kv_fold`: later layers' keys and values depend on the
// routed heads, and a block's layout on its fold, so a wide request lowered
// to K = 0 never matches a narrow one's blocks, nor the reverse.
inline uint64_t PrefixKey(const std::vector<int32_t>& top_k, int32_t kv_fold) {
  return absl::HashOf(top_k, kv_fold);
}

}  // namespace moh
