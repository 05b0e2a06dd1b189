#include "service/language/language_servable.h"

#include <algorithm>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/field_error.h"
#include "base/log.h"
#include "base/status_macros.h"
#include "model/core/runtime.h"
#include "model/generation/generator.h"

namespace moh {
namespace {

constexpr size_t kMaxPromptBytes = 1 << 20;
constexpr size_t kMaxLabels = 64;
constexpr size_t kMaxTextBytes = 1 << 20;
constexpr size_t kMaxLabelBytes = 64 << 10;

// generation.cuda_paths on the model; logs the paths switched off.
void SetCudaPaths(const std::string& name, const v1::CudaPaths& paths,
                  LlamaModel& model) {
  model.set_cuda_paged_decode(paths.paged_decode());
  model.set_cuda_fused_ops(paths.fused_ops());
  model.set_cuda_varlen_prefill(paths.varlen_prefill());
  model.set_cuda_skinny_linear(paths.skinny_linear());
  std::vector<std::string> off;
  if (!paths.paged_decode()) off.push_back("paged_decode");
  if (!paths.fused_ops()) off.push_back("fused_ops");
  if (!paths.varlen_prefill()) off.push_back("varlen_prefill");
  if (!paths.skinny_linear()) off.push_back("skinny_linear");
  if (!off.empty()) {
    MOH_LOG(Info) << "model " << name
                  << ": CUDA paths off: " << absl::StrJoin(off, ", ")
                  << " (generation.cuda_paths)";
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<LanguageServable>> LanguageServable::Load(
    const v1::ModelConfig& config, const DeviceOptions& device,
    Metrics* metrics) {
  MOH_ASSIGN_OR_RETURN(LanguageModel lm,
                       LanguageModel::Load(config.model_dir(), device));
  const LlamaConfig& c = lm.model->config();
  const bool head_metrics = !config.has_head_metrics() || config.head_metrics();
  ModelMetrics* model_metrics =
      metrics->ForModel(config.name(), c.num_layers, c.num_heads, head_metrics);
  std::unique_ptr<LanguageServable> servable(
      new LanguageServable(config, std::move(lm), model_metrics));
  LanguageServable* self = servable.get();
  const LanguageModel& model = self->lm_;
  self->chat_template_ = LoadChatTemplate(config.model_dir());
  absl::StatusOr<TokenizerConfig> tokenizer_config =
      ReadTokenizerConfig(config.model_dir());
  if (tokenizer_config.ok()) {
    self->tokenizer_config_ = *std::move(tokenizer_config);
  } else if (!absl::IsNotFound(tokenizer_config.status())) {
    MOH_LOG(Warning) << "model " << config.name()
                     << ": tokenizer_config.json not used: "
                     << tokenizer_config.status().message();
  }
  if (!self->chat_template_.ok() &&
      !absl::IsNotFound(self->chat_template_.status())) {
    // Completions still work; chats say why they cannot.
    MOH_LOG(Warning) << "model " << config.name() << ": no chat template: "
                     << self->chat_template_.status().message();
  }

  LanguageExecutor::Options options;
  options.model_name = config.name();
  const v1::GenerationConfig& g = config.generation();
  options.max_running = g.max_running();
  options.max_seq_len = g.max_seq_len();
  options.max_queued_requests = g.max_queued_requests();
  options.prefill_token_budget = g.prefill_token_budget();
  options.adaptive_queue_depth = config.adaptive().queue_depth();
  options.kv_block_size = g.kv_block_size();
  options.kv_blocks = g.kv_blocks();
  options.prefix_caching = g.prefix_caching();
  options.idle_gather = absl::Microseconds(g.idle_gather_us());
  options.on_device_lost = [self](const absl::Status& status) {
    self->MarkDeviceLost(status);
  };
  model.model->set_attention_workspace_bytes(int64_t{g.attention_workspace_mb()}
                                             << 20);
  static_assert(config_limits::kCudaGraphs.default_value == kDefaultCudaGraphs);
  model.model->set_cuda_graphs(g.cuda_graphs());
  SetCudaPaths(config.name(), g.cuda_paths(), *model.model);
  MOH_RETURN_IF_ERROR(model.model->set_kv_cache_dtype(
      g.kv_cache_dtype(), "generation.kv_cache_dtype"));
  // Label scoring (Classify of a text) uses one sequence's cache beside the
  // blocks of Generate.
  const int32_t max_seq_len = config_limits::ResolveMaxSeqLen(
      options.max_seq_len, c.max_position_embeddings);
  const int32_t block_size =
      config_limits::ResolveKvBlockSize(g.kv_block_size(), max_seq_len);
  MOH_RETURN_IF_ERROR(model.model->CheckMemoryFits(
      config_limits::ResolveKvBlocks(g.kv_blocks(), options.max_running,
                                     max_seq_len, block_size) +
          config_limits::KvBlocksFor(max_seq_len, block_size),
      block_size));
  MOH_ASSIGN_OR_RETURN(self->executor_,
                       LanguageExecutor::Create(options, model, model_metrics));
  MOH_ASSIGN_OR_RETURN(
      self->classifier_,
      BatchedClassifier::Create(config, c.moh, model_metrics,
                                [self](std::vector<ClassifyTask>& batch) {
                                  // Task by task: one that expired or whose
                                  // client left meanwhile is skipped.
                                  for (ClassifyTask& task : batch) {
                                    if (self->classifier_->FinishIfGone(task)) {
                                      continue;
                                    }
                                    self->ScoreLabels(task);
                                  }
                                  return absl::OkStatus();
                                }));
  return servable;
}

LanguageServable::LanguageServable(const v1::ModelConfig& config,
                                   LanguageModel lm, ModelMetrics* metrics)
    : Servable(config.name(), "llama"),
      default_max_new_tokens_(config.generation().default_max_new_tokens()),
      lm_(std::move(lm)),
      metrics_(metrics) {}

LanguageServable::~LanguageServable() {
  // The batcher's threads use the model: stop them first.
  classifier_.reset();
  executor_.reset();
}

absl::Status LanguageServable::Warmup() const {
  const Activation trained = Activation::AtRatio(lm_.model->config().moh, 0);
  return moh::ScoreLabels(*lm_.model, {0, 0, 0}, {{0}}, trained).status();
}

void LanguageServable::Describe(v1::ModelInfo* info) const {
  info->set_max_seq_len(executor_->max_seq_len());
  info->set_kv_cache_dtype(DtypeName(lm_.model->kv_cache_dtype()));
  // Converted weights only; HostedModel::Info names the dtype otherwise.
  info->set_weights(WeightFormatName(lm_.model->linear_weights()));
  const LanguageExecutor::Options& options = executor_->options();
  info->set_kv_block_size(options.kv_block_size);
  info->set_kv_blocks(options.kv_blocks);
  info->set_prefix_caching(options.prefix_caching);
  DescribeMoh(lm_.model->config().moh, info);
}

const MohConfig& LanguageServable::moh() const {
  return lm_.model->config().moh;
}

absl::StatusOr<uint64_t> LanguageServable::Generate(
    GenerateCall call, std::shared_ptr<GenerationObserver> observer) {
  if (call.prompt.has_value() == call.token_ids.has_value()) {
    return absl::InvalidArgumentError(
        "prompt or token_ids: exactly one must be set");
  }
  GenerationJob job;
  if (call.prompt) {
    if (call.prompt->empty()) {
      return absl::InvalidArgumentError("prompt must not be empty");
    }
    if (call.prompt->size() > kMaxPromptBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("prompt must be at most ", kMaxPromptBytes,
                       " bytes, got ", call.prompt->size()));
    }
    if (!lm_.tokenizer) {
      return absl::InvalidArgumentError(
          absl::StrCat("prompt: model '", name(),
                       "' has no tokenizer.json; send token_ids instead"));
    }
    job.prompt_ids =
        lm_.tokenizer->Encode(*call.prompt, call.add_special_tokens);
  } else {
    job.prompt_ids = std::move(*call.token_ids);
  }
  job.sampling = std::move(call.sampling);
  if (lm_.generation_defaults) {
    const GenerationDefaults& d = *lm_.generation_defaults;
    const SamplingFieldsSet& set = call.sampling_set;
    SamplingParams& s = job.sampling;
    if (!set.temperature) s.temperature = d.do_sample ? d.temperature : 0.0f;
    if (!set.top_k) s.top_k = d.do_sample ? d.top_k : 0;
    if (!set.top_p) s.top_p = d.do_sample ? d.top_p : 1.0f;
    if (!set.min_p) s.min_p = d.do_sample ? d.min_p : 0.0f;
    if (!set.repetition_penalty) s.repetition_penalty = d.repetition_penalty;
  }
  // Unset: the configured default, clamped to what the context leaves after
  // the prompt (a prompt too long for any output is refused by Submit).
  const int64_t room = int64_t{executor_->max_seq_len()} -
                       static_cast<int64_t>(job.prompt_ids.size());
  job.sampling.max_new_tokens =
      call.max_new_tokens.value_or(static_cast<int32_t>(std::max<int64_t>(
          1, std::min<int64_t>(default_max_new_tokens_, room))));
  if (call.response_format.type != ResponseFormat::Type::kText) {
    MOH_ASSIGN_OR_RETURN(job.grammar, Grammar(call.response_format));
  }
  job.ratio = call.ratio;
  job.min_ratio = call.min_ratio;
  job.deadline = call.deadline;
  job.n = call.n;
  job.priority = call.priority;
  return executor_->Submit(std::move(job), std::move(observer));
}

absl::StatusOr<std::shared_ptr<const CompiledGrammar>>
LanguageServable::Grammar(const ResponseFormat& format) {
  if (!lm_.tokenizer) {
    return FieldError("response_format",
                      absl::StrCat("needs a model with a tokenizer; '", name(),
                                   "' has no tokenizer.json"));
  }
  GrammarCompiler* compiler = nullptr;
  {
    absl::MutexLock lock(&grammar_mu_);
    if (grammar_compiler_ == nullptr) {
      absl::StatusOr<std::unique_ptr<GrammarCompiler>> created =
          GrammarCompiler::Create(*lm_.tokenizer, lm_.eos_ids, {});
      if (!created.ok()) return created.status();
      grammar_compiler_ = std::move(*created);
    }
    compiler = grammar_compiler_.get();  // lives as long as the servable
  }
  return compiler->Compile(format);
}

absl::StatusOr<std::string> LanguageServable::ChatPrompt(
    const std::vector<ChatMessage>& messages,
    bool add_generation_prompt) const {
  if (!chat_template_.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "messages: model '", name(), "' has no chat template",
        absl::IsNotFound(chat_template_.status())
            ? " (tokenizer_config.json \"chat_template\"); use /v1/completions"
            : absl::StrCat(": ", chat_template_.status().message())));
  }
  const LoadedChatTemplate& t = *chat_template_;
  absl::StatusOr<std::string> prompt = t.chat_template.Render(
      messages, add_generation_prompt,
      {{"bos_token", t.bos_token}, {"eos_token", t.eos_token}});
  if (!prompt.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("messages: ", prompt.status().message()));
  }
  return prompt;
}

