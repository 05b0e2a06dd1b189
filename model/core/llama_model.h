// MoH-LLaMA decoder: RMSNorm, RoPE (rope_theta), SwiGLU MLP, grouped-query
// attention with a KV cache, and per-token head gates from a MoH router.
//
// Forward() runs a batch of rows, each continuing its own sequence in its own
// KV-cache slot with its own activation ratio. Rows are right-padded to the
// longest; padding never influences a row's result (masked keys, no cache
// writes). This lets one call serve a prefill, a decode step, or both mixed.
//
// On CUDA, decode steps (one new token per row) run as CUDA graphs: a
// step's kernels are recorded once per shape (rows, routed K per layer, the
// keys read rounded up: GraphKvLen) and launched again as one unit, which
// removes the host's per-kernel cost that otherwise bounds batch-1 decode
// (set_cuda_graphs).
//
// Thread-compatibility: a loaded model is immutable; Forward() may run
// concurrently on different KvCache objects (or disjoint slots is NOT enough:
// one KvCache has one user at a time). On CUDA concurrent calls take turns
// (their kernels share the model's stream anyway).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "model/checkpoint/checkpoint.h"
#include "model/core/activation.h"
#include "model/core/best_logits.h"
#include "model/core/device_context.h"
#include "model/core/head_sparse_attention.h"
#include "model/core/kv_cache.h"
#include "model/core/linear.h"
#include "model/core/model_config.h"
#include "model/core/moh_router.h"
#include "model/core/runtime.h"
#include "model/core/varlen_attention.h"

