// Ragged paged attention for CPU, float32, as an XLA FFI custom call: over float32 K/V pools,
// or over int8 pools with one float32 scale per (layer, block, KV head, token) beside them
// (--kv-cache-dtype int8, jserve/pallas/kv_cache.py). An int8 page's rows that some row of a
// unit sees are dequantized once per unit into a per-thread float32 page (convert, times the
// token's scale) and then scored and accumulated by the same float32 code as a float pool's.
//
// The operation and masking contract are ragged_common.py's: sequence s owns query rows
// cu_q_lens[s]:cu_q_lens[s + 1] and kv_lens[s] cached positions reached through
// block_tables[s]; its query token t of q_len sees positions p <= kv_lens[s] - q_len + t (and,
// with a window, p > that - sliding_window). Positions no row may see are never read, so stale
// slots and unused pages (which may hold anything, NaN included) cannot reach an output; rows
// no sequence owns are 0.
//
// Why native code: XLA's CPU backend runs ragged_xla's per-page loop as a chain of small ops on
// one thread and gathers pages at a few GB/s. Here a work unit is one KV head of up to
// kBlockRows query tokens of one sequence (a decode row is a unit of one token): each page it
// needs is read straight from the pool once for all of the unit's (token, query head) rows, and
// scored and accumulated with vector code. The online softmax steps once per tile of
// kTilePages pages rather than once per page: a row's max, rescale and bookkeeping were about
// a quarter of a prefill unit's time, and tiles of 4 pages made the kernel 1.10-1.13x faster on
// prefill and mixed batches (interleaved A/B in one process).
//
// The units run over XLA's intra-op threads through jserve::run_units (parallel_units.h).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include "parallel_units.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBlockRows = 32;    // query tokens of a prefill chunk per unit
constexpr int64_t kPrefetchPages = 4;  // pages requested ahead of the one being computed
constexpr int64_t kTilePages = 4;      // pages per online-softmax step
constexpr int64_t kLineBytes = 64;     // cache lines

struct Unit {
  int64_t seq, head, r0, r1;  // query tokens [r0, r1) of the sequence
};

struct Problem {
  const float* q;      // [T, Hq, D]
  const char* k;       // [L, NB, Hkv, B, D] float32, or int8
  const char* v;       // [L, NB, Hkv, B, D] float32, or int8
  const float* k_scale;  // [L, NB, Hkv, B] int8 pools' scales; null for float32 pools
  const float* v_scale;
  int64_t itemsize;      // bytes of one pool element: 4 or 1
  const int32_t* tables;  // [S, MB]
  const int32_t* cu;      // [S + 1]
  const int32_t* kv;      // [S]
  float* out;             // [T, Hq, D]
  int64_t hq, hkv, d, nb, bs, mb, layer;
  float scale, soft_cap;  // soft_cap <= 0: none
  int64_t window;         // <= 0: none
};

// exp for the softmax, written so loops over it vectorize (libm's expf does not): Cody-Waite
// range reduction and a degree-6 polynomial, about 2 ulp on the range softmax uses (x <= 0).
inline float fast_exp(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &p, sizeof bits);
  bits += static_cast<int32_t>(n) << 23;
  std::memcpy(&p, &bits, sizeof p);
  return p;
}

#if defined(__AVX2__) && defined(__FMA__)
// {sum of a[0]'s lanes, ..., sum of a[7]'s lanes}.
inline __m256 sum_lanes8(const __m256* a) {
  const __m256 s01 = _mm256_hadd_ps(a[0], a[1]);
  const __m256 s23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 s45 = _mm256_hadd_ps(a[4], a[5]);
  const __m256 s67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23);  // low half: lanes 0-3 of a[0..3]; high: 4-7
  const __m256 s4567 = _mm256_hadd_ps(s45, s67);
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                       _mm256_permute2f128_ps(s0123, s4567, 0x31));
}
#endif
#if defined(__AVX2__) && defined(__FMA__)
// Query rows that share each K and V load in the vector loops below: their accumulators (8 per
// row) and operands must fit the vector registers (32 with AVX-512VL, 16 with AVX2 alone). A
// decode unit's rows are the query heads of one KV head (3 for SmolLM2): with one row per load
// the loops issued a load per FMA. Three rows per load made SmolLM2's attention 1.04-1.08x
// faster on decode batches and 1.16-1.19x on prefill and mixed ones (interleaved, same bits).
#if defined(__AVX512VL__)
constexpr int64_t kSharedRows = 3;
#else
constexpr int64_t kSharedRows = 1;
#endif

