// moh_read_bandwidth: the machine's memory read bandwidth, the ceiling of
// batch-1 decoding (every weight is read once a token). Sums a float array
// far larger than the last-level cache with 1, 2, ... threads (each thread a
// contiguous slice) and prints, as one JSON object, the best of --passes
// passes in GB/s (10^9 bytes) for each thread count. bench/suite.py runs it.
//
//   moh_read_bandwidth [--mib=1024] [--threads=1,2] [--passes=5]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace {

// Four independent accumulators of 16-byte vectors: the baseline x86-64 ISA
// (SSE2) already reads faster than memory delivers.
typedef float Vec4 __attribute__((vector_size(16)));

float SumSlice(const Vec4* v, size_t n) {
  Vec4 a = {0, 0, 0, 0}, b = a, c = a, d = a;
  size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    a += v[i];
    b += v[i + 1];
    c += v[i + 2];
    d += v[i + 3];
  }
  for (; i < n; ++i) a += v[i];
  const Vec4 s = a + b + c + d;
  return s[0] + s[1] + s[2] + s[3];
}

// Seconds for one pass over `n` vectors split among `threads` threads.
double Pass(const Vec4* v, size_t n, int threads, float* sink) {
  std::vector<float> sums(threads);
  std::vector<std::thread> pool;
  const auto start = std::chrono::steady_clock::now();
  const size_t per = n / threads;
  for (int t = 0; t < threads; ++t) {
    const size_t begin = t * per, count = t + 1 == threads ? n - begin : per;
    pool.emplace_back(
        [&, t, begin, count] { sums[t] = SumSlice(v + begin, count); });
  }
  for (std::thread& th : pool) th.join();
  const double s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  for (float x : sums) *sink += x;
  return s;
}

bool Flag(const char* arg, const char* name, std::string* value) {
  const size_t len = std::strlen(name);
  if (std::strncmp(arg, name, len) != 0 || arg[len] != '=') return false;
  *value = arg + len + 1;
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  size_t mib = 1024;
  int passes = 5;
  std::vector<int> thread_counts = {1, 2};
  for (int i = 1; i < argc; ++i) {
    std::string v;
    if (Flag(argv[i], "--mib", &v)) {
      mib = std::strtoul(v.c_str(), nullptr, 10);
    } else if (Flag(argv[i], "--passes", &v)) {
      passes = std::max(1, std::atoi(v.c_str()));
    } else if (Flag(argv[i], "--threads", &v)) {
      thread_counts.clear();
      for (size_t p = 0; p < v.size();) {
        thread_counts.push_back(std::max(1, std::atoi(v.c_str() + p)));
        p = v.find(',', p);
        if (p == std::string::npos) break;
        ++p;
      }
    } else {
      std::fprintf(stderr,
                   "usage: %s [--mib=1024] [--threads=1,2] [--passes=5]\n",
                   argv[0]);
      return 2;
    }
  }
  const size_t n = mib * (1 << 20) / sizeof(Vec4);
  std::unique_ptr<Vec4[]> data(new Vec4[n]);
  for (size_t i = 0; i < n; ++i) data[i] = Vec4{1, 1, 1, 1};  // fault pages in
  float sink = 0;
  std::printf("{\"bytes\": %zu, \"passes\": %d, \"gb_per_s\": {", n * 16,
              passes);
  for (size_t k = 0; k < thread_counts.size(); ++k) {
    double best = 1e30;
    for (int p = 0; p < passes; ++p) {
      best = std::min(best, Pass(data.get(), n, thread_counts[k], &sink));
    }
    std::printf("%s\"%d\": %.2f", k ? ", " : "", thread_counts[k],
                n * 16 / best / 1e9);
  }
  std::printf("}, \"checksum\": %g}\n", sink);
  return 0;
}
