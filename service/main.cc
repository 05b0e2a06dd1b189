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
#include <exception>
#include <map>
#include <memory>
#include <optional>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "base/log.h"
#include "base/status_macros.h"
#include "model/core/device_context.h"
#include "model/core/fused_layer_ops.h"
#include "model/core/runtime.h"
#include "service/config/config_limits.h"
#include "service/config/server_config.h"
#include "service/grpc/inference_service.h"
#include "service/grpc/unparsable_requests.h"
#include "service/http/metrics_http.h"
#include "service/http/openai_http.h"
#include "service/metrics/metrics.h"
#include "service/metrics/request_log.h"
#include "service/net/tls_pem.h"
#include "service/serving/auth.h"
#include "service/serving/model_manager.h"
#include "service/serving/request_workers.h"

ABSL_FLAG(std::string, config, "",
          "Text-format moh.v1.ServerConfig file (several models, all limits)");
ABSL_FLAG(std::string, model_dir, "",
          "Serve this one model directory (overrides the config's models)");
ABSL_FLAG(std::string, model_name, "", "Name of --model_dir's model");
ABSL_FLAG(int32_t, port, 0, "gRPC port (default 50051)");
ABSL_FLAG(int32_t, metrics_port, 0,
          "Prometheus /metrics port (default 9464; -1: off)");
ABSL_FLAG(int32_t, http_port, 0,
          "OpenAI-compatible HTTP API port (default 8000; -1: off)");
ABSL_FLAG(std::string, host, "", "Listen address (default 0.0.0.0)");
ABSL_FLAG(std::string, device, "", "auto, cpu, cuda or cuda:N (default auto)");
ABSL_FLAG(std::string, dtype, "",
          "auto, float32, bfloat16 or float16 (default auto)");
ABSL_FLAG(double, drain_timeout, 0,
          "Seconds in-flight requests may run after SIGTERM (default 30)");
ABSL_FLAG(int32_t, threads, 0,
          "LibTorch intra-op threads (0 = the default: every core but one with "
          "OpenBLAS's OpenMP build, else 1; see model/core/runtime.h)");
ABSL_FLAG(std::string, demo_dir, MOH_DEFAULT_DEMO_DIR,
          "Where the demo models live (used when no model is configured)");
ABSL_FLAG(bool, verbose, false, "Log every request (debug level)");
ABSL_FLAG(bool, access_log, false,
          "Log every finished request at info level (the access log)");
ABSL_FLAG(std::string, tls_cert, "",
          "TLS: the server's PEM certificate chain (with --tls_key)");
ABSL_FLAG(std::string, tls_key, "", "TLS: the server's PEM private key");
ABSL_FLAG(std::string, tls_client_ca, "",
          "Mutual TLS: require client certificates signed by this PEM CA");
ABSL_FLAG(std::string, auth_token_file, "",
          "Bearer tokens, one per line: Inference calls must send one");
ABSL_FLAG(int32_t, health_port, 0,
          "Plaintext port serving only grpc.health.v1, for probes that cannot "
          "speak TLS (default 0: off)");
ABSL_FLAG(bool, cuda_programmatic_launch, false,
          "CUDA: this project's kernels launch with programmatic dependent "
          "launch (config cuda_programmatic_launch)");
ABSL_FLAG(double, gpu_memory_fraction, 0,
          "CUDA: the share of each GPU's memory this process may hold, in "
          "(0, 1] (0 = the config's, default 1; config gpu_memory_fraction)");
ABSL_FLAG(std::optional<bool>, reflection, std::nullopt,
          "gRPC server reflection (default true)");