// sc[g * ld + j + r] = q_g . k_{j+r} for g < R, r < 8: eight dot products per row accumulate
// lane-wise, then one transposing reduction turns their eight vectors into one vector of eight
// scores (a horizontal sum per position would cost more than its dot product at d = 64).
template <int R>
inline void scores_8(const float* qs, const float* k0, float* sc, int64_t d, int64_t ld) {
  __m256 a[R][8];
  for (int g = 0; g < R; ++g)
    for (int r = 0; r < 8; ++r) a[g][r] = _mm256_setzero_ps();
  for (int64_t i = 0; i < d; i += 8) {
    __m256 qv[R];
    for (int g = 0; g < R; ++g) qv[g] = _mm256_loadu_ps(qs + g * d + i);
    for (int r = 0; r < 8; ++r) {
      const __m256 kv = _mm256_loadu_ps(k0 + r * d + i);
      for (int g = 0; g < R; ++g) a[g][r] = _mm256_fmadd_ps(qv[g], kv, a[g][r]);
    }
  }
  for (int g = 0; g < R; ++g) _mm256_storeu_ps(sc + g * ld, sum_lanes8(a[g]));
}

// acc[g, c:c + 64] += sum over j0 <= j < j1 of sc[g * ld + j] * v_j[c:c + 64] for g < R: the
// output columns stay in registers across the page's positions.
template <int R>
inline void values_64(const float* sc, const float* vp, float* acc, int64_t d, int64_t ld,
                      int64_t c, int64_t j0, int64_t j1) {
  __m256 a[R][8];
  for (int g = 0; g < R; ++g)
    for (int r = 0; r < 8; ++r) a[g][r] = _mm256_loadu_ps(acc + g * d + c + 8 * r);
  for (int64_t j = j0; j < j1; ++j) {
    __m256 w[R];
    for (int g = 0; g < R; ++g) w[g] = _mm256_broadcast_ss(sc + g * ld + j);
    const float* vj = vp + j * d + c;
    for (int r = 0; r < 8; ++r) {
      const __m256 vv = _mm256_loadu_ps(vj + 8 * r);
      for (int g = 0; g < R; ++g) a[g][r] = _mm256_fmadd_ps(w[g], vv, a[g][r]);
    }
  }
  for (int g = 0; g < R; ++g)
    for (int r = 0; r < 8; ++r) _mm256_storeu_ps(acc + g * d + c + 8 * r, a[g][r]);
}

// f(g, n) over the rows [0, group) in blocks of n = kSharedRows rows, then what is left.
template <typename F>
inline void for_row_blocks(int64_t group, F f) {
  int64_t g = 0;
  for (; g + kSharedRows <= group; g += kSharedRows) f(g, kSharedRows);
  if (g < group) f(g, group - g);
}
#endif

// sc[g * ld + j] = q_g . k_j for the query rows g < group and the positions j0 <= j < j1 of one
// page (k: its [bs, d] rows; ld: sc's row stride).
inline void page_scores(const float* qs, const float* kp, float* sc, int64_t group, int64_t d,
                        int64_t ld, int64_t j0, int64_t j1) {
  int64_t j = j0;
#if defined(__AVX2__) && defined(__FMA__)
  if (d % 8 == 0) {
    for (; j + 8 <= j1; j += 8) {
      for_row_blocks(group, [&](int64_t g, int64_t n) {
        const float* q = qs + g * d;
        float* s = sc + g * ld + j;
        if (n == 3) return scores_8<3>(q, kp + j * d, s, d, ld);
        if (n == 2) return scores_8<2>(q, kp + j * d, s, d, ld);
        for (int64_t h = 0; h < n; ++h) scores_8<1>(q + h * d, kp + j * d, s + h * ld, d, ld);
      });
    }
  }
#endif
  for (; j < j1; ++j) {  // the rest, and machines without AVX2
    const float* kj = kp + j * d;
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = qs + g * d;
      float s = 0.0f;
      for (int64_t i = 0; i < d; ++i) s += qg[i] * kj[i];
      sc[g * ld + j] = s;
    }
  }
}

