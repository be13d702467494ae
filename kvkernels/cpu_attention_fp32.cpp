// Paged flash attention in float32 for x86 CPUs with AVX2 and FMA (the engine's CPU path for float32 models
// where the AVX-512 BF16 kernel in cpu_attention.cpp does not run).
//
// The same contract and work split as cpu_attention.cpp (kvkernels/attention.py has the contract): one call runs a
// whole engine step; one work item is (sequence, KV head, 16 query positions) with the G query heads that share
// the KV head as extra rows, over key tiles of 64 with an online softmax, threads taking items from a shared
// counter, one KV head after the other and longest first within one. What differs, for 8-wide ymm and 16
// registers:
//   - rows are the vector lanes: Q^T [D][rows], the scores S^T [keys][rows] and O^T [D][rows] hold 8 rows per
//     vector. S = Q K^T then needs no transposed K: each FMA multiplies 8 rows' q[d] by one key's k[d]
//     broadcast straight from the cache, so K and V are read in place through the block tables (no pack pass;
//     FP8 caches are dequantised per tile through a 256-entry table). The softmax's row max, sum and the rescale
//     of O are plain element-wise vector ops, no horizontal reduction;
//   - the exponential is a degree-5 polynomial (relative error 2e-7) on inputs clamped at -127 (base 2), where
//     its result is 0: masked scores and the first tile's -inf max cost no more than any other.
//
// Why: the torch path gathers K/V out of the cache (index_select) and runs SDPA's float32 flash kernel, ~75-115
// GFLOP/s of useful work on SmolLM2's shapes under AVX2 (it computes its last 512-key block in full). Measured
// under the AVX2 emulation on 2 threads, the two paths taking turns (`python -m benchmarks.cpu_kernel_bench --fp32`),
// ms a layer: a 1,000-token prefill 8.6 against 14.7, 2,048 tokens 36 against 48, 952 new tokens over 2,048
// cached 41 against 49 (~134 GFLOP/s, near MKL sgemm's ~160 on these 2 cores: the softmax takes most of the
// rest), one decode over 250 tokens 0.04 against 0.08 (no gather, no SDPA call overhead), 32 such decodes 1.0-1.1
// against 1.25-1.35 (a decode's 3 rows fill only 3 of 8 lanes, yet no gather pays for it), and over an FP8 cache
// 1.3-1.7 against 8.5-9.9. With AVX-512 SDPA is faster on prefills: cpu_backend.py keeps it there.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

