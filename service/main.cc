// moh-server: the gRPC microservice serving MoH models (SPEC §3–§5).
//
//   moh-server                                  # the shipped demo models
//   moh-server --model_dir=DIR [--model_name=NAME] --port=50051
//   --metrics_port=9464 moh-server --config=server.textproto        # several
//   models, all limits
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <pthread.h>
#include <signal.h>

#include <atomic>
#include <map>
#include <memory>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "base/log.h"
#include "model/core/device_context.h"
#include "model/core/runtime.h"
#include "prometheus/exposer.h"
#include "service/inference_service.h"
#include "service/metrics.h"
#include "service/model_manager.h"
#include "service/server_config.h"

ABSL_FLAG(std::string, config, "",
          "Text-format moh.v1.ServerConfig file (several models, all limits)");
ABSL_FLAG(std::string, model_dir, "",
          "Serve this one model directory (overrides the config's models)");
ABSL_FLAG(std::string, model_name, "", "Name of --model_dir's model");
ABSL_FLAG(int32_t, port, 0, "gRPC port (default 50051)");
ABSL_FLAG(int32_t, metrics_port, 0,
          "Prometheus /metrics port (default 9464; -1: off)");
ABSL_FLAG(std::string, host, "", "Listen address (default 0.0.0.0)");
ABSL_FLAG(std::string, device, "", "auto, cpu, cuda or cuda:N (default auto)");
ABSL_FLAG(std::string, dtype, "",
          "auto, float32, bfloat16 or float16 (default auto)");
ABSL_FLAG(double, drain_timeout, 0,
          "Seconds in-flight requests may run after SIGTERM (default 30)");
ABSL_FLAG(int32_t, threads, 0,
          "LibTorch intra-op threads (0 = the default: every core but one with "
          "OpenBLAS's OpenMP build, else 1; see model/runtime.h)");
ABSL_FLAG(std::string, demo_dir, MOH_DEFAULT_DEMO_DIR,
          "Where the demo models live (used when no model is configured)");
ABSL_FLAG(bool, verbose, false, "Log every request (debug level)");

