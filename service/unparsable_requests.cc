#include "service/unparsable_requests.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "moh/v1/inference.grpc.pb.h"
#include "moh/v1/inference.pb.h"

namespace moh {
namespace {

using grpc::experimental::InterceptionHookPoints;

class UnparsableRequestInterceptor : public grpc::experimental::Interceptor {
 public:
  UnparsableRequestInterceptor(Metrics* metrics, Rpc rpc,
                               std::string message_type)
      : metrics_(metrics), rpc_(rpc), message_type_(std::move(message_type)) {}

  void Intercept(
      grpc::experimental::InterceptorBatchMethods* methods) override {
    // The server hands interceptors the parsed request, or null when the
    // bytes did not parse.
    if (methods->QueryInterceptionHookPoint(
            InterceptionHookPoints::POST_RECV_MESSAGE) &&
        methods->GetRecvMessage() == nullptr) {
      unparsable_ = true;
    }
    if (unparsable_ && methods->QueryInterceptionHookPoint(
                           InterceptionHookPoints::PRE_SEND_STATUS)) {
      methods->ModifySendStatus(grpc::Status(
          grpc::StatusCode::INVALID_ARGUMENT,
          absl::StrCat("request: the message is not a valid ", message_type_,
                       " (it could not be parsed)")));
      metrics_->RequestWithoutModel(rpc_, absl::StatusCode::kInvalidArgument);
    }
    methods->Proceed();
  }

 private:
  Metrics* const metrics_;
  const Rpc rpc_;
  const std::string message_type_;
  bool unparsable_ = false;
};

}  // namespace

grpc::experimental::Interceptor*
UnparsableRequestCounter::CreateServerInterceptor(
    grpc::experimental::ServerRpcInfo* info) {
  const absl::string_view method = info->method();
  const std::string service =
      absl::StrCat("/", v1::Inference::service_full_name(), "/");
  if (method == service + "Generate") {
    return new UnparsableRequestInterceptor(
        metrics_, Rpc::kGenerate,
        v1::GenerateRequest::descriptor()->full_name());
  }
  if (method == service + "Classify") {
    return new UnparsableRequestInterceptor(
        metrics_, Rpc::kClassify,
        v1::ClassifyRequest::descriptor()->full_name());
  }
  return nullptr;
}

}  // namespace moh