namespace moh {
namespace {

constexpr char kServiceName[] = "moh.v1.Inference";

// TLS with `pem` (client certificates required when it has a client CA),
// else plaintext.
std::shared_ptr<grpc::ServerCredentials> ServerCredentials(
    const std::optional<TlsPem>& pem) {
  if (!pem) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions options(
      pem->client_ca.empty()
          ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
          : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  options.pem_key_cert_pairs.push_back({pem->private_key, pem->cert_chain});
  options.pem_root_certs = pem->client_ca;
  return grpc::SslServerCredentials(options);
}

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
  if (absl::GetFlag(FLAGS_http_port) != 0) {
    config.set_http_port(absl::GetFlag(FLAGS_http_port));
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
  if (absl::GetFlag(FLAGS_access_log)) config.set_access_log(true);
  if (!absl::GetFlag(FLAGS_tls_cert).empty()) {
    config.mutable_tls()->set_cert_file(absl::GetFlag(FLAGS_tls_cert));
  }
  if (!absl::GetFlag(FLAGS_tls_key).empty()) {
    config.mutable_tls()->set_key_file(absl::GetFlag(FLAGS_tls_key));
  }
  if (!absl::GetFlag(FLAGS_tls_client_ca).empty()) {
    config.mutable_tls()->set_client_ca_file(
        absl::GetFlag(FLAGS_tls_client_ca));
  }
  if (!absl::GetFlag(FLAGS_auth_token_file).empty()) {
    config.set_auth_token_file(absl::GetFlag(FLAGS_auth_token_file));
  }
  if (absl::GetFlag(FLAGS_health_port) != 0) {
    config.set_health_port(absl::GetFlag(FLAGS_health_port));
  }
  if (absl::GetFlag(FLAGS_cuda_programmatic_launch)) {
    config.set_cuda_programmatic_launch(true);
  }
  if (absl::GetFlag(FLAGS_gpu_memory_fraction) != 0) {
    config.set_gpu_memory_fraction(absl::GetFlag(FLAGS_gpu_memory_fraction));
  }
  if (absl::GetFlag(FLAGS_reflection).has_value()) {
    config.set_reflection(*absl::GetFlag(FLAGS_reflection));
  }
  absl::Status status = ResolveServerConfig(&config);
  if (!status.ok()) return status;
  return config;
}

// The Prometheus exporter on metrics_port (null when it is off).
absl::StatusOr<std::unique_ptr<MetricsHttpServer>> StartMetricsHttp(
    const v1::ServerConfig& config, const std::optional<TlsPem>& tls,
    Metrics& metrics) {
  if (config.metrics_port() <= 0) return nullptr;
  MOH_ASSIGN_OR_RETURN(
      std::unique_ptr<MetricsHttpServer> server,
      MetricsHttpServer::Start(
          config.metrics_host(), config.metrics_port(), tls,
          metrics.Collectables(),
          absl::Seconds(config.http_header_timeout_seconds())));
  MOH_LOG(Info) << "metrics on " << (tls.has_value() ? "https://" : "http://")
                << config.metrics_host() << ":" << config.metrics_port()
                << "/metrics";
  return server;
}

// The bearer tokens of auth_token_file (null without one).
absl::StatusOr<std::unique_ptr<TokenAuth>> LoadAuth(
    const v1::ServerConfig& config) {
  if (config.auth_token_file().empty()) return nullptr;
  return TokenAuth::FromFile(config.auth_token_file());
}

// The gRPC server on host:port with `service`, its limits and interceptors.
absl::StatusOr<std::unique_ptr<grpc::Server>> StartGrpc(
    const v1::ServerConfig& config, const std::optional<TlsPem>& tls,
    InferenceService& service, Metrics& metrics) {
  grpc::EnableDefaultHealthCheckService(true);
  if (!config.has_reflection() || config.reflection()) {
    grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  }
  grpc::ServerBuilder builder;
  const std::string address = absl::StrCat(config.host(), ":", config.port());
  int bound_port = 0;
  builder.AddListeningPort(address, ServerCredentials(tls), &bound_port);
  builder.RegisterService(&service);
  std::vector<
      std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>
      interceptors;
  interceptors.push_back(std::make_unique<UnparsableRequestCounter>(&metrics));
  builder.experimental().SetInterceptorCreators(std::move(interceptors));
  builder.SetMaxReceiveMessageSize(config.max_message_mb() << 20);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS,
                             config.max_concurrent_streams());
  grpc::ResourceQuota quota("moh-server");
  quota.Resize(static_cast<size_t>(config.grpc_memory_mb()) << 20);
  builder.SetResourceQuota(quota);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || bound_port == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", address));
  }
  return server;
}

// The OpenAI-compatible API on http_port (null when it is off).
absl::StatusOr<std::unique_ptr<OpenAiHttpServer>> StartOpenAiHttp(
    const v1::ServerConfig& config, const std::optional<TlsPem>& tls,
    ModelManager& models, RequestWorkers* workers, const TokenAuth* auth) {
  if (config.http_port() == config_limits::kHttpPortOff) return nullptr;
  OpenAiHttpServer::Options options;
  options.host = config.host();
  options.port = config.http_port();
  options.tls = tls;
  options.max_connections = config.http_max_connections();
  options.max_connections_per_client = config.http_max_connections_per_client();
  options.threads = config.http_threads();
  options.header_timeout = absl::Seconds(config.http_header_timeout_seconds());
  options.body_timeout = absl::Seconds(config.http_body_timeout_seconds());
  options.max_body_bytes = static_cast<size_t>(config.max_message_mb()) << 20;
  options.body_memory_bytes = static_cast<size_t>(config.http_body_memory_mb())
                              << 20;
  MOH_ASSIGN_OR_RETURN(
      std::unique_ptr<OpenAiHttpServer> server,
      OpenAiHttpServer::Start(options, &models, workers, auth));
  MOH_LOG(Info) << "OpenAI-compatible API on "
                << (tls.has_value() ? "https://" : "http://") << config.host()
                << ":" << config.http_port() << "/v1";
  return server;
}

// Kubernetes' gRPC probes cannot speak TLS: health_port serves the same
// health status, alone and in plaintext, on a port of its own (null when it
// is off).
absl::StatusOr<std::unique_ptr<grpc::Server>> StartHealthPort(
    const v1::ServerConfig& config) {
  if (config.health_port() == 0) return nullptr;
  grpc::ServerBuilder builder;
  const std::string address =
      absl::StrCat(config.host(), ":", config.health_port());
  int bound = 0;
  builder.AddListeningPort(address, grpc::InsecureServerCredentials(), &bound);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || bound == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", address));
  }
  MOH_LOG(Info) << "health checks (plaintext) on " << address;
  return server;
}