// acc[g] += sum over j0 <= j < j1 of sc[g * ld + j] * v_j for one page (v: its [bs, d] rows).
inline void page_values(const float* sc, const float* vp, float* acc, int64_t group, int64_t d,
                        int64_t ld, int64_t j0, int64_t j1) {
#if defined(__AVX2__) && defined(__FMA__)
  if (d % 64 == 0) {
    for_row_blocks(group, [&](int64_t g, int64_t n) {
      const float* s = sc + g * ld;
      float* a = acc + g * d;
      for (int64_t c = 0; c < d; c += 64) {
        if (n == 3) {
          values_64<3>(s, vp, a, d, ld, c, j0, j1);
        } else if (n == 2) {
          values_64<2>(s, vp, a, d, ld, c, j0, j1);
        } else {
          for (int64_t h = 0; h < n; ++h) values_64<1>(s + h * ld, vp, a + h * d, d, ld, c, j0, j1);
        }
      }
    });
    return;
  }
#endif
  for (int64_t j = j0; j < j1; ++j) {  // one V row load serves every query head
    const float* vj = vp + j * d;
    for (int64_t g = 0; g < group; ++g) {
      const float w = sc[g * ld + j];
      float* ag = acc + g * d;
      for (int64_t i = 0; i < d; ++i) ag[i] += w * vj[i];
    }
  }
}

// dst[i] = src[i] * scale for i < d: one int8 pool row dequantized.
inline void dequantize_row(const int8_t* src, float scale, float* dst, int64_t d) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 s16 = _mm512_set1_ps(scale);
  for (; i + 16 <= d; i += 16) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm512_storeu_ps(dst + i, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), s16));
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 s8 = _mm256_set1_ps(scale);
  for (; i + 8 <= d; i += 8) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), s8));
  }
#endif
  for (; i < d; ++i) dst[i] = static_cast<float>(src[i]) * scale;
}

// Rows [j0, j1) of one page of `pool` (element offset `at`, rows of d) as float32 rows indexed
// from the page's start: a float32 pool's own rows, or an int8 pool's rows dequantized with
// their tokens' scales (index at / d: the scales' layout is the pool's without D) into `buf`.
inline const float* page_rows(const Problem& p, const char* pool, const float* scale,
                              int64_t at, int64_t j0, int64_t j1, float* buf) {
  if (scale == nullptr) return reinterpret_cast<const float*>(pool) + at;
  const int8_t* rows = reinterpret_cast<const int8_t*>(pool) + at;
  for (int64_t j = j0; j < j1; ++j) {
    dequantize_row(rows + j * p.d, scale[at / p.d + j], buf + j * p.d, p.d);
  }
  return buf;
}

// One unit's working rows: scaled queries, accumulators, one tile's scores, running max and
// softmax denominator, and one dequantized page (int8 pools).
struct UnitScratch {
  std::vector<float> qs, acc, sc, mx, den, page;
};

