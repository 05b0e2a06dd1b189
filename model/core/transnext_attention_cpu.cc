#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "model/core/transnext_attention.h"
#include "model/kernels/cpu_blas.h"

namespace moh {
namespace {

// Queries per work item: enough for an efficient product against the pooled
// keys, small enough to spread one image's head over the threads.
constexpr int64_t kSegmentRows = 128;

float Dot(const float* a, const float* b, int64_t n) {
  // Four partial sums: independent chains the compiler may keep in lanes.
  float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    s0 += a[i] * b[i];
    s1 += a[i + 1] * b[i + 1];
    s2 += a[i + 2] * b[i + 2];
    s3 += a[i + 3] * b[i + 3];
  }
  for (; i < n; ++i) s0 += a[i] * b[i];
  return (s0 + s1) + (s2 + s3);
}

// Pairs [begin, end) of one head and one image.
struct Segment {
  int64_t begin, end, head, image;
};

}  // namespace

at::Tensor TransNextPairAttentionCpu(const TransNextPairInputs& in) {
  const int64_t n_tokens = in.tokens, heads = in.heads, d = in.head_dim;
  const int64_t c = heads * d, all_tokens = in.rows * n_tokens;
  const int64_t pooled = in.keys.size(1);
  const bool local = in.local_keys.defined();
  const int64_t window = local ? in.neighbours.size(1) : 0;
  const bool listed = in.pair_token.defined();
  // Pairs run head after head; unlisted, every token of every head.
  const int64_t pairs = listed ? in.pair_token.size(0) : heads * all_tokens;
  at::Tensor out = at::zeros({all_tokens, c}, in.gates.options());
  if (pairs == 0) return out;

  const at::Tensor queries = in.queries.contiguous();
  const at::Tensor gates = in.gates.contiguous();
  const at::Tensor qe = in.query_embedding.contiguous();
  const at::Tensor scale = in.scale.contiguous();
  const at::Tensor bias = in.bias.contiguous();
  at::Tensor neighbours, local_bias, tokens_t, tokens_b;
  if (local) {
    neighbours = in.neighbours.contiguous();
    local_bias = in.local_bias.contiguous();
    // [H, W, D]: each window position's learnable token, contiguous.
    tokens_t = in.learnable_tokens.transpose(1, 2).contiguous();
    tokens_b = in.learnable_bias.contiguous();
  }
  const int64_t* pair_token =
      listed ? in.pair_token.data_ptr<int64_t>() : nullptr;
  const int64_t* pair_head =
      listed ? in.pair_head.data_ptr<int64_t>() : nullptr;
  auto token_of = [&](int64_t p) {
    return listed ? pair_token[p] : p % all_tokens;
  };
  auto head_of = [&](int64_t p) {
    return listed ? pair_head[p] : p / all_tokens;
  };
  // A pair's raw query: its own row when listed, else its head's columns of
  // its token's row.
  const float* q_data = queries.data_ptr<float>();
  auto query_of = [&](int64_t p) {
    return listed ? q_data + p * d : q_data + token_of(p) * c + head_of(p) * d;
  };

  std::vector<Segment> segments;
  for (int64_t p = 0; p < pairs;) {
    const int64_t h = head_of(p), b = token_of(p) / n_tokens;
    int64_t e = p + 1;
    while (e < pairs && e - p < kSegmentRows && head_of(e) == h &&
           token_of(e) / n_tokens == b) {
      ++e;
    }
    segments.push_back({p, e, h, b});
    p = e;
  }

  const float* keys = in.keys.data_ptr<float>();
  const float* values = in.values.data_ptr<float>();
  const int64_t key_row = in.keys.stride(1), key_image = in.keys.stride(0);
  const int64_t value_row = in.values.stride(1),
                value_image = in.values.stride(0);
  const float* local_keys = local ? in.local_keys.data_ptr<float>() : nullptr;
  const float* local_values =
      local ? in.local_values.data_ptr<float>() : nullptr;
  const int64_t lk_row = local ? in.local_keys.stride(1) : 0;
  const int64_t lk_image = local ? in.local_keys.stride(0) : 0;
  const int64_t lv_row = local ? in.local_values.stride(1) : 0;
  const int64_t lv_image = local ? in.local_values.stride(0) : 0;
  float* o = out.data_ptr<float>();

  at::parallel_for(0, segments.size(), 1, [&](int64_t first, int64_t last) {
    std::vector<float> qn(kSegmentRows * d), qs(kSegmentRows * d);
    std::vector<float> pool(kSegmentRows * pooled), acc(kSegmentRows * d);
    std::vector<float> win(std::max<int64_t>(window, 1));
    for (int64_t si = first; si < last; ++si) {
      const Segment& seg = segments[si];
      const int64_t rows = seg.end - seg.begin, h = seg.head, b = seg.image;
      const float* embedding = qe.data_ptr<float>() + h * d;
      const float* head_scale = scale.data_ptr<float>() + h * n_tokens;
      // Normalized queries (F.normalize: / max(||q||, 1e-12)); scaled ones
      // with the query embedding for the scores.
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t p = seg.begin + r;
        const float* q = query_of(p);
        const float norm = std::max(std::sqrt(Dot(q, q, d)), 1e-12f);
        const float s = head_scale[token_of(p) % n_tokens];
        for (int64_t i = 0; i < d; ++i) {
          qn[r * d + i] = q[i] / norm;
          qs[r * d + i] = (qn[r * d + i] + embedding[i]) * s;
        }
      }
      // Pooled (or every token's) scores [rows, P] = qs K^T.
      const float* k_head = keys + b * key_image + h * d;
      const float* v_head = values + b * value_image + h * d;
      Gemm(/*transpose_a=*/true, pooled, rows, d, 1.0f, k_head, key_row,
           qs.data(), d, 0.0f, pool.data(), pooled);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t n = token_of(seg.begin + r) % n_tokens;
        float* scores = pool.data() + r * pooled;
        const float* cpb = bias.data_ptr<float>() + (h * n_tokens + n) * pooled;
        float max = -std::numeric_limits<float>::infinity();
        for (int64_t k = 0; k < pooled; ++k) {
          scores[k] += cpb[k];
          max = std::max(max, scores[k]);
        }
        const int64_t* nb =
            local ? neighbours.data_ptr<int64_t>() + n * window : nullptr;
        if (local) {
          const float* rpb = local_bias.data_ptr<float>() + h * window;
          for (int64_t j = 0; j < window; ++j) {
            win[j] =
                nb[j] < 0
                    ? -std::numeric_limits<float>::infinity()
                    : Dot(qs.data() + r * d,
                          local_keys + b * lk_image + nb[j] * lk_row + h * d,
                          d) +
                          rpb[j];
            max = std::max(max, win[j]);
          }
        }
        // One softmax over the window and the pooled keys.
        float sum = 0.0f;
        for (int64_t k = 0; k < pooled; ++k) {
          scores[k] = std::exp(scores[k] - max);
          sum += scores[k];
        }
        for (int64_t j = 0; j < window; ++j) {
          win[j] = std::exp(win[j] - max);
          sum += win[j];
        }
        const float inv = 1.0f / sum;
        for (int64_t k = 0; k < pooled; ++k) scores[k] *= inv;
        float* a = acc.data() + r * d;
        std::fill(a, a + d, 0.0f);
        if (local) {
          // Window weights: attention + q_norm . learnable token + bias;
          // positions outside the grid hold zero values.
          const float* lt = tokens_t.data_ptr<float>() + h * window * d;
          const float* lb = tokens_b.data_ptr<float>() + h * window;
          for (int64_t j = 0; j < window; ++j) {
            if (nb[j] < 0) continue;
            const float w =
                win[j] * inv + lb[j] + Dot(qn.data() + r * d, lt + j * d, d);
            const float* v =
                local_values + b * lv_image + nb[j] * lv_row + h * d;
            for (int64_t i = 0; i < d; ++i) a[i] += w * v[i];
          }
        }
      }
      // acc += attention [rows, P] V [P, D].
      Gemm(/*transpose_a=*/false, d, rows, pooled, 1.0f, v_head, value_row,
           pool.data(), pooled, 1.0f, acc.data(), d);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t token = token_of(seg.begin + r);
        const float gate = gates.data_ptr<float>()[token * heads + h];
        float* dst = o + token * c + h * d;
        for (int64_t i = 0; i < d; ++i) dst[i] = acc[r * d + i] * gate;
      }
    }
  });
  return out;
}

}  // namespace moh
