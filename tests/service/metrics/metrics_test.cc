#include "service/metrics/metrics.h"

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "prometheus/client_metric.h"
#include "prometheus/metric_family.h"
#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"

namespace moh {
namespace {

using prometheus::ClientMetric;
using prometheus::MetricFamily;
using prometheus::MetricType;
using LabelMap = std::map<std::string, std::string>;

std::vector<MetricFamily> CollectAll(const Metrics& metrics) {
  std::vector<MetricFamily> all;
  for (const auto& weak : metrics.Collectables()) {
    std::shared_ptr<prometheus::Collectable> c = weak.lock();
    if (c == nullptr) continue;
    for (MetricFamily& f : c->Collect()) all.push_back(std::move(f));
  }
  return all;
}

const MetricFamily* FindFamily(const std::vector<MetricFamily>& families,
                               const std::string& name) {
  for (const MetricFamily& f : families) {
    if (f.name == name) return &f;
  }
  return nullptr;
}

LabelMap Labels(const ClientMetric& m) {
  LabelMap labels;
  for (const auto& l : m.label) labels[l.name] = l.value;
  return labels;
}

// The series of family `name` whose label set is exactly `labels`.
const ClientMetric* FindSeries(const std::vector<MetricFamily>& families,
                               const std::string& name,
                               const LabelMap& labels) {
  const MetricFamily* f = FindFamily(families, name);
  if (f == nullptr) return nullptr;
  for (const ClientMetric& m : f->metric) {
    if (Labels(m) == labels) return &m;
  }
  return nullptr;
}

int SeriesCount(const std::vector<MetricFamily>& families,
                const std::string& name) {
  const MetricFamily* f = FindFamily(families, name);
  return f == nullptr ? 0 : static_cast<int>(f->metric.size());
}

// Cumulative count of the bucket with upper bound `le`; -1 if no such bucket.
int64_t BucketCount(const ClientMetric& m, double le) {
  for (const auto& b : m.histogram.bucket) {
    if (b.upper_bound == le) return static_cast<int64_t>(b.cumulative_count);
  }
  return -1;
}

class MetricsTest : public ::testing::Test {
 protected:
  MetricsTest()
      : registry_(std::make_shared<prometheus::Registry>()),
        metrics_(registry_) {}

  std::vector<MetricFamily> Collect() { return CollectAll(metrics_); }

  double CounterValue(const std::string& name, const LabelMap& labels) {
    const std::vector<MetricFamily> families = Collect();
    const ClientMetric* m = FindSeries(families, name, labels);
    EXPECT_NE(m, nullptr) << name;
    return m == nullptr ? -1 : m->counter.value;
  }

  double GaugeValue(const std::string& name, const LabelMap& labels) {
    const std::vector<MetricFamily> families = Collect();
    const ClientMetric* m = FindSeries(families, name, labels);
    EXPECT_NE(m, nullptr) << name;
    return m == nullptr ? -1 : m->gauge.value;
  }

  // moh_requests_total of `model`'s `rpc` answered with `code` (its gRPC name).
  double Requests(const std::string& model, const std::string& rpc,
                  const std::string& code) {
    return CounterValue("moh_requests_total",
                        {{"model", model}, {"rpc", rpc}, {"code", code}});
  }

  ClientMetric::Histogram HistogramValue(const std::string& name,
                                         const LabelMap& labels) {
    const std::vector<MetricFamily> families = Collect();
    const ClientMetric* m = FindSeries(families, name, labels);
    EXPECT_NE(m, nullptr) << name;
    return m == nullptr ? ClientMetric::Histogram{} : m->histogram;
  }

