#include "service/inference_service.h"

#include <atomic>
#include <chrono>
#include <deque>
#include <memory>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "service/grpc_status.h"
#include "service/request_log.h"

namespace moh {
namespace {

absl::Time Deadline(const grpc::CallbackServerContext* context) {
  const auto deadline = context->deadline();
  if (deadline == std::chrono::system_clock::time_point::max()) {
    return absl::InfiniteFuture();
  }
  return absl::FromChrono(deadline);
}

// The call's request id (the client's x-request-id, or a fresh one), sent
// back in the initial metadata.
std::string CallRequestId(grpc::CallbackServerContext* context) {
  const auto& metadata = context->client_metadata();
  auto it = metadata.find(kRequestIdKey);
  std::optional<absl::string_view> given;
  if (it != metadata.end()) {
    given = absl::string_view(it->second.data(), it->second.size());
  }
  std::string id = RequestId(given);
  context->AddInitialMetadata(kRequestIdKey, id);
  return id;
}

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

// Streams one server-streaming call (Generate, GenerateImage). The model's
// threads produce messages through the RPC's observer (Generate: its
// callback thread, after each step); gRPC completes writes on its own
// threads. The reactor finishes only after the observer's final
// callback (or when the submission failed), so the observer never outlives it
// in use. It is deleted when both gRPC (OnDone) and the request worker (after
// Start) are done with it: once the request is submitted, the loop can finish
// the call, and gRPC end it, before Start returns.
//
// Traits: Request, Response, kTask (finding the model), kRpc (metrics),
// Submit(reactor, servable, request, deadline) -> id (builds the call and its
// observer), Cancel(servable, id), CanCoalesce(queued, response) (whether
// they belong to one output: one sample of a Generate) and Coalesce(queued,
// response) (merges a message produced while another is written into the
// queued one).
template <typename Traits>
class StreamingReactor
    : public grpc::ServerWriteReactor<typename Traits::Response> {
 public:
  using Request = typename Traits::Request;
  using Response = typename Traits::Response;

  // `auth`: the call's authentication (OK, or why it is refused). The rest
  // of the work (Start) runs on a request worker.
  StreamingReactor(ModelManager* models, RequestWorkers* workers,
                   grpc::CallbackServerContext* context, const Request* request,
                   const absl::Status& auth)
      : start_(absl::Now()),
        deadline_(Deadline(context)),
        request_id_(CallRequestId(context)),
        server_metrics_(models->metrics()),
        include_routing_(request->include_routing()) {
    if (!auth.ok()) {
      FinishWith(auth);
      return;
    }
    // gRPC keeps `request` until the call is done, and Start reads it only
    // before it submits the job or finishes the call.
    holds_.fetch_add(1, std::memory_order_relaxed);  // Start's
    absl::Status queued = workers->Run([this, models, request] {
      // The last resort: what a request makes throw ends that call alone.
      try {
        Start(models, *request);
      } catch (const std::exception& e) {
        Unexpected(e.what());
      } catch (...) {
        Unexpected("unknown exception");
      }
      Release();
    });
    if (!queued.ok()) {
      holds_.fetch_sub(1, std::memory_order_relaxed);  // Start will not run
      FinishWith(queued);
    }
  }

  void OnCancel() override {
    bool submitted;
    {
      absl::MutexLock lock(&mu_);
      cancelled_ = true;
      submitted = submitted_;
    }
    // The loop answers with its final callback; Finish happens there.
    if (submitted) Traits::Cancel(model_, id_);
  }
  void OnWriteDone(bool ok) override {
    std::optional<grpc::Status> finish;
    {
      absl::MutexLock lock(&mu_);
      queue_.pop_front();  // the message just written
      writing_ = false;
      if (!ok) DropUnsent();  // the stream is gone; nothing more to send
      if (!queue_.empty()) {
        writing_ = true;
        this->StartWrite(&queue_.front());
      } else if (final_status_) {
        finish = final_status_;
      }
    }
    if (finish) FinishWith(*finish);
  }

  void OnDone() override { Release(); }

  // For the observers (on the model's threads).
  bool include_routing() const { return include_routing_; }
  const Servable& model() const { return *model_; }

  // Queues `response` (if any); with `done`, finishes the call once every
  // queued message has been written.
  void Send(std::optional<Response> response,
            std::optional<absl::Status> done) {
    std::optional<grpc::Status> finish;
    {
      absl::MutexLock lock(&mu_);
      if (cancelled_) {
        if (!done) return;
        DropUnsent();
        response.reset();
        // An expiry is counted as one.
        if (done->ok()) done = GoneStatus();
      }
      if (response) Enqueue(std::move(*response));
      if (done) final_status_ = ToGrpcStatus(*done);
      if (!writing_ && !queue_.empty()) {
        writing_ = true;
        this->StartWrite(&queue_.front());
      } else if (!writing_ && final_status_) {
        finish = final_status_;
      }
    }
    if (finish) FinishWith(*finish);
  }

 private:
  // An exception escaped Start: logged with the request id; the call ends
  // INTERNAL unless its job was submitted (the loop then ends it).
  void Unexpected(const char* what) {
    const absl::Status error =
        UnexpectedException(RpcName(Traits::kRpc), request_id_, what);
    bool submitted;
    {
      absl::MutexLock lock(&mu_);
      submitted = submitted_;
    }
    if (!submitted) FinishWith(error);
  }

  // Drops one of the holds; the last one deletes the reactor.
  void Release() {
    if (holds_.fetch_sub(1, std::memory_order_acq_rel) == 1) delete this;
  }

  // On a request worker: finds the model and hands it the request
  // (tokenizing, checks, admission).
  void Start(ModelManager* models, const Request& request) {
    {
      absl::MutexLock lock(&mu_);
      if (cancelled_) {
        // Gone while it waited for a worker: nothing to prepare.
        FinishWith(GoneStatus());
        return;
      }
    }
    auto found = models->Find(request.model(), Traits::kTask);
    if (!found.ok()) {
      FinishWith(found.status());
      return;
    }
    model_name_ = (*found)->name();
    auto servable = (*found)->Ready();
    if (!servable.ok()) {
      FinishWith(servable.status());
      return;
    }
    model_ = *servable;
    metrics_ = model_->metrics();
    auto id = Traits::Submit(this, model_, request, deadline_);
    if (!id.ok()) {
      FinishWith(id.status());
      return;
    }
    bool cancelled;
    {
      absl::MutexLock lock(&mu_);
      id_ = *id;
      submitted_ = true;
      cancelled = cancelled_;
    }
    // A cancellation that arrived while the request was being submitted.
    if (cancelled) Traits::Cancel(model_, id_);
  }

  // The status of a call gRPC cancelled: its deadline passed (gRPC cancels a
  // call whose deadline passed; its timer may fire a little before our clock
  // reaches the deadline it reported: allow for it), or the client went.
  absl::Status GoneStatus() const {
    constexpr absl::Duration kTimerSlack = absl::Milliseconds(50);
    return absl::Now() + kTimerSlack >= deadline_
               ? absl::DeadlineExceededError("deadline exceeded")
               : absl::CancelledError("cancelled by the client");
  }

  // Queues `response` for writing. While gRPC writes one message, what the
  // loop produces meanwhile is coalesced into the next one, so that a slow
  // reader or a busy server costs one write per backlog, not one per output.
  // Messages that cannot be merged (another sample's) queue beside it: at
  // most one per sample.
  void Enqueue(Response response) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (queue_.size() >= (writing_ ? 2u : 1u)) {
      // Every message but the front one, if being written, is only queued.
      const auto unsent = writing_ ? std::next(queue_.begin()) : queue_.begin();
      for (auto it = queue_.end(); it != unsent;) {
        --it;
        if (Traits::CanCoalesce(*it, response)) {
          Traits::Coalesce(*it, std::move(response));
          return;
        }
      }
    }
    queue_.push_back(std::move(response));
  }

