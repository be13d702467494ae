// Paged flash attention in bfloat16 for CPUs with AVX-512 BF16 (the engine's CPU path for bf16 models).
//
// One call runs a whole engine step: prefill chunks, extends over a cached prefix and decodes, read straight
// from the paged cache through the block tables (kvkernels/attention.py has the contract). Two passes:
//   1. pack: each sequence's K and V are copied out of the cache into the layouts the dot-product
//      instruction wants (VNNI: the two bf16 of a pair adjacent), FP8 caches dequantised on the way. Only
//      sequences with more than one query tile are packed up front, once for all their work items; a decode's
//      (or short prefill's) one work item packs each tile itself just before using it, while it is in L1;
//   2. attend: one work item is (sequence, KV head, 16 query positions). The G query heads that share the
//      KV head ride along as extra rows, so GQA reads each K/V tile once. Over key tiles of 64 it computes
//      S = Q K^T with _mm512_dpbf16_ps, an online softmax in float32 on the scores still in registers, and
//      O += P V with P rounded to bf16 (as flash attention does on GPUs); O is divided by the softmax sum at
//      the end.
// Threads take work items from a shared counter, one KV head after the other and longest first within one,
// so that causal prefills balance and a head's packed K/V stays in cache while both threads read it.
//
// Why not SDPA: torch's CPU flash kernel computes in float32 (about 180 GFLOP/s on 2 cores here, the same
// for bf16 inputs), while vdpbf16ps multiplies bf16 pairs at about 4x the float32 FMA rate. This kernel runs
// at about 800 GFLOP/s on SmolLM2's shapes (`python -m benchmarks.cpu_kernel_bench`: a 3,000-token prefill in
// 12.5 ms a layer against SDPA's 68; 400 new tokens over a 2,900-token cached prefix in 3.5 ms against 18),
// about 75% of the dot-product peak measured here (548 GFLOP/s a core); the two micro-kernels alone reach
// 86%, and the softmax takes about 5% of the time.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

namespace {

using bf16 = uint16_t;

constexpr int kKeyTile = 64;    // keys per tile: 4 vectors of 16 scores
constexpr int kQueryTile = 16;  // query positions per work item (8 and 32 measure the same)
constexpr int kRows = 6;        // rows per micro-kernel call (6 x 4 accumulators + 5 operands fit 32 zmm)
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kMaxSlack = 8.0f;  // in log2 units; see qk_softmax_tile
constexpr float kMaskedScore = -1e30f;  // a masked score: 2^(scale * it - m) is 0, and never NaN

struct Seq {
  int q_start;
  int q_len;
  int seq_len;
  int padded_len;  // seq_len rounded up to kKeyTile
  bool packed_up_front;  // several work items read its K/V: packed once in pass 1 (else by its one item)
  int64_t pack_offset;  // packed_up_front: first element of this sequence's region in the packed K (and V)
  const int32_t* table;
};

struct Step {
  const bf16* q;
  bf16* out;
  const void* k_cache;
  const void* v_cache;
  const bf16* k_lut;  // FP8 caches: bf16 value of each stored byte, scale applied; nullptr for bf16 caches
  const bf16* v_lut;
  bf16* k_pack;
  bf16* v_pack;
  int num_heads;
  int num_kv_heads;
  int block_size;
  float score_scale;  // softmax scale * log2(e): the softmax runs in base 2
  std::vector<Seq> seqs;
};

inline __m512bh as_bh(__m512i x) { return (__m512bh)x; }

inline __m512i broadcast_pair(const bf16* p) {
  int32_t pair;
  std::memcpy(&pair, p, sizeof(pair));
  return _mm512_set1_epi32(pair);
}

// 2^x for finite x <= kMaxSlack (results under 2^-149 flush to 0): 2^floor(x) * 2^f with f = x - floor(x)
// in [0, 1). vreduceps gives f in one instruction and vscalefps floors x itself; 2^f is a degree-3
// polynomial fitted on [0, 1) (relative error under 8e-5, well below the 4e-3 of rounding P to bf16).
// Masked scores are a large finite negative, not -inf, so no clamp is needed.
inline __m512 exp2_ps(__m512 x) {
  const __m512 f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 p = _mm512_set1_ps(0.07802428f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.22606754f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.69583338f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.99992526f));
  return _mm512_scalef_ps(p, x);
}

