#include "service/config/server_config.h"

#include <cstdio>
#include <fstream>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "service/config/config_limits.h"
#include "service/engine/batcher.h"

namespace moh {
namespace {

using ::testing::HasSubstr;

std::string WriteTemp(const std::string& text) {
  char path[] = "/tmp/moh_config_XXXXXX";
  const int fd = mkstemp(path);
  EXPECT_GE(fd, 0);
  close(fd);
  std::ofstream(path) << text;
  return path;
}

TEST(ServerConfigTest, ReadsTextFormatAndFillsDefaults) {
  const std::string path = WriteTemp(R"(
    port: 6000
    models { model_dir: "/models/lm/" batching { max_batch_size: 8 } }
    models { name: "vit" model_dir: "/models/vit" generation { max_running: 4 } }
  )");
  auto config = ReadServerConfigFile(path);
  ASSERT_TRUE(config.ok()) << config.status();
  ASSERT_TRUE(ResolveServerConfig(&*config).ok());
  EXPECT_EQ(config->port(), 6000);
  EXPECT_EQ(config->metrics_port(), 9464);
  EXPECT_EQ(config->host(), "0.0.0.0");
  EXPECT_DOUBLE_EQ(config->drain_timeout_seconds(), 30.0);
  EXPECT_EQ(config->max_message_mb(), 64);
  EXPECT_EQ(config->max_concurrent_streams(), 256);
  EXPECT_EQ(config->grpc_memory_mb(), 2048);
  EXPECT_EQ(config->request_threads(), 4);
  EXPECT_EQ(config->request_queue(), 1024);
  EXPECT_EQ(config->image_decode_memory_mb(), 512);
  EXPECT_EQ(config->http_body_memory_mb(), 1024);
  EXPECT_EQ(config->http_max_connections_per_client(), 64);
  EXPECT_EQ(config->http_header_timeout_seconds(), 30);
  EXPECT_EQ(config->http_body_timeout_seconds(), 60);
  EXPECT_EQ(config->http_threads(), 2);
  EXPECT_DOUBLE_EQ(config->gpu_memory_fraction(), 1.0);
  const v1::ModelConfig& lm = config->models(0);
  EXPECT_EQ(lm.name(), "lm");  // the directory's base name
  EXPECT_EQ(lm.device(), "auto");
  EXPECT_EQ(lm.batching().max_batch_size(), 8);
  EXPECT_DOUBLE_EQ(lm.batching().max_queue_delay_ms(), 5.0);
  EXPECT_EQ(lm.batching().max_queued_requests(), 256);
  EXPECT_EQ(lm.generation().max_running(), 16);
  EXPECT_EQ(lm.generation().prefill_token_budget(), 512);
  EXPECT_EQ(lm.generation().default_max_new_tokens(), 64);
  EXPECT_EQ(lm.generation().attention_workspace_mb(), 256);
  EXPECT_EQ(lm.generation().kv_cache_dtype(), "auto");
  EXPECT_EQ(lm.generation().kv_block_size(), 16);
  EXPECT_EQ(lm.generation().kv_blocks(), 0);  // automatic
  EXPECT_TRUE(lm.generation().prefix_caching());
  EXPECT_EQ(lm.generation().idle_gather_us(), 300);
  EXPECT_EQ(lm.generation().cuda_graphs(), 64);
  const v1::CudaPaths& paths = lm.generation().cuda_paths();
  EXPECT_TRUE(paths.paged_decode());
  EXPECT_TRUE(paths.fused_ops());
  EXPECT_TRUE(paths.varlen_prefill());
  EXPECT_TRUE(paths.skinny_linear());
  EXPECT_FALSE(config->cuda_programmatic_launch());
  EXPECT_EQ(config->models(1).generation().max_running(), 4);
  std::remove(path.c_str());
}

TEST(ServerConfigTest, ParseErrorNamesFileAndLine) {
  const std::string path = WriteTemp("port: 1\nmodels { nmae: \"x\" }\n");
  auto config = ReadServerConfigFile(path);
  ASSERT_FALSE(config.ok());
  EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(config.status().message()), HasSubstr(path));
  EXPECT_THAT(std::string(config.status().message()), HasSubstr("line 2"));
  std::remove(path.c_str());
  EXPECT_EQ(ReadServerConfigFile("/nonexistent/moh.conf").status().code(),
            absl::StatusCode::kNotFound);
}

TEST(ServerConfigTest, RejectsOutOfRangeFieldsNamingThem) {
  struct Case {
    std::string text;
    std::string message;
  } cases[] = {
      {"port: 70000 models { model_dir: \"m\" }", "port must be in [1, 65535]"},
      {"metrics_port: -5 models { model_dir: \"m\" }", "metrics_port"},
      {"port: 7000 metrics_port: 7000 models { model_dir: \"m\" }",
       "metrics_port must differ from port"},
      {"threads: -1 models { model_dir: \"m\" }",
       "threads must be in [0, 1024]"},
      {"health_port: 50051 models { model_dir: \"m\" }",
       "health_port must be in [1, 65535] and differ from port"},
      {"max_message_mb: 2000 models { model_dir: \"m\" }",
       "max_message_mb must be in [1, 1024]"},
      {"max_concurrent_streams: -1 models { model_dir: \"m\" }",
       "max_concurrent_streams must be in [1, 100000]"},
      {"grpc_memory_mb: 10 models { model_dir: \"m\" }",
       "grpc_memory_mb must be in [64, 1048576]"},
      {"request_threads: 300 models { model_dir: \"m\" }",
       "request_threads must be in [1, 256]"},
      {"request_queue: -2 models { model_dir: \"m\" }",
       "request_queue must be in [1, 1048576]"},
      {"image_decode_memory_mb: -1 models { model_dir: \"m\" }",
       "image_decode_memory_mb must be in [1, 1048576]"},
      {"http_max_connections_per_client: 5000 models { model_dir: \"m\" }",
       "http_max_connections_per_client must be in [1, 4096]"},
      {"http_header_timeout_seconds: 0.5 models { model_dir: \"m\" }",
       "http_header_timeout_seconds must be in [1, 3600]"},
      {"http_body_timeout_seconds: 7200 models { model_dir: \"m\" }",
       "http_body_timeout_seconds must be in [1, 3600]"},
      {"http_threads: 65 models { model_dir: \"m\" }",
       "http_threads must be in [1, 64]"},
      {"gpu_memory_fraction: 1.5 models { model_dir: \"m\" }",
       "gpu_memory_fraction must be in (0, 1], got 1.5"},
      {"gpu_memory_fraction: -0.25 models { model_dir: \"m\" }",
       "gpu_memory_fraction must be in (0, 1], got -0.25"},
      {"http_body_memory_mb: -1 models { model_dir: \"m\" }",
       "http_body_memory_mb must be in [1, 1048576]"},
      {"max_message_mb: 64 http_body_memory_mb: 32 models { model_dir: \"m\" }",
       "http_body_memory_mb must be at least max_message_mb (64), got 32"},
      {"", "models: at least one model"},
      {"models { name: \"x\" }", "models[0].model_dir must be set"},
      {"models { model_dir: \"m\" batching { max_batch_size: -1 } }",
       "models[0].batching.max_batch_size must be in [1, 4096]"},
      {"models { model_dir: \"m\" batching { max_queue_delay_ms: -1 } }",
       "models[0].batching.max_queue_delay_ms"},
      {"models { model_dir: \"m\" } models { model_dir: \"n\" generation { "
       "max_running: 99999 } }",
       "models[1].generation.max_running must be in [1, 4096]"},
      {"models { model_dir: \"m\" generation { max_seq_len: -1 } }",
       "models[0].generation.max_seq_len"},
      {"models { model_dir: \"m\" generation { attention_workspace_mb: "
       "100000 } }",
       "models[0].generation.attention_workspace_mb must be in [1, 65536]"},
      {"models { model_dir: \"m\" generation { kv_block_size: 5000 } }",
       "models[0].generation.kv_block_size must be in [1, 4096]"},
      {"models { model_dir: \"m\" generation { kv_blocks: -3 } }",
       "models[0].generation.kv_blocks"},
      {"models { model_dir: \"m\" generation { kv_blocks: 99999999 } }",
       "models[0].generation.kv_blocks must be in [0, 16777216]"},
      {"models { model_dir: \"m\" adaptive { queue_depth: -1 } }",
       "models[0].adaptive.queue_depth"},
      {"models { model_dir: \"a/m\" } models { model_dir: \"b/m\" }",
       "models[1].name \"m\" is used by another model"},
      {"models { model_dir: \"bad\\xc8name\" }",
       "models[0].name must be valid UTF-8, got \"bad\xEF\xBF\xBDname\""},
      {"models { model_dir: \"m\" aliases { name: \"a\\nb\" "
       "activation_ratio: 0.5 } }",
       "models[0].aliases[0].name must not hold control characters, got "
       "\"a\\nb\""},
      {"models { model_dir: \"m\" aliases { activation_ratio: 0.5 } }",
       "models[0].aliases[0].name must be set"},
      {"models { model_dir: \"m\" aliases { name: \"m@0\" } }",
       "models[0].aliases[0].activation_ratio must be in (0, 1], got 0"},
      {"models { model_dir: \"m\" aliases { name: \"a\" activation_ratio: "
       "0.5 min_activation_ratio: 0.75 } }",
       "models[0].aliases[0].min_activation_ratio must be in [0, 0.5] (its "
       "activation_ratio), got 0.75"},
      {"models { model_dir: \"m\" } models { model_dir: \"n\" aliases { "
       "name: \"m\" activation_ratio: 0.5 } }",
       "models[1].aliases[0].name \"m\" is used by another model or alias"},
      // In full, where the range is not a plain [min, max].
      {"metrics_port: -5 models { model_dir: \"m\" }",
       "metrics_port must be in [1, 65535] or -1 (off), got -5"},
      {"threads: -1 models { model_dir: \"m\" }",
       "threads must be in [0, 1024] (0 = the default), got -1"},
      {"threads: 4096 models { model_dir: \"m\" }",
       "threads must be in [0, 1024] (0 = the default), got 4096"},
      {"drain_timeout_seconds: -2 models { model_dir: \"m\" }",
       "drain_timeout_seconds must be in [0.001, 86400], got -2"},
      {"models { model_dir: \"m\" batching { max_queue_delay_ms: -1 } }",
       "models[0].batching.max_queue_delay_ms must be in (0, 10000], got -1"},
      {"models { model_dir: \"m\" batching { max_queued_requests: -1 } }",
       "models[0].batching.max_queued_requests must be in [1, 1048576], got "
       "-1"},
      {"models { model_dir: \"m\" generation { max_seq_len: -1 } }",
       "models[0].generation.max_seq_len must be >= 0 (0 = model maximum), "
       "got -1"},
      {"models { model_dir: \"m\" generation { prefill_token_budget: -1 } }",
       "models[0].generation.prefill_token_budget must be in [1, 1048576], "
       "got -1"},
      {"models { model_dir: \"m\" generation { idle_gather_us: -1 } }",
       "models[0].generation.idle_gather_us must be in [0, 100000], got -1"},
      {"models { model_dir: \"m\" generation { cuda_graphs: -1 } }",
       "models[0].generation.cuda_graphs must be in [0, 4096], got -1"},
      {"models { model_dir: \"m\" generation { cuda_graphs: 5000 } }",
       "models[0].generation.cuda_graphs must be in [0, 4096], got 5000"},
      {"models { model_dir: \"m\" adaptive { queue_depth: -1 } }",
       "models[0].adaptive.queue_depth must be >= 0 (0 = off), got -1"},
  };
  for (const Case& c : cases) {
    const std::string path = WriteTemp(c.text);
    auto config = ReadServerConfigFile(path);
    std::remove(path.c_str());
    ASSERT_TRUE(config.ok()) << c.text << ": " << config.status();
    absl::Status status = ResolveServerConfig(&*config);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.text;
    EXPECT_THAT(std::string(status.message()), HasSubstr(c.message)) << c.text;
  }
}

// A Batcher built without a config behaves as an unconfigured model's.
TEST(ServerConfigTest, BatcherDefaultsAreTheConfigDefaults) {
  v1::ServerConfig config;
  config.add_models()->set_model_dir("m");
  ASSERT_TRUE(ResolveServerConfig(&config).ok());
  const v1::BatchingConfig& batching = config.models(0).batching();
  struct Task {
    size_t size() const { return 1; }
  };
  const Batcher<Task>::Options options;
  EXPECT_EQ(options.max_batch_size, batching.max_batch_size());
  EXPECT_EQ(options.max_queue_delay,
            absl::Milliseconds(batching.max_queue_delay_ms()));
  EXPECT_EQ(options.max_queued_requests, batching.max_queued_requests());
}

TEST(ServerConfigTest, ZeroCudaGraphsStaysOff) {
  v1::ServerConfig config;
  config.add_models()->mutable_generation()->set_cuda_graphs(0);
  config.mutable_models(0)->set_model_dir("m");
  ASSERT_TRUE(ResolveServerConfig(&config).ok());
  EXPECT_EQ(config.models(0).generation().cuda_graphs(), 0);
}

// A path switched off stays off; the others take their default, on.
TEST(ServerConfigTest, CudaPathsSwitchedOffStayOff) {
  v1::ServerConfig config;
  v1::ModelConfig* model = config.add_models();
  model->set_model_dir("m");
  v1::CudaPaths* paths = model->mutable_generation()->mutable_cuda_paths();
  paths->set_fused_ops(false);
  paths->set_skinny_linear(false);
  ASSERT_TRUE(ResolveServerConfig(&config).ok());
  const v1::CudaPaths& resolved = config.models(0).generation().cuda_paths();
  EXPECT_TRUE(resolved.paged_decode());
  EXPECT_FALSE(resolved.fused_ops());
  EXPECT_TRUE(resolved.varlen_prefill());
  EXPECT_FALSE(resolved.skinny_linear());
}

TEST(ServerConfigTest, UnsetMaxSeqLenIsTheModelMaximumCappedAt4096) {
  EXPECT_EQ(config_limits::ResolveMaxSeqLen(0, 2048), 2048);
  EXPECT_EQ(config_limits::ResolveMaxSeqLen(0, 32768), 4096);
  EXPECT_EQ(config_limits::ResolveMaxSeqLen(100, 32768), 100);
}

TEST(ServerConfigTest, DemoConfigServesTheThreeDemoModels) {
  v1::ServerConfig config = DemoServerConfig("/demo");
  ASSERT_TRUE(ResolveServerConfig(&config).ok());
  ASSERT_EQ(config.models_size(), 3);
  EXPECT_EQ(config.models(0).name(), "demo-lm");
  EXPECT_EQ(config.models(0).model_dir(), "/demo/demo-lm");
  EXPECT_EQ(config.models(1).name(), "demo-vit");
  EXPECT_EQ(config.models(1).model_dir(), "/demo/demo-vit");
  EXPECT_EQ(config.models(2).name(), "demo-dit");
  EXPECT_EQ(config.models(2).model_dir(), "/demo/demo-dit");
}

}  // namespace
}  // namespace moh
