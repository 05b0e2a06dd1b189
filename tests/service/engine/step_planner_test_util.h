// What the StepPlanner tests share: a fake model that consumes a StepPlan
// the way the engine loop's executor does, without LibTorch.
#pragma once

#include <cstdint>
#include <map>
#include <vector>

#include "service/engine/step_planner.h"

namespace moh {

// The fake model: a request finishes after the number of outputs given to
// Expect(); Run() answers, row by row of a plan, whether that row's request
// finished (only rows that emit a token count).
class FakeModel {
 public:
  void Expect(uint64_t id, int32_t outputs) { remaining_[id] = outputs; }
  std::vector<bool> Run(const StepPlan& plan) {
    std::vector<bool> finished;
    for (const PlannedRow& row : plan.rows) {
      finished.push_back(row.emits && --remaining_[row.id] == 0);
    }
    return finished;
  }

 private:
  std::map<uint64_t, int32_t> remaining_;
};

}  // namespace moh
