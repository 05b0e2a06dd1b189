// The language family: Generate through the continuous-batching executor,
// and Classify of a text by scoring candidate labels, in dynamic batches.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "model/generation/grammar.h"
#include "model/generation/language_model.h"
#include "moh/v1/server_config.pb.h"
#include "service/engine/batched_classifier.h"
#include "service/language/language_executor.h"
#include "service/metrics/metrics.h"
#include "service/servable/servable.h"

namespace moh {

class LanguageServable : public Servable {
 public:
  // Loads the model of `config.model_dir()` on `device`, checks that its KV
  // cache fits, and starts the executor.
  static absl::StatusOr<std::unique_ptr<LanguageServable>> Load(
      const v1::ModelConfig& config, const DeviceOptions& device,
      Metrics* metrics);
  ~LanguageServable() override;

  void Describe(v1::ModelInfo* info) const override;
  bool Serves(Task task) const override {
    return task == Task::kGenerate || task == Task::kClassifyText;
  }
  const MohConfig& moh() const override;
  ModelMetrics* metrics() const override { return metrics_; }
  absl::StatusOr<uint64_t> Generate(
      GenerateCall call, std::shared_ptr<GenerationObserver> observer) override;
  void CancelGenerate(uint64_t id) override;
  absl::StatusOr<std::string> ChatPrompt(
      const std::vector<ChatMessage>& messages,
      bool add_generation_prompt) const override;
  std::string TokenText(int32_t id) const override;
  absl::StatusOr<TokenizeResult> Tokenize(
      const TokenizeCall& call) const override;
  absl::StatusOr<std::string> Detokenize(
      const std::vector<int32_t>& tokens) const override;
  absl::StatusOr<TokenizerInfo> DescribeTokenizer() const override;
  absl::Status Classify(ClassifyCall call, ClassifyDone done) override;
  void StopAccepting() override;
  bool Idle() const override;

  // One forward of a short prompt in a cache of its own.
  absl::Status Warmup() const;

 private:
  LanguageServable(const v1::ModelConfig& config, LanguageModel lm,
                   ModelMetrics* metrics);
  absl::StatusOr<ClassifyTask> Prepare(ClassifyCall& call) const;
  // OK when the model has a tokenizer, else a FieldError naming "model".
  absl::Status HasTokenizer() const;
  void ScoreLabels(ClassifyTask& task);
  // The grammar of a structured output (on a request worker: compiles run
  // here, never on the engine loop). The compiler is made at the first one.
  absl::StatusOr<std::shared_ptr<const CompiledGrammar>> Grammar(
      const ResponseFormat& format);

  const int32_t default_max_new_tokens_;
  const LanguageModel lm_;
  // tokenizer_config.json's chat template, or why there is none (NOT_FOUND:
  // the model has none; else it did not load).
  absl::StatusOr<LoadedChatTemplate> chat_template_ =
      absl::NotFoundError("not loaded");
  // tokenizer_config.json's fields for clients (none: the file is absent or
  // bad, whose error the chat template's warning names).
  TokenizerConfig tokenizer_config_;
  ModelMetrics* const metrics_;
  absl::Mutex grammar_mu_;
  std::unique_ptr<GrammarCompiler> grammar_compiler_
      ABSL_GUARDED_BY(grammar_mu_);
  std::unique_ptr<LanguageExecutor> executor_;
  std::unique_ptr<BatchedClassifier> classifier_;  // last: stopped first
};

}  // namespace moh
