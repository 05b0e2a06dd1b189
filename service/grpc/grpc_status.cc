#include "service/grpc/grpc_status.h"

#include "base/utf8.h"

namespace moh {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()),
                      LossyUtf8(status.message()));
}

}  // namespace moh