// ---- pass 1: pack -------------------------------------------------------------------------------------

// The 256-entry FP8 -> bf16 table in eight registers, looked up 32 bytes at a time: each vpermt2w indexes 64
// entries by the low 6 bits, and bits 6 and 7 pick among the four results.
struct Fp8Table {
  __m512i part[8];
  explicit Fp8Table(const bf16* lut) {
    for (int i = 0; i < 8; ++i) part[i] = _mm512_loadu_si512(lut + 32 * i);
  }
  __m512i lookup(const uint8_t* src) const {  // 32 bytes -> 32 bf16
    const __m512i index = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
    const __m512i r0 = _mm512_permutex2var_epi16(part[0], index, part[1]);
    const __m512i r1 = _mm512_permutex2var_epi16(part[2], index, part[3]);
    const __m512i r2 = _mm512_permutex2var_epi16(part[4], index, part[5]);
    const __m512i r3 = _mm512_permutex2var_epi16(part[6], index, part[7]);
    const __mmask32 bit6 = _mm512_test_epi16_mask(index, _mm512_set1_epi16(64));
    const __mmask32 bit7 = _mm512_test_epi16_mask(index, _mm512_set1_epi16(128));
    return _mm512_mask_blend_epi16(bit7, _mm512_mask_blend_epi16(bit6, r0, r1), _mm512_mask_blend_epi16(bit6, r2, r3));
  }
};

// Copies the tile's 64 K (or V) rows of one KV head out of the paged cache into rows[64][D] as bf16 (FP8
// through its lookup table). Keys past seq_len are zeros: masked scores multiply them by 0, and stale cache
// memory could hold NaN.
template <int D, typename Elem>
void stage_rows(const Step& step, const Seq& seq, const void* cache, const bf16* lut, int kv_head, int tile,
                bf16* rows) {
  std::optional<Fp8Table> table;
  if constexpr (sizeof(Elem) == 1) table.emplace(lut);
  for (int j = 0; j < kKeyTile; ++j) {
    const int pos = tile * kKeyTile + j;
    bf16* out = rows + j * D;
    if (pos >= seq.seq_len) {
      std::memset(out, 0, D * sizeof(bf16));
      continue;
    }
    const int64_t slot = static_cast<int64_t>(seq.table[pos / step.block_size]) * step.block_size +
                         pos % step.block_size;
    const Elem* src = static_cast<const Elem*>(cache) + (slot * step.num_kv_heads + kv_head) * D;
    if constexpr (sizeof(Elem) == 1) {
      for (int d = 0; d < D; d += 32) _mm512_storeu_si512(out + d, table->lookup(src + d));
    } else {
      std::memcpy(out, src, D * sizeof(bf16));
    }
  }
}

// K tile: [16-key group][dim pair p][key in group][2], so S = Q K^T vectorises over keys: the dim pair p of
// 16 consecutive keys is one gather of 32-bit words from the staged rows.
template <int D>
void pack_keys(const bf16* rows, bf16* dst) {
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i row_words = _mm512_mullo_epi32(lanes, _mm512_set1_epi32(D / 2));
  for (int group = 0; group < kKeyTile / 16; ++group) {
    for (int p = 0; p < D / 2; ++p) {
      const __m512i index = _mm512_add_epi32(row_words, _mm512_set1_epi32(group * 16 * (D / 2) + p));
      _mm512_storeu_si512(dst + (group * (D / 2) + p) * 32, _mm512_i32gather_epi32(index, rows, 4));
    }
  }
}

