// y = x W^T + b with float32 or bfloat16 activations x [M, K] and an int8 or int4 weight with float16 group scales
// and offsets (W = scale * q + offset, kvkernels/weight_only.py): the decode step of a weight-only quantized model on
// CPUs. y (and b) are in x's dtype; products accumulate in float32.
//
// A decode step reads every weight once for two FLOPs per row of x, so it is bound by reading the weights: int8
// with a group of 32 is 1.125 bytes a weight against bf16's 2, int4 0.625. The weights are unpacked to float32 in
// registers, never written back, and multiplied in float32 (no int8 dot products: those would round x to int8).
//
// Layout (kvkernels/cpu_weight_only.py, pack): panels of 16 output features, each a run of blocks, one a group
// of K: blocks [N / 16, K / group, 64 + group * 16 * bits / 8] bytes. A block opens with the 16 features' float16
// scales, then their 16 offsets (one cache line), then the group's q, one k after the other, 16 features each:
// int8 16 bytes a k; int4 16 bytes a pair of k, feature f's k in the low nibble of byte f and its k + 1 in the
// high. A task streams its panels from memory in order; a block is a whole number of cache lines.
//
// Group sums: lanes are output features, so a group's sum q * x takes one broadcast of x[m][k] and one FMA per k,
// and the group's scale and offset apply once: y += scale * sum_k q x + offset * sum_k x, the second sum computed
// once a call for every row and group (xsum).
//
// bfloat16 x is widened to float32 once a call, and a panel's results rounded to bfloat16 as they are stored, so
// that a bfloat16 model calls one op a linear: a decode step has over a hundred linears, and a conversion op
// around each costs more than the smaller layers' own work.
//
// One source, two builds (kvkernels/cpu_weight_only.py): with AVX-512 (F, BW, VL) a Features is one zmm
// register; with AVX2 + FMA (+ F16C) two ymm.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#ifndef KVROUTE_WO_LIBRARY
#error "build with -DKVROUTE_WO_LIBRARY=<op namespace> (kvkernels/cpu_weight_only.py does)"
#endif
// TORCH_LIBRARY pastes its namespace argument, so a macro naming it must be expanded one level up.
#define KVROUTE_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define KVROUTE_LIBRARY_IMPL(ns, m) TORCH_LIBRARY_IMPL(ns, CPU, m)

namespace {

constexpr int64_t kPanel = 16;       // output features per panel
constexpr int64_t kScaleBytes = 64;  // a block's 16 float16 scales and 16 float16 offsets
// How far ahead of a block to prefetch; the hardware prefetcher alone under-reads one stream a core
// (kvkernels/cpu_bf16_linear.cpp measured the same at 2 KB).
constexpr int64_t kPrefetchBytes = 2048;

#ifdef __AVX512F__
constexpr int kMaxRows = 8;  // 8 rows x (chain + total) + weights fit the 32 zmm registers

struct Features {
  __m512 v;
};

inline Features zero() { return {_mm512_setzero_ps()}; }
inline Features add(Features a, Features b) { return {_mm512_add_ps(a.v, b.v)}; }
inline Features mul(Features a, Features b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline Features fma(Features a, Features b, Features c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline Features fma_broadcast(Features w, float x, Features acc) {
  return {_mm512_fmadd_ps(w.v, _mm512_set1_ps(x), acc.v)};
}
inline Features load_floats(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void store_floats(float* p, Features a) { _mm512_storeu_ps(p, a.v); }
inline Features load_halves(const uint8_t* p) {
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
inline Features load_int8(const uint8_t* p) {
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
}
inline void load_int4(const uint8_t* p, Features& lo, Features& hi) {
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  lo = {_mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)))};
  hi = {_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4))};
}
// Lane f's value at 16 consecutive k of a [k, 16] tile: tile[k * 16 + f], k = 0..15.
inline Features column(const float* tile, int64_t f) {
  const __m512i k16 = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
  return {_mm512_i32gather_ps(k16, tile + f, 4)};
}
// float32 -> bfloat16, rounded to nearest even as torch rounds (the values are finite).
inline __m512i round_to_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  return _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
}
inline void store_row(float* p, Features v) { store_floats(p, v); }
inline void store_row(at::BFloat16* p, Features v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(round_to_bf16(v.v)));
}
#else
constexpr int kMaxRows = 4;  // 4 rows x 2 ymm accumulators, their totals and the weights fill the 16 ymm registers