  std::shared_ptr<prometheus::Registry> registry_;
  Metrics metrics_;
};

int64_t Bucket(const ClientMetric::Histogram& h, double le) {
  ClientMetric m;
  m.histogram = h;
  return BucketCount(m, le);
}

TEST(MetricsNamesTest, RpcAndBatchKindNames) {
  EXPECT_STREQ(RpcName(Rpc::kGenerate), "Generate");
  EXPECT_STREQ(RpcName(Rpc::kClassify), "Classify");
  EXPECT_STREQ(RpcName(Rpc::kMessages), "Messages");
  EXPECT_STREQ(BatchKindName(BatchKind::kPrefill), "prefill");
  EXPECT_STREQ(BatchKindName(BatchKind::kDecode), "decode");
  EXPECT_STREQ(BatchKindName(BatchKind::kClassify), "classify");
}

TEST_F(MetricsTest, ForModelReturnsSameObject) {
  ModelMetrics* a = metrics_.ForModel("m", 2, 4, true);
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(metrics_.ForModel("m", 2, 4, true), a);
  // Later calls return the first object whatever their arguments.
  EXPECT_EQ(metrics_.ForModel("m", 7, 7, false), a);
  EXPECT_NE(metrics_.ForModel("other", 2, 4, true), a);
  EXPECT_EQ(SeriesCount(Collect(), "moh_head_tokens_total"), 2 * 2 * 4);
}

TEST_F(MetricsTest, EveryFamilyPresentWithHelpAndType) {
  metrics_.ForModel("m", 1, 2, true)->SetKvCacheConfig(16, 64);
  metrics_.SetGpuMemoryReader([] {
    return std::map<std::string, GpuMemoryReading>{{"cuda:0", {1.0, 2.0}}};
  });
  const std::vector<MetricFamily> families = Collect();
  const std::map<std::string, MetricType> expected = {
      {"moh_requests_total", MetricType::Counter},
      {"moh_request_duration_seconds", MetricType::Histogram},
      {"moh_queue_duration_seconds", MetricType::Histogram},
      {"moh_time_to_first_token_seconds", MetricType::Histogram},
      {"moh_inter_token_latency_seconds", MetricType::Histogram},
      {"moh_prompt_tokens_total", MetricType::Counter},
      {"moh_generated_tokens_total", MetricType::Counter},
      {"moh_images_generated_total", MetricType::Counter},
      {"moh_image_seconds", MetricType::Histogram},
      {"moh_diffusion_steps_total", MetricType::Counter},
      {"moh_batch_size", MetricType::Histogram},
      {"moh_requests_running", MetricType::Gauge},
      {"moh_requests_waiting", MetricType::Gauge},
      {"moh_kv_cache_usage_ratio", MetricType::Gauge},
      {"moh_kv_cache_config_info", MetricType::Gauge},
      {"moh_kv_blocks_in_use", MetricType::Gauge},
      {"moh_kv_blocks_cached", MetricType::Gauge},
      {"moh_prefix_cache_queries_total", MetricType::Counter},
      {"moh_prefix_cache_hits_total", MetricType::Counter},
      {"moh_activation_ratio", MetricType::Histogram},
      {"moh_head_tokens_total", MetricType::Counter},
      {"moh_activation_ratio_lowered_total", MetricType::Counter},
      {"moh_model_load_seconds", MetricType::Gauge},
      {"moh_cuda_graph_replays_total", MetricType::Counter},
      {"moh_sampled_tokens_total", MetricType::Counter},
      {"process_cpu_seconds_total", MetricType::Counter},
      {"process_resident_memory_bytes", MetricType::Gauge},
      {"process_virtual_memory_bytes", MetricType::Gauge},
      {"process_start_time_seconds", MetricType::Gauge},
      {"process_open_fds", MetricType::Gauge},
      {"moh_gpu_memory_bytes", MetricType::Gauge},
      {"moh_gpu_memory_limit_bytes", MetricType::Gauge},
  };
  for (const auto& [name, type] : expected) {
    const MetricFamily* f = FindFamily(families, name);
    ASSERT_NE(f, nullptr) << name;
    EXPECT_EQ(f->type, type) << name;
    EXPECT_FALSE(f->help.empty()) << name;
    EXPECT_FALSE(f->metric.empty()) << name;
  }
  for (const MetricFamily& f : families) {
    EXPECT_FALSE(f.help.empty()) << f.name;
  }
}

TEST_F(MetricsTest, RequestFinishedCountsByRpcAndCode) {
  ModelMetrics* m = metrics_.ForModel("m", 1, 1, false);
  m->RequestFinished(Rpc::kGenerate, absl::StatusCode::kOk,
                     absl::Milliseconds(3));
  m->RequestFinished(Rpc::kGenerate, absl::StatusCode::kOk,
                     absl::Milliseconds(200));
  m->RequestFinished(Rpc::kGenerate, absl::StatusCode::kInvalidArgument,
                     absl::Milliseconds(1));
  m->RequestFinished(Rpc::kClassify, absl::StatusCode::kResourceExhausted,
                     absl::Seconds(2));

  EXPECT_EQ(Requests("m", "Generate", "OK"), 2);
  EXPECT_EQ(Requests("m", "Generate", "INVALID_ARGUMENT"), 1);
  EXPECT_EQ(Requests("m", "Classify", "RESOURCE_EXHAUSTED"), 1);
  EXPECT_EQ(Requests("m", "Classify", "OK"), 0);

  const auto gen = HistogramValue("moh_request_duration_seconds",
                                  {{"model", "m"}, {"rpc", "Generate"}});
  EXPECT_EQ(gen.sample_count, 3u);
  EXPECT_NEAR(gen.sample_sum, 0.204, 1e-12);
  EXPECT_EQ(Bucket(gen, 0.001), 1);
  EXPECT_EQ(Bucket(gen, 0.0025), 1);
  EXPECT_EQ(Bucket(gen, 0.005), 2);
  EXPECT_EQ(Bucket(gen, 0.25), 3);
  EXPECT_EQ(Bucket(gen, 60), 3);
  const auto cls = HistogramValue("moh_request_duration_seconds",
                                  {{"model", "m"}, {"rpc", "Classify"}});
  EXPECT_EQ(cls.sample_count, 1u);
  EXPECT_DOUBLE_EQ(cls.sample_sum, 2.0);
  EXPECT_EQ(Bucket(cls, 1), 0);
  EXPECT_EQ(Bucket(cls, 2.5), 1);
}

TEST_F(MetricsTest, EveryStatusCodeHasItsGrpcName) {
  const std::vector<std::string> names = {
      "OK",
      "CANCELLED",
      "UNKNOWN",
      "INVALID_ARGUMENT",
      "DEADLINE_EXCEEDED",
      "NOT_FOUND",
      "ALREADY_EXISTS",
      "PERMISSION_DENIED",
      "RESOURCE_EXHAUSTED",
      "FAILED_PRECONDITION",
      "ABORTED",
      "OUT_OF_RANGE",
      "UNIMPLEMENTED",
      "INTERNAL",
      "UNAVAILABLE",
      "DATA_LOSS",
      "UNAUTHENTICATED",
  };
  ModelMetrics* m = metrics_.ForModel("m", 1, 1, false);
  for (size_t i = 0; i < names.size(); ++i) {
    m->RequestFinished(Rpc::kClassify, static_cast<absl::StatusCode>(i),
                       absl::ZeroDuration());
  }
  // An out-of-range code counts as UNKNOWN rather than crashing.
  m->RequestFinished(Rpc::kClassify, static_cast<absl::StatusCode>(99),
                     absl::ZeroDuration());
  for (const std::string& code : names) {
    EXPECT_EQ(Requests("m", "Classify", code), code == "UNKNOWN" ? 2 : 1)
        << code;
  }
}

// ListModels is the server's RPC: no model has a series for it, so none sits
// at zero forever. Each model has its request and queue series per RPC (the
// HTTP API's endpoints included), and an OK counter for each.
TEST_F(MetricsTest, PerModelSeriesOnlyForTheModelsRpcs) {
  metrics_.ForModel("m", 1, 1, false);
  const std::vector<MetricFamily> families = Collect();
  for (const char* name : {"moh_requests_total", "moh_request_duration_seconds",
                           "moh_queue_duration_seconds"}) {
    const MetricFamily* f = FindFamily(families, name);
    ASSERT_NE(f, nullptr) << name;
    std::vector<std::string> rpcs;
    for (const ClientMetric& m : f->metric) rpcs.push_back(Labels(m)["rpc"]);
    EXPECT_THAT(rpcs, ::testing::UnorderedElementsAre(
                          "Generate", "Classify", "GenerateImage",
                          "Completions", "ChatCompletions", "Tokenize",
                          "Detokenize", "TokenizerInfo", "Messages"))
        << name;
  }
}

TEST_F(MetricsTest, QueueAndTokenLatencies) {
  ModelMetrics* m = metrics_.ForModel("m", 1, 1, false);
  m->QueueTime(Rpc::kClassify, absl::Microseconds(200));
  m->TimeToFirstToken(absl::Milliseconds(50));
  m->InterTokenLatency(absl::Milliseconds(12));
  m->InterTokenLatency(absl::Milliseconds(30));

  const auto queue = HistogramValue("moh_queue_duration_seconds",
                                    {{"model", "m"}, {"rpc", "Classify"}});
  EXPECT_EQ(queue.sample_count, 1u);
  EXPECT_NEAR(queue.sample_sum, 0.0002, 1e-12);
  EXPECT_EQ(Bucket(queue, 0.0001), 0);
  EXPECT_EQ(Bucket(queue, 0.00025), 1);
  EXPECT_EQ(HistogramValue("moh_queue_duration_seconds",
                           {{"model", "m"}, {"rpc", "Generate"}})
                .sample_count,
            0u);

  const auto ttft =
      HistogramValue("moh_time_to_first_token_seconds", {{"model", "m"}});
  EXPECT_EQ(ttft.sample_count, 1u);
  EXPECT_NEAR(ttft.sample_sum, 0.05, 1e-12);
  EXPECT_EQ(Bucket(ttft, 0.04), 0);
  EXPECT_EQ(Bucket(ttft, 0.06), 1);

  const auto itl =
      HistogramValue("moh_inter_token_latency_seconds", {{"model", "m"}});
  EXPECT_EQ(itl.sample_count, 2u);
  EXPECT_NEAR(itl.sample_sum, 0.042, 1e-12);
  EXPECT_EQ(Bucket(itl, 0.01), 0);
  EXPECT_EQ(Bucket(itl, 0.015), 1);
  EXPECT_EQ(Bucket(itl, 0.03), 2);
}

TEST_F(MetricsTest, TokenCountersIgnoreNonPositive) {
  ModelMetrics* m = metrics_.ForModel("m", 1, 1, false);
  m->PromptTokens(10);
  m->PromptTokens(5);
  m->PromptTokens(-3);
  m->GeneratedTokens(7);
  m->GeneratedTokens(0);
  EXPECT_EQ(CounterValue("moh_prompt_tokens_total", {{"model", "m"}}), 15);
  EXPECT_EQ(CounterValue("moh_generated_tokens_total", {{"model", "m"}}), 7);
  m->CudaGraphReplays(3);
  m->CudaGraphReplays(0);
  m->CudaGraphReplays(-1);
  EXPECT_EQ(CounterValue("moh_cuda_graph_replays_total", {{"model", "m"}}), 3);
  m->SampledTokens(SampledFrom::kReduced, 4);
  m->SampledTokens(SampledFrom::kReducedThenWhole, 1);
  m->SampledTokens(SampledFrom::kWhole, 0);
  EXPECT_EQ(CounterValue("moh_sampled_tokens_total",
                         {{"model", "m"}, {"logits", "reduced"}}),
            4);
  EXPECT_EQ(CounterValue("moh_sampled_tokens_total",
                         {{"model", "m"}, {"logits", "reduced_then_whole"}}),
            1);
  EXPECT_EQ(CounterValue("moh_sampled_tokens_total",
                         {{"model", "m"}, {"logits", "whole"}}),
            0);
}

TEST_F(MetricsTest, BatchSizeByKindWithPowerOfTwoBuckets) {
  ModelMetrics* m = metrics_.ForModel("m", 1, 1, false);
  m->BatchSize(BatchKind::kPrefill, 1);
  m->BatchSize(BatchKind::kPrefill, 3);
  m->BatchSize(BatchKind::kDecode, 256);
  m->BatchSize(BatchKind::kDecode, 300);

  const auto prefill =
      HistogramValue("moh_batch_size", {{"model", "m"}, {"kind", "prefill"}});
  std::vector<double> bounds;
  for (const auto& b : prefill.bucket) bounds.push_back(b.upper_bound);
  EXPECT_THAT(bounds,
              ::testing::ElementsAre(1, 2, 4, 8, 16, 32, 64, 128, 256,
                                     std::numeric_limits<double>::infinity()));
  EXPECT_EQ(prefill.sample_count, 2u);
  EXPECT_EQ(Bucket(prefill, 1), 1);
  EXPECT_EQ(Bucket(prefill, 2), 1);
  EXPECT_EQ(Bucket(prefill, 4), 2);

  const auto decode =
      HistogramValue("moh_batch_size", {{"model", "m"}, {"kind", "decode"}});
  EXPECT_EQ(decode.sample_count, 2u);
  EXPECT_EQ(Bucket(decode, 128), 0);
  EXPECT_EQ(Bucket(decode, 256), 1);
  EXPECT_EQ(
      HistogramValue("moh_batch_size", {{"model", "m"}, {"kind", "classify"}})
          .sample_count,
      0u);
}

TEST_F(MetricsTest, Gauges) {
  ModelMetrics* m = metrics_.ForModel("m", 1, 1, false);
  m->SetRunning(5);
  m->SetWaiting(12);
  m->SetKvCacheUsage(0.25);
  m->SetLoadSeconds(3.5);
  m->SetRunning(4);
  EXPECT_EQ(GaugeValue("moh_requests_running", {{"model", "m"}}), 4);
  EXPECT_EQ(GaugeValue("moh_requests_waiting", {{"model", "m"}}), 12);
  EXPECT_EQ(GaugeValue("moh_kv_cache_usage_ratio", {{"model", "m"}}), 0.25);
  EXPECT_EQ(GaugeValue("moh_model_load_seconds", {{"model", "m"}}), 3.5);
  m->SetKvBlocks(7, 3);
  EXPECT_EQ(GaugeValue("moh_kv_blocks_in_use", {{"model", "m"}}), 7);
  EXPECT_EQ(GaugeValue("moh_kv_blocks_cached", {{"model", "m"}}), 3);
  m->SetKvCacheConfig(16, 640);
  EXPECT_EQ(GaugeValue("moh_kv_cache_config_info", {{"model", "m"},
                                                    {"block_size", "16"},
                                                    {"num_gpu_blocks", "640"}}),
            1);
}

TEST_F(MetricsTest, PrefixCacheCountsTokensQueriedAndHit) {
  ModelMetrics* m = metrics_.ForModel("m", 1, 1, false);
  m->PrefixCache(40, 32);
  m->PrefixCache(9, 0);
  m->PrefixCache(0, 0);  // prefix caching off: nothing looked up
  EXPECT_EQ(CounterValue("moh_prefix_cache_queries_total", {{"model", "m"}}),
            49);
  EXPECT_EQ(CounterValue("moh_prefix_cache_hits_total", {{"model", "m"}}), 32);
}

TEST_F(MetricsTest, ActivationRatioBucketsSeparateCommonRatios) {
  ModelMetrics* m = metrics_.ForModel("m", 1, 1, false);
  m->ActivationRatio(0.5);
  m->ActivationRatio(0.5625);
  m->ActivationRatio(0.75);
  m->RatioLowered();
  m->RatioLowered();
  const auto h = HistogramValue("moh_activation_ratio", {{"model", "m"}});
  EXPECT_EQ(h.sample_count, 3u);
  EXPECT_DOUBLE_EQ(h.sample_sum, 1.8125);
  EXPECT_EQ(Bucket(h, 0.45), 0);
  EXPECT_EQ(Bucket(h, 0.5), 1);
  EXPECT_EQ(Bucket(h, 0.55), 1);
  EXPECT_EQ(Bucket(h, 0.6), 2);
  EXPECT_EQ(Bucket(h, 0.7), 2);
  EXPECT_EQ(Bucket(h, 0.75), 3);
  EXPECT_EQ(Bucket(h, 1.0), 3);
  EXPECT_EQ(
      CounterValue("moh_activation_ratio_lowered_total", {{"model", "m"}}), 2);
}

TEST_F(MetricsTest, HeadTokensPerLayerAndHead) {
  ModelMetrics* m = metrics_.ForModel("m", 2, 3, true);
  EXPECT_EQ(SeriesCount(Collect(), "moh_head_tokens_total"), 6);
  m->HeadTokens({1, 2, 3, 4, 5, 6});
  m->HeadTokens({10, 0, 0, 0, 0, 60});
  for (int layer = 0; layer < 2; ++layer) {
    for (int head = 0; head < 3; ++head) {
      const int i = layer * 3 + head;
      const double extra = i == 0 ? 10 : i == 5 ? 60 : 0;
      EXPECT_EQ(CounterValue("moh_head_tokens_total",
                             {{"model", "m"},
                              {"layer", std::to_string(layer)},
                              {"head", std::to_string(head)}}),
                i + 1 + extra)
          << layer << "/" << head;
    }
  }
}

TEST_F(MetricsTest, HeadTokensWithWrongSizeIsIgnored) {
  ModelMetrics* m = metrics_.ForModel("m", 2, 2, true);
  m->HeadTokens({1, 1, 1});
  m->HeadTokens({1, 1, 1, 1, 1});
  m->HeadTokens({});
  const std::vector<MetricFamily> families = Collect();
  const MetricFamily* f = FindFamily(families, "moh_head_tokens_total");
  ASSERT_NE(f, nullptr);
  ASSERT_EQ(f->metric.size(), 4u);
  for (const ClientMetric& s : f->metric) EXPECT_EQ(s.counter.value, 0);
}

TEST_F(MetricsTest, HeadMetricsOffCreatesNoSeries) {
  ModelMetrics* m = metrics_.ForModel("m", 4, 8, false);
  m->HeadTokens(std::vector<int64_t>(32, 1));
  EXPECT_EQ(SeriesCount(Collect(), "moh_head_tokens_total"), 0);
}

TEST_F(MetricsTest, ModelsAreIsolated) {
  ModelMetrics* a = metrics_.ForModel("a", 1, 2, true);
  ModelMetrics* b = metrics_.ForModel("b", 1, 2, true);
  a->PromptTokens(3);
  a->SetRunning(2);
  a->HeadTokens({5, 6});
  a->RequestFinished(Rpc::kGenerate, absl::StatusCode::kOk, absl::Seconds(1));
  b->PromptTokens(100);
  EXPECT_EQ(CounterValue("moh_prompt_tokens_total", {{"model", "a"}}), 3);
  EXPECT_EQ(CounterValue("moh_prompt_tokens_total", {{"model", "b"}}), 100);
  EXPECT_EQ(GaugeValue("moh_requests_running", {{"model", "b"}}), 0);
  EXPECT_EQ(CounterValue("moh_head_tokens_total",
                         {{"model", "b"}, {"layer", "0"}, {"head", "1"}}),
            0);
  EXPECT_EQ(Requests("b", "Generate", "OK"), 0);
  EXPECT_EQ(Requests("a", "Generate", "OK"), 1);
}

TEST_F(MetricsTest, ConcurrentUpdatesAreExact) {
  constexpr int kThreads = 8;
  constexpr int kIters = 5000;
  const absl::StatusCode codes[] = {
      absl::StatusCode::kOk, absl::StatusCode::kDeadlineExceeded,
      absl::StatusCode::kUnavailable, absl::StatusCode::kInternal};
  std::atomic<ModelMetrics*> seen{nullptr};
  std::atomic<bool> same{true};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      ModelMetrics* m = metrics_.ForModel("m", 2, 2, true);
      ModelMetrics* expected = nullptr;
      if (!seen.compare_exchange_strong(expected, m) && expected != m) {
        same = false;
      }
      for (int i = 0; i < kIters; ++i) {
        m->RequestFinished(Rpc::kGenerate, codes[(i + t) % 4],
                           absl::Milliseconds(1));
        m->GeneratedTokens(2);
        m->HeadTokens({1, 0, 0, 1});
        m->BatchSize(BatchKind::kDecode, t + 1);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_TRUE(same);

  const std::vector<MetricFamily> families = Collect();
  double requests = 0;
  for (const ClientMetric& s :
       FindFamily(families, "moh_requests_total")->metric) {
    requests += s.counter.value;
  }
  EXPECT_EQ(requests, kThreads * kIters);
  for (absl::StatusCode code :
       {absl::StatusCode::kOk, absl::StatusCode::kDeadlineExceeded}) {
    const char* name =
        code == absl::StatusCode::kOk ? "OK" : "DEADLINE_EXCEEDED";
    const ClientMetric* s =
        FindSeries(families, "moh_requests_total",
                   {{"model", "m"}, {"rpc", "Generate"}, {"code", name}});
    ASSERT_NE(s, nullptr) << name;
    EXPECT_EQ(s->counter.value, kThreads * kIters / 4) << name;
  }
  EXPECT_EQ(FindSeries(families, "moh_generated_tokens_total", {{"model", "m"}})
                ->counter.value,
            2.0 * kThreads * kIters);
  EXPECT_EQ(FindSeries(families, "moh_head_tokens_total",
                       {{"model", "m"}, {"layer", "1"}, {"head", "1"}})
                ->counter.value,
            kThreads * kIters);
  EXPECT_EQ(FindSeries(families, "moh_batch_size",
                       {{"model", "m"}, {"kind", "decode"}})
                ->histogram.sample_count,
            static_cast<uint64_t>(kThreads * kIters));
  EXPECT_EQ(FindSeries(families, "moh_request_duration_seconds",
                       {{"model", "m"}, {"rpc", "Generate"}})
                ->histogram.sample_count,
            static_cast<uint64_t>(kThreads * kIters));
}

TEST_F(MetricsTest, ProcessMetrics) {
  const std::vector<MetricFamily> before = Collect();
  const ClientMetric* cpu = FindSeries(before, "process_cpu_seconds_total", {});
  const ClientMetric* rss =
      FindSeries(before, "process_resident_memory_bytes", {});
  const ClientMetric* vms =
      FindSeries(before, "process_virtual_memory_bytes", {});
  const ClientMetric* start =
      FindSeries(before, "process_start_time_seconds", {});
  const ClientMetric* fds = FindSeries(before, "process_open_fds", {});
  ASSERT_NE(cpu, nullptr);
  ASSERT_NE(rss, nullptr);
  ASSERT_NE(vms, nullptr);
  ASSERT_NE(start, nullptr);
  ASSERT_NE(fds, nullptr);
  EXPECT_GE(cpu->counter.value, 0);
  EXPECT_GT(rss->gauge.value, 1 << 20);
  EXPECT_GE(vms->gauge.value, rss->gauge.value);
  const double now = static_cast<double>(std::time(nullptr));
  EXPECT_LE(start->gauge.value, now + 2);
  EXPECT_GT(start->gauge.value, now - 3600);
  EXPECT_GE(fds->gauge.value, 3);  // stdin, stdout, stderr

  const int fd = open("/dev/null", O_RDONLY);
  ASSERT_GE(fd, 0);
  const std::vector<MetricFamily> after = Collect();
  close(fd);
  EXPECT_EQ(FindSeries(after, "process_open_fds", {})->gauge.value,
            fds->gauge.value + 1);
}

TEST_F(MetricsTest, GpuMemoryFromReader) {
  EXPECT_EQ(FindFamily(Collect(), "moh_gpu_memory_bytes"), nullptr);
  EXPECT_EQ(FindFamily(Collect(), "moh_gpu_memory_limit_bytes"), nullptr);
  metrics_.SetGpuMemoryReader([] {
    return std::map<std::string, GpuMemoryReading>{{"cuda:0", {1024, 8192}},
                                                   {"cuda:1", {2048, 4096}}};
  });
  const std::vector<MetricFamily> families = Collect();
  for (const auto& [device, in_use, limit] :
       {std::tuple{"cuda:0", 1024, 8192}, std::tuple{"cuda:1", 2048, 4096}}) {
    const ClientMetric* used =
        FindSeries(families, "moh_gpu_memory_bytes", {{"device", device}});
    const ClientMetric* may = FindSeries(families, "moh_gpu_memory_limit_bytes",
                                         {{"device", device}});
    ASSERT_NE(used, nullptr) << device;
    ASSERT_NE(may, nullptr) << device;
    EXPECT_EQ(used->gauge.value, in_use) << device;
    EXPECT_EQ(may->gauge.value, limit) << device;
  }
}

TEST_F(MetricsTest, CollectablesDoNotOutliveMetricsCollector) {
  auto registry = std::make_shared<prometheus::Registry>();
  std::vector<std::weak_ptr<prometheus::Collectable>> collectables;
  {
    Metrics metrics(registry);
    collectables = metrics.Collectables();
    ASSERT_EQ(collectables.size(), 2u);
    for (const auto& c : collectables) EXPECT_NE(c.lock(), nullptr);
  }
  // The process collector goes with Metrics; the registry is the caller's.
  EXPECT_NE(collectables[0].lock(), nullptr);
  EXPECT_EQ(collectables[1].lock(), nullptr);
}

// Everything exported, with every series populated, passes promtool's lint.
TEST_F(MetricsTest, PromtoolCheckMetricsPasses) {
  ModelMetrics* m = metrics_.ForModel("tiny-moh", 2, 4, true);
  m->RequestFinished(Rpc::kGenerate, absl::StatusCode::kOk,
                     absl::Milliseconds(120));
  m->RequestFinished(Rpc::kClassify, absl::StatusCode::kInvalidArgument,
                     absl::Milliseconds(2));
  m->QueueTime(Rpc::kGenerate, absl::Milliseconds(4));
  m->TimeToFirstToken(absl::Milliseconds(30));
  m->InterTokenLatency(absl::Milliseconds(9));
  m->PromptTokens(12);
  m->GeneratedTokens(8);
  m->BatchSize(BatchKind::kPrefill, 2);
  m->BatchSize(BatchKind::kDecode, 5);
  m->BatchSize(BatchKind::kClassify, 1);
  m->SetRunning(1);
  m->SetWaiting(2);
  m->SetKvCacheUsage(0.125);
  m->ActivationRatio(0.5625);
  m->HeadTokens({1, 2, 3, 4, 5, 6, 7, 8});
  m->RatioLowered();
  m->SetLoadSeconds(0.75);
  metrics_.SetGpuMemoryReader([] {
    return std::map<std::string, GpuMemoryReading>{{"cuda:0", {4096, 65536}}};
  });

  const std::string path = ::testing::TempDir() + "/moh_metrics_test.prom";
  const std::string out_path = path + ".out";
  {
    std::ofstream out(path);
    prometheus::TextSerializer().Serialize(out, Collect());
  }
  if (access("/usr/bin/promtool", X_OK) != 0) {
    GTEST_SKIP() << "/usr/bin/promtool not installed";
  }
  const std::string cmd = "/usr/bin/promtool check metrics < '" + path +
                          "' > '" + out_path + "' 2>&1";
  const int status = std::system(cmd.c_str());
  std::ifstream result(out_path);
  std::stringstream output;
  output << result.rdbuf();
  ASSERT_TRUE(WIFEXITED(status)) << cmd;
  EXPECT_EQ(WEXITSTATUS(status), 0) << output.str();
  EXPECT_EQ(output.str(), "") << output.str();
  std::remove(path.c_str());
  std::remove(out_path.c_str());
}

}  // namespace
}  // namespace moh

namespace moh {
namespace {

TEST(ImageMetricsTest, ImagesStepsAndTimePerImage) {
  Metrics metrics(std::make_shared<prometheus::Registry>());
  ModelMetrics* m = metrics.ForModel("dit", std::vector<int32_t>{4, 6}, true);
  m->DiffusionSteps(3);
  m->DiffusionSteps(0);
  m->ImageGenerated(absl::Milliseconds(80));
  m->BatchSize(BatchKind::kImageStep, 5);
  bool images = false, steps = false, seconds = false, batch = false;
  for (const prometheus::MetricFamily& f : metrics.registry()->Collect()) {
    for (const prometheus::ClientMetric& c : f.metric) {
      if (f.name == "moh_images_generated_total") {
        images = c.counter.value == 1;
      } else if (f.name == "moh_diffusion_steps_total") {
        steps = c.counter.value == 3;
      } else if (f.name == "moh_image_seconds") {
        seconds =
            c.histogram.sample_count == 1 && c.histogram.sample_sum == 0.08;
      } else if (f.name == "moh_batch_size") {
        for (const prometheus::ClientMetric::Label& l : c.label) {
          if (l.name == "kind" && l.value == "image_step") {
            batch = c.histogram.sample_count == 1;
          }
        }
      }
    }
  }
  EXPECT_TRUE(images && steps && seconds && batch);
}

}  // namespace
}  // namespace moh