// V tile: [key pair][dim][2], so O += P V vectorises over dims: rows 2q and 2q+1 interleaved element-wise.
template <int D>
void pack_values(const bf16* rows, bf16* dst) {
  alignas(64) int16_t low[32], high[32];
  for (int i = 0; i < 16; ++i) {
    low[2 * i] = i, low[2 * i + 1] = 32 + i;
    high[2 * i] = 16 + i, high[2 * i + 1] = 48 + i;
  }
  const __m512i take_low = _mm512_load_si512(low), take_high = _mm512_load_si512(high);
  for (int pair = 0; pair < kKeyTile / 2; ++pair) {
    const bf16* a = rows + 2 * pair * D;
    const bf16* b = a + D;
    for (int c = 0; c < D; c += 32) {
      const __m512i x = _mm512_loadu_si512(a + c), y = _mm512_loadu_si512(b + c);
      _mm512_storeu_si512(dst + (pair * D + c) * 2, _mm512_permutex2var_epi16(x, take_low, y));
      _mm512_storeu_si512(dst + (pair * D + c) * 2 + 32, _mm512_permutex2var_epi16(x, take_high, y));
    }
  }
}

// Packs keys [tile * kKeyTile, +kKeyTile) of one sequence and KV head into the layouts above.
template <int D, typename Elem>
void pack_tile(const Step& step, const Seq& seq, int kv_head, int tile, bf16* k_dst, bf16* v_dst) {
  alignas(64) bf16 rows[kKeyTile * D];
  stage_rows<D, Elem>(step, seq, step.k_cache, step.k_lut, kv_head, tile, rows);
  pack_keys<D>(rows, k_dst);
  stage_rows<D, Elem>(step, seq, step.v_cache, step.v_lut, kv_head, tile, rows);
  pack_values<D>(rows, v_dst);
}

// Where pass 1 puts a tile of a packed_up_front sequence.
inline int64_t packed_tile_offset(const Seq& seq, int kv_head, int tile, int head_dim) {
  return seq.pack_offset + (static_cast<int64_t>(kv_head) * seq.padded_len + tile * kKeyTile) * head_dim;
}

// ---- pass 2: attend -----------------------------------------------------------------------------------

// Row state of the online softmax, in base 2: m is the running max of the scaled scores, l the running sum
// of 2^(score - m) as 16 partial sums (one horizontal add at the end instead of one per tile), o the
// unnormalised output.
struct Rows {
  const bf16* const* q;
  const int* positions;  // each row's position in its sequence: it sees keys 0..position
  float* m;
  __m512* l;
  float* o;  // [rows][D]
  bf16* p;   // [rows][kKeyTile]: the current tile's probabilities
};