struct Features {
  __m256 a, b;  // features 0-7, 8-15
};

inline Features zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Features add(Features x, Features y) { return {_mm256_add_ps(x.a, y.a), _mm256_add_ps(x.b, y.b)}; }
inline Features mul(Features x, Features y) { return {_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)}; }
inline Features fma(Features x, Features y, Features z) {
  return {_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)};
}
inline Features fma_broadcast(Features w, float x, Features acc) {
  const __m256 xv = _mm256_set1_ps(x);
  return {_mm256_fmadd_ps(w.a, xv, acc.a), _mm256_fmadd_ps(w.b, xv, acc.b)};
}
inline Features load_floats(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void store_floats(float* p, Features x) {
  _mm256_storeu_ps(p, x.a);
  _mm256_storeu_ps(p + 8, x.b);
}
inline Features load_halves(const uint8_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))};
}
inline __m256 widen8(const uint8_t* p) {  // 8 int8 -> 8 float32
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline Features load_int8(const uint8_t* p) { return {widen8(p), widen8(p + 8)}; }
inline void load_int4(const uint8_t* p, Features& lo, Features& hi) {
  const __m256i v0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i v1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
  const __m256i low = _mm256_set1_epi32(15);
  lo = {_mm256_cvtepi32_ps(_mm256_and_si256(v0, low)), _mm256_cvtepi32_ps(_mm256_and_si256(v1, low))};
  hi = {_mm256_cvtepi32_ps(_mm256_srli_epi32(v0, 4)), _mm256_cvtepi32_ps(_mm256_srli_epi32(v1, 4))};
}
// Lane f's value at 16 consecutive k of a [k, 16] tile: tile[k * 16 + f], k = 0..15.
inline Features column(const float* tile, int64_t f) {
  const __m256i k16 = _mm256_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112);
  return {_mm256_i32gather_ps(tile + f, k16, 4), _mm256_i32gather_ps(tile + 128 + f, k16, 4)};
}
// float32 -> bfloat16, rounded to nearest even as torch rounds (the values are finite).
inline __m256i round_to_bf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  return _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
}
inline void store_row(float* p, Features v) { store_floats(p, v); }
inline void store_row(at::BFloat16* p, Features v) {
  // packus interleaves the two registers' 128-bit halves; the permute puts the 16 values back in order.
  const __m256i packed = _mm256_packus_epi32(round_to_bf16(v.a), round_to_bf16(v.b));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_permute4x64_epi64(packed, 0xD8));
}
#endif

// Independent accumulators a row keeps within a group: one FMA chain per row stalls on the FMA's latency
// when there are fewer than about four rows to interleave.
template <int kRows>
constexpr int chains() {
  return kRows == 1 ? 4 : kRows == 2 ? 2 : 1;
}

