#include "service/grpc/inference_service.h"

#include <atomic>
#include <memory>

#include "absl/time/clock.h"
#include "service/grpc/grpc_status.h"
#include "service/grpc/grpc_streaming_reactor.h"
#include "service/metrics/request_log.h"
#include "service/serving/dispatch.h"

namespace moh {
namespace {

v1::FinishReason ToProto(FinishReason reason) {
  switch (reason) {
    case FinishReason::kLength:
      return v1::LENGTH;
    case FinishReason::kStop:
      return v1::STOP;
    case FinishReason::kEos:
      return v1::EOS;
    case FinishReason::kCancelled:
      return v1::CANCELLED;
  }
  return v1::FINISH_REASON_UNSPECIFIED;
}

// The request's sampling fields into `call`: their values (an absent field
// takes gRPC's default) and which of them the request set.
void FromProto(const v1::SamplingParams& p, GenerateCall* call) {
  call->sampling_set = {p.has_temperature(), p.top_k() != 0, p.has_top_p(),
                        p.min_p() != 0.0f, p.has_repetition_penalty()};
  if (p.has_max_new_tokens()) call->max_new_tokens = p.max_new_tokens();
  SamplingParams& s = call->sampling;
  s.temperature = p.has_temperature() ? p.temperature() : 0.0f;
  s.top_k = p.top_k();
  s.top_p = p.has_top_p() ? p.top_p() : 1.0f;
  if (p.has_seed()) s.seed = p.seed();
  s.stop.assign(p.stop().begin(), p.stop().end());
  s.repetition_penalty =
      p.has_repetition_penalty() ? p.repetition_penalty() : 1.0f;
  s.stop_token_ids.assign(p.stop_token_ids().begin(), p.stop_token_ids().end());
  for (const auto& [id, bias] : p.logit_bias()) {
    s.logit_bias.emplace_back(id, bias);
  }
  s.ignore_eos = p.ignore_eos();
  s.min_tokens = p.min_tokens();
  s.min_p = p.min_p();
  s.presence_penalty = p.presence_penalty();
  s.frequency_penalty = p.frequency_penalty();
  if (p.has_logprobs()) s.logprobs = p.logprobs();
  if (p.has_prompt_logprobs()) s.prompt_logprobs = p.prompt_logprobs();
}

// Log-probability entries with their tokens' text.
void ToProto(const std::vector<LogprobEntry>& entries, const Servable& model,
             google::protobuf::RepeatedPtrField<v1::TokenLogprob>* out) {
  for (const LogprobEntry& e : entries) {
    v1::TokenLogprob* p = out->Add();
    p->set_token_id(e.token.id);
    p->set_token(model.TokenText(e.token.id));
    p->set_logprob(e.token.logprob);
    p->set_rank(e.rank);
    for (const TokenLogprob& top : e.top) {
      v1::TopLogprob* t = p->add_top_logprobs();
      t->set_token_id(top.id);
      t->set_token(model.TokenText(top.id));
      t->set_logprob(top.logprob);
    }
  }
}

// Generate: text chunks, then the summary.
struct GenerateTraits {
  using Request = v1::GenerateRequest;
  using Response = v1::GenerateResponse;
  static constexpr Rpc kRpc = Rpc::kGenerate;
  using Reactor = StreamingReactor<GenerateTraits>;

  class Observer : public GenerationObserver {
   public:
    explicit Observer(Reactor* reactor) : reactor_(reactor) {}
    void OnChunk(const GenerationChunk& chunk) override {
      v1::GenerateResponse response;
      response.set_index(chunk.index);
      response.set_text(chunk.text);
      response.mutable_token_ids()->Add(chunk.token_ids.begin(),
                                        chunk.token_ids.end());
      ToProto(chunk.logprobs, reactor_->model(), response.mutable_logprobs());
      ToProto(chunk.prompt_logprobs, reactor_->model(),
              response.mutable_prompt_logprobs());
      reactor_->Send(std::move(response), std::nullopt);
    }
    void OnFinished(const GenerationSummary& summary) override {
      v1::GenerateResponse response;
      response.set_index(summary.index);
      response.set_finish_reason(ToProto(summary.finish_reason));
      response.mutable_usage()->set_prompt_tokens(summary.prompt_tokens);
      response.mutable_usage()->set_completion_tokens(
          summary.completion_tokens);
      response.set_effective_activation_ratio(summary.effective_ratio);
      response.set_activation_ratio(summary.applied_ratio);
      if (reactor_->include_routing()) {
        *response.mutable_routing() =
            ToRouting(summary.head_tokens, reactor_->model().moh(),
                      summary.routed_tokens, {});
      }
      reactor_->Send(std::move(response),
                     summary.last
                         ? std::optional<absl::Status>(absl::OkStatus())
                         : std::nullopt);
    }
    void OnError(const absl::Status& status) override {
      reactor_->Send(std::nullopt, status);
    }

