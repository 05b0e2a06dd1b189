// The policy half of continuous batching (SPEC §4), after vLLM v1's scheduler
// contract: Schedule(now) returns the plan of one step, Update() consumes what
// the model made of it. It decides which requests leave (cancelled, past their
// deadline), which queued ones take a slot (by free slots and KV memory),
// which run at their activation floor (adaptive activation), and which rows
// the step computes (every decode row, then prompt chunks under
// prefill_token_budget).
//
// KV memory comes in two forms. Slots (kv_blocks 0): each request holds
// prompt + max_outputs positions of a max_seq_len slot. Paged (kv_blocks >
// 0): the cache is kv_blocks blocks of kv_block_size positions
// (KvBlockPool); a request is admitted when the blocks it can need at most
// (prompt + max_outputs, less the blocks of its prompt already cached) fit
// beside what running requests hold and may still need, and its blocks are
// allocated as it grows, so admission never over-commits and nothing is
// preempted. With prefix caching, whole blocks of a sequence (its prompt,
// then the tokens it generated: a conversation's next turn starts with both)
// are registered once computed, under the key of the activation that
// computed them (later
// layers' keys and values depend on the routed heads), and a request whose
// prompt starts with registered blocks under the same key reads them instead
// of computing them; they are evicted least recently used first when free
// blocks run out.
//
// A step that runs out of memory can be planned again smaller (ShrinkSteps):
// steps then compute at most half its tokens for a while, the limit doubling
// back after steps that ran.
//
// The ratio ceiling: a request whose KV is stored narrow (PlannedWork::
// kv_fold > 1: it can never read the routed KV heads, so it stores only the
// shared ones) holds kv_block_size * kv_fold of its positions per block, so
// it needs kv_fold times fewer blocks, and admission counts that. Its blocks
// are registered and matched at its fold only (kv_block_pool.h).
//
// Pure: no threads, no model, no clock of its own (time is an argument), so
// its tests run on a fake clock with a fake model. Any model whose work is a
// sequence of steps fits: a request with prompt_len 0 starts emitting at its
// first step (a diffusion sampler's step is a row of one token). The engine
// loop (engine_loop.h) owns the thread and calls it. Not thread-safe.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "service/engine/kv_block_pool.h"

