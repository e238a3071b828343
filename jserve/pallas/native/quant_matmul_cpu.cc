// y = x @ w[layer] with w in GGUF's quantized blocks, packed in column panels: the CPU model's
// projections and output head over weights that stay quantized in memory, as XLA FFI custom
// calls. A second handler gathers columns of such a weight: the embedding lookup of a tied
// table.
//
// The weight is one self-describing byte array (jserve.pallas.quant_blocks packs it at load):
//   header  int64[4]: magic, L (layers), P (panels of 16 columns), K (input features)
//   table   int64[L * P]: panel (l, j)'s byte offset in the array << 8 | its format code
//   panels  each 16 columns of one layer's [K, N] weight in one format, its K rows in groups
//           (32 or 16 k, a group sharing its scales), each group of the 16 columns contiguous:
//           its scales as 16 lanes, then its quants with the 16 columns of each k (or pair or
//           quad of k) side by side, so one load gives one k's 16 columns.
// Formats may differ between panels and layers (a Q4_K_M file mixes Q4_K and Q6_K within a
// fused projection), never within a panel. One more format is jserve's own, not GGUF's: INT8,
// --quantization int8's per-channel int8 weights (Q8_0's layout with float32 scales).
//
// The kernel makes float32 weights exactly as gguf.quants dequantizes them (every product of
// a scale and a quant below is exact in float32 but Q6_K's and INT8's, which round once, as
// numpy's float32 product does), and each column sums its products one FMA per k in k order, as
// native/packed_matmul_cpu.cc does over the dequantized float32 weight: the two kernels give
// the same bits, so serving the blocks never changes a greedy token. (Quantizing x to int8 per
// block and taking integer dot products, llama.cpp's way, would change the sums.) A register
// block of MR rows x NP panels, its accumulators held over all of K, turns each k's quants
// into weights in registers as it goes: at a few tokens a step is bound by reading weights, and
// blocks are 3.8 (Q8_0) to 7.1 (Q4_0, Q4_K) times fewer bytes than float32; at one or two rows
// a block takes four panels (AVX-512), so four chains of FMAs are in flight. Past one register block of rows, the first block also
// keeps the weights it makes, as float32 panels in a buffer that stays in L1/L2 (the stores and
// the dequantization mostly use ports its FMAs leave free), and the float32 kernel's own block
// (float_block.h) reads them for the chunk's other rows, so the dequantization is shared.
// Rows of x go in chunks that fit L2 and work units of (row chunk, group of panels) run over
// XLA's intra-op threads (parallel_units.h), each writing its own columns of y. The first row
// block of a chunk prefetches the next panels into L2. Rows past `rows` (a step's padding) are
// zeros.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#endif

#include "float_block.h"
#include "parallel_units.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

namespace f32 = jserve::f32;

constexpr int64_t kPanel = 16;                   // columns per panel: one vector of 16 lanes
constexpr int64_t kMagic = 0x3142515645534a;     // "JSEVQB1", little-endian
constexpr int64_t kHeaderWords = 4;              // magic, L, P, K
constexpr int64_t kChunkBytes = 512 << 10;       // a row chunk of x stays within L2
constexpr int64_t kUnitsPerThread = 4;           // slack, so a late pool thread costs little
constexpr int kBlockPanels = 2;                  // NP of a full register block
// At one or two rows the FMAs of a panel's column form one chain of latency-bound steps (k by
// k), so a block of kFewRows rows takes kFewRowsPanels panels: more chains in flight.
constexpr int kFewRows = 2;
#if defined(__AVX512F__)
constexpr int kFewRowsPanels = 4;  // 8 accumulators, 4 panels' scales and weights: 32 zmm
#else
constexpr int kFewRowsPanels = kBlockPanels;
#endif
#if defined(__AVX512F__)
constexpr int kRows = 8;  // 16 accumulators, a panel's weights and both panels' scales: 32 zmm
#else
constexpr int kRows = 4;
#endif