namespace moh {

// Default bound on the dense attention workspace of one step: 256 MiB.
inline constexpr int64_t kDefaultAttentionWorkspaceBytes = int64_t{256} << 20;

// One forward step over a batch of B rows.
struct DecoderBatch {
  // [B, T] int64 (any device): the new tokens of each row, right-padded.
  at::Tensor token_ids;
  std::vector<int32_t> num_tokens;  // valid tokens per row, in [1, T]
  // Where each row's keys and values live (kv_cache.h), one of:
  //  - block_tables: row b's position p is in block
  //    block_tables[b][p / block_size] (a paged cache); rows may share blocks
  //    they read (a common prefix) but never a block they write;
  //  - slots (when block_tables is empty): row b's whole sequence is in block
  //    slots[b] (one block per sequence; distinct).
  std::vector<std::vector<int32_t>> block_tables;
  std::vector<int32_t> slots;
  std::vector<int32_t> start_positions;  // tokens already cached for the row
  // Per row (paged only; empty: every row wide): whether its KV is stored
  // narrow (the ratio ceiling, kv_cache.h): only KV heads
  // [0, narrow_kv_heads()) in blocks of block_size * narrow_fold() of its
  // positions, and their projections only are computed. Such a row's routed
  // K must be 0 in every layer: it never reads the routed KV heads. Its
  // results equal the same row run wide.
  std::vector<bool> narrow;
  // Routed K of every layer per row (Activation::top_k), as resolved at
  // admission. When empty, resolved here from `ratios` (per row; <= 0: the
  // trained default), for callers that hold plain ratios.
  std::vector<LayerTopK> top_k;
  std::vector<float> ratios;
  bool all_logits = false;  // logits at every position, else the last valid one
  // With !all_logits and > 0: logits at the last `logits_tail` valid positions
  // of each row ([B, logits_tail, V]; a row shorter than that repeats its
  // first position at the front).
  int32_t logits_tail = 0;
  bool record_gates = false;  // also return the gates of every layer
  // With !all_logits, logits_tail <= 1 and top_logits > 0: the step keeps
  // the logits where they lie and returns each row's top_logits best of its
  // logits [0, top_logits_limit) (BestLogits: value, then lower id) as
  // DecoderOutput::top_values / top_ids, and whole rows only for the rows
  // whole_logits flags (empty: none), as DecoderOutput::logits [R, V] in
  // row order. A GPU step then copies B * top_logits values and ids to the
  // host, not B * V logits.
  int64_t top_logits = 0;
  int64_t top_logits_limit = 0;
  std::vector<bool> whole_logits;
  // With top_logits, per row (empty: none): the step also returns RowStats
  // of logits [0, top_logits_limit) under these (best_logits.h), as
  // DecoderOutput::row_stats, for draws that need sums over the whole row.
  std::vector<RowReduction> row_reductions;
};

struct DecoderOutput {
  at::Tensor logits;  // float32 [B, V] (last valid position) or [B, T, V]
  // float32 logits and every tensor below are on the host (CPU) whatever
  // the model's device: one copy and one wait per Forward.
  at::Tensor head_token_counts;  // int64 CPU [B, L, H]: tokens each head served
  std::vector<at::Tensor>
      gates;  // when recorded: per layer float32 CPU [B, T, H]
  // With DecoderBatch::top_logits: float32 and int64 CPU [B, top_logits].
  at::Tensor top_values;
  at::Tensor top_ids;
  // With DecoderBatch::row_reductions: float64 CPU [B, kRowStats].
  at::Tensor row_stats;
  // With DecoderBatch::top_logits: every row's logits [B, V] where they lie
  // (the model's device), for a row whose reduction does not decide its
  // draw after all (SequenceOutput::NextFromReduced); valid until the next
  // Forward of the model.
  at::Tensor resident_logits;
};

// The narrow width of a model of `config` (LlamaModel::narrow_kv_heads).
int64_t NarrowKvHeads(const LlamaConfig& config);

// Keys a graph-recorded decode step reads when its longest row has `kv_len`:
// rounded up to a multiple of the smallest power of two of at least
// kv_len / 16 (and 64), i.e. less than kv_len / 8 more, so that one graph
// serves that many consecutive steps; keys beyond a row's length are masked.
int64_t GraphKvLen(int64_t kv_len);

// Rows a graph-recorded decode step runs with when it has `rows`: 1, 2 or
// 4, then a multiple of 8, so that one graph serves the steps of several
// batch sizes (rows come and go in serving, and each new shape runs its
// first step eagerly and its second records a graph).
int64_t GraphRows(int64_t rows);

// `batch` with rows appended up to `rows`, each a copy of its first row
// (token, position, blocks, K, reductions; never drawn from whole). A copy
// computes what the first row computes, so it writes the same keys and
// values into the same place, and the rows before it are unchanged:
// FirstRows of the padded step's output is the step's output.
DecoderBatch PadRows(const DecoderBatch& batch, int64_t rows);

// The first `rows` rows of every per-row output of `out`.
DecoderOutput FirstRows(DecoderOutput out, int64_t rows);

// When a decode-step shape (a graph's key) records its graph. Its first
// step runs eagerly (a shape seen once may not come back) and its second
// records, while the model keeps fewer graphs than its maximum. A recording
// that ran out of device memory (RESOURCE_EXHAUSTED) is tried again once
// the shape has seen twice as many steps as it had then: memory that
// finished requests free may let it fit, and a shape that keeps failing
// costs a try ever more rarely. A recording that failed otherwise (the step
// did what a graph cannot hold) is never tried again: that shape always
// runs eagerly.
class GraphRecording {
 public:
  // A step of this shape that has no graph yet; `room`: the model keeps
  // fewer graphs than its maximum. Whether this step records.
  bool Step(bool room) {
    ++seen_;
    return !never_ && room && seen_ >= next_try_;
  }
  // The recording this step tried failed with `status`.
  void Failed(const absl::Status& status) {
    if (absl::IsResourceExhausted(status)) {
      next_try_ = 2 * seen_;
    } else {
      never_ = true;
    }
  }
  // Whether the shape always runs eagerly.
  bool never() const { return never_; }
  // The step of this shape (from 1) that tries to record next.
  int64_t next_try() const { return next_try_; }