std::string LanguageServable::TokenText(int32_t id) const {
  if (!lm_.tokenizer) return "";
  absl::StatusOr<std::string> text =
      lm_.tokenizer->Decode({id}, /*skip_special_tokens=*/false);
  return text.ok() ? *std::move(text) : "";
}

absl::Status LanguageServable::HasTokenizer() const {
  if (lm_.tokenizer) return absl::OkStatus();
  return FieldError("model",
                    absl::StrCat("'", name(), "' has no tokenizer.json"));
}

absl::StatusOr<TokenizeResult> LanguageServable::Tokenize(
    const TokenizeCall& call) const {
  MOH_RETURN_IF_ERROR(HasTokenizer());
  if (call.prompt.size() > kMaxPromptBytes) {
    return FieldError("prompt",
                      absl::StrCat("must be at most ", kMaxPromptBytes,
                                   " bytes, got ", call.prompt.size()));
  }
  TokenizeResult result;
  result.tokens = lm_.tokenizer->Encode(call.prompt, call.add_special_tokens);
  if (call.token_strs) {
    result.token_strs.emplace();
    for (int32_t id : result.tokens) {
      result.token_strs->push_back(lm_.tokenizer->IdToToken(id).value_or(""));
    }
  }
  result.max_model_len = executor_->max_seq_len();
  return result;
}