// ---- 16 lanes, one per column of a panel, in this build's ISA ----------------------------
#if defined(__AVX512F__)
using VF = __m512;
using VI = __m512i;
inline VF zero() { return _mm512_setzero_ps(); }
inline __m128i bytes16(const uint8_t* p) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}
inline VI load_u8(const uint8_t* p) { return _mm512_cvtepu8_epi32(bytes16(p)); }
inline VI load_i8(const uint8_t* p) { return _mm512_cvtepi8_epi32(bytes16(p)); }
inline VF load_f16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline VF load_f32(const uint8_t* p) { return _mm512_loadu_ps(reinterpret_cast<const float*>(p)); }
inline VF to_float(VI v) { return _mm512_cvtepi32_ps(v); }
inline VI low_bits(VI v, int mask) { return _mm512_and_si512(v, _mm512_set1_epi32(mask)); }
template <int N>
inline VI shr(VI v) { return _mm512_srli_epi32(v, N); }
template <int N>
inline VI shl(VI v) { return _mm512_slli_epi32(v, N); }
inline VI either(VI a, VI b) { return _mm512_or_si512(a, b); }
inline VI minus(VI v, int c) { return _mm512_sub_epi32(v, _mm512_set1_epi32(c)); }
inline VF mul(VF a, VF b) { return _mm512_mul_ps(a, b); }
inline VF mul_add(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }  // a b + c, one rounding
inline VF mul_sub(VF a, VF b, VF c) { return _mm512_fmsub_ps(a, b, c); }  // a b - c, one rounding
inline VF times_x(float x, VF w, VF acc) { return _mm512_fmadd_ps(_mm512_set1_ps(x), w, acc); }
inline void store(float* p, VF v) { _mm512_storeu_ps(p, v); }
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
struct VF {
  __m256 lo, hi;
};
struct VI {
  __m256i lo, hi;
};
inline VF zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline __m128i bytes16(const uint8_t* p) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}
inline VI load_u8(const uint8_t* p) {
  const __m128i b = bytes16(p);
  return {_mm256_cvtepu8_epi32(b), _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8))};
}
inline VI load_i8(const uint8_t* p) {
  const __m128i b = bytes16(p);
  return {_mm256_cvtepi8_epi32(b), _mm256_cvtepi8_epi32(_mm_srli_si128(b, 8))};
}
inline VF load_f16(const uint8_t* p) {
  return {_mm256_cvtph_ps(bytes16(p)), _mm256_cvtph_ps(bytes16(p + 16))};
}
inline VF load_f32(const uint8_t* p) {
  const float* f = reinterpret_cast<const float*>(p);
  return {_mm256_loadu_ps(f), _mm256_loadu_ps(f + 8)};
}
inline VF to_float(VI v) { return {_mm256_cvtepi32_ps(v.lo), _mm256_cvtepi32_ps(v.hi)}; }
inline VI low_bits(VI v, int mask) {
  const __m256i m = _mm256_set1_epi32(mask);
  return {_mm256_and_si256(v.lo, m), _mm256_and_si256(v.hi, m)};
}
template <int N>
inline VI shr(VI v) { return {_mm256_srli_epi32(v.lo, N), _mm256_srli_epi32(v.hi, N)}; }
template <int N>
inline VI shl(VI v) { return {_mm256_slli_epi32(v.lo, N), _mm256_slli_epi32(v.hi, N)}; }
inline VI either(VI a, VI b) { return {_mm256_or_si256(a.lo, b.lo), _mm256_or_si256(a.hi, b.hi)}; }
inline VI minus(VI v, int c) {
  const __m256i m = _mm256_set1_epi32(c);
  return {_mm256_sub_epi32(v.lo, m), _mm256_sub_epi32(v.hi, m)};
}
inline VF mul(VF a, VF b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline VF mul_add(VF a, VF b, VF c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline VF mul_sub(VF a, VF b, VF c) {
  return {_mm256_fmsub_ps(a.lo, b.lo, c.lo), _mm256_fmsub_ps(a.hi, b.hi, c.hi)};
}
inline VF times_x(float x, VF w, VF acc) {
  const __m256 b = _mm256_set1_ps(x);
  return {_mm256_fmadd_ps(b, w.lo, acc.lo), _mm256_fmadd_ps(b, w.hi, acc.hi)};
}
inline void store(float* p, VF v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
#else
// Plain arrays the compiler vectorizes as it can; each lane computes what the vector builds do,
// and `times_x` is the f32 kernel's portable `acc += x * w`, in k order (k_order.h).
#include "k_order.h"
struct VF {
  float v[kPanel];
};
struct VI {
  int32_t v[kPanel];
};
inline VF zero() { return VF{}; }
inline VI load_u8(const uint8_t* p) {
  VI r;
  for (int c = 0; c < kPanel; ++c) r.v[c] = p[c];
  return r;
}
inline VI load_i8(const uint8_t* p) {
  VI r;
  for (int c = 0; c < kPanel; ++c) r.v[c] = static_cast<int8_t>(p[c]);
  return r;
}
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in float32
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return sign ? -magnitude : magnitude;
  }
  const uint32_t bits = exponent == 0x1f ? sign | 0x7f800000u | (mantissa << 13)
                                         : sign | ((exponent + 112) << 23) | (mantissa << 13);
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline VF load_f16(const uint8_t* p) {
  VF r;
  for (int c = 0; c < kPanel; ++c) {
    uint16_t h;
    std::memcpy(&h, p + 2 * c, sizeof h);
    r.v[c] = half_to_float(h);
  }
  return r;
}
inline VF load_f32(const uint8_t* p) {
  VF r;
  std::memcpy(r.v, p, sizeof r.v);
  return r;
}
inline VF to_float(VI a) {
  VF r;
  for (int c = 0; c < kPanel; ++c) r.v[c] = static_cast<float>(a.v[c]);
  return r;
}
inline VI low_bits(VI a, int mask) {
  for (int c = 0; c < kPanel; ++c) a.v[c] &= mask;
  return a;
}
template <int N>
inline VI shr(VI a) {
  for (int c = 0; c < kPanel; ++c) a.v[c] = static_cast<int32_t>(static_cast<uint32_t>(a.v[c]) >> N);
  return a;
}
template <int N>
inline VI shl(VI a) {
  for (int c = 0; c < kPanel; ++c) a.v[c] = static_cast<int32_t>(static_cast<uint32_t>(a.v[c]) << N);
  return a;
}
inline VI either(VI a, VI b) {
  for (int c = 0; c < kPanel; ++c) a.v[c] |= b.v[c];
  return a;
}
inline VI minus(VI a, int k) {
  for (int c = 0; c < kPanel; ++c) a.v[c] -= k;
  return a;
}
inline VF mul(VF a, VF b) {
  for (int c = 0; c < kPanel; ++c) a.v[c] *= b.v[c];
  return a;
}
inline VF mul_add(VF a, VF b, VF d) {
  for (int c = 0; c < kPanel; ++c) a.v[c] = a.v[c] * b.v[c] + d.v[c];
  return a;
}
inline VF mul_sub(VF a, VF b, VF d) {
  for (int c = 0; c < kPanel; ++c) a.v[c] = a.v[c] * b.v[c] - d.v[c];
  return a;
}
inline VF times_x(float x, VF w, VF acc) {
  for (int c = 0; c < kPanel; ++c) acc.v[c] += x * w.v[c];
  return acc;
}
inline void store(float* p, VF v) { std::copy(v.v, v.v + kPanel, p); }
#endif

// ---- the formats: a group's scales, and its weights kStep k at a time ----------------------
// Each format: kCode (jserve.pallas.quant_blocks.BlockFormat's code), kGroupK (k per group of
// scales), kSuperK (k per unit of the packed layout: a K-quant's super-block), kSuperBytes (its
// bytes in a panel), kStep (k per weights() call), open(panel, g) -> Group, weights(group, s,
// w0..w3): the weights of k = g * kGroupK + s * kStep + i as wi.

struct Q4_0 {  // per group: d[16] f16, then 16 pairs of k: byte c = q[2i][c] | q[2i + 1][c] << 4
  static constexpr int kCode = 1, kGroupK = 32, kSuperK = 32, kStep = 2;
  static constexpr int64_t kSuperBytes = 32 + 256;
  struct Group {
    VF d;
    const uint8_t* q;
  };
  static Group open(const uint8_t* panel, int64_t g) {
    const uint8_t* p = panel + g * kSuperBytes;
    return {load_f16(p), p + 32};
  }
  static void weights(const Group& G, int s, VF& w0, VF& w1, VF&, VF&) {
    const VI v = load_u8(G.q + 16 * s);
    w0 = mul(G.d, to_float(minus(low_bits(v, 15), 8)));
    w1 = mul(G.d, to_float(minus(shr<4>(v), 8)));
  }
};

struct Q4_1 {  // per group: d[16], m[16] f16, then the pairs as Q4_0's: w = d q + m
  static constexpr int kCode = 2, kGroupK = 32, kSuperK = 32, kStep = 2;
  static constexpr int64_t kSuperBytes = 64 + 256;
  struct Group {
    VF d, m;
    const uint8_t* q;
  };
  static Group open(const uint8_t* panel, int64_t g) {
    const uint8_t* p = panel + g * kSuperBytes;
    return {load_f16(p), load_f16(p + 32), p + 64};
  }
  static void weights(const Group& G, int s, VF& w0, VF& w1, VF&, VF&) {
    const VI v = load_u8(G.q + 16 * s);
    w0 = mul_add(G.d, to_float(low_bits(v, 15)), G.m);
    w1 = mul_add(G.d, to_float(shr<4>(v)), G.m);
  }
};

struct Q8_0 {  // per group: d[16] f16, then q[32][16] int8: w = d q
  static constexpr int kCode = 3, kGroupK = 32, kSuperK = 32, kStep = 2;
  static constexpr int64_t kSuperBytes = 32 + 512;
  struct Group {
    VF d;
    const uint8_t* q;
  };
  static Group open(const uint8_t* panel, int64_t g) {
    const uint8_t* p = panel + g * kSuperBytes;
    return {load_f16(p), p + 32};
  }
  static void weights(const Group& G, int s, VF& w0, VF& w1, VF&, VF&) {
    w0 = mul(G.d, to_float(load_i8(G.q + 32 * s)));
    w1 = mul(G.d, to_float(load_i8(G.q + 32 * s + 16)));
  }
};

// jserve's --quantization int8 (not a GGUF type): Q8_0's layout with float32 scales and groups
// of 16 k (K need only be a multiple of 16), so the quantizer's float32 scale of each group of
// 16 k of a column is kept as it is.
struct INT8 {  // per group: d[16] f32, then q[16][16] int8: w = d q (one float32 rounding)
  static constexpr int kCode = 6, kGroupK = 16, kSuperK = 16, kStep = 2;
  static constexpr int64_t kSuperBytes = 64 + 256;
  using Group = Q8_0::Group;  // a scale and the quants, read as Q8_0 reads them
  static Group open(const uint8_t* panel, int64_t g) {
    const uint8_t* p = panel + g * kSuperBytes;
    return {load_f32(p), p + 64};
  }
  static void weights(const Group& G, int s, VF& w0, VF& w1, VF& w2, VF& w3) {
    Q8_0::weights(G, s, w0, w1, w2, w3);
  }
};

// Per super-block of 256 k: d[16], dmin[16] f16, sc[8][16] and mn[8][16] (6-bit, one byte each),
// then 128 pairs of k as Q4_0's. Group j (32 k) has scale d sc[j] and offset dmin mn[j]:
// w = (d sc) q - dmin mn.
struct Q4_K {
  static constexpr int kCode = 4, kGroupK = 32, kSuperK = 256, kStep = 2;
  static constexpr int64_t kSuperBytes = 64 + 256 + 2048;
  struct Group {
    VF scale, offset;
    const uint8_t* q;
  };
  static Group open(const uint8_t* panel, int64_t g) {
    const uint8_t* p = panel + g / 8 * kSuperBytes;
    const int64_t j = g % 8;
    const VF scale = mul(load_f16(p), to_float(load_u8(p + 64 + 16 * j)));
    const VF offset = mul(load_f16(p + 32), to_float(load_u8(p + 192 + 16 * j)));
    return {scale, offset, p + 320 + 256 * j};
  }
  static void weights(const Group& G, int s, VF& w0, VF& w1, VF&, VF&) {
    const VI v = load_u8(G.q + 16 * s);
    w0 = mul_sub(G.scale, to_float(low_bits(v, 15)), G.offset);
    w1 = mul_sub(G.scale, to_float(shr<4>(v)), G.offset);
  }
};

// Per super-block of 256 k: d[16] f16, sc[16][16] int8, the low 4 bits of the quants as 128
// pairs of k (as Q4_0's), then their high 2 bits as 64 quads of k (byte c = h[4i][c] |
// h[4i + 1][c] << 2 | h[4i + 2][c] << 4 | h[4i + 3][c] << 6). Group j (16 k) has scale d sc[j]:
// w = (d sc) (q - 32).
struct Q6_K {
  static constexpr int kCode = 5, kGroupK = 16, kSuperK = 256, kStep = 4;
  static constexpr int64_t kSuperBytes = 32 + 256 + 2048 + 1024;
  struct Group {
    VF scale;
    const uint8_t *low, *high;
  };
  static Group open(const uint8_t* panel, int64_t g) {
    const uint8_t* p = panel + g / 16 * kSuperBytes;
    const int64_t j = g % 16;
    const VF scale = mul(load_f16(p), to_float(load_i8(p + 32 + 16 * j)));
    return {scale, p + 288 + 128 * j, p + 2336 + 64 * j};
  }
  static VF weight(VF scale, VI low4, VI high2) {
    return mul(scale, to_float(minus(either(low4, shl<4>(high2)), 32)));
  }
  static void weights(const Group& G, int s, VF& w0, VF& w1, VF& w2, VF& w3) {
    const VI h = load_u8(G.high + 16 * s);
    const VI a = load_u8(G.low + 32 * s), b = load_u8(G.low + 32 * s + 16);
    w0 = weight(G.scale, low_bits(a, 15), low_bits(h, 3));
    w1 = weight(G.scale, shr<4>(a), low_bits(shr<2>(h), 3));
    w2 = weight(G.scale, low_bits(b, 15), low_bits(shr<4>(h), 3));
    w3 = weight(G.scale, shr<4>(b), shr<6>(h));
  }
};

template <class F>
constexpr int64_t panel_bytes(int64_t k) {
  return k / F::kSuperK * F::kSuperBytes;
}

// The weights w0.. of k, k + 1, .. (F::kStep of them) into a float32 panel [K, 16].
template <class F>
inline void keep_weights(float* panel, int64_t k, VF w0, VF w1, VF w2, VF w3) {
  float* row = panel + k * kPanel;
  store(row, w0);
  if constexpr (F::kStep > 1) store(row + kPanel, w1);
  if constexpr (F::kStep > 2) store(row + 2 * kPanel, w2), store(row + 3 * kPanel, w3);
}

// ---- the register block ------------------------------------------------------------------
// out[r, 16 p + c] = x[r, :] @ panel p's column c, for r < MR and p < NP. The accumulators are
// named variables: GCC keeps a vector array on the stack and stores it back on every k.
#define JSERVE_FMA(r, p, i)                                                       \
  if constexpr (MR > r) a##r##_##p = times_x(xk[r * ldx + i], w##i, a##r##_##p);
#define JSERVE_K(p, i)                                                                       \
  if constexpr (F::kStep > i) {                                                              \
    JSERVE_FMA(0, p, i) JSERVE_FMA(1, p, i) JSERVE_FMA(2, p, i) JSERVE_FMA(3, p, i)          \
    JSERVE_FMA(4, p, i) JSERVE_FMA(5, p, i) JSERVE_FMA(6, p, i) JSERVE_FMA(7, p, i)          \
  }
#define JSERVE_PANEL(p)                                                           \
  if constexpr (NP > p) {                                                         \
    VF w0 = zero(), w1 = w0, w2 = w0, w3 = w0;                                    \
    F::weights(group##p, s, w0, w1, w2, w3);                                      \
    if constexpr (KEEP) keep_weights<F>(kept + p * K * kPanel, k, w0, w1, w2, w3);  \
    JSERVE_K(p, 0) JSERVE_K(p, 1) JSERVE_K(p, 2) JSERVE_K(p, 3)                   \
  }
#define JSERVE_STORE(r)                                                     \
  if constexpr (MR > r) {                                                   \
    store(out + r * ldo, a##r##_0);                                         \
    if constexpr (NP > 1) store(out + r * ldo + kPanel, a##r##_1);          \
    if constexpr (NP > 2) store(out + r * ldo + 2 * kPanel, a##r##_2);      \
    if constexpr (NP > 3) store(out + r * ldo + 3 * kPanel, a##r##_3);      \
  }
// With KEEP, the weights made on the way are also stored in `kept` as the NP panels of the
// float32 kernel's layout ([K, 16] each), for the float32 block to read for more rows.
template <class F, int MR, int NP, bool KEEP>
void block(const float* x, int64_t ldx, const uint8_t* const* panels, int64_t K, float* out,
           int64_t ldo, const uint8_t* next, int64_t next_bytes, float* kept) {
  static_assert(MR <= 8 && NP <= 4 && MR * NP <= 16 && !(KEEP && NP > 2));
  VF a0_0 = zero(), a0_1 = a0_0, a1_0 = a0_0, a1_1 = a0_0, a2_0 = a0_0, a2_1 = a0_0;
  VF a3_0 = a0_0, a3_1 = a0_0, a4_0 = a0_0, a4_1 = a0_0, a5_0 = a0_0, a5_1 = a0_0;
  VF a6_0 = a0_0, a6_1 = a0_0, a7_0 = a0_0, a7_1 = a0_0;
  VF a0_2 = a0_0, a0_3 = a0_0, a1_2 = a0_0, a1_3 = a0_0, a2_2 = a0_0, a2_3 = a0_0;
  VF a3_2 = a0_0, a3_3 = a0_0, a4_2 = a0_0, a4_3 = a0_0, a5_2 = a0_0, a5_3 = a0_0;
  VF a6_2 = a0_0, a6_3 = a0_0, a7_2 = a0_0, a7_3 = a0_0;  // NP 4 takes at most 4 rows
  const int64_t groups = K / F::kGroupK;
  const int64_t ahead = next ? (next_bytes + groups - 1) / groups : 0;  // of `next`, a group
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t b = 0; b < ahead; b += 64) __builtin_prefetch(next + g * ahead + b, 0, 2);
    const typename F::Group group0 = F::open(panels[0], g);
    const typename F::Group group1 = NP > 1 ? F::open(panels[1], g) : group0;
    const typename F::Group group2 = NP > 2 ? F::open(panels[2], g) : group0;
    const typename F::Group group3 = NP > 3 ? F::open(panels[3], g) : group0;
    for (int s = 0; s < F::kGroupK / F::kStep; ++s) {
      const int64_t k = g * F::kGroupK + s * F::kStep;
      const float* xk = x + k;
      JSERVE_PANEL(0) JSERVE_PANEL(1) JSERVE_PANEL(2) JSERVE_PANEL(3)
    }
  }
  JSERVE_STORE(0) JSERVE_STORE(1) JSERVE_STORE(2) JSERVE_STORE(3)
  JSERVE_STORE(4) JSERVE_STORE(5) JSERVE_STORE(6) JSERVE_STORE(7)
}
#undef JSERVE_FMA
#undef JSERVE_K
#undef JSERVE_PANEL
#undef JSERVE_STORE

// block<rows, NP, KEEP>, for the last block of a chunk, which may be short.
template <class F, int MR, int NP, bool KEEP>
void block_of_rows(int64_t rows, const float* x, int64_t ldx, const uint8_t* const* panels,
                   int64_t K, float* out, int64_t ldo, const uint8_t* next, int64_t next_bytes,
                   float* kept) {
  if (rows == MR) {
    block<F, MR, NP, KEEP>(x, ldx, panels, K, out, ldo, next, next_bytes, kept);
  } else if constexpr (MR > 1) {
    block_of_rows<F, MR - 1, NP, KEEP>(rows, x, ldx, panels, K, out, ldo, next, next_bytes,
                                       kept);
  }
}

// ---- the weight's header and table -------------------------------------------------------

struct Weight {
  const uint8_t* base;
  const int64_t* table;  // this layer's P entries
  int64_t layers, panels, k;

  int format(int64_t j) const { return static_cast<int>(table[j] & 0xff); }
  const uint8_t* panel(int64_t j) const { return base + (table[j] >> 8); }
};

int64_t bytes_of(int format, int64_t k) {  // a panel's bytes; 0 for an unknown format
  switch (format) {
    case Q4_0::kCode: return k % Q4_0::kSuperK ? 0 : panel_bytes<Q4_0>(k);
    case Q4_1::kCode: return k % Q4_1::kSuperK ? 0 : panel_bytes<Q4_1>(k);
    case Q8_0::kCode: return k % Q8_0::kSuperK ? 0 : panel_bytes<Q8_0>(k);
    case Q4_K::kCode: return k % Q4_K::kSuperK ? 0 : panel_bytes<Q4_K>(k);
    case Q6_K::kCode: return k % Q6_K::kSuperK ? 0 : panel_bytes<Q6_K>(k);
    case INT8::kCode: return k % INT8::kSuperK ? 0 : panel_bytes<INT8>(k);
    default: return 0;
  }
}

// The weight's layer `layer`, or an error naming what does not match: a wrong header, a layer
// out of range, or a panel whose format is unknown, whose K it cannot split, or which runs past
// the array.
ffi::Error open_weight(ffi::Buffer<ffi::U8>& w, int64_t k, int64_t panels, int64_t layer,
                       Weight& out) {
  const int64_t size = static_cast<int64_t>(w.element_count());
  const uint8_t* base = w.typed_data();
  int64_t header[kHeaderWords] = {};
  if (size >= static_cast<int64_t>(sizeof header)) std::memcpy(header, base, sizeof header);
  if (header[0] != kMagic) return ffi::Error::InvalidArgument("quant matmul: not a packed weight");
  out = {base, reinterpret_cast<const int64_t*>(base) + kHeaderWords, header[1], header[2],
         header[3]};
  if (out.k != k || out.panels != panels || out.layers < 1 ||
      (kHeaderWords + out.layers * panels) * 8 > size) {
    return ffi::Error::InvalidArgument(
        "quant matmul: the weight's K or panels do not match x [T, K] and y [T, N]");
  }
  if (layer < 0 || layer >= out.layers) {
    return ffi::Error::InvalidArgument("quant matmul: layer out of range");
  }
  out.table += layer * panels;  // (its entries are 8-byte aligned: XLA aligns its buffers)
  for (int64_t j = 0; j < panels; ++j) {
    const int64_t offset = out.table[j] >> 8, bytes = bytes_of(out.format(j), k);
    if (bytes == 0 || offset < 0 || offset > size - bytes) {
      return ffi::Error::InvalidArgument("quant matmul: a panel's format or offset is wrong");
    }
  }
  return ffi::Error::Success();
}

// ---- rows of x times panels, and the dispatch on the panels' format ----------------------

struct Problem {
  const float* x;  // [T, K]
  Weight w;
  float* y;  // [T, N]
  int64_t t, k, n;
};

// A panel of format F as the float32 kernel's panel: out [K, 16], exactly its weights (the
// column gather's source).
template <class F>
void dequantize(const uint8_t* panel, int64_t K, float* out) {
  for (int64_t g = 0; g < K / F::kGroupK; ++g) {
    const typename F::Group group = F::open(panel, g);
    for (int s = 0; s < F::kGroupK / F::kStep; ++s, out += F::kStep * kPanel) {
      VF w0 = zero(), w1 = w0, w2 = w0, w3 = w0;
      F::weights(group, s, w0, w1, w2, w3);
      store(out, w0);
      if constexpr (F::kStep > 1) store(out + kPanel, w1);
      if constexpr (F::kStep > 2) store(out + 2 * kPanel, w2), store(out + 3 * kPanel, w3);
    }
  }
}

// y[t0:t1, c0:c0 + COLS] by blocks of up to MR rows, each written by block(t, rows, out, ldo).
// A block whose columns run past N goes through a local buffer so only y's own are written.
template <int MR, int COLS, class Block>
void by_row_blocks(const Problem& p, int64_t c0, int64_t t0, int64_t t1, const Block& block) {
  const int64_t width = std::min<int64_t>(COLS, p.n - c0);
  const bool whole = width == COLS;
  float padded[MR * COLS];
  for (int64_t t = t0; t < t1; t += MR) {
    const int64_t rows = std::min<int64_t>(MR, t1 - t);
    block(t, rows, whole ? p.y + t * p.n + c0 : padded, whole ? p.n : COLS);
    if (!whole) {
      for (int64_t r = 0; r < rows; ++r) {
        std::copy(padded + r * COLS, padded + r * COLS + width, p.y + (t + r) * p.n + c0);
      }
    }
  }
}

// y[t0:t1, the columns of panels j to j + NP - 1] = x[t0:t1] @ those panels (all of format F).
// Register blocks of rows turn the quants into weights in registers as they go. Past one block
// of rows, the first block also keeps the weights it makes, as float32 panels in a buffer that
// stays in L1/L2 (its FMAs leave the ports that make them mostly free), and the float32
// kernel's own register block reads those for the other rows (the same bits).
template <class F, int NP>
void rows_of_panels(const Problem& p, int64_t j, int64_t t0, int64_t t1, int64_t next) {
  const uint8_t* panels[NP];
  for (int q = 0; q < NP; ++q) panels[q] = p.w.panel(j + q);
  const uint8_t* ahead = next >= 0 ? p.w.panel(next) : nullptr;
  const int64_t ahead_bytes = next >= 0 ? NP * bytes_of(p.w.format(next), p.k) : 0;
  constexpr int MR = NP > kBlockPanels ? kFewRows : kRows;
  if (NP > kBlockPanels || t1 - t0 <= kRows) {
    by_row_blocks<MR, NP * kPanel>(
        p, j * kPanel, t0, t1, [&](int64_t t, int64_t rows, float* out, int64_t ldo) {
          block_of_rows<F, MR, NP, false>(rows, p.x + t * p.k, p.k, panels, p.k, out, ldo,
                                          ahead, ahead_bytes, nullptr);
        });
    return;
  }
  if constexpr (NP <= kBlockPanels) {  // (NP of kFewRowsPanels only takes few rows)
    thread_local std::vector<float> floats;
    floats.resize(NP * p.k * kPanel);
    by_row_blocks<kRows, NP * kPanel>(
        p, j * kPanel, t0, t0 + kRows, [&](int64_t t, int64_t rows, float* out, int64_t ldo) {
          block<F, kRows, NP, true>(p.x + t * p.k, p.k, panels, p.k, out, ldo, ahead,
                                    ahead_bytes, floats.data());
        });
    constexpr int FP = f32::kBlockPanels < NP ? f32::kBlockPanels : NP;  // its block's panels
    for (int q = 0; q < NP; q += FP) {
      const float* panel = &floats[q * p.k * kPanel];
      const int64_t c0 = (j + q) * kPanel;
      by_row_blocks<f32::kRows, FP * kPanel>(
          p, c0, t0 + kRows, t1, [&](int64_t t, int64_t rows, float* out, int64_t ldo) {
            f32::block_of_rows<f32::kRows, FP>(rows, p.x + t * p.k, p.k, panel, p.k, out, ldo,
                                               nullptr);
          });
    }
  }
}

template <int NP>
void rows_of_panels_as_stored(const Problem& p, int64_t j, int64_t t0, int64_t t1,
                              int64_t next) {
  switch (p.w.format(j)) {
    case Q4_0::kCode: return rows_of_panels<Q4_0, NP>(p, j, t0, t1, next);
    case Q4_1::kCode: return rows_of_panels<Q4_1, NP>(p, j, t0, t1, next);
    case Q8_0::kCode: return rows_of_panels<Q8_0, NP>(p, j, t0, t1, next);
    case Q4_K::kCode: return rows_of_panels<Q4_K, NP>(p, j, t0, t1, next);
    case Q6_K::kCode: return rows_of_panels<Q6_K, NP>(p, j, t0, t1, next);
    case INT8::kCode: return rows_of_panels<INT8, NP>(p, j, t0, t1, next);
  }
}

// Column c of a packed panel of format F: out [K].
template <class F>
void column(const uint8_t* panel, int64_t c, int64_t K, float* out) {
  thread_local std::vector<float> floats;
  floats.resize(K * kPanel);
  dequantize<F>(panel, K, floats.data());
  for (int64_t k = 0; k < K; ++k) out[k] = floats[k * kPanel + c];
}

void column_as_stored(const Weight& w, int64_t id, float* out) {
  const int64_t j = id / kPanel, c = id % kPanel;
  switch (w.format(j)) {
    case Q4_0::kCode: return column<Q4_0>(w.panel(j), c, w.k, out);
    case Q4_1::kCode: return column<Q4_1>(w.panel(j), c, w.k, out);
    case Q8_0::kCode: return column<Q8_0>(w.panel(j), c, w.k, out);
    case Q4_K::kCode: return column<Q4_K>(w.panel(j), c, w.k, out);
    case Q6_K::kCode: return column<Q6_K>(w.panel(j), c, w.k, out);
    case INT8::kCode: return column<INT8>(w.panel(j), c, w.k, out);
  }
}

ffi::Error QuantMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                           ffi::Buffer<ffi::U8> w, ffi::Buffer<ffi::S32> layer,
                           ffi::Buffer<ffi::S32> rows, ffi::Result<ffi::Buffer<ffi::F32>> y) {
  const auto xd = x.dimensions();
  const auto yd = y->dimensions();
  if (xd.size() != 2 || yd.size() != 2 || yd[0] != xd[0]) {
    return ffi::Error::InvalidArgument("quant matmul: x must be [T, K] and y [T, N]");
  }
  Problem p;
  const int64_t panels = (yd[1] + kPanel - 1) / kPanel;
  if (auto error = open_weight(w, xd[1], panels, layer.typed_data()[0], p.w); error.failure()) {
    return error;
  }
  p.t = std::clamp<int64_t>(rows.typed_data()[0], 0, xd[0]);
  p.k = xd[1];
  p.n = yd[1];
  p.x = x.typed_data();
  p.y = y->typed_data();
  std::fill(p.y + p.t * p.n, p.y + xd[0] * p.n, 0.0f);
  if (p.t == 0) return ffi::Error::Success();
  const int64_t chunk_rows =
      std::max<int64_t>(kRows, kChunkBytes / (p.k * int64_t{sizeof(float)}) / kRows * kRows);
  const int64_t chunks = (p.t + chunk_rows - 1) / chunk_rows;
  const int64_t workers = std::max<int64_t>(1, pool.num_threads());  // the caller among them
  const int64_t groups_wanted = std::max<int64_t>(1, workers * kUnitsPerThread / chunks);
  const int64_t group = (panels + groups_wanted * kFewRowsPanels - 1) /
                        (groups_wanted * kFewRowsPanels) * kFewRowsPanels;  // whole blocks
  const int64_t groups = (panels + group - 1) / group;
  jserve::run_units(pool, chunks * groups, [&](int64_t u) {
    const int64_t t0 = u / groups * chunk_rows, t1 = std::min(p.t, t0 + chunk_rows);
    const int64_t j0 = u % groups * group, j1 = std::min(panels, j0 + group);
    const int64_t most = t1 - t0 <= kFewRows ? kFewRowsPanels : kBlockPanels;
    for (int64_t j = j0; j < j1;) {
      int64_t np = 1;  // panels of one format taken together, at most `most`
      while (np < most && j + np < j1 && p.w.format(j + np) == p.w.format(j)) ++np;
      np = np >= kFewRowsPanels ? kFewRowsPanels : np >= 2 ? 2 : 1;
      const int64_t after = j + np, next = after < j1 ? after : -1;
      if (np == kFewRowsPanels) {
        rows_of_panels_as_stored<kFewRowsPanels>(p, j, t0, t1, next);
      } else if (np == 2) {
        rows_of_panels_as_stored<2>(p, j, t0, t1, next);
      } else {
        rows_of_panels_as_stored<1>(p, j, t0, t1, next);
      }
      j = after;
    }
  });
  return ffi::Error::Success();
}

ffi::Error QuantColumnsImpl(ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::U8> w,
                            ffi::Result<ffi::Buffer<ffi::F32>> out) {
  const auto od = out->dimensions();
  if (ids.dimensions().size() != 1 || od.size() != 2 || od[0] != ids.dimensions()[0]) {
    return ffi::Error::InvalidArgument("quant columns: ids must be [T] and out [T, K]");
  }
  int64_t header[kHeaderWords] = {};
  if (w.element_count() >= sizeof header) std::memcpy(header, w.typed_data(), sizeof header);
  Weight weight;
  if (auto error = open_weight(w, od[1], header[2], 0, weight); error.failure()) return error;
  const int64_t last = weight.panels * kPanel - 1;
  for (int64_t t = 0; t < od[0]; ++t) {
    const int64_t id = std::clamp<int64_t>(ids.typed_data()[t], 0, last);
    column_as_stored(weight, id, out->typed_data() + t * od[1]);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JserveQuantMatmulF32, QuantMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::U8>>()   // w, packed
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rows: leading rows of x computed
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y

XLA_FFI_DEFINE_HANDLER_SYMBOL(JserveQuantColumnsF32, QuantColumnsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // ids: columns wanted
                                  .Arg<ffi::Buffer<ffi::U8>>()   // w, packed, one layer
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out [T, K]
