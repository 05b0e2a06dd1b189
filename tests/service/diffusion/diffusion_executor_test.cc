// Step-level batching of GenerateImage (service/diffusion/diffusion_executor.h)
// on the tiny MoH-DiT of tests/reference/make_dit_fixtures.py: requests
// submitted together, at different steps, guidance scales and ratios, share
// forwards and each gets the reference's image (tests/reference/moh_dit.py);
// progress after every step; the row budget; the VAE decode on its own thread;
// cancellation, deadlines and bad fields.
#include "service/diffusion/diffusion_executor.h"

#include <pthread.h>

#include <atomic>
#include <fstream>
#include <sstream>

#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "service/vision/image_decoder.h"
#include "tests/base/test_paths.h"

namespace moh {
namespace {

using nlohmann::json;
using ::testing::HasSubstr;

const std::string kFixtures = test_paths::FixturesDir();

json ReadJson(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return json::parse(s.str());
}

std::string ThreadName() {
  char name[16] = {};
  pthread_getname_np(pthread_self(), name, sizeof(name));
  return name;
}

// Orders the callbacks of all recorders.
std::atomic<int64_t> g_sequence{0};

class Recorder : public ImageObserver {
 public:
  void OnProgress(int32_t step, int32_t steps) override {
    // The loop thread waits here, before its first step is recorded, until
    // the test lets it go on.
    if (hold_ != nullptr) {
      hold_->WaitForNotificationWithTimeout(absl::Seconds(60));
      hold_ = nullptr;
    }
    absl::MutexLock lock(&mu_);
    progress_.push_back(step);
    progress_order_.push_back(g_sequence++);
    steps_ = steps;
    progress_thread_ = ThreadName();
  }
  void OnFinished(const ImageResult& result) override {
    absl::MutexLock lock(&mu_);
    result_ = result;
    finished_thread_ = ThreadName();
    done_.Notify();
  }
  void OnError(const absl::Status& status) override {
    absl::MutexLock lock(&mu_);
    status_ = status;
    done_.Notify();
  }
  bool Wait() {
    return done_.WaitForNotificationWithTimeout(absl::Seconds(60));
  }
  std::vector<int32_t> progress() {
    absl::MutexLock lock(&mu_);
    return progress_;
  }
  ImageResult result() {
    absl::MutexLock lock(&mu_);
    return result_;
  }
  // When (g_sequence) each progress callback ran.
  std::vector<int64_t> progress_order() {
    absl::MutexLock lock(&mu_);
    return progress_order_;
  }
  std::string progress_thread() {
    absl::MutexLock lock(&mu_);
    return progress_thread_;
  }
  std::string finished_thread() {
    absl::MutexLock lock(&mu_);
    return finished_thread_;
  }
  absl::Status status() {
    absl::MutexLock lock(&mu_);
    return status_;
  }
  // Set before submitting: the first progress callback waits for `hold`.
  void HoldFirstProgress(absl::Notification* hold) { hold_ = hold; }

 private:
  absl::Notification* hold_ = nullptr;
  absl::Mutex mu_;
  absl::Notification done_;
  std::vector<int32_t> progress_;
  std::vector<int64_t> progress_order_;
  std::string progress_thread_, finished_thread_;
  int32_t steps_ = 0;
  ImageResult result_;
  absl::Status status_;
};

class DiffusionExecutorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string dir = kFixtures + "/dit_tiny";
    auto model = DitModel::Load(dir, DeviceOptions{"cpu", "float32"});
    ASSERT_TRUE(model.ok()) << model.status();
    model_ = std::move(*model);
    auto vae = VaeDecoder::Load(dir + "/" + model_->config().vae,
                                at::TensorOptions().dtype(at::kFloat));
    ASSERT_TRUE(vae.ok()) << vae.status();
    vae_ = std::move(*vae);
    golden_ = ReadJson(dir + "/golden.json");
  }

  std::unique_ptr<DiffusionExecutor> Scheduler(int32_t max_running) {
    DiffusionExecutor::Options options;
    options.model_name = "dit";
    options.max_running = max_running;
    auto scheduler =
        DiffusionExecutor::Create(options, *model_, vae_.get(), nullptr);
    EXPECT_TRUE(scheduler.ok()) << scheduler.status();
    return std::move(*scheduler);
  }

  static ImageJob JobOf(const json& s) {
    ImageJob job;
    job.class_id = s.at("class").get<int64_t>();
    job.seed = s.at("seed").get<uint64_t>();
    job.steps = s.at("steps").get<int32_t>();
    job.guidance = s.at("guidance").get<float>();
    job.ratio = s.at("ratio").get<float>();
    return job;
  }

  std::unique_ptr<DitModel> model_;
  std::unique_ptr<VaeDecoder> vae_;
  json golden_;
};

