#include "service/step_planner.h"

#include <algorithm>

#include "service/adaptive_activation.h"

namespace moh {

int64_t StepPlan::decode_rows() const {
  return std::count_if(rows.begin(), rows.end(),
                       [](const PlannedRow& r) { return !r.prefill; });
}

int64_t StepPlan::prefill_rows() const {
  return static_cast<int64_t>(rows.size()) - decode_rows();
}

StepPlanner::StepPlanner(const StepPlannerOptions& options)
    : options_(options), slot_owner_(options.max_running, 0) {}

void StepPlanner::Enqueue(uint64_t id, const PlannedWork& work,
                          absl::Time now) {
  queue_.push_back(Queued{id, work, now});
}

void StepPlanner::Cancel(uint64_t id) {
  const bool queued = std::any_of(queue_.begin(), queue_.end(),
                                  [id](const Queued& q) { return q.id == id; });
  if (queued || running_.count(id) != 0) cancelled_.insert(id);
}

StepPlan StepPlanner::Schedule(absl::Time now) {
  StepPlan plan;
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

  // Admission: first come, into the lowest free slot, while its KV positions
  // fit. Adaptive activation lowers a request that allows it when more than
  // adaptive_queue_depth requests wait (itself included) as it is admitted.
  int32_t slot = 0;
  while (!queue_.empty()) {
    while (slot < options_.max_running && slot_owner_[slot] != 0) ++slot;
    const Queued& next = queue_.front();
    if (slot == options_.max_running ||
        reserved_ + next.work.reserved() > total_positions()) {
      break;
    }
    const int64_t waiting = queue_.size();
    const bool lowered = LowerActivation(options_.adaptive_queue_depth, waiting,
                                         next.work.can_lower);
    plan.admitted.push_back(
        AdmittedRequest{next.id, slot, lowered, now - next.enqueued});
    running_[next.id] = Running{next.work, slot, 0, next_order_++};
    slot_owner_[slot] = next.id;
    reserved_ += next.work.reserved();
    queue_.pop_front();
  }

  // The step: a decode row per request past its prompt (slot order), then
  // prompt chunks, first admitted first, under the prefill budget.
  std::vector<const Running*> prefilling;
  for (uint64_t id : slot_owner_) {
    if (id == 0) continue;
    const Running& r = running_.at(id);
    if (r.cached >= r.work.prompt_len) {
      plan.rows.push_back(PlannedRow{id, r.slot, r.cached, 1, false, true});
    } else {
      prefilling.push_back(&r);
    }
  }
  std::sort(
      prefilling.begin(), prefilling.end(),
      [](const Running* a, const Running* b) { return a->order < b->order; });
  int32_t budget = options_.prefill_token_budget;
  for (const Running* r : prefilling) {
    if (budget == 0) break;
    const int32_t n = std::min(r->work.prompt_len - r->cached, budget);
    budget -= n;
    plan.rows.push_back(PlannedRow{slot_owner_[r->slot], r->slot, r->cached, n,
                                   true, r->cached + n == r->work.prompt_len});
  }
  return plan;
}

std::vector<uint64_t> StepPlanner::Update(const StepPlan& plan,
                                          const std::vector<bool>& finished) {
  std::vector<uint64_t> done;
  for (size_t i = 0; i < plan.rows.size(); ++i) {
    const PlannedRow& row = plan.rows[i];
    auto it = running_.find(row.id);
    if (it == running_.end()) continue;
    it->second.cached += row.num_tokens;
    if (i < finished.size() && finished[i]) done.push_back(row.id);
  }
  for (uint64_t id : done) Release(id);
  return done;
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
  slot_owner_[it->second.slot] = 0;
  reserved_ -= it->second.work.reserved();
  cancelled_.erase(id);
  running_.erase(it);
}

}  // namespace moh