   private:
    Reactor* const reactor_;
  };

  static absl::StatusOr<uint64_t> Dispatch(const ModelManager& models,
                                           const Request& request,
                                           absl::Time deadline,
                                           Reactor* reactor,
                                           Dispatched* dispatched) {
    GenerateCall call;
    if (!request.prompt().empty()) call.prompt = request.prompt();
    if (!request.token_ids().empty()) {
      call.token_ids.emplace(request.token_ids().begin(),
                             request.token_ids().end());
    }
    FromProto(request.sampling(), &call);
    call.ratio = request.activation().ratio();
    call.min_ratio = request.activation().min_ratio();
    call.deadline = deadline;
    call.n = request.n() == 0 ? 1 : request.n();
    call.priority = request.priority();
    const v1::ResponseFormat& format = request.response_format();
    if (format.has_json_object()) {
      call.response_format.type = ResponseFormat::Type::kJsonObject;
    } else if (format.has_json_schema()) {
      call.response_format = {ResponseFormat::Type::kJsonSchema,
                              format.json_schema().schema()};
    }
    return DispatchGenerate(models, request.model(), std::move(call),
                            std::nullopt, std::make_shared<Observer>(reactor),
                            dispatched);
  }
  static void Cancel(Servable* model, uint64_t id) {
    model->CancelGenerate(id);
  }
  // A message carries the text and ids "since the previous message" of its
  // sample; the last one also the summary.
  static bool CanCoalesce(const Response& queued, const Response& response) {
    return queued.index() == response.index();
  }
  static void Coalesce(Response& next, Response response) {
    std::string text = next.text() + response.text();
    next.MergeFrom(response);  // ids appended; the summary's fields set
    next.set_text(std::move(text));
  }
};

// GenerateImage: progress messages, then the image.
struct GenerateImageTraits {
  using Request = v1::GenerateImageRequest;
  using Response = v1::GenerateImageResponse;
  static constexpr Rpc kRpc = Rpc::kGenerateImage;
  using Reactor = StreamingReactor<GenerateImageTraits>;

  class Observer : public ImageObserver {
   public:
    Observer(Reactor* reactor, bool progress)
        : reactor_(reactor), progress_(progress) {}
    void OnProgress(int32_t step, int32_t steps) override {
      if (!progress_ || step == steps) return;  // the last message says it
      v1::GenerateImageResponse response;
      response.set_step(step);
      response.set_steps(steps);
      reactor_->Send(std::move(response), std::nullopt);
    }
    void OnFinished(const ImageResult& result) override {
      v1::GenerateImageResponse response;
      response.set_step(result.steps);
      response.set_steps(result.steps);
      response.set_png(result.png);
      response.set_width(result.width);
      response.set_height(result.height);
      response.set_class_index(static_cast<int32_t>(result.class_id));
      response.set_seed(result.seed);
      response.set_guidance_scale(result.guidance);
      response.set_activation_ratio(result.applied_ratio);
      response.set_effective_activation_ratio(result.effective_ratio);
      if (reactor_->include_routing()) {
        *response.mutable_routing() =
            ToRouting(result.head_tokens, reactor_->model().moh(),
                      result.routed_tokens, {});
      }
      v1::ImageTimings* timings = response.mutable_timings();
      timings->set_queue_seconds(absl::ToDoubleSeconds(result.queued));
      timings->set_sampling_seconds(absl::ToDoubleSeconds(result.sampling));
      timings->set_decode_seconds(absl::ToDoubleSeconds(result.decoding));
      reactor_->Send(std::move(response), absl::OkStatus());
    }
    void OnError(const absl::Status& status) override {
      reactor_->Send(std::nullopt, status);
    }

   private:
    Reactor* const reactor_;
    const bool progress_;
  };