// One unit: query tokens [r0, r1) of sequence u.seq for the query heads of KV head u.head (one
// token for a decode row, up to kBlockRows of a prefill chunk), read page by page over the
// positions any of them may see, with an online softmax per (token, query head) row. Every
// row's K/V page is loaded once for all of the unit's rows.
// kD is the head dim when known at compile time (0: read it from the problem).
template <int64_t kD>
void run_unit(const Problem& p, const Unit& u) {
  const int64_t d = kD ? kD : p.d;
  const int64_t group = p.hq / p.hkv, bs = p.bs;
  const int64_t q_start = p.cu[u.seq], q_len = p.cu[u.seq + 1] - q_start;
  const int64_t kv_len = p.kv[u.seq];
  const int64_t rows = (u.r1 - u.r0) * group;  // row m: token r0 + m / group, head m % group
  // Token t sees positions [first(t), ctx(t)]: its causal limit and its window's start.
  auto ctx = [&](int64_t t) { return kv_len - q_len + t; };
  auto first = [&](int64_t t) {
    return p.window > 0 ? std::max<int64_t>(ctx(t) - p.window + 1, 0) : int64_t{0};
  };
  // Per-thread buffers, grown once and reused by every unit the thread runs: a step runs
  // hundreds of units per layer, most of them one decode row.
  thread_local UnitScratch scratch;
  auto& [qs, acc, sc, mx, den, page_buf] = scratch;
  qs.resize(rows * d);
  page_buf.resize(p.k_scale ? bs * d : 0);
  sc.resize(rows * kTilePages * bs);
  acc.assign(rows * d, 0.0f);
  mx.assign(rows, -std::numeric_limits<float>::infinity());
  den.assign(rows, 0.0f);
  for (int64_t t = u.r0; t < u.r1; ++t) {
    const float* src = p.q + ((q_start + t) * p.hq + u.head * group) * d;
    float* dst = qs.data() + (t - u.r0) * group * d;
    for (int64_t i = 0; i < group * d; ++i) dst[i] = src[i] * p.scale;
  }
  const int32_t* table = p.tables + u.seq * p.mb;
  const int64_t page_stride = p.hkv * bs * d;
  const int64_t layer_offset = p.layer * p.nb * page_stride + u.head * bs * d;
  const int64_t lo = first(u.r0), hi = ctx(u.r1 - 1) + 1;  // what any row sees; hi <= kv_len
  const int64_t last_page = (hi - 1) / bs;
  const int64_t ts = kTilePages * bs;  // row stride of sc: one tile's positions
  // The positions of a page some row sees: [j0, j1). Nothing outside them is read, and each of
  // them is a written slot (below kv_len), so it is finite.
  auto seen = [&](int64_t page) {
    const int64_t base = page * bs;
    return std::pair<int64_t, int64_t>{std::max<int64_t>(lo - base, 0),
                                       std::min<int64_t>(hi - base, bs)};
  };
  for (int64_t tile = lo / bs; tile <= last_page; tile += kTilePages) {
    const int64_t tile_end = std::min(last_page + 1, tile + kTilePages);  // pages [tile, end)
    // Scores of every page of the tile, then one softmax step per row over the tile's
    // positions, then the weighted values page by page: a row's bookkeeping (max, rescale)
    // is paid once per tile rather than once per page.
    for (int64_t page = tile; page < tile_end; ++page) {
      const int64_t at = layer_offset + table[page] * page_stride;
      // Pages are scattered in the pool, so the hardware prefetcher cannot run ahead across
      // them: ask for the next pages' K and V while this one is computed. Each page is asked
      // for again at every page until it is reached: asking once per page (at 2-6 pages
      // ahead) was as slow as not asking at all. They go to L2 (hint 2), not L1: 4 pages of a
      // SmolLM2 head's K and V are 32 KiB, a whole L1 on many cores, and into L1 a 32 x 512
      // decode's 30 layers took 57-66 ms on an AMD Zen 4 against 30-32 ms into L2 (2 pages
      // ahead: 34-39 ms; 6: 35 ms). On a Zen 5, with a 48 KiB L1, into L1 was 1.2-1.3x faster
      // than into L2 at 2 pages ahead.
      for (int64_t ahead = 1; ahead <= kPrefetchPages && page + ahead <= last_page; ++ahead) {
        const int64_t next = (layer_offset + table[page + ahead] * page_stride) * p.itemsize;
        for (int64_t b = 0; b < bs * d * p.itemsize; b += kLineBytes) {
          __builtin_prefetch(p.k + next + b, 0, 2);
          __builtin_prefetch(p.v + next + b, 0, 2);
        }
      }
      const auto [j0, j1] = seen(page);
      const float* kp = page_rows(p, p.k, p.k_scale, at, j0, j1, page_buf.data());
      page_scores(qs.data(), kp, sc.data() + (page - tile) * bs, rows, d, ts, j0, j1);
    }
    // The tile's positions some row sees, [t0, t1), relative to the tile's first position.
    const int64_t tile_base = tile * bs;
    const int64_t t0 = std::max<int64_t>(lo - tile_base, 0);
    const int64_t t1 = std::min<int64_t>(hi - tile_base, (tile_end - tile) * bs);
    for (int64_t m = 0; m < rows; ++m) {
      const int64_t t = u.r0 + m / group;
      float* sm = sc.data() + m * ts;
      // This row's own visible part of the tile: [a, b); the rest weighs 0.
      const int64_t a = std::max<int64_t>(t0, first(t) - tile_base);
      const int64_t b = std::min<int64_t>(t1, ctx(t) + 1 - tile_base);
      for (int64_t j = t0; j < std::min(a, t1); ++j) sm[j] = 0.0f;
      for (int64_t j = std::max(b, t0); j < t1; ++j) sm[j] = 0.0f;
      if (a >= b) continue;
      if (p.soft_cap > 0.0f) {
        for (int64_t j = a; j < b; ++j) sm[j] = p.soft_cap * std::tanh(sm[j] / p.soft_cap);
      }
      float tile_max = sm[a];
      for (int64_t j = a + 1; j < b; ++j) tile_max = std::max(tile_max, sm[j]);
      const float m_new = std::max(mx[m], tile_max);
      float sum = 0.0f;
      for (int64_t j = a; j < b; ++j) {
        sm[j] = fast_exp(sm[j] - m_new);
        sum += sm[j];
      }
      // Rescale what was accumulated only when the max moved (after the first tiles, rarely).
      if (den[m] > 0.0f && m_new != mx[m]) {
        const float alpha = fast_exp(mx[m] - m_new);
        den[m] *= alpha;
        float* am = acc.data() + m * d;
        for (int64_t i = 0; i < d; ++i) am[i] *= alpha;
      }
      mx[m] = m_new;
      den[m] += sum;
    }
    for (int64_t page = tile; page < tile_end; ++page) {
      const auto [j0, j1] = seen(page);
      const int64_t at = layer_offset + table[page] * page_stride;
      const float* vp = page_rows(p, p.v, p.v_scale, at, j0, j1, page_buf.data());
      page_values(sc.data() + (page - tile) * bs, vp, acc.data(), rows, d, ts, j0, j1);
    }
  }
  for (int64_t t = u.r0; t < u.r1; ++t) {
    float* dst = p.out + ((q_start + t) * p.hq + u.head * group) * d;
    const int64_t m0 = (t - u.r0) * group;
    for (int64_t g = 0; g < group; ++g) {
      const float inv = den[m0 + g] > 0.0f ? 1.0f / den[m0 + g] : 0.0f;
      for (int64_t i = 0; i < d; ++i) dst[g * d + i] = acc[(m0 + g) * d + i] * inv;
    }
  }
}

