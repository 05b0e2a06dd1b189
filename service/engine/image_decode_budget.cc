#include "service/engine/image_decode_budget.h"

#include <utility>

#include "absl/strings/str_format.h"

namespace moh {
namespace {

double MiB(int64_t bytes) { return static_cast<double>(bytes) / (1 << 20); }

}  // namespace

ImageDecodeBudget::Reservation::Reservation(Reservation&& other) noexcept
    : budget_(std::exchange(other.budget_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)) {}

ImageDecodeBudget::Reservation& ImageDecodeBudget::Reservation::operator=(
    Reservation&& other) noexcept {
  if (this != &other) {
    Release();
    budget_ = std::exchange(other.budget_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

ImageDecodeBudget::Reservation::~Reservation() { Release(); }

void ImageDecodeBudget::Reservation::Release() {
  if (budget_ == nullptr) return;
  absl::MutexLock lock(&budget_->mu_);
  budget_->reserved_bytes_ -= bytes_;
  budget_ = nullptr;
  bytes_ = 0;
}

ImageDecodeBudget::ImageDecodeBudget(int64_t capacity_bytes)
    : capacity_bytes_(capacity_bytes) {}

absl::StatusOr<ImageDecodeBudget::Reservation> ImageDecodeBudget::Reserve(
    int64_t bytes) {
  if (bytes > capacity_bytes_) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "image needs %.1f MiB to decode, more than the whole decode budget "
        "(image_decode_memory_mb: %g)",
        MiB(bytes), MiB(capacity_bytes_)));
  }
  absl::MutexLock lock(&mu_);
  if (bytes > capacity_bytes_ - reserved_bytes_) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "image needs %.1f MiB to decode and other decodes hold %.1f MiB of "
        "the decode budget (image_decode_memory_mb: %g); retry later",
        MiB(bytes), MiB(reserved_bytes_), MiB(capacity_bytes_)));
  }
  reserved_bytes_ += bytes;
  return Reservation(this, bytes);
}

int64_t ImageDecodeBudget::reserved_bytes() const {
  absl::MutexLock lock(&mu_);
  return reserved_bytes_;
}

}  // namespace moh