absl::StatusOr<std::string> LanguageServable::Detokenize(
    const std::vector<int32_t>& tokens) const {
  MOH_RETURN_IF_ERROR(HasTokenizer());
  const int32_t vocab = lm_.tokenizer->vocab_size();
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (!lm_.tokenizer->IdToToken(tokens[i]).has_value()) {
      return FieldError(absl::StrCat("tokens[", i, "]"),
                        absl::StrCat("must be a token id of the vocabulary, "
                                     "in [0, ",
                                     vocab, "), got ", tokens[i]));
    }
  }
  return lm_.tokenizer->Decode(tokens, /*skip_special_tokens=*/false);
}

absl::StatusOr<TokenizerInfo> LanguageServable::DescribeTokenizer() const {
  MOH_RETURN_IF_ERROR(HasTokenizer());
  const Tokenizer& tokenizer = *lm_.tokenizer;
  const TokenizerConfig& config = tokenizer_config_;
  TokenizerInfo info;
  info.tokenizer_class = config.tokenizer_class.empty()
                             ? "PreTrainedTokenizerFast"
                             : config.tokenizer_class;
  // The model's own ids name the tokens the config leaves out.
  const auto text_of = [&](std::optional<int32_t> id) {
    return id.has_value() ? tokenizer.IdToToken(*id) : std::nullopt;
  };
  const std::optional<int32_t> eos =
      lm_.eos_ids.empty() ? tokenizer.eos_id() : lm_.eos_ids.front();
  info.bos_token =
      config.bos_token ? config.bos_token : text_of(tokenizer.bos_id());
  info.eos_token = config.eos_token ? config.eos_token : text_of(eos);
  info.pad_token = config.pad_token;
  info.unk_token = config.unk_token;
  info.chat_template = config.chat_template;
  info.model_max_length = executor_->max_seq_len();
  info.vocab_size = tokenizer.vocab_size();
  return info;
}