  static absl::StatusOr<uint64_t> Dispatch(const ModelManager& models,
                                           const Request& request,
                                           absl::Time deadline,
                                           Reactor* reactor,
                                           Dispatched* dispatched) {
    GenerateImageCall call;
    switch (request.condition_case()) {
      case v1::GenerateImageRequest::kClassIndex:
        call.class_index = request.class_index();
        break;
      case v1::GenerateImageRequest::kClassLabel:
        call.class_label = request.class_label();
        break;
      case v1::GenerateImageRequest::CONDITION_NOT_SET:
        break;
    }
    if (request.has_seed()) call.seed = request.seed();
    call.steps = request.steps();
    if (request.has_guidance_scale()) call.guidance = request.guidance_scale();
    call.ratio = request.activation().ratio();
    call.min_ratio = request.activation().min_ratio();
    call.deadline = deadline;
    return DispatchGenerateImage(
        models, request.model(), std::move(call),
        std::make_shared<Observer>(reactor, request.progress()), dispatched);
  }
  static void Cancel(Servable* model, uint64_t id) {
    model->CancelGenerateImage(id);
  }
  // Progress while a write is in flight: only the latest step matters.
  static bool CanCoalesce(const Response&, const Response&) { return true; }
  static void Coalesce(Response& next, Response response) {
    next = std::move(response);
  }
};

ClassifyCall FromProto(const v1::ClassifyRequest& request) {
  ClassifyCall call;
  switch (request.input_case()) {
    case v1::ClassifyRequest::kImage:
      call.image = request.image();
      break;
    case v1::ClassifyRequest::kPixels:
      call.pixels.emplace(std::vector<int64_t>(request.pixels().shape().begin(),
                                               request.pixels().shape().end()),
                          std::vector<float>(request.pixels().data().begin(),
                                             request.pixels().data().end()));
      break;
    case v1::ClassifyRequest::kText:
      call.text = request.text();
      break;
    case v1::ClassifyRequest::INPUT_NOT_SET:
      break;
  }
  call.labels.assign(request.labels().begin(), request.labels().end());
  call.top_n = request.top_n();
  call.ratio = request.activation().ratio();
  call.min_ratio = request.activation().min_ratio();
  return call;
}

}  // namespace

v1::Routing ToRouting(const std::vector<int64_t>& head_tokens,
                      const MohConfig& moh, int64_t tokens,
                      const std::vector<int64_t>& layer_tokens) {
  v1::Routing routing;
  routing.set_tokens(tokens);
  const size_t num_layers = moh.layers.size();
  if (num_layers == 0 || head_tokens.size() % num_layers != 0) return routing;
  const size_t stride = head_tokens.size() / num_layers;
  for (size_t l = 0; l < num_layers; ++l) {
    const MohLayerConfig& config = moh.layers[l];
    const size_t heads =
        std::min<size_t>(stride, static_cast<size_t>(config.num_heads));
    v1::LayerRouting* layer = routing.add_layers();
    layer->set_layer(l);
    if (config.stage >= 0) {
      layer->set_stage(config.stage);
      layer->set_block(config.block);
    }
    layer->set_tokens(l < layer_tokens.size() ? layer_tokens[l] : tokens);
    layer->mutable_head_tokens()->Add(head_tokens.begin() + l * stride,
                                      head_tokens.begin() + l * stride + heads);
  }
  return routing;
}

grpc::ServerWriteReactor<v1::GenerateResponse>* InferenceService::Generate(
    grpc::CallbackServerContext* context, const v1::GenerateRequest* request) {
  CallArrived();
  return new GenerateTraits::Reactor(models_, workers_, context, request,
                                     Authenticate(context));
}

grpc::ServerWriteReactor<v1::GenerateImageResponse>*
InferenceService::GenerateImage(grpc::CallbackServerContext* context,
                                const v1::GenerateImageRequest* request) {
  CallArrived();
  return new GenerateImageTraits::Reactor(models_, workers_, context, request,
                                          Authenticate(context));
}

absl::Status InferenceService::Authenticate(
    const grpc::CallbackServerContext* context) const {
  if (auth_ == nullptr) return absl::OkStatus();
  return auth_->Check(context->client_metadata());
}

grpc::ServerUnaryReactor* InferenceService::Classify(
    grpc::CallbackServerContext* context, const v1::ClassifyRequest* request,
    v1::ClassifyResponse* response) {
  CallArrived();
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  const absl::Time start = absl::Now();
  std::string request_id = CallRequestId(context);
  const absl::Status auth = Authenticate(context);
  // gRPC keeps the request, response and context until Finish.
  absl::Status queued =
      auth.ok() ? workers_->Run([this, context, request, response, reactor,
                                 start, request_id] {
        // The last resort, as for the streaming calls: before the request
        // reaches a model (which then finishes the call), an exception ends
        // this call alone.
        auto handed = std::make_shared<std::atomic<bool>>(false);
        try {
          StartClassify(context, *request, response, reactor, start, request_id,
                        handed);
        } catch (const std::exception& e) {
          ClassifyUnexpected(reactor, *request, start, request_id, *handed,
                             e.what());
        } catch (...) {
          ClassifyUnexpected(reactor, *request, start, request_id, *handed,
                             "unknown exception");
        }
      })
                : auth;
  if (!queued.ok()) {
    RecordRequest(nullptr, models_->metrics(), Rpc::kClassify, request->model(),
                  queued.code(), start, request_id);
    reactor->Finish(ToGrpcStatus(queued));
  }
  return reactor;
}

void InferenceService::ClassifyUnexpected(grpc::ServerUnaryReactor* reactor,
                                          const v1::ClassifyRequest& request,
                                          absl::Time start,
                                          const std::string& request_id,
                                          bool handed, const char* what) {
  const absl::Status error = UnexpectedException("Classify", request_id, what);
  if (handed) return;  // the model finishes the call
  RecordRequest(nullptr, models_->metrics(), Rpc::kClassify, request.model(),
                absl::StatusCode::kInternal, start, request_id);
  reactor->Finish(ToGrpcStatus(error));
}

void InferenceService::StartClassify(
    grpc::CallbackServerContext* context, const v1::ClassifyRequest& request,
    v1::ClassifyResponse* response, grpc::ServerUnaryReactor* reactor,
    absl::Time start, const std::string& request_id,
    const std::shared_ptr<std::atomic<bool>>& handed) {
  ClassifyCall call = FromProto(request);
  call.deadline = Deadline(context);
  call.cancelled = [context] { return context->IsCancelled(); };
  const bool include_routing = request.include_routing();
  // The model, once dispatch.h has found it (before `done` can run).
  auto dispatched = std::make_shared<Dispatched>();
  Metrics* const server = models_->metrics();
  auto finish = [reactor, server, start, dispatched,
                 request_id](const absl::Status& status) {
    const Servable* model = dispatched->servable;
    RecordRequest(model != nullptr ? model->metrics() : nullptr, server,
                  Rpc::kClassify, dispatched->model, status.code(), start,
                  request_id);
    reactor->Finish(ToGrpcStatus(status));
  };
  // From here the model may finish the call: an exception is left to it
  // (finding the model allocates at most a name, before it can throw).
  handed->store(true);
  absl::Status status = DispatchClassify(
      *models_, request.model(), std::move(call),
      [response, finish, include_routing,
       dispatched](absl::StatusOr<ClassifyResult> result) {
        const Servable* model = dispatched->servable;
        if (!result.ok()) {
          finish(result.status());
          return;
        }
        for (const ClassScoreResult& c : result->classes) {
          v1::ClassScore* score = response->add_classes();
          score->set_label(c.label);
          score->set_index(c.index);
          score->set_score(c.score);
          score->set_log_likelihood(c.log_likelihood);
        }
        response->set_effective_activation_ratio(result->effective_ratio);
        response->set_activation_ratio(result->applied_ratio);
        if (include_routing) {
          *response->mutable_routing() =
              ToRouting(result->head_tokens, model->moh(),
                        result->routed_tokens, result->layer_tokens);
        }
        finish(absl::OkStatus());
      },
      dispatched.get());
  if (!status.ok()) finish(status);
}

grpc::ServerUnaryReactor* InferenceService::ListModels(
    grpc::CallbackServerContext* context, const v1::ListModelsRequest*,
    v1::ListModelsResponse* response) {
  CallArrived();
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  const absl::Status auth = Authenticate(context);
  if (!auth.ok()) {
    reactor->Finish(ToGrpcStatus(auth));
    return reactor;
  }
  for (v1::ModelInfo& info : models_->List()) {
    *response->add_models() = std::move(info);
  }
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

}  // namespace moh