namespace {

constexpr int kKeyTile = 64;
constexpr int kQueryTile = 16;
constexpr int kKeyStep = 4;  // keys per S^T micro-kernel call; also dims per O^T call
constexpr int kVecs = 3;     // row vectors per micro-kernel call; see qk_block
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kMaskedScore = -1e30f;
// exp2_ps's input floor: its 2^n, built from exponent bits, is a normal float for n >= -126 and 0 at n = -127.
constexpr float kExpFloor = -127.0f;

struct Seq {
  int q_start;
  int q_len;
  int seq_len;
  const int32_t* table;
};

struct Step {
  const float* q;
  float* out;
  const void* k_cache;
  const void* v_cache;
  const float* k_lut;  // FP8 caches: float value of each stored byte, scale applied; nullptr for float32 caches
  const float* v_lut;
  int num_heads;
  int num_kv_heads;
  int block_size;
  float score_scale;  // softmax scale * log2(e): the softmax runs in base 2
  std::vector<Seq> seqs;
};

// 2^x, 0 for x < -126.5 (and for -inf and NaN): 2^n * 2^f with n = round(x), f in [-0.5, 0.5]. Inputs below
// the floor, -inf and NaN (maxps returns its second operand when either is NaN) become n = -127, whose 2^n
// bits are 0.
inline __m256 exp2_ps(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(kExpFloor));
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, n);
  __m256 p = _mm256_set1_ps(0.0013400442f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.0096760467f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.0555032715f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.2402210683f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.6931471825f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0000001192f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// s[n][M vectors of rows] = Q^T rows . k[n] for kKeyStep keys, each k[n] a cache row of D floats. M is at most
// 3: 12 accumulators, M Q vectors and one broadcast key value take all 16 ymm. 12 independent FMA chains, not
// 8, keep both FMA ports busy through their 4-cycle latency, with 7 loads per 12 FMAs instead of 6 per 8. Each
// key is broadcast just before its FMAs: holding all 4 (19 registers) made GCC fold the Q loads into the FMAs.
template <int M, int D>
inline void qk_block(const float* qt, int stride, const float* const* k, float* s) {
  __m256 acc[M][kKeyStep];
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < kKeyStep; ++n) acc[m][n] = _mm256_setzero_ps();
  const float* const rows[kKeyStep] = {k[0], k[1], k[2], k[3]};
  for (int d = 0; d < D; ++d) {
    __m256 q[M];
    for (int m = 0; m < M; ++m) q[m] = _mm256_loadu_ps(qt + d * stride + m * 8);
    for (int n = 0; n < kKeyStep; ++n) {
      const __m256 b = _mm256_broadcast_ss(rows[n] + d);
      for (int m = 0; m < M; ++m) acc[m][n] = _mm256_fmadd_ps(q[m], b, acc[m][n]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < kKeyStep; ++n) _mm256_storeu_ps(s + n * stride + m * 8, acc[m][n]);
}

// o^T[d0 + i][M vectors of rows] += sum over keys j of p^T[j][rows] * v[j][d0 + i], for kKeyStep dims.
template <int M>
inline void pv_block(const float* pt, int stride, const float* const* v, int num_keys, int d0, float* ot) {
  __m256 acc[kKeyStep][M];
  for (int i = 0; i < kKeyStep; ++i)
    for (int m = 0; m < M; ++m) acc[i][m] = _mm256_setzero_ps();
  // num_keys >= 1: as a for loop, which might run zero times, GCC stores the accumulators on every key.
  int j = 0;
  do {
    __m256 p[M];
    for (int m = 0; m < M; ++m) p[m] = _mm256_loadu_ps(pt + j * stride + m * 8);
    const float* row = v[j] + d0;
    for (int i = 0; i < kKeyStep; ++i) {
      const __m256 b = _mm256_broadcast_ss(row + i);
      for (int m = 0; m < M; ++m) acc[i][m] = _mm256_fmadd_ps(p[m], b, acc[i][m]);
    }
  } while (++j < num_keys);
  for (int i = 0; i < kKeyStep; ++i) {
    for (int m = 0; m < M; ++m) {
      float* o = ot + i * stride + m * 8;
      _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), acc[i][m]));
    }
  }
}

struct Scratch {
  std::vector<float> qt, ot, s, m, l, positions;  // [D][rows], [D][rows], [kKeyTile][rows], [rows] x 3
  std::vector<float> zeros;                      // the row that pads a tile to whole kKeyStep keys
  std::vector<float> k_stage, v_stage;           // an FP8 tile dequantised
  std::vector<const float*> k_rows, v_rows;
  Scratch(int max_rows, int head_dim)
      : qt(head_dim * max_rows), ot(head_dim * max_rows), s(kKeyTile * max_rows), m(max_rows), l(max_rows),
        positions(max_rows), zeros(head_dim), k_stage(kKeyTile * head_dim), v_stage(kKeyTile * head_dim),
        k_rows(kKeyTile), v_rows(kKeyTile) {}
};

struct WorkItem {
  int seq;
  int kv_head;
  int query_tile;
  int64_t cost;
};

template <int D>
void dequant_row(const uint8_t* src, const float* lut, float* dst) {
  for (int d = 0; d < D; d += 8) {
    const __m256i index = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + d)));
    _mm256_storeu_ps(dst + d, _mm256_i32gather_ps(lut, index, 4));
  }
}