void LanguageServable::CancelGenerate(uint64_t id) { executor_->Cancel(id); }

void LanguageServable::StopAccepting() { executor_->StopAccepting(); }

bool LanguageServable::Idle() const {
  return classifier_->Idle() && executor_->idle();
}

absl::Status LanguageServable::Classify(ClassifyCall call, ClassifyDone done) {
  MOH_ASSIGN_OR_RETURN(ClassifyTask task, Prepare(call));
  return classifier_->Submit(std::move(task), std::move(call), std::move(done));
}

absl::StatusOr<ClassifyTask> LanguageServable::Prepare(
    ClassifyCall& call) const {
  MOH_RETURN_IF_ERROR(CheckClassifyCall(call));
  if (!call.text) {
    return NotServedError(call.image ? "image" : "pixels", name(), family(),
                          Task::kClassifyImage, "send text and labels");
  }
  const LlamaConfig& c = lm_.model->config();
  if (call.labels.empty() || call.labels.size() > kMaxLabels) {
    return absl::InvalidArgumentError(absl::StrCat(
        "labels: a language model scores candidate labels; send 1 to ",
        kMaxLabels, " labels, got ", call.labels.size()));
  }
  if (call.text->empty() || call.text->size() > kMaxTextBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("text must have 1 to ", kMaxTextBytes, " bytes, got ",
                     call.text->size()));
  }
  if (!lm_.tokenizer) {
    return absl::InvalidArgumentError(
        absl::StrCat("text: model '", name(), "' has no tokenizer.json"));
  }
  // Sizes before any tokenizing.
  for (size_t i = 0; i < call.labels.size(); ++i) {
    if (call.labels[i].size() > kMaxLabelBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("labels[", i, "] must have at most ", kMaxLabelBytes,
                       " bytes, got ", call.labels[i].size()));
    }
  }
  ClassifyTask task;
  MOH_ASSIGN_OR_RETURN(task.activation,
                       Activation::Resolve(c.moh, call.ratio, call.min_ratio));
  if (call.top_n > static_cast<int32_t>(call.labels.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("top_n must be in [0, ", call.labels.size(),
                     "] (the number of labels), got ", call.top_n));
  }
  task.top_n = call.top_n > 0 ? call.top_n : call.labels.size();
  task.context_ids = lm_.tokenizer->Encode(*call.text, true);
  const int64_t max_len = executor_->max_seq_len();
  for (size_t i = 0; i < call.labels.size(); ++i) {
    std::vector<int32_t> ids = lm_.tokenizer->Encode(call.labels[i], false);
    if (ids.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("labels[", i, "] must not be empty"));
    }
    if (static_cast<int64_t>(task.context_ids.size() + ids.size()) > max_len) {
      return absl::InvalidArgumentError(
          absl::StrCat("text + labels[", i, "] must fit in ", max_len,
                       " tokens, got ", task.context_ids.size() + ids.size()));
    }
    task.label_ids.push_back(std::move(ids));
  }
  task.labels = std::move(call.labels);
  return task;
}

void LanguageServable::ScoreLabels(ClassifyTask& task) {
  // Its cache and logits are allocated here: an allocation failure is this
  // request's error, not the process's end.
  auto scored = CatchTorchErrors("label scoring", [&] {
    return moh::ScoreLabels(*lm_.model, task.context_ids, task.label_ids,
                            task.activation, executor_->max_seq_len());
  });
  if (!scored.ok()) {
    classifier_->Finish(
        task, ForwardFailed(lm_.model->options().device(), scored.status()));
    return;
  }
  const std::vector<double>& ll = scored->log_likelihoods;
  // Scores: each label's likelihood, normalized over the candidates.
  at::Tensor probs = at::softmax(at::tensor(ll, at::kDouble), 0);
  std::vector<int32_t> order(ll.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return ll[a] > ll[b]; });
  ClassifyResult result;
  for (int32_t i = 0; i < task.top_n; ++i) {
    const int32_t index = order[i];
    result.classes.push_back({task.labels[index], index,
                              static_cast<float>(probs[index].item<double>()),
                              ll[index]});
  }
  result.applied_ratio = static_cast<float>(task.activation.nominal_ratio());
  result.effective_ratio =
      EffectiveRatio(scored->head_token_counts, scored->tokens);
  result.routed_tokens = scored->tokens;
  result.head_tokens = HeadTokenVector(scored->head_token_counts);
  classifier_->Finish(task, std::move(result));
}

}  // namespace moh