 private:
  int64_t seen_ = 0;
  int64_t next_try_ = 2;
  bool never_ = false;
};

// Graphs a model keeps by default (LlamaModel::set_cuda_graphs).
inline constexpr int64_t kDefaultCudaGraphs = 64;

class LlamaModel {
 public:
  // Loads `dir` (config.json + checkpoint). Every tensor of the checkpoint must
  // be used and have the expected shape; errors name the file and tensor.
  static absl::StatusOr<std::unique_ptr<LlamaModel>> Load(
      const std::string& dir, const DeviceOptions& device_options);
  static absl::StatusOr<std::unique_ptr<LlamaModel>> Load(
      const std::string& dir, const LlamaConfig& config,
      const at::TensorOptions& options,
      WeightFormat weights = WeightFormat::kAsLoaded);
  // Builds the model from tensors named as in a Hugging Face checkpoint.
  // Linear weights (q/k/v/o, MLP, lm_head; a tied embedding with them) are
  // converted to `weights` as each is taken, so the float32 copy of one
  // tensor at a time is all the conversion adds: a checkpoint whose float32
  // size exceeds the memory loads in int8 (bfloat16: half, int8: a quarter,
  // plus a float32 scale per row). Norms, router and biases stay float32.
  static absl::StatusOr<std::unique_ptr<LlamaModel>> FromTensors(
      const LlamaConfig& config, TensorStore& store,
      const at::TensorOptions& options,
      WeightFormat weights = WeightFormat::kAsLoaded);
  ~LlamaModel();

  // A KV cache of `num_blocks` blocks of `block_size` positions (at most
  // config().max_position_embeddings), in kv_cache_dtype(): `num_slots`
  // sequences of up to `max_seq_len` tokens (one block each), or a paged
  // cache of small blocks.
  KvCache CreateKvCache(int64_t num_blocks, int64_t block_size) const;

  // RESOURCE_EXHAUSTED, naming the sizes, when the model's weights, a KV
  // cache of `num_blocks` x `block_size` and the attention workspace bound
  // (set_attention_workspace_bytes) would not fit the device's memory (CUDA;
  // always OK on CPU). Checked before the cache is allocated, so that a
  // model configured too large fails alone instead of failing its requests.
  absl::Status CheckMemoryFits(int64_t num_blocks, int64_t block_size) const;

  // INVALID_ARGUMENT on inconsistent input (shapes, slots, positions beyond the
  // cache, token ids outside the vocabulary); INTERNAL on a LibTorch error.
  absl::StatusOr<DecoderOutput> Forward(const DecoderBatch& batch,
                                        KvCache& cache) const;

  // The ratio ceiling (kv_cache.h): when every layer's shared heads read
  // whole KV groups (S % (H / KV) == 0), a row at routed K = 0 reads KV
  // heads [0, w) only, w the widest layer's S / (H / KV): the model's narrow
  // width. 0 when it has none (w == KV, e.g. a layer without routed heads or
  // a dense model; S not aligned to KV groups; KV % w != 0).
  int64_t narrow_kv_heads() const { return narrow_kv_heads_; }
  // Positions of a narrow row one block holds, in units of block_size:
  // KV / w; 1 without a narrow width.
  int64_t narrow_fold() const {
    return narrow_kv_heads_ > 0 ? config_.num_kv_heads / narrow_kv_heads_ : 1;
  }

  // Whether a row at routed K `top_k` (one per layer) may be stored narrow:
  // the model has a narrow width and K is 0 in every layer. The caller
  // decides once per sequence, from the activation it can never exceed.
  bool CanStoreNarrow(const LayerTopK& top_k) const {
    return narrow_kv_heads_ > 0 &&
           std::all_of(top_k.begin(), top_k.end(),
                       [](int32_t k) { return k == 0; });
  }

  const LlamaConfig& config() const { return config_; }
  const at::TensorOptions& options() const { return options_; }