void run_unit_any(const Problem& p, const Unit& u) {
  switch (p.d) {
    case 64: return run_unit<64>(p, u);
    case 128: return run_unit<128>(p, u);
    default: return run_unit<0>(p, u);
  }
}

// The call's sizes and pointers (the pools' and scales' set by the caller), checked; then
// every unit of the step over XLA's threads.
ffi::Error Attend(ffi::ThreadPool pool, Problem& p, ffi::Buffer<ffi::F32> q,
                  ffi::Span<const int64_t> pd, ffi::Buffer<ffi::S32> block_tables,
                  ffi::Buffer<ffi::S32> cu_q_lens, ffi::Buffer<ffi::S32> kv_lens,
                  ffi::Buffer<ffi::S32> num_seqs, ffi::Buffer<ffi::S32> layer,
                  ffi::Result<ffi::Buffer<ffi::F32>> out, float sm_scale, int64_t sliding_window,
                  float soft_cap) {
  const auto qd = q.dimensions();
  const auto td = block_tables.dimensions();
  if (qd.size() != 3 || pd.size() != 5 || td.size() != 2) {
    return ffi::Error::InvalidArgument("ragged attention: unexpected ranks");
  }
  if (qd[1] % pd[2]) {
    return ffi::Error::InvalidArgument(
        "native ragged attention: query heads must be a multiple of KV heads");
  }
  p.q = q.typed_data();
  p.tables = block_tables.typed_data();
  p.cu = cu_q_lens.typed_data();
  p.kv = kv_lens.typed_data();
  p.out = out->typed_data();
  p.hq = qd[1];
  p.d = qd[2];
  p.nb = pd[1];
  p.hkv = pd[2];
  p.bs = pd[3];
  p.mb = td[1];
  p.layer = layer.typed_data()[0];
  p.scale = sm_scale;
  p.soft_cap = soft_cap;
  p.window = sliding_window;
  std::memset(p.out, 0, sizeof(float) * qd[0] * qd[1] * qd[2]);
  const int64_t n = num_seqs.typed_data()[0];
  std::vector<Unit> units;
  for (int64_t s = 0; s < n; ++s) {
    const int64_t q_len = p.cu[s + 1] - p.cu[s];
    if (q_len < 1 || p.kv[s] < q_len) continue;  // no rows, or a malformed sequence
    // Later blocks of a chunk see more context: queued first, they balance the threads.
    for (int64_t r1 = q_len; r1 > 0; r1 -= kBlockRows) {
      for (int64_t h = 0; h < p.hkv; ++h) {
        units.push_back({s, h, std::max<int64_t>(r1 - kBlockRows, 0), r1});
      }
    }
  }
  jserve::run_units(pool, static_cast<int64_t>(units.size()),
                    [&](int64_t i) { run_unit_any(p, units[i]); });
  return ffi::Error::Success();
}