// kRows rows of x [kRows, K] (row stride K) against one panel; xsum [kRows, G] the rows' sums by group.
template <int kBits, int kRows>
void panel_rows(const float* x, int64_t K, const float* xsum, int64_t group, const uint8_t* panel,
                int64_t block_bytes, float* y, int64_t ldy, const float* bias) {
  constexpr int kChains = chains<kRows>();
  constexpr int kPerLoad = kBits == 4 ? 2 : 1;  // k a 16-byte load covers
  constexpr int kStep = std::max(kChains, kPerLoad);
  const int64_t G = K / group;
  Features total[kRows];
  for (int r = 0; r < kRows; ++r) total[r] = zero();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* block = panel + g * block_bytes;
    for (int64_t line = 0; line < block_bytes; line += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(block) + kPrefetchBytes + line, _MM_HINT_T0);
    }
    const uint8_t* q = block + kScaleBytes;
    const float* xg = x + g * group;
    Features acc[kRows][kChains];
    for (int r = 0; r < kRows; ++r)
      for (int c = 0; c < kChains; ++c) acc[r][c] = zero();
    for (int64_t k = 0; k < group; k += kStep) {
      for (int j = 0; j < kStep; j += kPerLoad) {
        if constexpr (kBits == 8) {
          const Features w = load_int8(q + (k + j) * kPanel);
          for (int r = 0; r < kRows; ++r) acc[r][j % kChains] = fma_broadcast(w, xg[r * K + k + j], acc[r][j % kChains]);
        } else {
          Features lo, hi;
          load_int4(q + (k + j) / 2 * kPanel, lo, hi);
          for (int r = 0; r < kRows; ++r) {
            acc[r][j % kChains] = fma_broadcast(lo, xg[r * K + k + j], acc[r][j % kChains]);
            acc[r][(j + 1) % kChains] = fma_broadcast(hi, xg[r * K + k + j + 1], acc[r][(j + 1) % kChains]);
          }
        }
      }
    }
    const Features scales = load_halves(block), offsets = load_halves(block + 32);
    for (int r = 0; r < kRows; ++r) {
      Features sum = acc[r][0];
      for (int c = 1; c < kChains; ++c) sum = add(sum, acc[r][c]);
      total[r] = fma(sum, scales, total[r]);
      total[r] = fma_broadcast(offsets, xsum[r * G + g], total[r]);
    }
  }
  for (int r = 0; r < kRows; ++r) {
    if (bias != nullptr) total[r] = add(total[r], load_floats(bias));
    store_floats(y + r * ldy, total[r]);
  }
}

template <int kBits>
void rows_against_panel(const float* x, int64_t M, int64_t K, const float* xsum, int64_t group, const uint8_t* panel,
                        int64_t block_bytes, float* y, int64_t ldy, const float* bias) {
  const int64_t G = K / group;
  int64_t m = 0;
  for (; m + kMaxRows <= M; m += kMaxRows) {
    panel_rows<kBits, kMaxRows>(x + m * K, K, xsum + m * G, group, panel, block_bytes, y + m * ldy, ldy, bias);
  }
  const float* xr = x + m * K;
  const float* sr = xsum + m * G;
  float* yr = y + m * ldy;
  switch (M - m) {
    case 1: panel_rows<kBits, 1>(xr, K, sr, group, panel, block_bytes, yr, ldy, bias); break;
    case 2: panel_rows<kBits, 2>(xr, K, sr, group, panel, block_bytes, yr, ldy, bias); break;
    case 3: panel_rows<kBits, 3>(xr, K, sr, group, panel, block_bytes, yr, ldy, bias); break;
#ifdef __AVX512F__
    case 4: panel_rows<kBits, 4>(xr, K, sr, group, panel, block_bytes, yr, ldy, bias); break;
    case 5: panel_rows<kBits, 5>(xr, K, sr, group, panel, block_bytes, yr, ldy, bias); break;
    case 6: panel_rows<kBits, 6>(xr, K, sr, group, panel, block_bytes, yr, ldy, bias); break;
    case 7: panel_rows<kBits, 7>(xr, K, sr, group, panel, block_bytes, yr, ldy, bias); break;
#endif
    default: break;
  }
}

// x as float32 [M, K]: itself, or widened into `scratch`.
const float* float_rows(const at::Tensor& x, std::vector<float>& scratch) {
  if (x.scalar_type() == at::kFloat) return x.data_ptr<float>();
  const at::BFloat16* src = x.data_ptr<at::BFloat16>();
  scratch.resize(x.numel());
  for (int64_t i = 0; i < x.numel(); ++i) scratch[i] = static_cast<float>(src[i]);
  return scratch.data();
}