// For M rows and the tile's 64 keys from k0: S = Q K^T with the rows' scores in registers, then the online
// softmax on them; the tile's probabilities go to p as bf16, and o is rescaled when a row's max grows.
template <int M, int D>
inline void qk_softmax_tile(const Rows& rows, int k0, const bf16* k_tile, float score_scale) {
  __m512 acc[M][4];
  for (int r = 0; r < M; ++r)
    for (int n = 0; n < 4; ++n) acc[r][n] = _mm512_setzero_ps();
  for (int p = 0; p < D / 2; ++p) {
    __m512bh k[4];
    for (int n = 0; n < 4; ++n) k[n] = as_bh(_mm512_loadu_si512(k_tile + (n * (D / 2) + p) * 32));
    for (int r = 0; r < M; ++r) {
      const __m512bh q = as_bh(broadcast_pair(rows.q[r] + 2 * p));
      for (int n = 0; n < 4; ++n) acc[r][n] = _mm512_dpbf16_ps(acc[r][n], q, k[n]);
    }
  }
  // In phases over all M rows, so that the rows' independent reductions and exponentials overlap.
  // A row's reference max m moves only when a score passes it by more than kMaxSlack: probabilities up to
  // 2^kMaxSlack are exact enough in float32 and bf16, and most tiles then need neither the horizontal max
  // nor the rescale of o and l, only a compare of the raw scores against (m + kMaxSlack) / scale.
  const __m512 masked = _mm512_set1_ps(kMaskedScore);
  for (int r = 0; r < M; ++r) {
    const int visible = rows.positions[r] - k0 + 1;  // keys [0, visible) of the tile count for this row
    if (visible < kKeyTile) {
      const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      for (int n = 0; n < 4; ++n) {
        const __m512i keys = _mm512_add_epi32(lanes, _mm512_set1_epi32(n * 16));
        acc[r][n] = _mm512_mask_mov_ps(masked, _mm512_cmplt_epi32_mask(keys, _mm512_set1_epi32(visible)), acc[r][n]);
      }
    }
    const __m512 raw_max = _mm512_max_ps(_mm512_max_ps(acc[r][0], acc[r][1]), _mm512_max_ps(acc[r][2], acc[r][3]));
    const __m512 limit = _mm512_set1_ps((rows.m[r] + kMaxSlack) / score_scale);  // -inf before the first tile
    if (_mm512_cmp_ps_mask(raw_max, limit, _CMP_GT_OQ)) {
      const float m_new = _mm512_reduce_max_ps(raw_max) * score_scale;
      const __m512 alpha = _mm512_set1_ps(std::exp2(rows.m[r] - m_new));  // 0 on the first tile (m = -inf)
      rows.l[r] = _mm512_mul_ps(rows.l[r], alpha);
      float* o = rows.o + r * D;
      for (int d = 0; d < D; d += 16) _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_loadu_ps(o + d), alpha));
      rows.m[r] = m_new;
    }
  }
  const __m512 scale = _mm512_set1_ps(score_scale);
  for (int r = 0; r < M; ++r) {
    const __m512 shift = _mm512_set1_ps(rows.m[r]);
    __m512 sum = rows.l[r];
    for (int n = 0; n < 4; ++n) {
      acc[r][n] = exp2_ps(_mm512_fmsub_ps(acc[r][n], scale, shift));
      sum = _mm512_add_ps(sum, acc[r][n]);
    }
    rows.l[r] = sum;
    bf16* p = rows.p + r * kKeyTile;
    _mm512_storeu_si512(p, (__m512i)_mm512_cvtne2ps_pbh(acc[r][1], acc[r][0]));
    _mm512_storeu_si512(p + 32, (__m512i)_mm512_cvtne2ps_pbh(acc[r][3], acc[r][2]));
  }
}

// o[r][0:D] += p[r][0:64] . V for the tile's 64 keys (M rows), 64 dims at a time.
template <int M, int D>
inline void pv_tile(const bf16* p, const bf16* v_tile, float* o) {
  constexpr int kDims = D < 64 ? D : 64;
  constexpr int kVecs = kDims / 16;
  for (int d0 = 0; d0 < D; d0 += kDims) {
    __m512 acc[M][kVecs];
    for (int r = 0; r < M; ++r)
      for (int n = 0; n < kVecs; ++n) acc[r][n] = _mm512_loadu_ps(o + r * D + d0 + n * 16);
    for (int pair = 0; pair < kKeyTile / 2; ++pair) {
      __m512bh v[kVecs];
      for (int n = 0; n < kVecs; ++n) v[n] = as_bh(_mm512_loadu_si512(v_tile + (pair * D + d0 + n * 16) * 2));
      for (int r = 0; r < M; ++r) {
        const __m512bh w = as_bh(broadcast_pair(p + r * kKeyTile + 2 * pair));
        for (int n = 0; n < kVecs; ++n) acc[r][n] = _mm512_dpbf16_ps(acc[r][n], w, v[n]);
      }
    }
    for (int r = 0; r < M; ++r)
      for (int n = 0; n < kVecs; ++n) _mm512_storeu_ps(o + r * D + d0 + n * 16, acc[r][n]);
  }
}