  // See AttentionMode (head_sparse_attention.h). Set before use; not
  // thread-safe to change while Forward runs.
  void set_attention_mode(AttentionMode mode) { attention_mode_ = mode; }
  // Bound on the dense path's per-chunk attention workspace (scores and
  // mask; see dense_attention.h). Same contract as set_attention_mode.
  void set_attention_workspace_bytes(int64_t bytes) {
    attention_workspace_bytes_ = bytes;
  }
  // Up to `max_graphs` decode-step shapes are recorded as CUDA graphs (the
  // first step of a shape runs eagerly, the second records it); beyond
  // that, steps of new shapes run eagerly. 0: every step eagerly. The graphs
  // share one memory pool. Without effect on CPU. Same contract as
  // set_attention_mode.
  void set_cuda_graphs(int64_t max_graphs) { max_cuda_graphs_ = max_graphs; }
  int64_t cuda_graphs() const { return max_cuda_graphs_; }
  // On CUDA, decode steps (one query per row) attend over the paged cache in
  // place (paged_decode_attention.h) where the kernel takes the shape;
  // false: through the dense path's gathered copy (DenseAttention). Same
  // contract as set_attention_mode.
  void set_cuda_paged_decode(bool on) { cuda_paged_decode_ = on; }
  // On CUDA, a layer's small per-token operations (the residual add and
  // RMSNorm, RoPE, the keys' and values' store, SwiGLU, the query-norm
  // router's gates) run as one kernel each (fused_layer_ops.h) where the
  // kernels take the tensors; false: as chains of ATen ops. Same contract
  // as set_attention_mode.
  void set_cuda_fused_ops(bool on) { cuda_fused_ops_ = on; }
  // On CUDA, steps of prompt chunks (more than one query in a row) attend
  // through FlashAttention over the rows' packed keys, unpadded and without
  // a mask (varlen_attention.h), in bfloat16 and float16 where it takes the
  // shape; false: through DenseAttention's padded rows and mask. Same
  // contract as set_attention_mode.
  void set_cuda_varlen_prefill(bool on) { cuda_varlen_prefill_ = on; }
  // On CUDA, the products of a decode step's few rows with few outputs (the
  // attention's projections and, with SwiGLU before it, the MLP's down
  // projection, with set_cuda_fused_ops) run as one kernel each without
  // split-K (FusedSkinnyLinear, FusedSiluMulLinear) where it takes them;
  // false: through cuBLAS (and a SwiGLU kernel). Same contract as
  // set_attention_mode.
  void set_cuda_skinny_linear(bool on) { cuda_skinny_linear_ = on; }
  // Runs every step of one token a row with its rows padded as a CUDA graph
  // step's are (GraphRows, PadRows), on any device: what a graph step
  // computes, checked on the CPU (tests). Same contract as
  // set_attention_mode.
  void set_graph_rows_everywhere(bool on) { graph_rows_everywhere_ = on; }
  // Decode steps that ran as a recorded graph (replays), for tests and logs.
  int64_t graph_replays() const;
  // The element type of the caches CreateKvCache makes (and CheckMemoryFits
  // counts): the model's own by default. Keys and values are rounded to it
  // when stored and widened back to the model's type when read, so a 16-bit
  // cache halves KV memory and the bytes attention reads. INVALID_ARGUMENT
  // for float16 on CPU. Same contract as set_attention_mode.
  absl::Status set_kv_cache_dtype(at::ScalarType dtype);
  // The same from a setting's value: "auto" (the model's dtype), "float32",
  // "bfloat16" or "float16" (ResolveKvCacheDtype); errors name `field`.
  absl::Status set_kv_cache_dtype(absl::string_view name,
                                  absl::string_view field);
  at::ScalarType kv_cache_dtype() const { return kv_cache_dtype_; }
  // How the linear weights are held (DeviceOptions::weights at Load): as
  // the model's dtype, bfloat16 (Bf16Linear) or int8 (Int8Linear), each
  // multiplied with float32 activations (linear.h; a prefill rounds them to
  // bfloat16 on AVX512_BF16 CPUs, to int8 per 32 values on AVX512_VNNI);
  // a tied embedding's
  // looked-up rows are widened.
  WeightFormat linear_weights() const { return linear_weights_; }