void linear(const at::Tensor& x, const at::Tensor& blocks, int64_t bits, int64_t group,
            const std::optional<at::Tensor>& bias, at::Tensor& out) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "x must be float32 or bfloat16");
  TORCH_CHECK(out.scalar_type() == dtype, "out must be in x's dtype");
  TORCH_CHECK(blocks.scalar_type() == at::kByte, "blocks must be uint8");
  TORCH_CHECK(bits == 8 || bits == 4, "bits must be 8 or 4");
  TORCH_CHECK(group == 32 || group == 64 || group == 128, "group must be 32, 64 or 128");
  TORCH_CHECK(x.dim() == 2 && blocks.dim() == 3 && out.dim() == 2, "x [M, K], blocks [N / 16, K / group, bytes]");
  TORCH_CHECK(x.is_contiguous() && blocks.is_contiguous() && out.is_contiguous(), "x, blocks, out: contiguous");
  const int64_t M = x.size(0), K = x.size(1), P = blocks.size(0), N = P * kPanel, G = K / group;
  const int64_t block_bytes = kScaleBytes + group * kPanel * bits / 8;
  TORCH_CHECK(K % group == 0 && blocks.size(1) == G && blocks.size(2) == block_bytes,
              "blocks must be [N / 16, K / group, 64 + group * 2 * bits] with K = x.size(1)");
  TORCH_CHECK(out.size(0) == M && out.size(1) == N, "out must be [M, N]");
  std::vector<float> bias_scratch;
  const float* bias_ptr = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == dtype && bias->is_contiguous() && bias->numel() == N,
                "bias must be [N] in x's dtype");
    bias_ptr = float_rows(*bias, bias_scratch);
  }
  if (M == 0) return;
  std::vector<float> x_scratch;
  const float* xp = float_rows(x, x_scratch);
  // Each row's sum over each group, for the offsets' term; a few hundred floats.
  std::vector<float> xsum(M * G);
  for (int64_t i = 0; i < M * G; ++i) {
    float sum = 0.f;
    for (int64_t k = 0; k < group; ++k) sum += xp[i * group + k];
    xsum[i] = sum;
  }
  const float* sp = xsum.data();
  const uint8_t* wp = blocks.data_ptr<uint8_t>();
  const bool bf16_out = dtype == at::kBFloat16;
  float* yp = bf16_out ? nullptr : out.data_ptr<float>();
  at::BFloat16* yb = bf16_out ? out.data_ptr<at::BFloat16>() : nullptr;
  const int64_t panel_bytes = G * block_bytes;
  // Tasks of at least ~64 KB of weights, so that scheduling a task costs little against reading it.
  const int64_t grain = std::max<int64_t>(1, 65536 / panel_bytes);
  at::parallel_for(0, P, grain, [&](int64_t begin, int64_t end) {
    // bfloat16 out: a panel's [M, 16] results in float32 here first, rounded to nearest even as they are copied.
    std::vector<float> staged(bf16_out ? M * kPanel : 0);
    for (int64_t p = begin; p < end; ++p) {
      const float* bp = bias_ptr ? bias_ptr + p * kPanel : nullptr;
      float* y = bf16_out ? staged.data() : yp + p * kPanel;
      const int64_t ldy = bf16_out ? kPanel : N;
      if (bits == 8) {
        rows_against_panel<8>(xp, M, K, sp, group, wp + p * panel_bytes, block_bytes, y, ldy, bp);
      } else {
        rows_against_panel<4>(xp, M, K, sp, group, wp + p * panel_bytes, block_bytes, y, ldy, bp);
      }
      if (bf16_out) {
        for (int64_t m = 0; m < M; ++m)
          for (int64_t f = 0; f < kPanel; ++f) yb[m * N + p * kPanel + f] = at::BFloat16(staged[m * kPanel + f]);
      }
    }
  });
}