// After SIGTERM: stops admitting, lets what runs finish within
// drain_timeout_seconds, then answers UNAVAILABLE until clients go quiet.
void Drain(const v1::ServerConfig& config, ModelManager& models,
           OpenAiHttpServer* http, const InferenceService& service) {
  models.StopLoading();
  models.StopAccepting();
  if (http != nullptr) http->StopAccepting();
  const absl::Time give_up =
      absl::Now() + absl::Seconds(config.drain_timeout_seconds());
  while (!models.Idle() && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  if (!models.Idle()) {
    MOH_LOG(Warning) << "drain timeout: cancelling what is still running";
  }
  // Lame duck: gRPC cancels calls that reach it while it shuts down
  // (CANCELLED, not retryable; grpc/grpc#41785), so the server keeps
  // answering UNAVAILABLE until its clients have gone quiet (load balancers
  // have moved them) for kQuietPeriod, within the drain timeout.
  constexpr absl::Duration kQuietPeriod = absl::Milliseconds(250);
  while (absl::Now() < give_up &&
         absl::Now() - service.last_call() < kQuietPeriod) {
    absl::SleepFor(absl::Milliseconds(20));
  }
}

// Logs why the server cannot start; its exit status.
int Fail(const absl::Status& status) {
  MOH_LOG(Error) << status.message();
  return 1;
}

// Logging, the CPU allocator and threads, from the config; logs the build.
void ConfigureProcess(const v1::ServerConfig& config) {
  if (config.log_requests()) SetLogLevel(LogLevel::kDebug);
  SetAccessLog(config.access_log());
  ConfigureCpuAllocator();
  ConfigureCpuThreads(config.threads());
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  if (cores > 0 && config.threads() > cores) {
    MOH_LOG(Warning) << "threads " << config.threads() << " is more than this "
                     << "machine's " << cores
                     << " hardware threads: the intra-op threads will wait "
                        "on each other";
  }
  MOH_LOG(Info) << LibTorchBuildSummary();
  MOH_LOG(Info) << "CPU: " << CpuThreadingSummary();
  SetGpuMemoryFraction(config.gpu_memory_fraction());
  if (config.gpu_memory_fraction() < 1) {
    MOH_LOG(Info) << "each GPU a model uses: at most "
                  << config.gpu_memory_fraction()
                  << " of its memory (gpu_memory_fraction)";
  }
  SetCudaProgrammaticLaunch(config.cuda_programmatic_launch());
  if (config.cuda_programmatic_launch()) {
    MOH_LOG(Info) << "CUDA kernels launch with programmatic dependent launch "
                     "(cuda_programmatic_launch)";
  }
}

// A CUDA build's GPU memory gauges, read at each scrape. When LibTorch
// cannot give the figures (a lost device, say) the scrape goes on without
// them.
void WatchGpuMemory(Metrics& metrics) {
  metrics.SetGpuMemoryReader([] {
    std::map<std::string, GpuMemoryReading> bytes;
    try {
      for (const GpuMemoryStats& gpu : GpuMemory()) {
        bytes[absl::StrCat("cuda:", gpu.device)] = {
            static_cast<double>(gpu.allocated_bytes),
            static_cast<double>(gpu.limit_bytes)};
      }
    } catch (const std::exception& e) {
      MOH_LOG(Warning) << "GPU memory figures: " << e.what();
      bytes.clear();
    }
    return bytes;
  });
}

// The gRPC health services to set together: the serving port's, and the
// health port's when there is one (`health_server` may be null).
std::vector<grpc::HealthCheckServiceInterface*> HealthServices(
    grpc::Server* server, grpc::Server* health_server) {
  std::vector<grpc::HealthCheckServiceInterface*> services = {
      server->GetHealthCheckService()};
  if (health_server != nullptr) {
    services.push_back(health_server->GetHealthCheckService());
  }
  return services;
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
  ConfigureProcess(*config);

  auto registry = std::make_shared<prometheus::Registry>();
  Metrics metrics(registry);
  if (CudaBuild()) WatchGpuMemory(metrics);
  absl::StatusOr<std::optional<TlsPem>> tls = ReadTlsPem(config->tls());
  if (!tls.ok()) return Fail(tls.status());
  auto metrics_http = StartMetricsHttp(*config, *tls, metrics);
  if (!metrics_http.ok()) return Fail(metrics_http.status());
  absl::StatusOr<std::unique_ptr<TokenAuth>> auth = LoadAuth(*config);
  if (!auth.ok()) return Fail(auth.status());

  ModelManager models(*config, &metrics);
  RequestWorkers::Options worker_options;
  worker_options.threads = config->request_threads();
  worker_options.max_queued = config->request_queue();
  absl::StatusOr<std::unique_ptr<RequestWorkers>> workers =
      RequestWorkers::Create(worker_options);
  if (!workers.ok()) return Fail(workers.status());
  InferenceService service(&models, auth->get(), workers->get());
  absl::StatusOr<std::unique_ptr<grpc::Server>> server =
      StartGrpc(*config, *tls, service, metrics);
  if (!server.ok()) return Fail(server.status());
  absl::StatusOr<std::unique_ptr<OpenAiHttpServer>> http =
      StartOpenAiHttp(*config, *tls, models, workers->get(), auth->get());
  if (!http.ok()) return Fail(http.status());
  absl::StatusOr<std::unique_ptr<grpc::Server>> health_server =
      StartHealthPort(*config);
  if (!health_server.ok()) return Fail(health_server.status());

  const auto set_health =
      [services =
           HealthServices(server->get(), health_server->get())](bool serving) {
        for (grpc::HealthCheckServiceInterface* h : services) {
          h->SetServingStatus(serving);
          h->SetServingStatus(kServiceName, serving);
        }
      };
  set_health(false);
  MOH_LOG(Info) << "moh-server listening on " << config->host() << ":"
                << config->port() << " (" << config->models_size()
                << " model(s) loading)";

  std::atomic<bool> draining{false};
  absl::Notification stop_watching;
  std::thread readiness([&] {
    models.WaitLoaded();
    if (draining) return;
    if (!models.AllReady()) {
      MOH_LOG(Error) << "not ready: a model failed to load (see ListModels)";
      return;
    }
    set_health(true);
    MOH_LOG(Info) << "ready: every model loaded and warmed up";
    // A model whose device is lost since (a CUDA context lost to an illegal
    // memory access, an ECC error) serves nothing more: NOT_SERVING, so
    // that an orchestrator routes around the server and restarts it.
    while (!stop_watching.WaitForNotificationWithTimeout(absl::Seconds(1))) {
      if (!models.AllReady()) {
        set_health(false);
        MOH_LOG(Error) << "not serving: a model lost its device (see "
                          "ListModels); restart the server";
        return;
      }
    }
  });

  int signal_number = 0;
  sigwait(&signals, &signal_number);
  draining = true;
  stop_watching.Notify();
  MOH_LOG(Info) << "signal " << signal_number << ": draining (up to "
                << absl::Seconds(config->drain_timeout_seconds()) << ")";
  set_health(false);
  Drain(*config, models, http->get(), service);
  http->reset();  // cancels what still runs over HTTP
  if (*health_server) (*health_server)->Shutdown();
  (*server)->Shutdown(std::chrono::system_clock::now() +
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