namespace moh {

struct StepPlannerOptions {
  int32_t max_running = 1;           // sequences at once (slots)
  int32_t max_seq_len = 1;           // positions per sequence
  int32_t max_queued_requests = 1;   // waiting before RESOURCE_EXHAUSTED
  int32_t prefill_token_budget = 1;  // prompt tokens per step, >= 1
  int32_t adaptive_queue_depth = 0;  // 0 = adaptive activation off
  // Paged KV: blocks of kv_block_size positions (both >= 1;
  // kv_blocks * kv_block_size >= max_seq_len); kv_blocks 0 = slots.
  int32_t kv_blocks = 0;
  int32_t kv_block_size = 0;
  bool prefix_caching = false;  // paged only
  // Model rows a step computes at most, summed over running requests'
  // rows_per_step (0: no limit but max_running). A request needing more
  // than the whole budget runs alone.
  int32_t max_step_rows = 0;
};

// What the planner knows of a request.
struct PlannedWork {
  int32_t prompt_len = 0;   // tokens to prefill before the first output
  int32_t max_outputs = 1;  // outputs at most (max_new_tokens, or steps)
  absl::Time deadline = absl::InfiniteFuture();
  bool can_lower = false;  // its activation has a floor below its ratio
  // Model rows it adds to every step (a guided image request: 2).
  int32_t rows_per_step = 1;
  // Prefix caching: the prompt (empty: not shared) and the keys of the KV
  // it computes at its activation and at its floor (when lowered).
  std::vector<int32_t> prompt_tokens;
  uint64_t prefix_key = 0;
  uint64_t lowered_prefix_key = 0;
  // Prefix caching: whether it reads cached blocks of its prompt (false: it
  // computes its whole prompt, e.g. for the prompt's log-probabilities; its
  // blocks are still registered for others).
  bool read_prefix = true;
  // Positions of it one block holds, in units of kv_block_size: 1 (full
  // width), or the model's narrow fold when it stores only the shared KV
  // heads (the ratio ceiling; paged only). Fixed at submission: lowering
  // never widens it.
  int32_t kv_fold = 1;
  // Admission order: higher first, first come first within a priority.
  int32_t priority = 0;
  // The request whose prompt this one shares (the first sample of its
  // group), or 0. It is admitted only once that one has computed its prompt
  // (or left), at that one's activation, so that it reads the prompt's
  // blocks from the prefix cache instead of computing them again.
  uint64_t after = 0;
  // KV positions it holds from admission to its end: the most it can fill.
  int64_t reserved() const { return int64_t{prompt_len} + max_outputs; }
};

// One row of a step.
struct PlannedRow {
  uint64_t id = 0;
  int32_t slot = 0;
  int32_t start = 0;       // positions already cached
  int32_t num_tokens = 0;  // tokens this step computes
  bool prefill = false;    // a prompt chunk (else a decode row)
  bool emits = false;      // yields an output: decode rows, a prompt's end
  // Paged: the request's blocks, covering positions [0, start + num_tokens).
  std::vector<int32_t> blocks;
};

// The tokens `rows` compute.
int64_t PlannedTokens(const std::vector<PlannedRow>& rows);

// A request leaving before the step.
struct EndedRequest {
  uint64_t id = 0;
  // OK: cancelled. DEADLINE_EXCEEDED, or UNAVAILABLE at shutdown.
  absl::Status status;
  bool was_running = false;  // held a slot (it may have streamed output)
};

struct AdmittedRequest {
  uint64_t id = 0;
  int32_t slot = 0;
  bool lowered = false;   // runs at its activation floor
  absl::Duration queued;  // time it waited
  // Prefix caching: prompt tokens looked up, and those found cached (its
  // rows start after them).
  int32_t prefix_queried = 0;
  int32_t prefix_hit = 0;
};

struct StepPlan {
  std::vector<EndedRequest> ended;  // in this order: queued, then running
  std::vector<AdmittedRequest> admitted;
  std::vector<PlannedRow> rows;  // decode rows, then prompt chunks
  int64_t decode_rows() const;
  int64_t prefill_rows() const;
};

class StepPlanner {
 public:
  // `options` must be in range (see LanguageExecutor::Create).
  explicit StepPlanner(const StepPlannerOptions& options);

  // Queues request `id` behind those of its priority or higher. The caller
  // checks the queue limit and that the work fits a sequence (reserved() <=
  // max_seq_len).
  void Enqueue(uint64_t id, const PlannedWork& work, absl::Time now);
  // The request leaves at the next Schedule() (OK status). Unknown ids:
  // ignored.
  void Cancel(uint64_t id);

  // Ends cancelled and expired requests, admits queued ones into free slots,
  // and lays out the next step's rows.
  StepPlan Schedule(absl::Time now);
  // The step ran: `finished[i]` says whether rows[i]'s request produced its
  // last output, `emitted[i]` (when given) the token it emitted (>= 0), so
  // that blocks of generated tokens are registered too. Returns the ids that
  // finished (their slots are free).
  std::vector<uint64_t> Update(const StepPlan& plan,
                               const std::vector<bool>& finished,
                               const std::vector<int32_t>& emitted = {});
  // The step failed: every request with a row in it leaves. Returns them.
  std::vector<uint64_t> Fail(const StepPlan& plan);
  // The step ran out of memory and left its requests as they were: their
  // rows are planned again, and later steps compute at most half its tokens
  // (decode rows and prompt chunks together; the decode rows a step leaves
  // out go first in the next), until kStepsBeforeRaising steps have run
  // without failing, when the limit doubles, and so on until it is off.
  // False when `plan` computed a single token, which no smaller step can:
  // then nothing changes (the caller fails its request).
  bool ShrinkSteps(const StepPlan& plan);
  static constexpr int64_t kStepsBeforeRaising = 32;
  // The most tokens a step computes since ShrinkSteps (0: no such limit).
  int64_t step_token_limit() const { return step_token_limit_; }
  // Every request, queued then running, leaves: returns their ids.
  std::vector<EndedRequest> Shutdown();

