// The per-layer head-load table of a response's `routing`: the live form of
// the MoH paper's head-load figure.
#ifndef MOH_CLIENT_HEAD_LOAD_TABLE_H_
#define MOH_CLIENT_HEAD_LOAD_TABLE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "moh/v1/inference.pb.h"

namespace moh::client {

// One row per layer, one column per head: the percentage of the routed tokens
// that head served, with '*' after shared heads, and a last column with the
// layer's activation (head-token pairs used / tokens x heads).
// `shared_heads[i]` is the number of shared heads (heads [0, S)) of the i-th
// layer of `routing`; an empty vector (or a missing entry) marks none. Returns
// a line saying so when `routing` has no layers or no tokens.
std::string FormatHeadLoadTable(const moh::v1::Routing& routing,
                                const std::vector<int32_t>& shared_heads);

// The shared-head counts per layer of the model that served `routing`, from a
// ListModels answer: the model named `model`, or, with `model` empty, the only
// model whose layer count and head counts match `routing`. Empty when unknown.
std::vector<int32_t> SharedHeadsFor(const moh::v1::ListModelsResponse& models,
                                    const std::string& model,
                                    const moh::v1::Routing& routing);

}  // namespace moh::client

#endif  // MOH_CLIENT_HEAD_LOAD_TABLE_H_
