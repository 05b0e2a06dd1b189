// Early-return helpers for absl::Status / absl::StatusOr.
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define MOH_CONCAT_INNER(a, b) a##b
#define MOH_CONCAT(a, b) MOH_CONCAT_INNER(a, b)

// Returns from the enclosing function if `expr` (an absl::Status) is not OK.
#define MOH_RETURN_IF_ERROR(expr)              \
  do {                                         \
    ::absl::Status moh_status_ = (expr);       \
    if (!moh_status_.ok()) return moh_status_; \
  } while (0)

// `lhs = value of expr` (an absl::StatusOr<T>), or returns its error.
#define MOH_ASSIGN_OR_RETURN(lhs, expr) \
  MOH_ASSIGN_OR_RETURN_IMPL(MOH_CONCAT(moh_statusor_, __LINE__), lhs, expr)
#define MOH_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                              \
  if (!tmp.ok()) return tmp.status();             \
  lhs = std::move(tmp).value()