template <int D>
void qk_softmax_rows(int num_rows, const Rows& rows, int k0, const bf16* k_tile, float score_scale) {
  for (int r = 0; r < num_rows; r += kRows) {
    const Rows at{rows.q + r, rows.positions + r, rows.m + r, rows.l + r, rows.o + r * D, rows.p + r * kKeyTile};
    switch (std::min(kRows, num_rows - r)) {
      case 6: qk_softmax_tile<6, D>(at, k0, k_tile, score_scale); break;
      case 5: qk_softmax_tile<5, D>(at, k0, k_tile, score_scale); break;
      case 4: qk_softmax_tile<4, D>(at, k0, k_tile, score_scale); break;
      case 3: qk_softmax_tile<3, D>(at, k0, k_tile, score_scale); break;
      case 2: qk_softmax_tile<2, D>(at, k0, k_tile, score_scale); break;
      default: qk_softmax_tile<1, D>(at, k0, k_tile, score_scale); break;
    }
  }
}

template <int D>
void pv_rows(int rows, const bf16* p, const bf16* v_tile, float* o) {
  for (int r = 0; r < rows; r += kRows) {
    const bf16* p_r = p + r * kKeyTile;
    float* o_r = o + r * D;
    switch (std::min(kRows, rows - r)) {
      case 6: pv_tile<6, D>(p_r, v_tile, o_r); break;
      case 5: pv_tile<5, D>(p_r, v_tile, o_r); break;
      case 4: pv_tile<4, D>(p_r, v_tile, o_r); break;
      case 3: pv_tile<3, D>(p_r, v_tile, o_r); break;
      case 2: pv_tile<2, D>(p_r, v_tile, o_r); break;
      default: pv_tile<1, D>(p_r, v_tile, o_r); break;
    }
  }
}

struct Scratch {
  std::vector<const bf16*> q_rows;
  std::vector<int> positions;
  std::vector<float> o, m;
  std::vector<__m512> l;
  std::vector<bf16> p;
  std::vector<bf16> k_tile, v_tile;  // the current tile of a sequence packed by its one work item
  explicit Scratch(int max_rows, int head_dim)
      : q_rows(max_rows), positions(max_rows), o(max_rows * head_dim), m(max_rows), l(max_rows),
        p(max_rows * kKeyTile), k_tile(kKeyTile * head_dim), v_tile(kKeyTile * head_dim) {}
};

struct WorkItem {
  int seq;
  int kv_head;
  int query_tile;
  int64_t cost;
};

template <int D, typename Elem>
void attend_item(const Step& step, const WorkItem& item, Scratch& w) {
  const Seq& seq = step.seqs[item.seq];
  const int group = step.num_heads / step.num_kv_heads;
  const int first = item.query_tile * kQueryTile;
  const int count = std::min(kQueryTile, seq.q_len - first);
  const int rows = count * group;
  const int prefix_len = seq.seq_len - seq.q_len;
  for (int i = 0; i < count; ++i) {
    for (int g = 0; g < group; ++g) {
      const int64_t token = seq.q_start + first + i;
      w.q_rows[i * group + g] = step.q + (token * step.num_heads + item.kv_head * group + g) * D;
      w.positions[i * group + g] = prefix_len + first + i;
    }
  }
  std::fill(w.o.begin(), w.o.begin() + rows * D, 0.0f);
  std::fill(w.m.begin(), w.m.begin() + rows, -std::numeric_limits<float>::infinity());
  std::fill(w.l.begin(), w.l.begin() + rows, _mm512_setzero_ps());
  const Rows state{w.q_rows.data(), w.positions.data(), w.m.data(), w.l.data(), w.o.data(), w.p.data()};
  const int num_keys = prefix_len + first + count;  // keys the last row sees
  for (int k0 = 0; k0 < num_keys; k0 += kKeyTile) {
    const bf16 *k_tile = w.k_tile.data(), *v_tile = w.v_tile.data();
    if (seq.packed_up_front) {
      const int64_t offset = packed_tile_offset(seq, item.kv_head, k0 / kKeyTile, D);
      k_tile = step.k_pack + offset;
      v_tile = step.v_pack + offset;
    } else {  // a decode or a short prefill: pack the tile just before use, while it is in L1
      pack_tile<D, Elem>(step, seq, item.kv_head, k0 / kKeyTile, w.k_tile.data(), w.v_tile.data());
    }
    qk_softmax_rows<D>(rows, state, k0, k_tile, step.score_scale);
    pv_rows<D>(rows, w.p.data(), v_tile, w.o.data());
  }
  for (int r = 0; r < rows; ++r) {
    const int i = r / group, g = r % group;
    const int64_t token = seq.q_start + first + i;
    bf16* out = step.out + (token * step.num_heads + item.kv_head * group + g) * D;
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(w.l[r]));
    for (int d = 0; d < D; d += 16) {
      const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(w.o.data() + r * D + d), inv);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + d), (__m256i)_mm512_cvtneps_pbh(x));
    }
  }
}