// One block's [group, 16] weights (k by k, the panel's 16 features each) in float32, as the format defines them:
// scale * q, then + offset (two roundings, as weight_only.dequantize computes them; not an FMA).
template <int kBits>
void block_weights(const uint8_t* block, int64_t group, float* tile) {
  const Features scale = load_halves(block), offset = load_halves(block + 32);
  const uint8_t* q = block + kScaleBytes;
  if constexpr (kBits == 8) {
    for (int64_t k = 0; k < group; ++k) store_floats(tile + k * kPanel, add(mul(load_int8(q + k * kPanel), scale), offset));
  } else {
    Features lo, hi;
    for (int64_t k = 0; k < group; k += 2) {
      load_int4(q + k / 2 * kPanel, lo, hi);
      store_floats(tile + k * kPanel, add(mul(lo, scale), offset));
      store_floats(tile + (k + 1) * kPanel, add(mul(hi, scale), offset));
    }
  }
}

// The whole weight [N, K] in float32 or bfloat16, for steps where a GEMM on it beats the decode kernel (a prefill):
// each block unpacked into a [group, 16] tile, then read back by feature (gathers from L1) into its 16 rows.
template <typename T>
void dequantize_as(const uint8_t* wp, int64_t bits, int64_t group, int64_t P, int64_t G, int64_t block_bytes, T* out) {
  const int64_t K = G * group;
  const int64_t grain = std::max<int64_t>(1, 65536 / (G * block_bytes));
  at::parallel_for(0, P, grain, [&](int64_t begin, int64_t end) {
    alignas(64) float tile[128 * kPanel];
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t g = 0; g < G; ++g) {
        const uint8_t* block = wp + (p * G + g) * block_bytes;
        if (bits == 8) {
          block_weights<8>(block, group, tile);
        } else {
          block_weights<4>(block, group, tile);
        }
        for (int64_t f = 0; f < kPanel; ++f) {
          T* row = out + (p * kPanel + f) * K + g * group;
          for (int64_t k = 0; k < group; k += 16) store_row(row + k, column(tile + k * kPanel, f));
        }
      }
    }
  });
}

void dequantize(const at::Tensor& blocks, int64_t bits, int64_t group, at::Tensor& out) {
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 3 && blocks.is_contiguous(),
              "blocks must be contiguous uint8 [N / 16, K / group, bytes]");
  TORCH_CHECK(bits == 8 || bits == 4, "bits must be 8 or 4");
  TORCH_CHECK(group == 32 || group == 64 || group == 128, "group must be 32, 64 or 128");
  const int64_t P = blocks.size(0), G = blocks.size(1), block_bytes = kScaleBytes + group * kPanel * bits / 8;
  TORCH_CHECK(blocks.size(2) == block_bytes, "blocks must be [N / 16, K / group, 64 + group * 2 * bits]");
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(0) == P * kPanel && out.size(1) == G * group,
              "out must be contiguous [N, K]");
  const uint8_t* wp = blocks.data_ptr<uint8_t>();
  if (out.scalar_type() == at::kFloat) {
    dequantize_as(wp, bits, group, P, G, block_bytes, out.data_ptr<float>());
  } else {
    TORCH_CHECK(out.scalar_type() == at::kBFloat16, "out must be float32 or bfloat16");
    dequantize_as(wp, bits, group, P, G, block_bytes, out.data_ptr<at::BFloat16>());
  }
}

}  // namespace

KVROUTE_LIBRARY(KVROUTE_WO_LIBRARY, m) {
  m.def("linear(Tensor x, Tensor blocks, int bits, int group, Tensor? bias, Tensor(a!) out) -> ()");
  m.def("dequantize(Tensor blocks, int bits, int group, Tensor(a!) out) -> ()");
}

KVROUTE_LIBRARY_IMPL(KVROUTE_WO_LIBRARY, m) {
  m.impl("linear", &linear);
  m.impl("dequantize", &dequantize);
}
