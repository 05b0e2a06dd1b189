#include "service/grpc/unparsable_requests.h"

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
  // `message_type` outlives the interceptor (the factory's).
  UnparsableRequestInterceptor(Metrics* metrics, Rpc rpc,
                               const std::string& message_type)
      : metrics_(metrics), rpc_(rpc), message_type_(message_type) {}

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
  const std::string& message_type_;
  bool unparsable_ = false;
};

}  // namespace

UnparsableRequestCounter::UnparsableRequestCounter(Metrics* metrics)
    : metrics_(metrics),
      methods_({
          {absl::StrCat("/", v1::Inference::service_full_name(), "/Generate"),
           Rpc::kGenerate, v1::GenerateRequest::descriptor()->full_name()},
          {absl::StrCat("/", v1::Inference::service_full_name(), "/Classify"),
           Rpc::kClassify, v1::ClassifyRequest::descriptor()->full_name()},
          {absl::StrCat("/", v1::Inference::service_full_name(),
                        "/GenerateImage"),
           Rpc::kGenerateImage,
           v1::GenerateImageRequest::descriptor()->full_name()},
      }) {}

grpc::experimental::Interceptor*
UnparsableRequestCounter::CreateServerInterceptor(
    grpc::experimental::ServerRpcInfo* info) {
  const absl::string_view path = info->method();
  for (const Method& method : methods_) {
    if (path == method.path) {
      return new UnparsableRequestInterceptor(metrics_, method.rpc,
                                              method.message_type);
    }
  }
  return nullptr;
}

}  // namespace moh