template <int D, typename Elem>
void run_step(const Step& step) {
  const int num_kv_heads = step.num_kv_heads;
  // Pass 1: pack every key tile of the sequences that several work items read.
  std::vector<std::array<int, 3>> tiles;
  for (int b = 0; b < static_cast<int>(step.seqs.size()); ++b) {
    if (!step.seqs[b].packed_up_front) continue;
    for (int h = 0; h < num_kv_heads; ++h)
      for (int t = 0; t < step.seqs[b].padded_len / kKeyTile; ++t) tiles.push_back({b, h, t});
  }
  at::parallel_for(0, static_cast<int64_t>(tiles.size()), 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const auto [b, h, t] = tiles[i];
      const int64_t offset = packed_tile_offset(step.seqs[b], h, t, D);
      pack_tile<D, Elem>(step, step.seqs[b], h, t, step.k_pack + offset, step.v_pack + offset);
    }
  });
  // Pass 2: attend, each thread taking the next work item from a shared counter.
  std::vector<WorkItem> items;
  const int group = step.num_heads / num_kv_heads;
  for (int b = 0; b < static_cast<int>(step.seqs.size()); ++b) {
    const Seq& seq = step.seqs[b];
    for (int t = 0; t * kQueryTile < seq.q_len; ++t) {
      const int count = std::min(kQueryTile, seq.q_len - t * kQueryTile);
      const int64_t keys = seq.seq_len - seq.q_len + t * kQueryTile + count;
      for (int h = 0; h < num_kv_heads; ++h) items.push_back({b, h, t, keys * count});
    }
  }
  // KV head first: the threads then work through one head's packed K/V together while it sits in cache
  // (a 3,300-token head is 845 KB; three do not fit a 1 MB L2). Longest first within a head.
  std::stable_sort(items.begin(), items.end(), [](const WorkItem& a, const WorkItem& b) {
    return a.kv_head != b.kv_head ? a.kv_head < b.kv_head : a.cost > b.cost;
  });
  std::atomic<int64_t> next{0};
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), num_items);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    Scratch scratch(kQueryTile * group, D);
    for (int64_t i = next++; i < num_items; i = next++) attend_item<D, Elem>(step, items[i], scratch);
  });
}

template <int D>
void dispatch_cache(const Step& step, bool fp8) {
  if (fp8) {
    run_step<D, uint8_t>(step);
  } else {
    run_step<D, bf16>(step);
  }
}

// Reused from call to call (a step's layers all need the same size): fresh multi-megabyte buffers per layer
// would cost more in page faults than the packing itself.
bf16* pack_buffer(std::vector<bf16>& buffer, int64_t size) {
  if (static_cast<int64_t>(buffer.size()) < size) buffer.resize(size);
  return buffer.data();
}

// The kernel reads a table's 256 entries through a raw pointer, one per FP8 byte: anything else reads past it.
void check_fp8_table(const at::Tensor& lut, const char* name) {
  TORCH_CHECK(lut.device().is_cpu() && lut.scalar_type() == at::kBFloat16 && lut.dim() == 1 && lut.size(0) == 256 &&
                  lut.is_contiguous(),
              name, " must be a contiguous bfloat16 CPU tensor of 256 entries (one per FP8 byte), got ",
              lut.scalar_type(), " ", lut.sizes(), " on ", lut.device(), lut.is_contiguous() ? "" : ", not contiguous");
}

void paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                     double softmax_scale, const std::optional<at::Tensor>& k_lut,
                     const std::optional<at::Tensor>& v_lut, at::Tensor& out) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16, "q and out must be bfloat16");
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "q, out and the caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && query_start_loc.scalar_type() == at::kInt &&
                  seq_lens.scalar_type() == at::kInt,
              "block_tables, query_start_loc and seq_lens must be int32");
  const bool fp8 = k_cache.element_size() == 1;
  TORCH_CHECK(fp8 == (k_lut.has_value() && v_lut.has_value()), "FP8 caches need k_lut and v_lut, others none");
  TORCH_CHECK(fp8 || k_cache.scalar_type() == at::kBFloat16, "the cache must be bfloat16 or FP8");
  if (fp8) {
    check_fp8_table(*k_lut, "k_lut");
    check_fp8_table(*v_lut, "v_lut");
  }
  const int head_dim = static_cast<int>(q.size(2));
  Step step;
  step.q = reinterpret_cast<const bf16*>(q.data_ptr());
  step.out = reinterpret_cast<bf16*>(out.data_ptr());
  step.k_cache = k_cache.data_ptr();
  step.v_cache = v_cache.data_ptr();
  step.k_lut = fp8 ? reinterpret_cast<const bf16*>(k_lut->data_ptr()) : nullptr;
  step.v_lut = fp8 ? reinterpret_cast<const bf16*>(v_lut->data_ptr()) : nullptr;
  step.num_heads = static_cast<int>(q.size(1));
  step.num_kv_heads = static_cast<int>(k_cache.size(2));
  step.block_size = static_cast<int>(k_cache.size(1));
  step.score_scale = static_cast<float>(softmax_scale) * kLog2e;
  TORCH_CHECK(step.num_heads % step.num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  const auto tables = block_tables.contiguous();
  const auto starts = query_start_loc.contiguous();
  const auto lens = seq_lens.contiguous();
  const int num_seqs = static_cast<int>(lens.size(0));
  int64_t packed = 0;
  for (int b = 0; b < num_seqs; ++b) {
    Seq seq;
    seq.q_start = starts.data_ptr<int32_t>()[b];
    seq.q_len = starts.data_ptr<int32_t>()[b + 1] - seq.q_start;
    seq.seq_len = lens.data_ptr<int32_t>()[b];
    seq.padded_len = (seq.seq_len + kKeyTile - 1) / kKeyTile * kKeyTile;
    seq.packed_up_front = seq.q_len > kQueryTile;
    seq.pack_offset = packed;
    seq.table = tables.data_ptr<int32_t>() + static_cast<int64_t>(b) * tables.size(1);
    if (seq.packed_up_front) packed += static_cast<int64_t>(seq.padded_len) * step.num_kv_heads * head_dim;
    step.seqs.push_back(seq);
  }
  thread_local std::vector<bf16> k_buffer, v_buffer;
  step.k_pack = pack_buffer(k_buffer, packed);
  step.v_pack = pack_buffer(v_buffer, packed);
  switch (head_dim) {
    case 32: dispatch_cache<32>(step, fp8); break;
    case 64: dispatch_cache<64>(step, fp8); break;
    case 128: dispatch_cache<128>(step, fp8); break;
    default: TORCH_CHECK(false, "head_dim must be 32, 64 or 128, got ", head_dim);
  }
}

}  // namespace

TORCH_LIBRARY(kvroute_cpu, m) {
  m.def(
      "paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor query_start_loc, "
      "Tensor seq_lens, float softmax_scale, Tensor? k_lut, Tensor? v_lut, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(kvroute_cpu, CPU, m) { m.impl("paged_attention", &paged_attention); }
