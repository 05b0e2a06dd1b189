#include "service/serving/model_manager.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/abbreviate.h"
#include "base/log.h"

namespace moh {

ModelManager::ModelManager(const v1::ServerConfig& config, Metrics* metrics)
    : metrics_(metrics),
      image_decode_budget_(int64_t{config.image_decode_memory_mb()} << 20) {
  for (const v1::ModelConfig& model : config.models()) {
    models_.push_back(
        std::make_unique<HostedModel>(model, metrics, &image_decode_budget_));
    for (const v1::ModelAlias& alias : model.aliases()) {
      aliases_.push_back(Alias{alias, models_.back().get()});
    }
  }
  loader_ = std::thread([this] {
    for (auto& model : models_) {
      if (stop_loading_) {
        MOH_LOG(Info) << "model " << model->name()
                      << ": not loaded (the server is stopping)";
        continue;
      }
      model->Load();
    }
  });
}

ModelManager::~ModelManager() {
  if (loader_.joinable()) loader_.join();
}

void ModelManager::StopLoading() { stop_loading_ = true; }

void ModelManager::WaitLoaded() {
  if (loader_.joinable()) loader_.join();
}

bool ModelManager::AllReady() const {
  for (const auto& model : models_) {
    if (model->state() != HostedModel::State::kReady) return false;
  }
  return true;
}

absl::StatusOr<HostedModel*> ModelManager::Find(absl::string_view name,
                                                Task task) const {
  if (name.empty()) {
    if (models_.size() == 1) return models_[0].get();
    HostedModel* loading = nullptr;
    for (const auto& model : models_) {
      const HostedModel::State state = model->state();
      if (model->Serves(task)) return model.get();
      // A model still loading has no known family yet: it may be the one.
      if (state == HostedModel::State::kLoading && loading == nullptr) {
        loading = model.get();
      }
    }
    return loading != nullptr ? loading : models_[0].get();
  }
  for (const auto& model : models_) {
    if (model->name() == name) return model.get();
  }
  for (const Alias& alias : aliases_) {
    if (alias.config.name() == name) return alias.model;
  }
  std::vector<std::string> names;
  for (const auto& model : models_) names.push_back(model->name());
  for (const Alias& alias : aliases_) names.push_back(alias.config.name());
  return absl::NotFoundError(absl::StrCat(
      "model '", Abbreviate(name),
      "' is not served here; models: ", absl::StrJoin(names, ", ")));
}

const v1::ModelAlias* ModelManager::FindAlias(absl::string_view name) const {
  for (const Alias& alias : aliases_) {
    if (alias.config.name() == name) return &alias.config;
  }
  return nullptr;
}

std::vector<v1::ModelInfo> ModelManager::List() const {
  std::vector<v1::ModelInfo> infos;
  for (const auto& model : models_) {
    infos.push_back(model->Info());
    const v1::ModelInfo info = infos.back();
    for (const Alias& alias : aliases_) {
      if (alias.model != model.get()) continue;
      v1::ModelInfo& entry = infos.emplace_back(info);
      entry.set_name(alias.config.name());
      entry.set_alias_of(model->name());
      entry.set_default_ratio(alias.config.activation_ratio());
    }
  }
  return infos;
}

void ModelManager::StopAccepting() {
  for (auto& model : models_) model->StopAccepting();
}

bool ModelManager::Idle() const {
  for (const auto& model : models_) {
    if (!model->Idle()) return false;
  }
  return true;
}

}  // namespace moh