ffi::Error RaggedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                               ffi::Buffer<ffi::F32> k_pool, ffi::Buffer<ffi::F32> v_pool,
                               ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> cu_q_lens,
                               ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> num_seqs,
                               ffi::Buffer<ffi::S32> layer, ffi::Result<ffi::Buffer<ffi::F32>> out,
                               float sm_scale, int64_t sliding_window, float soft_cap) {
  Problem p{};
  p.k = reinterpret_cast<const char*>(k_pool.typed_data());
  p.v = reinterpret_cast<const char*>(v_pool.typed_data());
  p.itemsize = sizeof(float);
  return Attend(pool, p, q, k_pool.dimensions(), block_tables, cu_q_lens, kv_lens, num_seqs,
                layer, out, sm_scale, sliding_window, soft_cap);
}

ffi::Error RaggedAttentionInt8Impl(
    ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::S8> k_pool,
    ffi::Buffer<ffi::S8> v_pool, ffi::Buffer<ffi::F32> k_scales, ffi::Buffer<ffi::F32> v_scales,
    ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> cu_q_lens,
    ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> num_seqs, ffi::Buffer<ffi::S32> layer,
    ffi::Result<ffi::Buffer<ffi::F32>> out, float sm_scale, int64_t sliding_window,
    float soft_cap) {
  const auto pd = k_pool.dimensions();
  if (k_scales.element_count() * pd.back() != k_pool.element_count() ||
      v_scales.element_count() != k_scales.element_count()) {
    return ffi::Error::InvalidArgument(
        "native ragged attention: int8 pools need one scale per (layer, block, head, token)");
  }
  Problem p{};
  p.k = reinterpret_cast<const char*>(k_pool.typed_data());
  p.v = reinterpret_cast<const char*>(v_pool.typed_data());
  p.k_scale = k_scales.typed_data();
  p.v_scale = v_scales.typed_data();
  p.itemsize = 1;
  return Attend(pool, p, q, pd, block_tables, cu_q_lens, kv_lens, num_seqs, layer, out, sm_scale,
                sliding_window, soft_cap);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JserveRaggedAttentionF32, RaggedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_pool
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v_pool
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // cu_q_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Attr<float>("sm_scale")
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<float>("soft_cap"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JserveRaggedAttentionInt8, RaggedAttentionInt8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::S8>>()   // k_pool
                                  .Arg<ffi::Buffer<ffi::S8>>()   // v_pool
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_scales
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v_scales
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // cu_q_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Attr<float>("sm_scale")
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<float>("soft_cap"));
