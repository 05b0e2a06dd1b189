#include "service/engine/step_planner.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "service/config/config_limits.h"
#include "service/engine/adaptive_activation.h"

namespace moh {

int64_t PlannedTokens(const std::vector<PlannedRow>& rows) {
  int64_t tokens = 0;
  for (const PlannedRow& row : rows) tokens += row.num_tokens;
  return tokens;
}

int64_t StepPlan::decode_rows() const {
  return std::count_if(rows.begin(), rows.end(),
                       [](const PlannedRow& r) { return !r.prefill; });
}

int64_t StepPlan::prefill_rows() const {
  return static_cast<int64_t>(rows.size()) - decode_rows();
}

StepPlanner::StepPlanner(const StepPlannerOptions& options)
    : options_(options), slot_owner_(options.max_running, 0) {
  if (options.kv_blocks > 0) {
    pool_ =
        std::make_unique<KvBlockPool>(options.kv_blocks, options.kv_block_size);
  }
}

int64_t StepPlanner::reserved_positions() const {
  if (!paged()) return reserved_;
  return (pool_->num_used() + blocks_to_allocate_) * pool_->block_size();
}

int64_t StepPlanner::total_positions() const {
  if (!paged()) return int64_t{options_.max_running} * options_.max_seq_len;
  return int64_t{pool_->num_blocks()} * pool_->block_size();
}

bool StepPlanner::TakeBlocks(Running& running, AdmittedRequest& admitted) {
  const PlannedWork& work = running.work;
  const int64_t block_size = BlockPositions(work);
  const uint64_t key =
      running.lowered ? work.lowered_prefix_key : work.prefix_key;
  const bool share = options_.prefix_caching && !work.prompt_tokens.empty();
  // At least the prompt's last token is computed: its logits are the first
  // output's.
  const std::vector<int32_t> hits =
      share && work.read_prefix
          ? pool_->Match(work.prompt_tokens.data(), work.prompt_len, key,
                         (work.prompt_len - 1) / block_size, work.kv_fold)
          : std::vector<int32_t>();
  const int64_t needed = config_limits::KvBlocksFor(
      work.reserved(), static_cast<int32_t>(block_size));
  const int64_t revived = std::count_if(
      hits.begin(), hits.end(),
      [this](int32_t block) { return pool_->refcount(block) == 0; });
  const int64_t fresh = needed - static_cast<int64_t>(hits.size());
  if (pool_->num_used() + revived + blocks_to_allocate_ + fresh >
      pool_->num_blocks()) {
    return false;
  }
  for (int32_t block : hits) pool_->Acquire(block);
  running.blocks = hits;
  running.to_allocate = fresh;
  blocks_to_allocate_ += fresh;
  running.cached = static_cast<int32_t>(hits.size() * block_size);
  running.prefix_key = key;
  running.registered = static_cast<int32_t>(hits.size());
  running.registering = share;
  if (share) {
    admitted.prefix_queried = work.prompt_len;
    admitted.prefix_hit = running.cached;
    running.tokens = std::move(running.work.prompt_tokens);
  }
  return true;
}

void StepPlanner::Grow(Running& running, int64_t positions) {
  while (static_cast<int64_t>(running.blocks.size()) *
             BlockPositions(running.work) <
         positions) {
    // Admission left a free block for every one a request may allocate.
    const int32_t block = pool_->Allocate();
    if (block < 0) return;
    running.blocks.push_back(block);
    --running.to_allocate;
    --blocks_to_allocate_;
  }
}

void StepPlanner::RegisterBlocks(Running& running) {
  const int64_t block_size = BlockPositions(running.work);
  const int64_t complete =
      std::min<int64_t>(running.cached, running.tokens.size()) / block_size;
  while (running.registering && running.registered < complete) {
    const int32_t i = running.registered;
    const int32_t parent = i == 0 ? -1 : running.blocks[i - 1];
    if (!pool_->Register(running.blocks[i], parent,
                         running.tokens.data() + i * block_size,
                         running.prefix_key, running.work.kv_fold)) {
      // The same prefix is registered by another request's blocks (computed
      // at the same time); this one's stay private.
      running.registering = false;
      return;
    }
    ++running.registered;
  }
}

void StepPlanner::Enqueue(uint64_t id, const PlannedWork& work,
                          absl::Time now) {
  auto behind = std::find_if(
      queue_.begin(), queue_.end(),
      [&work](const Queued& q) { return q.work.priority < work.priority; });
  queue_.insert(behind, Queued{id, work, now});
}

bool StepPlanner::WaitsForPrompt(const PlannedWork& work, bool* lowered) const {
  if (work.after == 0) return false;
  auto first = running_.find(work.after);
  if (first == running_.end()) {
    // Still queued (ahead of it) or gone: only a queued one is waited for.
    return std::any_of(queue_.begin(), queue_.end(),
                       [&work](const Queued& q) { return q.id == work.after; });
  }
  *lowered = first->second.lowered;
  return first->second.cached < first->second.work.prompt_len;
}

void StepPlanner::Cancel(uint64_t id) {
  const bool queued = std::any_of(queue_.begin(), queue_.end(),
                                  [id](const Queued& q) { return q.id == id; });
  if (queued || running_.count(id) != 0) cancelled_.insert(id);
}

StepPlan StepPlanner::Schedule(absl::Time now) {
  StepPlan plan;
  EndLeaving(now, plan);
  AdmitQueued(now, plan);
  PlanRows(plan);
  return plan;
}

void StepPlanner::EndLeaving(absl::Time now, StepPlan& plan) {
  // Queued requests that leave without ever being computed.
  for (auto it = queue_.begin(); it != queue_.end();) {
    absl::Status status;
    if (cancelled_.erase(it->id) != 0) {
      status = absl::OkStatus();
    } else if (it->work.deadline <= now) {
      status = absl::DeadlineExceededError(
          "deadline exceeded while waiting in the queue");
    } else {
      ++it;
      continue;
    }
    plan.ended.push_back(EndedRequest{it->id, status, false});
    it = queue_.erase(it);
  }
  // Running ones: cancellations first, then deadlines (in slot order).
  for (uint64_t id : slot_owner_) {
    if (id != 0 && cancelled_.count(id) != 0) {
      plan.ended.push_back(EndedRequest{id, absl::OkStatus(), true});
    }
  }
  for (uint64_t id : slot_owner_) {
    if (id != 0 && cancelled_.count(id) == 0 &&
        running_.at(id).work.deadline <= now) {
      plan.ended.push_back(EndedRequest{
          id,
          absl::DeadlineExceededError("deadline exceeded during generation"),
          true});
    }
  }
  for (const EndedRequest& ended : plan.ended) {
    if (ended.was_running) Release(ended.id);
  }
}

// Admission: by priority, then first come, into the lowest free slot, while
// its KV memory and its rows (max_step_rows) fit. Adaptive activation lowers
// a request that allows it when more than adaptive_queue_depth requests of its
// priority or higher wait (itself included) as it is admitted, so lower
// priorities are lowered first. A later sample of a group waits until the
// first has computed the prompt they share, and runs at its activation.
void StepPlanner::AdmitQueued(absl::Time now, StepPlan& plan) {
  int32_t slot = 0;
  while (!queue_.empty()) {
    while (slot < options_.max_running && slot_owner_[slot] != 0) ++slot;
    Queued& next = queue_.front();
    if (slot == options_.max_running ||
        (!paged() && reserved_ + next.work.reserved() > total_positions()) ||
        (options_.max_step_rows > 0 && step_rows_ > 0 &&
         step_rows_ + next.work.rows_per_step > options_.max_step_rows)) {
      return;
    }
    bool lowered = false;
    if (WaitsForPrompt(next.work, &lowered)) return;
    if (next.work.after == 0 || running_.count(next.work.after) == 0) {
      const int64_t waiting =
          std::count_if(queue_.begin(), queue_.end(), [&next](const Queued& q) {
            return q.work.priority >= next.work.priority;
          });
      lowered = LowerActivation(options_.adaptive_queue_depth, waiting,
                                next.work.can_lower);
    }
    AdmittedRequest admitted{next.id, slot, lowered, now - next.enqueued};
    Running running{std::move(next.work), slot, 0, next_order_};
    running.lowered = lowered;
    if (paged() && !TakeBlocks(running, admitted)) {
      next.work = std::move(running.work);  // waits for blocks
      return;
    }
    ++next_order_;
    plan.admitted.push_back(admitted);
    if (!paged()) reserved_ += running.work.reserved();
    step_rows_ += running.work.rows_per_step;
    running_[next.id] = std::move(running);
    slot_owner_[slot] = next.id;
    queue_.pop_front();
  }
}

// The step: a decode row per request past its prompt (slot order), then
// prompt chunks, first admitted first, under the prefill budget. Under a step
// token limit (ShrinkSteps) the decode rows start from the first one the last
// step left out, and prompt chunks have what the decode rows leave.
void StepPlanner::PlanRows(StepPlan& plan) {
  const int64_t limit = step_token_limit_ > 0
                            ? step_token_limit_
                            : std::numeric_limits<int64_t>::max();
  const int32_t slots = options_.max_running;
  int64_t tokens = 0;
  int32_t left_out = -1;  // the first slot whose decode row did not fit
  std::vector<Running*> prefilling;
  for (int32_t i = 0; i < slots; ++i) {
    const int32_t slot = (first_decode_slot_ + i) % slots;
    const uint64_t id = slot_owner_[slot];
    if (id == 0) continue;
    Running& r = running_.at(id);
    if (r.cached < r.work.prompt_len) {
      prefilling.push_back(&r);
    } else if (tokens < limit) {
      AddRow(PlannedRow{id, r.slot, r.cached, 1, false, true}, r, plan);
      ++tokens;
    } else if (left_out < 0) {
      left_out = slot;
    }
  }
  first_decode_slot_ = std::max(left_out, 0);
  std::sort(
      prefilling.begin(), prefilling.end(),
      [](const Running* a, const Running* b) { return a->order < b->order; });
  int32_t budget = static_cast<int32_t>(
      std::min<int64_t>(options_.prefill_token_budget, limit - tokens));
  for (Running* r : prefilling) {
    if (budget == 0) break;
    const int32_t n = std::min(r->work.prompt_len - r->cached, budget);
    budget -= n;
    AddRow(PlannedRow{slot_owner_[r->slot], r->slot, r->cached, n, true,
                      r->cached + n == r->work.prompt_len},
           *r, plan);
  }
}

void StepPlanner::AddRow(PlannedRow row, Running& running, StepPlan& plan) {
  if (paged()) {
    Grow(running, int64_t{row.start} + row.num_tokens);
    row.blocks = running.blocks;
  }
  plan.rows.push_back(std::move(row));
}

std::vector<uint64_t> StepPlanner::Update(const StepPlan& plan,
                                          const std::vector<bool>& finished,
                                          const std::vector<int32_t>& emitted) {
  std::vector<uint64_t> done;
  for (size_t i = 0; i < plan.rows.size(); ++i) {
    const PlannedRow& row = plan.rows[i];
    auto it = running_.find(row.id);
    if (it == running_.end()) continue;
    Running& r = it->second;
    r.cached += row.num_tokens;
    if (paged() && r.registering) {
      if (i < emitted.size() && emitted[i] >= 0) r.tokens.push_back(emitted[i]);
      RegisterBlocks(r);
    }
    if (i < finished.size() && finished[i]) done.push_back(row.id);
  }
  for (uint64_t id : done) Release(id);
  if (step_token_limit_ > 0 && ++steps_at_limit_ == kStepsBeforeRaising) {
    steps_at_limit_ = 0;
    step_token_limit_ *= 2;
    // Past every token a step can have: the limit is off.
    if (step_token_limit_ >=
        int64_t{options_.max_running} + options_.prefill_token_budget) {
      step_token_limit_ = 0;
    }
  }
  return done;
}

bool StepPlanner::ShrinkSteps(const StepPlan& plan) {
  const int64_t tokens = PlannedTokens(plan.rows);
  if (tokens <= 1) return false;
  step_token_limit_ = tokens / 2;
  steps_at_limit_ = 0;
  return true;
}

std::vector<uint64_t> StepPlanner::Fail(const StepPlan& plan) {
  std::vector<uint64_t> failed;
  for (const PlannedRow& row : plan.rows) {
    if (running_.count(row.id) == 0) continue;
    failed.push_back(row.id);
    Release(row.id);
  }
  return failed;
}

std::vector<EndedRequest> StepPlanner::Shutdown() {
  const absl::Status status = absl::UnavailableError("server shutting down");
  std::vector<EndedRequest> ended;
  for (const Queued& q : queue_) {
    ended.push_back(EndedRequest{q.id, status, false});
  }
  queue_.clear();
  for (uint64_t id : slot_owner_) {
    if (id != 0) ended.push_back(EndedRequest{id, status, true});
  }
  for (const EndedRequest& e : ended) {
    if (e.was_running) Release(e.id);
  }
  cancelled_.clear();
  return ended;
}

void StepPlanner::Release(uint64_t id) {
  auto it = running_.find(id);
  if (it == running_.end()) return;
  Running& r = it->second;
  slot_owner_[r.slot] = 0;
  if (paged()) {
    // Last block first: a shared prefix is evicted after the tails.
    for (auto block = r.blocks.rbegin(); block != r.blocks.rend(); ++block) {
      pool_->Release(*block);
    }
    blocks_to_allocate_ -= r.to_allocate;
  } else {
    reserved_ -= r.work.reserved();
  }
  step_rows_ -= r.work.rows_per_step;
  cancelled_.erase(id);
  running_.erase(it);
}

}  // namespace moh
