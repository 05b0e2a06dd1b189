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

// The inputs as the loops read them: contiguous tensors (kept alive here),
// their data and strides, and each pair's token, head and raw query.
struct PairData {
  explicit PairData(const TransNextPairInputs& in);

  int64_t TokenOf(int64_t p) const {
    return listed ? pair_token[p] : p % all_tokens;
  }
  int64_t HeadOf(int64_t p) const {
    return listed ? pair_head[p] : p / all_tokens;
  }
  // A pair's raw query: its own row when listed, else its head's columns of
  // its token's row.
  const float* QueryOf(int64_t p) const {
    return listed ? q_data + p * d : q_data + TokenOf(p) * c + HeadOf(p) * d;
  }

  int64_t n_tokens, heads, d, c, all_tokens, pooled, window;
  bool local, listed;
  at::Tensor queries, gates, qe, scale, bias;
  at::Tensor neighbours, local_bias, tokens_t, tokens_b;
  const int64_t* pair_token = nullptr;
  const int64_t* pair_head = nullptr;
  const float* q_data;
  const float *keys, *values;
  int64_t key_row, key_image, value_row, value_image;
  const float *local_keys = nullptr, *local_values = nullptr;
  int64_t lk_row = 0, lk_image = 0, lv_row = 0, lv_image = 0;
};

PairData::PairData(const TransNextPairInputs& in)
    : n_tokens(in.tokens),
      heads(in.heads),
      d(in.head_dim),
      c(in.heads * in.head_dim),
      all_tokens(in.rows * in.tokens),
      pooled(in.keys.size(1)),
      window(in.local_keys.defined() ? in.neighbours.size(1) : 0),
      local(in.local_keys.defined()),
      listed(in.pair_token.defined()),
      queries(in.queries.contiguous()),
      gates(in.gates.contiguous()),
      qe(in.query_embedding.contiguous()),
      scale(in.scale.contiguous()),
      bias(in.bias.contiguous()),
      q_data(queries.data_ptr<float>()),
      keys(in.keys.data_ptr<float>()),
      values(in.values.data_ptr<float>()),
      key_row(in.keys.stride(1)),
      key_image(in.keys.stride(0)),
      value_row(in.values.stride(1)),
      value_image(in.values.stride(0)) {
  if (local) {
    neighbours = in.neighbours.contiguous();
    local_bias = in.local_bias.contiguous();
    // [H, W, D]: each window position's learnable token, contiguous.
    tokens_t = in.learnable_tokens.transpose(1, 2).contiguous();
    tokens_b = in.learnable_bias.contiguous();
    local_keys = in.local_keys.data_ptr<float>();
    local_values = in.local_values.data_ptr<float>();
    lk_row = in.local_keys.stride(1);
    lk_image = in.local_keys.stride(0);
    lv_row = in.local_values.stride(1);
    lv_image = in.local_values.stride(0);
  }
  if (listed) {
    pair_token = in.pair_token.data_ptr<int64_t>();
    pair_head = in.pair_head.data_ptr<int64_t>();
  }
}

// Pairs [0, pairs) cut into segments of one head and one image, at most
// kSegmentRows long.
std::vector<Segment> CutSegments(const PairData& in, int64_t pairs) {
  std::vector<Segment> segments;
  for (int64_t p = 0; p < pairs;) {
    const int64_t h = in.HeadOf(p), b = in.TokenOf(p) / in.n_tokens;
    int64_t e = p + 1;
    while (e < pairs && e - p < kSegmentRows && in.HeadOf(e) == h &&
           in.TokenOf(e) / in.n_tokens == b) {
      ++e;
    }
    segments.push_back({p, e, h, b});
    p = e;
  }
  return segments;
}

// One thread's working rows for a segment.
struct SegmentBuffers {
  SegmentBuffers(int64_t d, int64_t pooled, int64_t window)
      : qn(kSegmentRows * d),
        qs(kSegmentRows * d),
        pool(kSegmentRows * pooled),
        acc(kSegmentRows * d),
        win(std::max<int64_t>(window, 1)) {}

  // Normalized queries, and scaled ones with the query embedding [rows, D];
  // the pooled keys' scores (then probabilities) [rows, P]; the attention
  // outputs [rows, D]; one row's window scores (then exps) [W].
  std::vector<float> qn, qs, pool, acc, win;
};

// Normalized queries (F.normalize: / max(||q||, 1e-12)); scaled ones with
// the query embedding for the scores.
void NormalizeQueries(const PairData& in, const Segment& seg, float* qn,
                      float* qs) {
  const int64_t d = in.d;
  const float* embedding = in.qe.data_ptr<float>() + seg.head * d;
  const float* head_scale = in.scale.data_ptr<float>() + seg.head * in.n_tokens;
  for (int64_t r = 0; r < seg.end - seg.begin; ++r) {
    const int64_t p = seg.begin + r;
    const float* q = in.QueryOf(p);
    const float norm = std::max(std::sqrt(Dot(q, q, d)), 1e-12f);
    const float s = head_scale[in.TokenOf(p) % in.n_tokens];
    for (int64_t i = 0; i < d; ++i) {
      qn[r * d + i] = q[i] / norm;
      qs[r * d + i] = (qn[r * d + i] + embedding[i]) * s;
    }
  }
}