 private:
  struct Layer {
    at::Tensor input_norm, post_norm;           // [C]
    LinearWeight q_proj, k_proj, v_proj, o_proj;  // [out, in]
    at::Tensor q_bias, k_bias, v_bias, o_bias;    // when attention_bias
    LinearWeight gate_proj, up_proj, down_proj;
    // k_proj over v_proj over q_proj, and gate_proj over up_proj, as one W
    // each (StackRows: the five are views of these), one product each where
    // every head is projected; kv_proj is k_proj over v_proj (a view of
    // kvq_proj), for the steps that project keys and values alone, and its
    // rows with the first heads' of q_proj are one product where only the
    // shared heads attend. Undefined when their formats differ. The biases
    // likewise, when attention_bias.
    LinearWeight kvq_proj, kv_proj, gate_up_proj;
    at::Tensor kvq_bias, kv_bias;
    MohRouter router;
  };

  LlamaModel(LlamaConfig config, at::TensorOptions options);
  // Tensor options of the caches CreateKvCache makes.
  at::TensorOptions kv_cache_options() const {
    return options_.dtype(kv_cache_dtype_);
  }
  // Positions a cache for sequences of `max_seq_len` holds.
  int64_t CachePositions(int64_t max_seq_len) const;
  absl::Status Validate(const DecoderBatch& batch, const KvCache& cache) const;
  absl::StatusOr<DecoderOutput> ForwardUnchecked(const DecoderBatch& batch,
                                                 KvCache& cache) const;
  // ForwardUnchecked with the rows as given (it pads a graph step's);
  // `graph`: GraphEligible(batch).
  absl::StatusOr<DecoderOutput> ForwardRows(const DecoderBatch& batch,
                                            KvCache& cache, bool graph) const;
  // The step's host-side indices (llama_model.cc).
  struct StepIndices;
  // The recorded decode steps (llama_model_graphs.cc).
  struct StepGraphs;
  // On CUDA, the model's steps one at a time (Forward holds it): a graph's
  // recording must see no other thread's launches on the model's stream.
  // Unlocked on CPU.
  std::unique_lock<std::mutex> LockDevice() const;
  // Whether `batch` may run as a graph: CUDA, decode rows only, dense
  // attention, no narrow row, no recorded gates, last logits only.
  bool GraphEligible(const DecoderBatch& batch) const;
  // Whether every row of `batch` adds one token and wants its last logits
  // only, without gates: the steps a graph may record.
  static bool OneTokenRows(const DecoderBatch& batch);
  // Every layer of the step, from its indices uploaded as `ints` and its
  // token ids `token_ids` ([B, T], on the device): the step's results on the
  // device (logits, head counts [B, L, H], recorded gates). Launches
  // kernels only: no wait for the device, no copy from the host.
  std::vector<at::Tensor> RunLayers(const DecoderBatch& batch,
                                    const StepIndices& indices,
                                    const at::Tensor& ints,
                                    const at::Tensor& token_ids,
                                    KvCache& cache) const;
  // The step's results through a recorded graph, on the device (the
  // graphs' pool: read them before the next replay): replayed when its shape
  // was recorded, recorded now (and replayed) at the shape's second step;
  // nullopt when it runs eagerly (first sight, the limit reached, or a
  // failed recording). Called with LockDevice() held.
  std::optional<std::vector<at::Tensor>> RunGraph(const DecoderBatch& batch,
                                                  const StepIndices& indices,
                                                  KvCache& cache) const;
  at::Tensor RmsNorm(const at::Tensor& x, const at::Tensor& weight) const;
  // h += residual in place, then RmsNorm(h, weight): one pass on the CPU.
  at::Tensor AddRmsNorm(at::Tensor& h, const at::Tensor& residual,
                        const at::Tensor& weight) const;
  // What every layer of one Forward shares. The step's N tokens are ragged:
  // row after row, valid tokens only.
  struct Step {
    const DecoderBatch& batch;
    int64_t rows = 0, width = 0;  // B and T of batch.token_ids
    at::Tensor positions;    // [B, T] int64 (padding repeats the last valid)
    at::Tensor row_len;      // [B] int64: keys in each row after this step
    at::Tensor block_table;  // [B, n] int64: each row's blocks
    at::Tensor token_row;    // [N] int64: the row of each token
    at::Tensor token_pos;    // [N] int64: its position
    at::Tensor token_flat;   // [N] int64: its index in [B * T]
    at::Tensor token_block, token_offset;  // [N] int64: its cache place
    at::Tensor top_k;  // [L, N] int64: routed heads per layer and token
    std::vector<int64_t> max_top_k;  // [L]: the largest K of each layer
    std::vector<int64_t> min_top_k;  // [L]: the smallest K of each layer
    int64_t kv_len = 0;              // keys the longest row reads
    // The ratio ceiling: the rows stored narrow (caches filled in per
    // layer), and the step's tokens of narrow and of wide rows ([Nn], [Nw]
    // int64); no narrow row: narrow.kv_heads 0 and both undefined.
    NarrowRows narrow;
    at::Tensor narrow_tokens, wide_tokens;
    // Dense attention's mask (DenseVisible), made by the first layer that
    // needs it whole and read by the others; the RoPE tables' rows of the
    // tokens' positions ([N, 1, D], RotateTokens' ATen path), likewise.
    mutable at::Tensor visible, rope_cos, rope_sin;
    // The query-norm router's gates at K = 0 ([N, H]: 1 for the first
    // shared_gates_heads heads, 0 after), made by the first layer whose
    // routed heads are all off and read by the others with as many shared.
    mutable at::Tensor shared_gates;
    mutable int64_t shared_gates_heads = 0;
    // Where each row's keys lie, packed (VarlenAttention), made by the
    // first layer that attends through it.
    mutable PackedKeys packed_keys;
  };
  // The layer's gates [N, H] for x [N, C] (queries q [N, H, D] before RoPE,
  // where projected): one kernel for the query-norm router on CUDA
  // (cuda_fused_ops_), else MohRouter::Gates.
  at::Tensor RouterGates(const Layer& layer, const at::Tensor& x,
                         const at::Tensor& q, const at::Tensor& top_k,
                         int64_t max_top_k) const;
  at::Tensor Rotate(const at::Tensor& x, const at::Tensor& positions) const;
  // x [N, heads, D] of the step's tokens rotated at their positions (q, and
  // k of every token), the tables' rows gathered once per step.
  at::Tensor RotateTokens(const at::Tensor& x, const Step& step) const;
  // x W^T (+ bias) for a layer's product: a CUDA decode step's few rows
  // through FusedSkinnyLinear where it takes them (cuda_skinny_linear_),
  // else Linear.
  at::Tensor Product(const at::Tensor& x, const LinearWeight& weight,
                     const at::Tensor& bias = {}) const;
  // silu(x W_gate^T) * x W_up^T: the MLP before its down projection.
  at::Tensor Mlp(const at::Tensor& x, const Layer& layer) const;
  // silu(gate) * up over the [gate | up] product both [N, 2I].
  at::Tensor SwiGlu(const at::Tensor& both) const;
  // The whole MLP, Mlp then down_proj; on CPU, a long step's rows in
  // chunks.
  at::Tensor MlpDown(const at::Tensor& x, const Layer& layer) const;
  // Tokens each head served per row and layer, from each layer's gates
  // ([N, H]): [B, L, H] int64.
  at::Tensor HeadCounts(const std::vector<at::Tensor>& gates, const Step& step,
                        int64_t rows) const;
  // Rotates this layer's keys and values of the step's tokens and writes
  // them into the cache: all KV heads for wide rows, the narrow width only
  // (its projection rows only) for narrow rows.
  // `kv`, when defined: the step's keys and values already projected
  // ([N, 2 KV D], from the kvq product; only when no row is narrow).
  void WriteKeysValues(int64_t layer_index, const Layer& layer,
                       const at::Tensor& x, const Step& step, KvCache& cache,
                       const at::Tensor& kv = at::Tensor()) const;
  at::Tensor Attention(int64_t layer_index, const Layer& layer,
                       const at::Tensor& x, const Step& step, KvCache& cache,
                       at::Tensor* gates) const;
  // The shared heads S when every row of the step is at K = 0 in `layer`
  // (max_top_k) and S fills whole KV groups: then only those heads have
  // gates and only their groups need reading. 0 otherwise.
  int64_t SharedOnlyHeads(const Layer& layer, int64_t max_top_k) const;
  // Attention() of such a layer on the dense path: the shared heads' queries,
  // KV groups and W_o columns only (every KV head is still stored).
  at::Tensor SharedHeadsAttention(int64_t layer_index, const Layer& layer,
                                  const at::Tensor& x, const Step& step,
                                  KvCache& cache, int64_t shared,
                                  at::Tensor* gates) const;
  // A decode step's attention through the paged kernel (CUDA), rows stored
  // narrow through their view (NarrowView) and wide ones through the
  // caches, queries [B, h, D] rotated, gates [B, h]: [B, h, D], gated (the
  // kernel leaves out the KV groups of a row whose gates are all 0);
  // undefined where the kernel does not serve them (PagedDecodeServes).
  at::Tensor PagedDecodeRows(const at::Tensor& queries,
                             const at::Tensor& key_cache,
                             const at::Tensor& value_cache,
                             const NarrowRows& narrow, const Step& step,
                             const at::Tensor& gates) const;
  // The step's queries q [N, h, D] (before RoPE) rotated, once this
  // layer's keys and values (kv as WriteKeysValues') are rotated and stored
  // and *gates, where undefined, are the router's (RouterGates): on CUDA one
  // kernel for the three where it takes the tensors (cuda_fused_ops_, kv
  // projected: FusedAttentionPrologue).
  at::Tensor PrepareAttention(int64_t layer_index, const Layer& layer,
                              const at::Tensor& x, const at::Tensor& q,
                              const at::Tensor& kv, const Step& step,
                              KvCache& cache, at::Tensor* gates) const;
  // Dense attention of the step's rotated queries [N, h, D] over caches of
  // h / G KV heads, each head's output times its gate (gates [N, h]):
  // [N, h, D].
  at::Tensor DenseHeads(const at::Tensor& rotated, const at::Tensor& key_cache,
                        const at::Tensor& value_cache, const NarrowRows& narrow,
                        const Step& step, const at::Tensor& gates) const;

  LlamaConfig config_;
  at::TensorOptions options_;
  std::unique_ptr<DeviceContext> context_;
  LinearWeight embed_tokens_;  // [V, C]
  LinearWeight lm_head_;       // [V, C] (aliases embed_tokens_ when tied)
  at::Tensor final_norm_;
  at::Tensor rope_cos_, rope_sin_;  // float32 [max_pos, head_dim]
  std::vector<Layer> layers_;
  AttentionMode attention_mode_ = AttentionMode::kAuto;
  int64_t attention_workspace_bytes_ = kDefaultAttentionWorkspaceBytes;
  at::ScalarType kv_cache_dtype_ = at::typeMetaToScalarType(options_.dtype());
  WeightFormat linear_weights_ = WeightFormat::kAsLoaded;
  int64_t narrow_kv_heads_ = 0;
  int64_t max_cuda_graphs_ = kDefaultCudaGraphs;
  bool cuda_paged_decode_ = true;
  bool cuda_fused_ops_ = true;
  bool cuda_varlen_prefill_ = true;
  bool cuda_skinny_linear_ = true;
  bool graph_rows_everywhere_ = false;
  std::unique_ptr<StepGraphs> graphs_;
};

}  // namespace moh
