#include "client/head_load_table.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/text_table.h"

namespace moh::client {
namespace {

bool LayoutMatches(const moh::v1::ModelInfo& info,
                   const moh::v1::Routing& routing) {
  if (info.layers_size() != routing.layers_size()) return false;
  for (int i = 0; i < routing.layers_size(); ++i) {
    if (info.layers(i).num_heads() != routing.layers(i).head_tokens_size()) {
      return false;
    }
  }
  return true;
}

std::vector<int32_t> SharedHeadCounts(const moh::v1::ModelInfo& info) {
  std::vector<int32_t> shared;
  for (const auto& layer : info.layers())
    shared.push_back(layer.shared_heads());
  return shared;
}

}  // namespace

std::string FormatHeadLoadTable(const moh::v1::Routing& routing,
                                const std::vector<int32_t>& shared_heads) {
  if (routing.layers_size() == 0 || routing.tokens() <= 0) {
    return "head load: no routing data\n";
  }
  int max_heads = 0;
  for (const auto& layer : routing.layers()) {
    max_heads = std::max(max_heads, layer.head_tokens_size());
  }
  std::vector<std::string> header = {"layer"};
  for (int h = 0; h < max_heads; ++h) header.push_back(absl::StrCat("h", h));
  header.push_back("active");
  TextTable table(std::move(header));
  for (int c = 0; c < max_heads + 2; ++c) table.AlignRight(c);

  const double tokens = static_cast<double>(routing.tokens());
  for (int i = 0; i < routing.layers_size(); ++i) {
    const moh::v1::LayerRouting& layer = routing.layers(i);
    const int shared =
        i < static_cast<int>(shared_heads.size()) ? shared_heads[i] : 0;
    std::vector<std::string> row = {absl::StrCat(layer.layer())};
    double served = 0;
    for (int h = 0; h < layer.head_tokens_size(); ++h) {
      served += static_cast<double>(layer.head_tokens(h));
      row.push_back(absl::StrFormat("%.1f%s",
                                    100.0 * layer.head_tokens(h) / tokens,
                                    h < shared ? "*" : " "));
    }
    row.resize(max_heads + 1);
    const int heads = std::max(layer.head_tokens_size(), 1);
    row.push_back(absl::StrFormat("%.3f", served / (tokens * heads)));
    table.AddRow(std::move(row));
  }
  const bool any_shared = std::any_of(shared_heads.begin(), shared_heads.end(),
                                      [](int32_t s) { return s > 0; });
  return absl::StrCat(
      "head load (% of ", routing.tokens(), " tokens served by each head",
      any_shared ? "; * = shared head" : "", "):\n", table.Render());
}

std::vector<int32_t> SharedHeadsFor(const moh::v1::ListModelsResponse& models,
                                    const std::string& model,
                                    const moh::v1::Routing& routing) {
  const moh::v1::ModelInfo* found = nullptr;
  for (const auto& info : models.models()) {
    if (!model.empty() ? info.name() == model : LayoutMatches(info, routing)) {
      if (found != nullptr) return {};  // Ambiguous.
      found = &info;
    }
  }
  if (found == nullptr || !LayoutMatches(*found, routing)) return {};
  return SharedHeadCounts(*found);
}

}  // namespace moh::client