TEST_F(DiffusionExecutorTest, RequestsBatchedTogetherGetTheReferenceImages) {
  std::unique_ptr<DiffusionExecutor> scheduler = Scheduler(8);
  std::vector<std::shared_ptr<Recorder>> recorders;
  for (const json& s : golden_.at("samples")) {
    recorders.push_back(std::make_shared<Recorder>());
    ASSERT_TRUE(scheduler->Submit(JobOf(s), recorders.back()).ok());
  }
  for (size_t i = 0; i < recorders.size(); ++i) {
    ASSERT_TRUE(recorders[i]->Wait());
    const json& s = golden_.at("samples")[i];
    ASSERT_TRUE(recorders[i]->status().ok()) << recorders[i]->status();
    const ImageResult result = recorders[i]->result();
    const int32_t steps = s.at("steps").get<int32_t>();
    std::vector<int32_t> expected(steps);
    for (int32_t k = 0; k < steps; ++k) expected[k] = k + 1;
    EXPECT_EQ(recorders[i]->progress(), expected);
    EXPECT_EQ(result.steps, steps);
    ASSERT_EQ(result.width, 32);
    auto pixels = DecodeImage(result.png, 3, 32);
    ASSERT_TRUE(pixels.ok()) << pixels.status();
    std::vector<uint8_t> want;
    for (const json& c : s.at("image_u8")) {
      for (const json& row : c) {
        for (const json& v : row) want.push_back(v.get<uint8_t>());
      }
    }
    at::Tensor got = at::round(*pixels * 255).to(at::kLong).flatten();
    at::Tensor expect =
        at::tensor(std::vector<int64_t>(want.begin(), want.end()));
    EXPECT_LE((got - expect).abs().max().item<int64_t>(), 1) << "sample " << i;
    EXPECT_GT(result.effective_ratio, 0.0);
    EXPECT_LE(result.effective_ratio, 1.0);
  }
}

TEST_F(DiffusionExecutorTest, RowBudgetCountsGuidedRequestsTwice) {
  // max_running 2 = two model rows per step: two unguided requests run side
  // by side, two guided ones (two rows each) one after the other.
  for (const float guidance : {1.0f, 3.0f}) {
    std::unique_ptr<DiffusionExecutor> scheduler = Scheduler(2);
    ImageJob job;
    job.steps = 4;
    job.guidance = guidance;
    auto first = std::make_shared<Recorder>();
    auto second = std::make_shared<Recorder>();
    // The first request's first step waits until the second is queued: on a
    // fast machine it could otherwise finish all its steps before that.
    absl::Notification second_queued;
    first->HoldFirstProgress(&second_queued);
    ASSERT_TRUE(scheduler->Submit(job, first).ok());
    ASSERT_TRUE(scheduler->Submit(job, second).ok());
    second_queued.Notify();
    ASSERT_TRUE(first->Wait() && second->Wait());
    ASSERT_TRUE(first->status().ok() && second->status().ok());
    const bool after =
        second->progress_order().front() > first->progress_order().back();
    EXPECT_EQ(after, guidance > 1.0f) << "guidance " << guidance;
  }
}

TEST_F(DiffusionExecutorTest, VaeDecodesOffTheLoopThread) {
  std::unique_ptr<DiffusionExecutor> scheduler = Scheduler(4);
  std::vector<std::shared_ptr<Recorder>> recorders;
  for (int i = 0; i < 3; ++i) {
    ImageJob job;
    job.steps = 3 + i;  // they finish at different steps
    job.guidance = 1.0f;
    recorders.push_back(std::make_shared<Recorder>());
    ASSERT_TRUE(scheduler->Submit(job, recorders.back()).ok());
  }
  for (const auto& r : recorders) {
    ASSERT_TRUE(r->Wait());
    ASSERT_TRUE(r->status().ok()) << r->status();
    EXPECT_EQ(r->progress_thread(), "moh-loop-dit");
    EXPECT_EQ(r->finished_thread(), "moh-vae-dit");
    EXPECT_GT(r->result().decoding, absl::ZeroDuration());
  }
  // Idle once every image is delivered.
  for (int i = 0; i < 200 && !scheduler->Idle(); ++i) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_TRUE(scheduler->Idle());
}

TEST_F(DiffusionExecutorTest, BadFieldsAreNamed) {
  std::unique_ptr<DiffusionExecutor> scheduler = Scheduler(2);
  auto recorder = std::make_shared<Recorder>();
  ImageJob job;
  job.steps = 1;
  EXPECT_THAT(std::string(scheduler->Submit(job, recorder).status().message()),
              HasSubstr("steps must be in [2, 1000]"));
  job.steps = 4;
  job.guidance = 0.5f;
  EXPECT_THAT(std::string(scheduler->Submit(job, recorder).status().message()),
              HasSubstr("guidance_scale must be in [1, 100]"));
  job.guidance = 1.0f;
  job.class_id = 10;
  EXPECT_THAT(std::string(scheduler->Submit(job, recorder).status().message()),
              HasSubstr("class_index must be in [0, 10)"));
  job.class_id = 1;
  job.ratio = 2.0f;
  EXPECT_THAT(std::string(scheduler->Submit(job, recorder).status().message()),
              HasSubstr("activation.ratio must be in (0, 1]"));
}

TEST_F(DiffusionExecutorTest, CancelledAndExpiredRequestsEndWithTheirStatus) {
  std::unique_ptr<DiffusionExecutor> scheduler = Scheduler(1);
  ImageJob job;
  job.steps = 1000;  // long enough to cancel midway
  job.guidance = 1.0f;
  auto running = std::make_shared<Recorder>();
  auto id = scheduler->Submit(job, running);
  ASSERT_TRUE(id.ok());
  ImageJob late = job;
  late.deadline = absl::Now() - absl::Seconds(1);
  auto expired = std::make_shared<Recorder>();
  ASSERT_TRUE(scheduler->Submit(late, expired).ok());
  scheduler->Cancel(*id);
  ASSERT_TRUE(running->Wait());
  EXPECT_EQ(running->status().code(), absl::StatusCode::kCancelled);
  ASSERT_TRUE(expired->Wait());
  EXPECT_EQ(expired->status().code(), absl::StatusCode::kDeadlineExceeded);
  for (int i = 0; i < 200 && !scheduler->Idle(); ++i) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_TRUE(scheduler->Idle());
}

}  // namespace
}  // namespace moh
