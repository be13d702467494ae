// y = x W^T + b with float32 activations x [M, K] and a bfloat16 weight, on AVX2 and FMA: the decode path of
// CPUs that cannot multiply bf16 (kvkernels/cpu_linear.py says when it runs).
//
// A decode step reads every weight once and does two FLOPs per row of x with it, so at a few rows it is bound by
// reading the weights: half the bytes of float32, widened to float32 in registers (a bf16 is the top half of a
// float32), is up to twice the speed. torch's own bf16 matmul on such a CPU widens the weight in a generic loop
// and runs slower than float32 from memory, and MKL's float32 sgemm repacks the weight on every call, which costs
// it half its speed at 2 to 32 rows.
//
// The weight is packed once, at load (kvkernels/cpu_linear.py, pack_weight), into panels of 16 output features:
// [N / 16, K, 16], each panel contiguous, so a task streams its panels from memory in order. Within a panel's
// 16 features the order is 0-3, 8-11, 4-7, 12-15: interleaving zeros below it with vpunpck{l,h}wd then widens
// them to features 0-7 and 8-15 in two shuffles, with no shifts on the FMA ports.
//
// Micro-kernel: up to 4 rows of x against one panel, 8 accumulators (4 rows x 16 features), one broadcast of
// x[m][k] per row and two FMAs per k. A panel (16 x K bf16: 18 KB at K = 576) stays in L1 while every group of
// 4 rows passes over it.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>

namespace {

constexpr int64_t kPanel = 16;  // output features per panel
// Rows of x per micro-kernel call: 8 accumulators, 2 weights, a broadcast and a zero are 12 of the 16 ymm
// registers. At 5 or 6 rows the compiler spills, and 32 rows ran 1.8x slower.
constexpr int kMaxRows = 4;
// How far ahead of the loop to prefetch the panels, in bytes. The hardware prefetcher alone left one row at 8.6
// GB/s a core against MKL's 11.8; 2 KB ahead reads at MKL's rate (SmolLM2's matrices, 1 and 2 threads).
constexpr int64_t kPrefetchBytes = 2048;

inline void widen(const uint16_t* p, __m256i zero, __m256& lo, __m256& hi) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, w));  // features 0-7
  hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, w));  // features 8-15
}

inline void store_row(float* y, __m256 a0, __m256 a1, const float* bias) {
  if (bias != nullptr) {
    a0 = _mm256_add_ps(a0, _mm256_loadu_ps(bias));
    a1 = _mm256_add_ps(a1, _mm256_loadu_ps(bias + 8));
  }
  _mm256_storeu_ps(y, a0);
  _mm256_storeu_ps(y + 8, a1);
}

// kRows rows of x against one panel.
template <int kRows>
inline void panel_rows(const float* x, int64_t K, const uint16_t* panel, float* y, int64_t N, const float* bias) {
  __m256 acc[kRows][2];
  for (int r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const __m256i zero = _mm256_setzero_si256();
  for (int64_t k = 0; k < K; ++k) {
    const uint16_t* w = panel + k * kPanel;
    if (k % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetchBytes, _MM_HINT_T0);  // one line
    __m256 lo, hi;
    widen(w, zero, lo, hi);
    for (int r = 0; r < kRows; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * K + k);
      acc[r][0] = _mm256_fmadd_ps(xv, lo, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xv, hi, acc[r][1]);
    }
  }
  for (int r = 0; r < kRows; ++r) store_row(y + r * N, acc[r][0], acc[r][1], bias);
}

void rows_against_panel(const float* x, int64_t M, int64_t K, const uint16_t* panel, float* y, int64_t N,
                        const float* bias) {
  int64_t m = 0;
  for (; m + kMaxRows <= M; m += kMaxRows) panel_rows<kMaxRows>(x + m * K, K, panel, y + m * N, N, bias);
  const float* xr = x + m * K;
  float* yr = y + m * N;
  switch (M - m) {
    case 1: panel_rows<1>(xr, K, panel, yr, N, bias); break;
    case 2: panel_rows<2>(xr, K, panel, yr, N, bias); break;
    case 3: panel_rows<3>(xr, K, panel, yr, N, bias); break;
    default: break;
  }
}

void bf16_linear(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                 at::Tensor& out) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat, "x and out must be float32");
  TORCH_CHECK(panels.scalar_type() == at::kBFloat16, "panels must be bfloat16");
  TORCH_CHECK(x.dim() == 2 && panels.dim() == 3 && out.dim() == 2, "x [M, K], panels [N / 16, K, 16], out [M, N]");
  TORCH_CHECK(x.is_contiguous() && panels.is_contiguous() && out.is_contiguous(), "x, panels, out: contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = panels.size(0) * kPanel;
  TORCH_CHECK(panels.size(1) == K && panels.size(2) == kPanel, "panels must be [N / 16, K, 16] with K = x.size(1)");
  TORCH_CHECK(out.size(0) == M && out.size(1) == N, "out must be [M, N]");
  const float* bias_ptr = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "bias must be float32 [N]");
    bias_ptr = bias->data_ptr<float>();
  }
  const float* xp = x.data_ptr<float>();
  const auto* wp = reinterpret_cast<const uint16_t*>(panels.data_ptr());
  float* yp = out.data_ptr<float>();
  // Tasks of at least ~64 KB of weights, so that scheduling a task costs little against reading it.
  const int64_t grain = std::max<int64_t>(1, 2048 / K);
  at::parallel_for(0, panels.size(0), grain, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      rows_against_panel(xp, M, K, wp + p * K * kPanel, yp + p * kPanel, N, bias_ptr ? bias_ptr + p * kPanel : nullptr);
    }
  });
}

}  // namespace

TORCH_LIBRARY(kvroute_cpu_linear, m) {
  m.def("bf16_linear(Tensor x, Tensor panels, Tensor? bias, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(kvroute_cpu_linear, CPU, m) { m.impl("bf16_linear", &bf16_linear); }
