// The fused CUDA layer kernels' checks (model/kernels/cuda_layer_ops.cu):
// each against the ATen chain it replaces (LlamaModel's and MohRouter's ops,
// written out), on fresh random inputs with the output poisoned first, for
// gpu_fused_ops_test.cc (on CUDA, through fused_layer_ops.h) and
// cuda_kernels_emulated_test.cc (the same kernels run on the CPU).
#pragma once

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "model/checkpoint/checkpoint.h"
#include "model/core/fused_layer_ops.h"
#include "model/core/kv_cache.h"
#include "model/core/moh_router.h"

namespace moh::layer_ops_reference {

// Elementwise |got - want| <= tolerance * max(1, |want|), NaN never passing.
inline void ExpectNear(const at::Tensor& got, const at::Tensor& want,
                       double tolerance, const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const at::Tensor g = got.to(at::kFloat).cpu();
  const at::Tensor w = want.to(at::kFloat).cpu();
  ASSERT_FALSE(at::isnan(g).any().item<bool>()) << what;
  const at::Tensor excess =
      (g - w).abs() - tolerance * at::clamp_min(w.abs(), 1.0);
  EXPECT_LE(excess.max().item<double>(), 0.0)
      << what << ": largest difference " << (g - w).abs().max().item<double>();
}

// One rounding of the type: float32 results differ by a reduction's order.
inline double Tolerance(at::ScalarType type) {
  return type == at::kFloat ? 1e-5 : 8e-3;
}

// hidden (after the residual add) * rsqrt(mean(hidden^2) + eps) * weight in
// float32, rounded once (at::rms_norm).
inline at::Tensor RmsNormChain(const at::Tensor& hidden,
                               const at::Tensor& weight, double eps) {
  const at::Tensor h = hidden.to(at::kFloat);
  return (h * at::rsqrt(h.pow(2).mean(-1, true) + eps) * weight.to(at::kFloat))
      .to(hidden.scalar_type());
}

inline at::Tensor RotateHalf(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

// x [N, H, D] * cos + rotate_half(x) * sin at positions [N], every op in
// x's type.
inline at::Tensor RopeChain(const at::Tensor& x, const at::Tensor& positions,
                            const at::Tensor& cos, const at::Tensor& sin) {
  return x * cos.index_select(0, positions).unsqueeze(1) +
         RotateHalf(x) * sin.index_select(0, positions).unsqueeze(1);
}

struct RopeTables {
  at::Tensor cos, sin;
};

// Tables as the model builds them: [positions, D] in `options`' type.
inline RopeTables MakeRopeTables(int64_t positions, int64_t d,
                                 const at::TensorOptions& options) {
  const at::Tensor inv = at::pow(
      10000.0, -at::arange(0, d, 2, at::kDouble) / static_cast<double>(d));
  const at::Tensor freqs = at::outer(at::arange(positions, at::kDouble), inv);
  const at::Tensor emb = at::cat({freqs, freqs}, -1);
  return {emb.cos().to(options), emb.sin().to(options)};
}

inline at::Tensor SiluMulChain(const at::Tensor& both) {
  const int64_t inter = both.size(1) / 2;
  return at::silu(both.narrow(1, 0, inter)).mul(both.narrow(1, inter, inter));
}

// The query-norm router's gates over the routed heads before top-K:
// softmax(norm / std(norm)) in float32 whatever the queries' type ([N,
// routed], on the CPU).
inline at::Tensor QueryNormChainGates(const at::Tensor& q, int64_t shared,
                                      int64_t routed) {
  const at::Tensor norms = at::linalg_vector_norm(
      q.narrow(1, shared, routed).to(at::kFloat), 2, {-1}, false, c10::nullopt);
  const at::Tensor std = at::std(norms, {1}, true, true);
  return at::softmax(norms / std, 1).to(at::kFloat).cpu();
}

// The routed part of gates [N, shared + routed] keeps top_k[t] heads, each
// of which ranks at or above every head it leaves out by `chain`
// (QueryNormChainGates); the shared heads are 1.
inline void ExpectTopKOf(const at::Tensor& gates, const at::Tensor& chain,
                         const at::Tensor& top_k, int64_t shared,
                         int64_t routed, const std::string& what) {
  const at::Tensor g = gates.to(at::kFloat).cpu();
  ASSERT_FALSE(at::isnan(g).any().item<bool>()) << what;
  const int64_t n = g.size(0);
  if (shared > 0) {
    EXPECT_TRUE(at::equal(g.narrow(1, 0, shared), at::ones({n, shared})))
        << what;
  }
  const at::Tensor kept = g.narrow(1, shared, routed);
  EXPECT_TRUE(((kept == 0) | (kept == 1)).all().item<bool>()) << what;
  EXPECT_TRUE(at::equal(kept.sum(1).to(at::kLong), top_k.cpu())) << what;
  const at::Tensor in = kept.to(at::kBool);
  const at::Tensor lowest_kept =
      at::where(in, chain, at::full_like(chain, INFINITY)).amin(1);
  const at::Tensor highest_left =
      at::where(in, at::full_like(chain, -INFINITY), chain).amax(1);
  EXPECT_TRUE((lowest_kept >= highest_left).all().item<bool>()) << what;
}

// The kernels as fused_layer_ops.h declares them (on CUDA, or emulated).
struct LayerKernels {
  std::function<at::Tensor(at::Tensor&, const at::Tensor&, const at::Tensor&,
                           double)>
      add_rms_norm;
  std::function<at::Tensor(const at::Tensor&, const at::Tensor&,
                           const at::Tensor&, const at::Tensor&)>
      rope;
  std::function<bool(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                     const at::Tensor&, const at::Tensor&, const at::Tensor&,
                     const at::Tensor&, const at::Tensor&, const at::Tensor&)>
      rope_store_kv;
  std::function<at::Tensor(const at::Tensor&)> silu_mul;
  std::function<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t,
                           int64_t)>
      query_norm_gates;
  std::function<AttentionPrologue(const AttentionPrologueInputs&)>
      attention_prologue;
  std::function<at::Tensor(const at::Tensor&, const at::Tensor&,
                           const at::Tensor&)>
      skinny_linear;
  std::function<at::Tensor(const at::Tensor&, const at::Tensor&)>
      silu_mul_linear;
};

// A freed block goes back to the next allocation of its size (the CUDA
// caching allocator; often glibc too): a kernel that leaves an element
// unwritten shows NaN there, not a value an earlier reference computed.
inline void PoisonNext(int64_t numel, const at::TensorOptions& options) {
  at::full({numel}, std::numeric_limits<float>::quiet_NaN(), options);
}

inline std::string Name(const at::TensorOptions& options) {
  return c10::toString(at::typeMetaToScalarType(options.dtype()));
}

// Rows of 16-byte loads (1, 2 and 3 of 4 a thread), of single elements
// (width 7), and a residual 16-byte aligned nowhere (single elements too).
inline void CheckAddRmsNorm(const LayerKernels& kernels,
                            const at::TensorOptions& options) {
  const at::ScalarType type = at::typeMetaToScalarType(options.dtype());
  struct Case {
    int64_t rows, width, residual_offset;
  };
  for (const auto& [rows, width, residual_offset] :
       std::vector<Case>{{1, 4096, 0},
                         {5, 1000, 0},
                         {64, 256, 0},
                         {3, 7, 0},
                         {2, 5000, 0},
                         {4, 256, 1}}) {
    const std::string what = Name(options) + " " + std::to_string(rows) + "x" +
                             std::to_string(width) + "+" +
                             std::to_string(residual_offset);
    at::Tensor hidden = at::randn({rows, width}, options);
    // A residual whose rows lie apart (a view of a wider product).
    const at::Tensor residual =
        at::randn({rows, width + 8}, options).narrow(1, residual_offset, width);
    const at::Tensor weight = 1 + 0.1 * at::randn({width}, options);
    at::Tensor expected_hidden = hidden.clone();
    PoisonNext(rows * width, options);
    const at::Tensor got = kernels.add_rms_norm(hidden, residual, weight, 1e-5);
    ASSERT_TRUE(got.defined()) << what;
    expected_hidden.add_(residual);
    EXPECT_TRUE(at::equal(hidden, expected_hidden)) << what;
    ExpectNear(got, RmsNormChain(expected_hidden, weight, 1e-5),
               Tolerance(type), what);
  }
}

inline void CheckRope(const LayerKernels& kernels,
                      const at::TensorOptions& options) {
  const at::ScalarType type = at::typeMetaToScalarType(options.dtype());
  for (const int64_t d : {8, 64, 128}) {
    const std::string what = Name(options) + " D=" + std::to_string(d);
    const int64_t tokens = 9, heads = 6;
    const RopeTables tables = MakeRopeTables(300, d, options);
    // Queries as a view of a wider product: tokens lie 2 * H * D apart.
    const at::Tensor x = at::randn({tokens, 2 * heads * d}, options)
                             .narrow(1, 0, heads * d)
                             .view({tokens, heads, d});
    const at::Tensor positions =
        at::randint(300, {tokens}, options.dtype(at::kLong));
    PoisonNext(tokens * heads * d, options);
    const at::Tensor got = kernels.rope(x, positions, tables.cos, tables.sin);
    ASSERT_TRUE(got.defined()) << what;
    ExpectNear(got, RopeChain(x, positions, tables.cos, tables.sin),
               Tolerance(type), what);
  }
}

// Into the whole cache, and into the narrow view of its first 2 KV heads
// (a block of twice the positions): the rotated keys and the values at
// their places, the sentinel everywhere else.
inline void CheckRopeStoreKv(const LayerKernels& kernels,
                             const at::TensorOptions& options) {
  const at::ScalarType type = at::typeMetaToScalarType(options.dtype());
  constexpr int64_t kBlocks = 6, kBlock = 4, kKv = 4, kD = 32, kTokens = 7;
  const RopeTables tables = MakeRopeTables(64, kD, options);
  const at::TensorOptions ints = options.dtype(at::kLong);
  for (const int64_t width : {kKv, int64_t{2}}) {
    const std::string what = Name(options) + " width " + std::to_string(width);
    const at::Tensor sentinel =
        at::full({kBlocks, kBlock, kKv, kD}, 7.0, options);
    auto view = [&](const at::Tensor& cache) {
      return width == kKv ? cache : NarrowView(cache, width);
    };
    const at::Tensor keys = sentinel.clone(), values = sentinel.clone();
    const int64_t span = view(keys).size(1);
    // Distinct (block, offset) places, in no order.
    const at::Tensor place =
        at::randperm(kBlocks * span, ints).narrow(0, 0, kTokens);
    const at::Tensor block = place.div(span, "floor");
    const at::Tensor offset = place.remainder(span);
    const at::Tensor positions = at::randint(64, {kTokens}, ints);
    const at::Tensor kv = at::randn({kTokens, 2 * width * kD}, options);
    const at::Tensor k = kv.narrow(1, 0, width * kD).view({kTokens, width, kD});
    const at::Tensor v =
        kv.narrow(1, width * kD, width * kD).view({kTokens, width, kD});
    ASSERT_TRUE(kernels.rope_store_kv(k, v, positions, tables.cos, tables.sin,
                                      block, offset, view(keys), view(values)))
        << what;
    const at::Tensor want_keys = sentinel.clone();
    const at::Tensor want_values = sentinel.clone();
    view(want_keys).index_put_({block, offset},
                               RopeChain(k, positions, tables.cos, tables.sin));
    view(want_values).index_put_({block, offset}, v);
    ExpectNear(keys, want_keys, Tolerance(type), what + " keys");
    EXPECT_TRUE(at::equal(values, want_values)) << what << " values";
  }
}

// 16-byte loads (a partial last block of columns at 1000), single
// elements (widths 100 and 33, and a product 16-byte aligned nowhere).
inline void CheckSiluMul(const LayerKernels& kernels,
                         const at::TensorOptions& options) {
  const at::ScalarType type = at::typeMetaToScalarType(options.dtype());
  struct Case {
    int64_t rows, inter, offset;
  };
  for (const auto& [rows, inter, offset] : std::vector<Case>{
           {1, 14336, 0}, {6, 1000, 0}, {3, 100, 0}, {70, 33, 0}, {5, 64, 1}}) {
    const std::string what = Name(options) + " " + std::to_string(rows) + "x" +
                             std::to_string(inter) + "+" +
                             std::to_string(offset);
    const int64_t numel = rows * 2 * inter;
    const at::Tensor both = 3 * at::randn({numel + offset}, options)
                                    .narrow(0, offset, numel)
                                    .view({rows, 2 * inter});
    PoisonNext(rows * inter, options);
    const at::Tensor got = kernels.silu_mul(both);
    ASSERT_TRUE(got.defined()) << what;
    ExpectNear(got, SiluMulChain(both), Tolerance(type), what);
  }
}

// x W^T (+ bias) of the inputs as they are, summed in float32 and rounded
// once to their type (cuBLAS's and the skinny kernel's arithmetic).
inline at::Tensor LinearChain(const at::Tensor& x, const at::Tensor& weight,
                              const at::Tensor& bias) {
  const at::Tensor f =
      at::linear(x.to(at::kFloat), weight.to(at::kFloat),
                 bias.defined() ? bias.to(at::kFloat) : at::Tensor());
  return f.to(x.scalar_type());
}

// A decode step's products through the skinny kernel: 1 to 8 rows (each of
// its row counts: 1, 2, 4 and 8, 3 and 5 rounded up), inner widths of one
// chunk of 8 to several chunks a thread (4,096 and 14,336: the 8B layer's),
// output counts that leave a thread block's last columns empty, a weight
// whose rows lie apart (a view of columns, as o_proj's shared heads), with
// and without bias; and the same with SwiGLU's input [gate | up] (as
// SiluMul, then the product). Each against LinearChain, the output
// poisoned first; and the shapes it refuses (undefined: cuBLAS runs them).
inline void CheckSkinnyLinear(const LayerKernels& kernels,
                              const at::TensorOptions& options) {
  const at::ScalarType type = at::typeMetaToScalarType(options.dtype());
  struct Case {
    int64_t rows, k, n, column0;
    bool bias;
  };
  for (const auto& [rows, k, n, column0, bias] :
       std::vector<Case>{{1, 4096, 6, 0, false},
                         {2, 64, 13, 8, true},
                         {3, 14336, 5, 0, false},
                         {5, 8, 1, 0, true},
                         {8, 2056, 9, 16, false}}) {
    for (const bool silu_mul : {false, true}) {
      const std::string what =
          Name(options) + " " + std::to_string(rows) + "x" + std::to_string(k) +
          "x" + std::to_string(n) + "+" + std::to_string(column0) +
          (bias ? " bias" : "") + (silu_mul ? " silu_mul" : "");
      const at::Tensor x = at::randn({rows, (silu_mul ? 2 : 1) * k}, options);
      // Outputs of about 1 whatever k: float32's sums stay within 1e-5.
      const at::Tensor weight =
          (at::randn({n, column0 + k + 8}, options) / std::sqrt(k))
              .narrow(1, column0, k);
      const at::Tensor b =
          bias && !silu_mul ? at::randn({n}, options) : at::Tensor();
      PoisonNext(rows * n, options);
      const at::Tensor got = silu_mul ? kernels.silu_mul_linear(x, weight)
                                      : kernels.skinny_linear(x, weight, b);
      ASSERT_TRUE(got.defined()) << what;
      const at::Tensor input = silu_mul ? SiluMulChain(x) : x;
      ExpectNear(got, LinearChain(input, weight, b), Tolerance(type), what);
    }
  }
  const at::Tensor w = at::randn({4, 64}, options);
  EXPECT_FALSE(kernels.skinny_linear(at::randn({9, 64}, options), w, {})
                   .defined());  // more rows than a decode step's few
  EXPECT_FALSE(kernels
                   .skinny_linear(at::randn({1, 12}, options),
                                  at::randn({4, 12}, options), {})
                   .defined());  // k not a multiple of 8
  EXPECT_FALSE(
      kernels.skinny_linear(at::randn({1, 65}, options).narrow(1, 1, 64), w, {})
          .defined());  // x not 16-byte aligned
  EXPECT_FALSE(kernels.silu_mul_linear(at::randn({1, 64}, options), w)
                   .defined());  // [gate | up] of the wrong width
}

// A query-norm router (it has no weights) of `shared` + `routed` heads, K =
// routed / 2; moh_router_test's too.
inline absl::StatusOr<MohRouter> QueryNormRouter(
    int32_t shared, int32_t routed, const at::TensorOptions& options) {
  MohLayerConfig layer;
  layer.num_heads = shared + routed;
  layer.shared_heads = shared;
  layer.top_k = routed / 2;
  TensorStore store;
  return MohRouter::Load(RouterKind::kQueryNorm, layer, /*hidden_size=*/64, "",
                         store, options);
}

// One token's queries, 1 shared head and 3 routed (head_dim 2) whose norms
// are 1, 1.00195 and 0.5: rounded to bfloat16 the first two are both 1.0
// and tie (topk then picks either, the kernels the lower head); in float32
// the second is larger. At K = 1 the router keeps it: NearTieGates.
inline at::Tensor NearTieQueries(const at::TensorOptions& options) {
  return at::tensor({0.f, 0.f, 1.f, 0.f, 1.f, 0.0625f, 0.5f, 0.f})
      .to(options)
      .view({1, 4, 2});
}
inline at::Tensor NearTieGates() {
  return at::tensor({1.f, 0.f, 1.f, 0.f}).view({1, 4});
}

// Against MohRouter's ATen chain: a valid top-K of its float32 gates
// (ExpectTopKOf) and the same heads, for every type; and a near tie that
// bfloat16 rounding would break the wrong way.
inline void CheckQueryNormGates(const LayerKernels& kernels,
                                const at::TensorOptions& options) {
  constexpr int64_t kTokens = 50, kD = 128;  // 8 heads a round, 16 threads each
  for (const auto& [shared, routed] :
       std::vector<std::pair<int32_t, int32_t>>{{16, 16}, {0, 12}, {2, 3}}) {
    const std::string what = Name(options) + " S=" + std::to_string(shared) +
                             " R=" + std::to_string(routed);
    auto router = QueryNormRouter(shared, routed, options);
    ASSERT_TRUE(router.ok()) << router.status();
    const MohLayerConfig& layer = router->layer();
    // Queries as a view of a wider product.
    const at::Tensor q = at::randn({kTokens, 2 * layer.num_heads * kD}, options)
                             .narrow(1, 0, layer.num_heads * kD)
                             .view({kTokens, layer.num_heads, kD});
    const at::Tensor top_k =
        at::randint(routed + 1, {kTokens}, options.dtype(at::kLong));
    PoisonNext(kTokens * layer.num_heads, options);
    const at::Tensor got = kernels.query_norm_gates(q, top_k, shared, routed);
    ASSERT_TRUE(got.defined()) << what;
    ExpectTopKOf(got, QueryNormChainGates(q, shared, routed), top_k, shared,
                 routed, what);
    // The router decides in float32 for every type: the same heads.
    const at::Tensor want =
        router->Gates(at::Tensor(), q, top_k, top_k.max().item<int64_t>());
    EXPECT_TRUE(at::equal(got.cpu(), want.cpu())) << what;
  }
  const at::Tensor k1 = at::ones({1}, options.dtype(at::kLong));
  const at::Tensor got =
      kernels.query_norm_gates(NearTieQueries(options), k1, 1, 3);
  ASSERT_TRUE(got.defined());
  EXPECT_TRUE(at::equal(got.to(at::kFloat).cpu(), NearTieGates()))
      << Name(options) << " near tie: " << got;
}

// The prologue of a layer's attention, with the router and without, at
// two shapes (the 8B layout's heads and head_dim; a small one whose
// head_dim takes 4 lanes a head): the rotated queries as RopeChain's, the
// keys and values where CheckRopeStoreKv wants them (the sentinel
// elsewhere), the gates the router's.
inline void CheckAttentionPrologue(const LayerKernels& kernels,
                                   const at::TensorOptions& options) {
  const at::ScalarType type = at::typeMetaToScalarType(options.dtype());
  const at::TensorOptions ints = options.dtype(at::kLong);
  struct Case {
    int32_t shared, routed;
    int64_t kv_heads, d, tokens;
    bool route;
  };
  for (const auto& [shared, routed, kv_heads, d, tokens, route] :
       std::vector<Case>{{16, 16, 8, 128, 3, true},
                         {2, 6, 2, 32, 5, true},
                         {2, 6, 2, 32, 5, false}}) {
    const int64_t heads = shared + routed, kBlocks = 4, kBlock = 4;
    const std::string what = Name(options) + " H=" + std::to_string(heads) +
                             " D=" + std::to_string(d) +
                             (route ? " routed" : " unrouted");
    const RopeTables tables = MakeRopeTables(64, d, options);
    // Keys, values and queries as views of one product (kvq_proj's).
    const int64_t kv_width = 2 * kv_heads * d;
    const at::Tensor kvq = at::randn({tokens, kv_width + heads * d}, options);
    AttentionPrologueInputs in;
    in.keys = kvq.narrow(1, 0, kv_heads * d).view({tokens, kv_heads, d});
    in.values =
        kvq.narrow(1, kv_heads * d, kv_heads * d).view({tokens, kv_heads, d});
    in.queries = kvq.narrow(1, kv_width, heads * d).view({tokens, heads, d});
    in.positions = at::randint(64, {tokens}, ints);
    in.cos = tables.cos;
    in.sin = tables.sin;
    const at::Tensor place =
        at::randperm(kBlocks * kBlock, ints).narrow(0, 0, tokens);
    in.block = place.div(kBlock, "floor");
    in.offset = place.remainder(kBlock);
    const at::Tensor sentinel =
        at::full({kBlocks, kBlock, kv_heads, d}, 7.0, options);
    in.key_cache = sentinel.clone();
    in.value_cache = sentinel.clone();
    auto router = QueryNormRouter(shared, routed, options);
    ASSERT_TRUE(router.ok()) << router.status();
    if (route) {
      in.top_k = at::randint(routed + 1, {tokens}, ints);
      in.shared = shared;
      in.routed = routed;
    }
    PoisonNext(tokens * heads * d, options);
    const AttentionPrologue got = kernels.attention_prologue(in);
    ASSERT_TRUE(got.rotated.defined()) << what;
    ExpectNear(got.rotated,
               RopeChain(in.queries, in.positions, tables.cos, tables.sin),
               Tolerance(type), what + " queries");
    const at::Tensor want_keys = sentinel.clone();
    const at::Tensor want_values = sentinel.clone();
    want_keys.index_put_(
        {in.block, in.offset},
        RopeChain(in.keys, in.positions, tables.cos, tables.sin));
    want_values.index_put_({in.block, in.offset}, in.values);
    ExpectNear(in.key_cache, want_keys, Tolerance(type), what + " keys");
    EXPECT_TRUE(at::equal(in.value_cache, want_values)) << what << " values";
    ASSERT_EQ(got.gates.defined(), route) << what;
    if (route) {
      const at::Tensor want = router->Gates(at::Tensor(), in.queries, in.top_k,
                                            in.top_k.max().item<int64_t>());
      EXPECT_TRUE(at::equal(got.gates.cpu(), want.cpu())) << what << " gates";
    }
  }
}

}  // namespace moh::layer_ops_reference