  int64_t num_waiting() const { return queue_.size(); }
  int64_t num_running() const { return running_.size(); }
  bool idle() const { return queue_.empty() && running_.empty(); }
  // KV positions held by running requests, of total_positions(): slots:
  // prompt + max_outputs each, of max_running * max_seq_len; paged: the
  // blocks in use and those running requests may still need, of every block.
  int64_t reserved_positions() const;
  int64_t total_positions() const;
  // Paged: blocks held by requests; blocks free but holding a cached prefix.
  int64_t blocks_in_use() const { return paged() ? pool_->num_used() : 0; }
  int64_t blocks_cached() const { return paged() ? pool_->num_cached() : 0; }

 private:
  struct Queued {
    uint64_t id;
    PlannedWork work;
    absl::Time enqueued;
  };
  struct Running {
    PlannedWork work;
    int32_t slot = 0;
    int32_t cached = 0;
    uint64_t order = 0;  // admission order: prompt chunks go first-come
    // Paged: its block table; blocks it may still allocate; its tokens
    // (prompt, then those it emitted) and the key their blocks register
    // under; how many blocks are registered (or were found cached), and
    // whether registering goes on.
    std::vector<int32_t> blocks;
    std::vector<int32_t> tokens;
    int64_t to_allocate = 0;
    uint64_t prefix_key = 0;
    int32_t registered = 0;
    bool registering = false;
    bool lowered = false;  // runs at its activation floor
  };

  bool paged() const { return pool_ != nullptr; }
  // Paged: positions of `work` one of its blocks holds.
  int64_t BlockPositions(const PlannedWork& work) const {
    return int64_t{pool_->block_size()} * work.kv_fold;
  }
  // Paged: whether `running`'s work fits the blocks (its cached prefix taken
  // into account); if so, takes them (and its prompt tokens, into
  // running.tokens). Fills the prefix fields of `admitted`.
  bool TakeBlocks(Running& running, AdmittedRequest& admitted);
  // Whether queued `work` must wait for the request it comes after to
  // compute its prompt; sets `*lowered` to that one's when it is running.
  bool WaitsForPrompt(const PlannedWork& work, bool* lowered) const;
  // Paged: allocates blocks until `running` covers `positions`.
  void Grow(Running& running, int64_t positions);
  // Paged: registers the blocks `running` has completed (their keys and
  // values computed, their tokens known).
  void RegisterBlocks(Running& running);
  // Schedule's three steps: the requests that leave (cancelled, past their
  // deadline), the queued ones admitted, the rows of the step.
  void EndLeaving(absl::Time now, StepPlan& plan);
  void AdmitQueued(absl::Time now, StepPlan& plan);
  void PlanRows(StepPlan& plan);
  // Appends `row` of `running` to the plan (paged: with its blocks, grown to
  // cover the row).
  void AddRow(PlannedRow row, Running& running, StepPlan& plan);
  void Release(uint64_t id);

  const StepPlannerOptions options_;
  std::deque<Queued> queue_;
  std::unordered_map<uint64_t, Running> running_;
  std::unordered_set<uint64_t> cancelled_;
  std::vector<uint64_t> slot_owner_;   // id per slot; 0 = free
  int64_t reserved_ = 0;               // slots: positions held
  int64_t step_rows_ = 0;              // rows_per_step of the running
  std::unique_ptr<KvBlockPool> pool_;  // paged
  int64_t blocks_to_allocate_ = 0;     // paged: sum of Running::to_allocate
  uint64_t next_order_ = 0;
  // Out of memory (ShrinkSteps): the most tokens a step computes (0: no
  // limit but the options'), the steps run since it last changed, and the
  // slot the decode rows of the next step start from.
  int64_t step_token_limit_ = 0;
  int64_t steps_at_limit_ = 0;
  int32_t first_decode_slot_ = 0;
};

}  // namespace moh