namespace moh {
namespace {

constexpr char kServiceName[] = "moh.v1.Inference";

absl::StatusOr<v1::ServerConfig> BuildConfig() {
  v1::ServerConfig config;
  if (!absl::GetFlag(FLAGS_config).empty()) {
    auto read = ReadServerConfigFile(absl::GetFlag(FLAGS_config));
    if (!read.ok()) return read.status();
    config = *read;
  }
  if (!absl::GetFlag(FLAGS_model_dir).empty()) {
    config.clear_models();
    v1::ModelConfig* model = config.add_models();
    model->set_model_dir(absl::GetFlag(FLAGS_model_dir));
    model->set_name(absl::GetFlag(FLAGS_model_name));
  } else if (config.models().empty()) {
    config.mutable_models()->CopyFrom(
        DemoServerConfig(absl::GetFlag(FLAGS_demo_dir)).models());
  }
  for (v1::ModelConfig& model : *config.mutable_models()) {
    if (!absl::GetFlag(FLAGS_device).empty()) {
      model.set_device(absl::GetFlag(FLAGS_device));
    }
    if (!absl::GetFlag(FLAGS_dtype).empty()) {
      model.set_dtype(absl::GetFlag(FLAGS_dtype));
    }
  }
  if (absl::GetFlag(FLAGS_port) != 0)
    config.set_port(absl::GetFlag(FLAGS_port));
  if (absl::GetFlag(FLAGS_metrics_port) != 0) {
    config.set_metrics_port(absl::GetFlag(FLAGS_metrics_port));
  }
  if (!absl::GetFlag(FLAGS_host).empty())
    config.set_host(absl::GetFlag(FLAGS_host));
  if (absl::GetFlag(FLAGS_drain_timeout) != 0) {
    config.set_drain_timeout_seconds(absl::GetFlag(FLAGS_drain_timeout));
  }
  if (absl::GetFlag(FLAGS_threads) != 0) {
    config.set_threads(absl::GetFlag(FLAGS_threads));
  }
  if (absl::GetFlag(FLAGS_verbose)) config.set_log_requests(true);
  absl::Status status = ResolveServerConfig(&config);
  if (!status.ok()) return status;
  return config;
}

int Run() {
  // SIGTERM/SIGINT are taken by one thread (sigwait) for the drain; block
  // them before any other thread starts so none of those receives them.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  auto config = BuildConfig();
  if (!config.ok()) {
    MOH_LOG(Error) << "configuration: " << config.status().message();
    return 2;
  }
  if (config->log_requests()) SetLogLevel(LogLevel::kDebug);
  ConfigureCpuThreads(config->threads());
  MOH_LOG(Info) << LibTorchBuildSummary();
  MOH_LOG(Info) << "CPU: " << CpuThreadingSummary();

  auto registry = std::make_shared<prometheus::Registry>();
  Metrics metrics(registry);
  if (CudaBuild()) {
    metrics.SetGpuMemoryReader([] {
      std::map<std::string, double> bytes;
      for (const GpuMemoryStats& gpu : GpuMemory()) {
        bytes[absl::StrCat("cuda:", gpu.device)] =
            static_cast<double>(gpu.allocated_bytes);
      }
      return bytes;
    });
  }
  std::unique_ptr<prometheus::Exposer> exposer;
  if (config->metrics_port() > 0) {
    const std::string address =
        absl::StrCat(config->host(), ":", config->metrics_port());
    try {
      exposer = std::make_unique<prometheus::Exposer>(address);
    } catch (const std::exception& e) {
      MOH_LOG(Error) << "metrics: cannot listen on " << address << ": "
                     << e.what();
      return 1;
    }
    for (const auto& collectable : metrics.Collectables()) {
      exposer->RegisterCollectable(collectable);
    }
    MOH_LOG(Info) << "metrics on http://" << address << "/metrics";
  }

  ModelManager models(*config, &metrics);
  InferenceService service(&models);
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  const std::string address = absl::StrCat(config->host(), ":", config->port());
  int bound_port = 0;
  builder.AddListeningPort(address, grpc::InsecureServerCredentials(),
                           &bound_port);
  builder.RegisterService(&service);
  builder.SetMaxReceiveMessageSize(64 << 20);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || bound_port == 0) {
    MOH_LOG(Error) << "cannot listen on " << address;
    return 1;
  }
  grpc::HealthCheckServiceInterface* health = server->GetHealthCheckService();
  auto set_health = [health](bool serving) {
    health->SetServingStatus(serving);
    health->SetServingStatus(kServiceName, serving);
  };
  set_health(false);
  MOH_LOG(Info) << "moh-server listening on " << address << " ("
                << config->models_size() << " model(s) loading)";

  std::atomic<bool> draining{false};
  std::thread readiness([&] {
    models.WaitLoaded();
    if (draining) return;
    if (models.AllReady()) {
      set_health(true);
      MOH_LOG(Info) << "ready: every model loaded and warmed up";
    } else {
      MOH_LOG(Error) << "not ready: a model failed to load (see ListModels)";
    }
  });

  int signal_number = 0;
  sigwait(&signals, &signal_number);
  draining = true;
  const absl::Duration drain_timeout =
      absl::Seconds(config->drain_timeout_seconds());
  MOH_LOG(Info) << "signal " << signal_number << ": draining (up to "
                << drain_timeout << ")";
  set_health(false);
  models.StopAccepting();
  const absl::Time give_up = absl::Now() + drain_timeout;
  while (!models.Idle() && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  if (!models.Idle()) {
    MOH_LOG(Warning) << "drain timeout: cancelling what is still running";
  }
  server->Shutdown(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(500));
  readiness.join();
  MOH_LOG(Info) << "stopped";
  return 0;
}

}  // namespace
}  // namespace moh

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Serves Mixture-of-Head models over gRPC.\n"
      "  moh-server [--model_dir=DIR | --config=FILE] [--port=50051] "
      "[--metrics_port=9464]");
  absl::FlagsUsageConfig usage;
  usage.version_string = [] {
    return absl::StrCat("moh-server\n", moh::LibTorchBuildSummary(), "\n");
  };
  absl::SetFlagsUsageConfig(usage);
  absl::ParseCommandLine(argc, argv);
  return moh::Run();
}