// Points w.k_rows / w.v_rows at the tile's `len` keys in the cache (FP8: at their dequantised copies), and the
// rest up to `padded` at zeros.
template <int D, typename Elem>
void locate_tile(const Step& step, const Seq& seq, int kv_head, int k0, int len, int padded, Scratch& w) {
  for (int j = 0; j < len; ++j) {
    const int pos = k0 + j;
    const int64_t slot =
        static_cast<int64_t>(seq.table[pos / step.block_size]) * step.block_size + pos % step.block_size;
    const int64_t offset = (slot * step.num_kv_heads + kv_head) * D;
    if constexpr (sizeof(Elem) == 1) {
      dequant_row<D>(static_cast<const uint8_t*>(step.k_cache) + offset, step.k_lut, w.k_stage.data() + j * D);
      dequant_row<D>(static_cast<const uint8_t*>(step.v_cache) + offset, step.v_lut, w.v_stage.data() + j * D);
      w.k_rows[j] = w.k_stage.data() + j * D;
      w.v_rows[j] = w.v_stage.data() + j * D;
    } else {
      w.k_rows[j] = static_cast<const float*>(step.k_cache) + offset;
      w.v_rows[j] = static_cast<const float*>(step.v_cache) + offset;
    }
  }
  for (int j = len; j < padded; ++j) w.k_rows[j] = w.v_rows[j] = w.zeros.data();
}