// Row r's scores: the pooled ones (`scores`, from the product) plus their
// bias, in place, and the window's (`win`, when local) from its keys and
// bias; returns their maximum. nb: the token's window positions.
float RowScores(const PairData& in, const Segment& seg, int64_t n,
                const int64_t* nb, const float* qs_row, float* scores,
                float* win) {
  const int64_t h = seg.head;
  const float* cpb =
      in.bias.data_ptr<float>() + (h * in.n_tokens + n) * in.pooled;
  float max = -std::numeric_limits<float>::infinity();
  for (int64_t k = 0; k < in.pooled; ++k) {
    scores[k] += cpb[k];
    max = std::max(max, scores[k]);
  }
  if (in.local) {
    const float* rpb = in.local_bias.data_ptr<float>() + h * in.window;
    for (int64_t j = 0; j < in.window; ++j) {
      win[j] = nb[j] < 0 ? -std::numeric_limits<float>::infinity()
                         : Dot(qs_row,
                               in.local_keys + seg.image * in.lk_image +
                                   nb[j] * in.lk_row + h * in.d,
                               in.d) +
                               rpb[j];
      max = std::max(max, win[j]);
    }
  }
  return max;
}

// One softmax over the window and the pooled keys: the pooled scores become
// probabilities in place, the window's their exps; returns 1 / the sum.
float SoftmaxOverBoth(float* scores, int64_t pooled, float* win, int64_t window,
                      float max) {
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
  return inv;
}

// a [D] += the window's values, each weighted by attention (win[j] * inv) +
// q_norm . learnable token + bias; positions outside the grid hold zero
// values.
void AddWindowValues(const PairData& in, const Segment& seg, const int64_t* nb,
                     const float* win, float inv, const float* qn_row,
                     float* a) {
  const int64_t h = seg.head, d = in.d;
  const float* lt = in.tokens_t.data_ptr<float>() + h * in.window * d;
  const float* lb = in.tokens_b.data_ptr<float>() + h * in.window;
  for (int64_t j = 0; j < in.window; ++j) {
    if (nb[j] < 0) continue;
    const float w = win[j] * inv + lb[j] + Dot(qn_row, lt + j * d, d);
    const float* v =
        in.local_values + seg.image * in.lv_image + nb[j] * in.lv_row + h * d;
    for (int64_t i = 0; i < d; ++i) a[i] += w * v[i];
  }
}

// One segment's pairs: their attention, gated, into their head's columns of
// their tokens' rows of `out` [B * N, H * D].
void SegmentAttention(const PairData& in, const Segment& seg,
                      SegmentBuffers& buf, float* out) {
  const int64_t rows = seg.end - seg.begin, h = seg.head, b = seg.image;
  const int64_t d = in.d, pooled = in.pooled;
  NormalizeQueries(in, seg, buf.qn.data(), buf.qs.data());
  // Pooled (or every token's) scores [rows, P] = qs K^T.
  const float* k_head = in.keys + b * in.key_image + h * d;
  const float* v_head = in.values + b * in.value_image + h * d;
  Gemm(/*transpose_a=*/true, pooled, rows, d, 1.0f, k_head, in.key_row,
       buf.qs.data(), d, 0.0f, buf.pool.data(), pooled);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t n = in.TokenOf(seg.begin + r) % in.n_tokens;
    float* scores = buf.pool.data() + r * pooled;
    const int64_t* nb =
        in.local ? in.neighbours.data_ptr<int64_t>() + n * in.window : nullptr;
    const float max = RowScores(in, seg, n, nb, buf.qs.data() + r * d, scores,
                                buf.win.data());
    const float inv =
        SoftmaxOverBoth(scores, pooled, buf.win.data(), in.window, max);
    float* a = buf.acc.data() + r * d;
    std::fill(a, a + d, 0.0f);
    if (in.local) {
      AddWindowValues(in, seg, nb, buf.win.data(), inv, buf.qn.data() + r * d,
                      a);
    }
  }
  // acc += attention [rows, P] V [P, D].
  Gemm(/*transpose_a=*/false, d, rows, pooled, 1.0f, v_head, in.value_row,
       buf.pool.data(), pooled, 1.0f, buf.acc.data(), d);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t token = in.TokenOf(seg.begin + r);
    const float gate = in.gates.data_ptr<float>()[token * in.heads + h];
    float* dst = out + token * in.c + h * d;
    for (int64_t i = 0; i < d; ++i) dst[i] = buf.acc[r * d + i] * gate;
  }
}

}  // namespace

at::Tensor TransNextPairAttentionCpu(const TransNextPairInputs& in) {
  const int64_t all_tokens = in.rows * in.tokens;
  // Pairs run head after head; unlisted, every token of every head.
  const int64_t pairs =
      in.pair_token.defined() ? in.pair_token.size(0) : in.heads * all_tokens;
  at::Tensor out =
      at::zeros({all_tokens, in.heads * in.head_dim}, in.gates.options());
  if (pairs == 0) return out;

  const PairData data(in);
  const std::vector<Segment> segments = CutSegments(data, pairs);
  float* o = out.data_ptr<float>();
  at::parallel_for(0, segments.size(), 1, [&](int64_t first, int64_t last) {
    SegmentBuffers buffers(data.d, data.pooled, data.window);
    for (int64_t si = first; si < last; ++si) {
      SegmentAttention(data, segments[si], buffers, o);
    }
  });
  return out;
}

}  // namespace moh
