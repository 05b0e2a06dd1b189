// A process-wide bound on the memory of images being decoded at once
// (config: image_decode_memory_mb). A decode reserves the bytes it will hold,
// estimated from the image's header, before it allocates them, and releases
// them when its Reservation is destroyed.
// Thread-safe; never blocks.
#pragma once

#include <cstdint>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace moh {

class ImageDecodeBudget {
 public:
  // Holds bytes of a budget until destroyed; move-only. The budget must
  // outlive it.
  class Reservation {
   public:
    Reservation(Reservation&& other) noexcept;
    Reservation& operator=(Reservation&& other) noexcept;
    Reservation(const Reservation&) = delete;
    Reservation& operator=(const Reservation&) = delete;
    ~Reservation();

    int64_t bytes() const { return bytes_; }

   private:
    friend class ImageDecodeBudget;
    Reservation(ImageDecodeBudget* budget, int64_t bytes)
        : budget_(budget), bytes_(bytes) {}
    void Release();

    ImageDecodeBudget* budget_;
    int64_t bytes_;
  };

  // `capacity_bytes` (> 0): the most bytes reserved at once.
  explicit ImageDecodeBudget(int64_t capacity_bytes);

  // Reserves `bytes` (>= 0), or answers RESOURCE_EXHAUSTED naming `image` and
  // the budget when they do not fit beside what is reserved now: load, which a
  // client may retry (unless `bytes` exceed the whole capacity, which the
  // message says).
  absl::StatusOr<Reservation> Reserve(int64_t bytes);

  int64_t capacity_bytes() const { return capacity_bytes_; }
  int64_t reserved_bytes() const;

 private:
  const int64_t capacity_bytes_;
  mutable absl::Mutex mu_;
  int64_t reserved_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace moh