// Online softmax over one tile for the 8 rows at lane offset c: masks keys past each row's position, moves the
// max, rescales l and O^T, and replaces the scores by 2^(scaled score - max). The max runs as kKeyStep partial
// chains and the sum as 2 (the exponential's constants leave registers for no more): single chains of dependent
// maxps and addps (4 cycles each) would take 2 x 64 x 4 cycles a tile, an eighth of its 8 rows' FMAs.
template <int D>
void softmax_rows(Scratch& w, int stride, int c, int k0, int padded, float score_scale) {
  const __m256 positions = _mm256_loadu_ps(w.positions.data() + c);
  // Rows are in position order, so the first row of the vector sees the fewest keys.
  const bool masks = k0 + padded - 1 > static_cast<int>(w.positions[c]);
  const __m256 masked = _mm256_set1_ps(kMaskedScore);
  float* const scores = w.s.data() + c;
  __m256 top[kKeyStep];
  for (int n = 0; n < kKeyStep; ++n) top[n] = masked;
  int j = 0;  // padded is a positive multiple of kKeyStep; do-while keeps top[] and sum[] in registers
  do {
    for (int n = 0; n < kKeyStep; ++n) {
      float* s = scores + (j + n) * stride;
      __m256 x = _mm256_loadu_ps(s);
      if (masks) {
        const __m256 key = _mm256_set1_ps(static_cast<float>(k0 + j + n));
        x = _mm256_blendv_ps(x, masked, _mm256_cmp_ps(key, positions, _CMP_GT_OQ));
        _mm256_storeu_ps(s, x);
      }
      top[n] = _mm256_max_ps(top[n], x);
    }
  } while ((j += kKeyStep) < padded);
  const __m256 scale = _mm256_set1_ps(score_scale);
  const __m256 m_old = _mm256_loadu_ps(w.m.data() + c);
  const __m256 tile_top = _mm256_max_ps(_mm256_max_ps(top[0], top[1]), _mm256_max_ps(top[2], top[3]));
  const __m256 m_new = _mm256_max_ps(m_old, _mm256_mul_ps(tile_top, scale));
  const __m256 alpha = exp2_ps(_mm256_sub_ps(m_old, m_new));  // 0 on the first tile (m_old = -inf)
  __m256 sum[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  j = 0;
  do {
    for (int n = 0; n < kKeyStep; ++n) {
      float* s = scores + (j + n) * stride;
      const __m256 p = exp2_ps(_mm256_fmsub_ps(_mm256_loadu_ps(s), scale, m_new));
      _mm256_storeu_ps(s, p);
      sum[n % 2] = _mm256_add_ps(sum[n % 2], p);
    }
  } while ((j += kKeyStep) < padded);
  const __m256 tile_sum = _mm256_add_ps(sum[0], sum[1]);
  _mm256_storeu_ps(w.l.data() + c, _mm256_fmadd_ps(_mm256_loadu_ps(w.l.data() + c), alpha, tile_sum));
  _mm256_storeu_ps(w.m.data() + c, m_new);
  for (int d = 0; d < D; ++d) {
    float* o = w.ot.data() + d * stride + c;
    _mm256_storeu_ps(o, _mm256_mul_ps(_mm256_loadu_ps(o), alpha));
  }
}

template <int D>
void qk_rows(int vecs, Scratch& w, int stride, int padded) {
  for (int v = 0; v < vecs; v += kVecs) {
    const float* qt = w.qt.data() + v * 8;
    for (int j = 0; j < padded; j += kKeyStep) {
      float* s = w.s.data() + j * stride + v * 8;
      const float* const* k = w.k_rows.data() + j;
      switch (std::min(kVecs, vecs - v)) {
        case 3: qk_block<3, D>(qt, stride, k, s); break;
        case 2: qk_block<2, D>(qt, stride, k, s); break;
        default: qk_block<1, D>(qt, stride, k, s); break;
      }
    }
  }
}

template <int D>
void pv_rows(int vecs, Scratch& w, int stride, int padded) {
  for (int v = 0; v < vecs; v += kVecs) {
    const float* pt = w.s.data() + v * 8;
    for (int d0 = 0; d0 < D; d0 += kKeyStep) {
      float* ot = w.ot.data() + d0 * stride + v * 8;
      switch (std::min(kVecs, vecs - v)) {
        case 3: pv_block<3>(pt, stride, w.v_rows.data(), padded, d0, ot); break;
        case 2: pv_block<2>(pt, stride, w.v_rows.data(), padded, d0, ot); break;
        default: pv_block<1>(pt, stride, w.v_rows.data(), padded, d0, ot); break;
      }
    }
  }
}

template <int D, typename Elem>
void attend_item(const Step& step, const WorkItem& item, Scratch& w) {
  const Seq& seq = step.seqs[item.seq];
  const int group = step.num_heads / step.num_kv_heads;
  const int first = item.query_tile * kQueryTile;
  const int count = std::min(kQueryTile, seq.q_len - first);
  const int rows = count * group;
  const int stride = (rows + 7) / 8 * 8;  // rows padded to whole vectors: the lanes past `rows` are ignored
  const int vecs = stride / 8;
  const int prefix_len = seq.seq_len - seq.q_len;
  for (int r = 0; r < stride; ++r) {
    const int i = std::min(r, rows - 1) / group, g = r % group;
    const float* q = step.q + ((seq.q_start + first + i) * static_cast<int64_t>(step.num_heads) +
                               item.kv_head * group + g) * D;
    for (int d = 0; d < D; ++d) w.qt[d * stride + r] = r < rows ? q[d] : 0.0f;
    w.positions[r] = static_cast<float>(prefix_len + first + i);
  }
  std::fill(w.ot.begin(), w.ot.begin() + D * stride, 0.0f);
  std::fill(w.m.begin(), w.m.begin() + stride, -std::numeric_limits<float>::infinity());
  std::fill(w.l.begin(), w.l.begin() + stride, 0.0f);
  const int num_keys = prefix_len + first + count;  // keys the last row sees
  for (int k0 = 0; k0 < num_keys; k0 += kKeyTile) {
    const int len = std::min(kKeyTile, num_keys - k0);
    const int padded = (len + kKeyStep - 1) / kKeyStep * kKeyStep;
    locate_tile<D, Elem>(step, seq, item.kv_head, k0, len, padded, w);
    qk_rows<D>(vecs, w, stride, padded);
    for (int v = 0; v < vecs; ++v) softmax_rows<D>(w, stride, v * 8, k0, padded, step.score_scale);
    pv_rows<D>(vecs, w, stride, padded);
  }
  for (int r = 0; r < rows; ++r) {
    const int i = r / group, g = r % group;
    float* out = step.out + ((seq.q_start + first + i) * static_cast<int64_t>(step.num_heads) +
                             item.kv_head * group + g) * D;
    const float inv = 1.0f / w.l[r];
    for (int d = 0; d < D; ++d) out[d] = w.ot[d * stride + r] * inv;
  }
}

template <int D, typename Elem>
void run_step(const Step& step) {
  std::vector<WorkItem> items;
  const int group = step.num_heads / step.num_kv_heads;
  for (int b = 0; b < static_cast<int>(step.seqs.size()); ++b) {
    const Seq& seq = step.seqs[b];
    for (int t = 0; t * kQueryTile < seq.q_len; ++t) {
      const int count = std::min(kQueryTile, seq.q_len - t * kQueryTile);
      const int64_t keys = seq.seq_len - seq.q_len + t * kQueryTile + count;
      for (int h = 0; h < step.num_kv_heads; ++h) items.push_back({b, h, t, keys * count});
    }
  }
  // KV head first, so that the threads read one head's K/V together while it is in cache; longest first within.
  std::stable_sort(items.begin(), items.end(), [](const WorkItem& a, const WorkItem& b) {
    return a.kv_head != b.kv_head ? a.kv_head < b.kv_head : a.cost > b.cost;
  });
  std::atomic<int64_t> next{0};
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), num_items);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    Scratch scratch((kQueryTile * group + 7) / 8 * 8, D);
    for (int64_t i = next++; i < num_items; i = next++) attend_item<D, Elem>(step, items[i], scratch);
  });
}

