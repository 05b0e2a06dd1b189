// Decode steps of LlamaModel as CUDA graphs (DeviceContext::Capture).
//
// A decode step on CUDA is a few hundred small launches per token, and the
// host's cost per launch (dispatch, allocation, the launch itself) is what
// bounds batch-1 decode, far above the time the device needs to read the
// weights. A recorded step is launched as one unit. What a recording holds
// fixed is its key: the rows, the block table's width, the keys attention
// reads (GraphKvLen), the routed K bounds of every layer (they size the
// router's top-k) and the cache's tensors. What changes from step to step
// (token ids, positions, block tables, row lengths, per-token K) is copied
// into the recording's input tensors before each replay. The rows are
// bucketed (GraphRows): a step of 37 rows runs as 40, the last three copies
// of its first (PadRows), and returns its 37 (FirstRows).
#include <algorithm>
#include <map>
#include <mutex>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/log.h"
#include "model/core/llama_model.h"
#include "model/core/llama_model_step.h"

namespace moh {

struct LlamaModel::StepGraphs {
  struct Entry {
    GraphRecording recording;         // when (and whether) it records
    at::Tensor ints, token_ids;       // the inputs the graph reads
    std::vector<at::Tensor> outputs;  // what it writes
    std::unique_ptr<DeviceContext::Graph> graph;
  };
  // Held through every CUDA step (LockDevice): a recording records
  // everything the model's stream runs, so no other step may launch on it
  // meanwhile, and the graphs share their scratch memory.
  std::mutex mutex;
  std::map<std::vector<int64_t>, Entry> entries;
  int64_t recorded = 0;
  int64_t replays = 0;
};

int64_t GraphRows(int64_t rows) {
  if (rows <= 2) return std::max<int64_t>(rows, 1);
  if (rows <= 4) return 4;
  return (rows + 7) / 8 * 8;
}

namespace {

// `v` with copies of its first element appended up to `rows` (empty stays
// empty: a field the batch does not use).
template <typename T>
void AppendFirst(std::vector<T>& v, int64_t rows) {
  if (!v.empty()) v.resize(static_cast<size_t>(rows), T(v.front()));
}

}  // namespace

DecoderBatch PadRows(const DecoderBatch& batch, int64_t rows) {
  const int64_t have = batch.token_ids.size(0);
  if (rows <= have || have == 0) return batch;
  DecoderBatch padded = batch;
  padded.token_ids =
      at::cat({batch.token_ids,
               batch.token_ids.narrow(0, 0, 1).expand({rows - have, -1})});
  AppendFirst(padded.num_tokens, rows);
  AppendFirst(padded.block_tables, rows);
  AppendFirst(padded.slots, rows);
  AppendFirst(padded.start_positions, rows);
  AppendFirst(padded.narrow, rows);
  AppendFirst(padded.top_k, rows);
  AppendFirst(padded.ratios, rows);
  AppendFirst(padded.row_reductions, rows);
  if (!padded.whole_logits.empty()) padded.whole_logits.resize(rows, false);
  return padded;
}

DecoderOutput FirstRows(DecoderOutput out, int64_t rows) {
  auto first = [rows](at::Tensor& t) {
    if (t.defined() && t.dim() > 0 && t.size(0) > rows)
      t = t.narrow(0, 0, rows);
  };
  // (A reducing step's logits are the rows it was asked for whole: never a
  // copy, so at most `rows` of them.)
  first(out.logits);
  first(out.head_token_counts);
  for (at::Tensor& gates : out.gates) first(gates);
  first(out.top_values);
  first(out.top_ids);
  first(out.row_stats);
  first(out.resident_logits);
  return out;
}

LlamaModel::LlamaModel(LlamaConfig config, at::TensorOptions options)
    : config_(std::move(config)),
      options_(options),
      context_(std::make_unique<DeviceContext>(options.device())),
      narrow_kv_heads_(NarrowKvHeads(config_)),
      graphs_(std::make_unique<StepGraphs>()) {}

LlamaModel::~LlamaModel() = default;

std::unique_lock<std::mutex> LlamaModel::LockDevice() const {
  if (!options_.device().is_cuda()) return {};
  return std::unique_lock<std::mutex>(graphs_->mutex);
}

int64_t LlamaModel::graph_replays() const {
  std::lock_guard<std::mutex> lock(graphs_->mutex);
  return graphs_->replays;
}

bool LlamaModel::GraphEligible(const DecoderBatch& batch) const {
  if (max_cuda_graphs_ <= 0 || !options_.device().is_cuda()) return false;
  // The ATen pair path waits for the device (nonzero, item).
  if (attention_mode_ == AttentionMode::kHeadSparse ||
      attention_mode_ == AttentionMode::kHeadSparseAten) {
    return false;
  }
  // Narrow rows are read in place by the paged kernel (PagedDecodeRows),
  // beside wide ones or alone; the gathering path is not recorded with them.
  if (!cuda_paged_decode_ &&
      std::any_of(batch.narrow.begin(), batch.narrow.end(),
                  [](bool narrow) { return narrow; })) {
    return false;
  }
  return OneTokenRows(batch);
}

bool LlamaModel::OneTokenRows(const DecoderBatch& batch) {
  if (batch.all_logits || batch.record_gates || batch.logits_tail > 1 ||
      batch.token_ids.size(1) != 1) {
    return false;
  }
  return std::all_of(batch.num_tokens.begin(), batch.num_tokens.end(),
                     [](int32_t count) { return count == 1; });
}

std::optional<std::vector<at::Tensor>> LlamaModel::RunGraph(
    const DecoderBatch& batch, const StepIndices& indices,
    KvCache& cache) const {
  const int64_t num_layers = static_cast<int64_t>(layers_.size());
  std::vector<int64_t> key = {batch.token_ids.size(0),
                              indices.table_width,
                              indices.kv_len,
                              batch.logits_tail,
                              static_cast<int64_t>(indices.host.size()),
                              cache.num_blocks(),
                              cache.block_size(),
                              indices.narrow_rows};
  key.insert(key.end(), indices.max_top_k.begin(), indices.max_top_k.end());
  key.insert(key.end(), indices.min_top_k.begin(), indices.min_top_k.end());
  for (int64_t l = 0; l < num_layers; ++l) {  // the cache the graph writes
    key.push_back(reinterpret_cast<intptr_t>(cache.keys(l).data_ptr()));
    key.push_back(reinterpret_cast<intptr_t>(cache.values(l).data_ptr()));
  }

  StepGraphs::Entry& entry = graphs_->entries[key];
  if (!entry.graph) {
    if (!entry.recording.Step(graphs_->recorded < max_cuda_graphs_)) {
      return std::nullopt;
    }
    entry.ints = at::empty({static_cast<int64_t>(indices.host.size())},
                           options_.dtype(at::kLong));
    entry.token_ids = at::empty(batch.token_ids.sizes(),
                                options_.dtype(batch.token_ids.scalar_type()));
    absl::StatusOr<std::unique_ptr<DeviceContext::Graph>> graph =
        context_->Capture([&] {
          entry.outputs =
              RunLayers(batch, indices, entry.ints, entry.token_ids, cache);
        });
    if (!graph.ok()) {
      // What the failed recording holds goes back to the pool.
      entry = StepGraphs::Entry{entry.recording};
      entry.recording.Failed(graph.status());
      MOH_LOG(Warning) << "decode steps of " << batch.token_ids.size(0)
                       << " rows run without a CUDA graph"
                       << (entry.recording.never()
                               ? ""
                               : absl::StrCat(" until their step ",
                                              entry.recording.next_try(),
                                              " of this shape tries again"))
                       << ": " << graph.status().message();
      return std::nullopt;
    }
    entry.graph = std::move(*graph);
    ++graphs_->recorded;
  }
  // This step's inputs into the recording's, then the recorded kernels, on
  // the model's stream in that order.
  const std::vector<int64_t>& host = indices.host;
  context_->UploadInto(
      at::from_blob(const_cast<int64_t*>(host.data()),
                    {static_cast<int64_t>(host.size())}, at::kLong),
      entry.ints);
  context_->UploadInto(batch.token_ids, entry.token_ids);
  entry.graph->Replay();
  ++graphs_->replays;
  // Read (downloaded by Forward) before the next replay of any graph
  // reuses the pool.
  return entry.outputs;
}

}  // namespace moh