  // Discards queued messages, but never the one gRPC is writing (it holds a
  // pointer to it until OnWriteDone).
  void DropUnsent() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    queue_.erase(writing_ ? std::next(queue_.begin()) : queue_.begin(),
                 queue_.end());
  }

  void FinishWith(const absl::Status& status) {
    FinishWith(ToGrpcStatus(status));
  }
  // Records the request and finishes; the reactor may be deleted right after.
  void FinishWith(const grpc::Status& status) {
    RecordRequest(metrics_, server_metrics_, Traits::kRpc, model_name_,
                  static_cast<absl::StatusCode>(status.error_code()), start_,
                  request_id_);
    this->Finish(status);
  }

  const absl::Time start_;
  const absl::Time deadline_;
  const std::string request_id_;
  Metrics* const server_metrics_;
  const bool include_routing_;
  std::string model_name_;
  Servable* model_ = nullptr;
  ModelMetrics* metrics_ = nullptr;
  uint64_t id_ = 0;
  // gRPC's (until OnDone) and, while it is queued or runs, Start's.
  std::atomic<int> holds_{1};

  absl::Mutex mu_;
  bool submitted_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  std::deque<Response> queue_ ABSL_GUARDED_BY(mu_);
  std::optional<grpc::Status> final_status_ ABSL_GUARDED_BY(mu_);
};

// Generate: text chunks, then the summary.
struct GenerateTraits {
  using Request = v1::GenerateRequest;
  using Response = v1::GenerateResponse;
  static constexpr Task kTask = Task::kGenerate;
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

  static absl::StatusOr<uint64_t> Submit(Reactor* reactor, Servable* model,
                                         const Request& request,
                                         absl::Time deadline) {
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
    return model->Generate(std::move(call),
                           std::make_shared<Observer>(reactor));
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
  static constexpr Task kTask = Task::kGenerateImage;
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

  static absl::StatusOr<uint64_t> Submit(Reactor* reactor, Servable* model,
                                         const Request& request,
                                         absl::Time deadline) {
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
    return model->GenerateImage(
        std::move(call),
        std::make_shared<Observer>(reactor, request.progress()));
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
  const absl::Status error =
      UnexpectedException("Classify", request_id, what);
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
  auto found = models_->Find(request.model(), TaskOf(call));
  absl::StatusOr<Servable*> ready =
      found.ok() ? (*found)->Ready() : found.status();
  if (!ready.ok()) {
    RecordRequest(nullptr, models_->metrics(), Rpc::kClassify,
                  found.ok() ? (*found)->name() : request.model(),
                  ready.status().code(), start, request_id);
    reactor->Finish(ToGrpcStatus(ready.status()));
    return;
  }
  Servable* model = *ready;
  ModelMetrics* metrics = model->metrics();
  auto finish = [reactor, metrics, start, model,
                 request_id](const absl::Status& status) {
    RecordRequest(metrics, nullptr, Rpc::kClassify, model->name(),
                  status.code(), start, request_id);
    reactor->Finish(ToGrpcStatus(status));
  };
  call.deadline = Deadline(context);
  call.cancelled = [context] { return context->IsCancelled(); };
  const bool include_routing = request.include_routing();
  handed->store(true);
  absl::Status status = model->Classify(
      std::move(call), [response, finish, include_routing,
                        model](absl::StatusOr<ClassifyResult> result) {
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
      });
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