template <int D>
void dispatch_cache(const Step& step, bool fp8) {
  if (fp8) {
    run_step<D, uint8_t>(step);
  } else {
    run_step<D, float>(step);
  }
}

// The kernel reads a table's 256 entries through a raw pointer, one per FP8 byte: anything else reads past it.
void check_fp8_table(const at::Tensor& lut, const char* name) {
  TORCH_CHECK(lut.device().is_cpu() && lut.scalar_type() == at::kFloat && lut.dim() == 1 && lut.size(0) == 256 &&
                  lut.is_contiguous(),
              name, " must be a contiguous float32 CPU tensor of 256 entries (one per FP8 byte), got ",
              lut.scalar_type(), " ", lut.sizes(), " on ", lut.device(), lut.is_contiguous() ? "" : ", not contiguous");
}

void paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                     double softmax_scale, const std::optional<at::Tensor>& k_lut,
                     const std::optional<at::Tensor>& v_lut, at::Tensor& out) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat, "q and out must be float32");
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "q, out and the caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && query_start_loc.scalar_type() == at::kInt &&
                  seq_lens.scalar_type() == at::kInt,
              "block_tables, query_start_loc and seq_lens must be int32");
  const bool fp8 = k_cache.element_size() == 1;
  TORCH_CHECK(fp8 == (k_lut.has_value() && v_lut.has_value()), "FP8 caches need k_lut and v_lut, others none");
  TORCH_CHECK(fp8 || k_cache.scalar_type() == at::kFloat, "the cache must be float32 or FP8");
  if (fp8) {
    check_fp8_table(*k_lut, "k_lut");
    check_fp8_table(*v_lut, "v_lut");
  }
  const int head_dim = static_cast<int>(q.size(2));
  Step step;
  step.q = q.data_ptr<float>();
  step.out = out.data_ptr<float>();
  step.k_cache = k_cache.data_ptr();
  step.v_cache = v_cache.data_ptr();
  step.k_lut = fp8 ? k_lut->data_ptr<float>() : nullptr;
  step.v_lut = fp8 ? v_lut->data_ptr<float>() : nullptr;
  step.num_heads = static_cast<int>(q.size(1));
  step.num_kv_heads = static_cast<int>(k_cache.size(2));
  step.block_size = static_cast<int>(k_cache.size(1));
  step.score_scale = static_cast<float>(softmax_scale) * kLog2e;
  TORCH_CHECK(step.num_heads % step.num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  const auto tables = block_tables.contiguous();
  const auto starts = query_start_loc.contiguous();
  const auto lens = seq_lens.contiguous();
  for (int b = 0; b < static_cast<int>(lens.size(0)); ++b) {
    Seq seq;
    seq.q_start = starts.data_ptr<int32_t>()[b];
    seq.q_len = starts.data_ptr<int32_t>()[b + 1] - seq.q_start;
    seq.seq_len = lens.data_ptr<int32_t>()[b];
    seq.table = tables.data_ptr<int32_t>() + static_cast<int64_t>(b) * tables.size(1);
    step.seqs.push_back(seq);
  }
  switch (head_dim) {
    case 32: dispatch_cache<32>(step, fp8); break;
    case 64: dispatch_cache<64>(step, fp8); break;
    case 128: dispatch_cache<128>(step, fp8); break;
    default: TORCH_CHECK(false, "head_dim must be 32, 64 or 128, got ", head_dim);
  }
}

}  // namespace

TORCH_LIBRARY(kvroute_cpu_fp32, m) {
  m.def(
      "paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor query_start_loc, "
      "Tensor seq_lens, float softmax_scale, Tensor? k_lut, Tensor? v_lut, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(kvroute_cpu_fp32, CPU, m) { m.impl("paged_attention", &paged_attention); }
