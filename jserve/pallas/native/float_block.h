// The float32 register block of the packed matmuls: out[r, 0:16 NP] = x[r, :] @ NP column
// panels of a [K, 16]-per-panel float32 weight, each column summed one FMA per k in k order.
// packed_matmul_cpu.cc runs it over the weights it is given; quant_matmul_cpu.cc over a
// panel it has just dequantized, which is how the two kernels give the same bits.

#pragma once

#include <algorithm>
#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace jserve::f32 {

constexpr int64_t kPanel = 16;  // columns per packed panel
// A register block is MR rows of x times NP panels. With AVX-512 a panel's 16 columns are one
// vector and a block takes two panels: 2 x MR accumulators, the two panel vectors and a
// broadcast fit 32 registers, and each broadcast of x feeds two FMAs. With AVX2 a panel is two
// vectors and a block one panel: MR x 2 accumulators, two panel vectors and a broadcast (32
// registers with AVX-512VL, 16 with AVX2 alone).
#if defined(__AVX512F__)
constexpr int kRows = 12, kBlockPanels = 2;
#elif defined(__AVX512VL__)
constexpr int kRows = 8, kBlockPanels = 1;
#else
constexpr int kRows = 6, kBlockPanels = 1;
#endif

// out[r, 0:16 NP] = x[r, :] @ the NP panels from `panel` for r < MR (out has row stride ldo);
// with `next`, the K rows of the NP panels from `next` are prefetched into L2 on the way.
#if defined(__AVX512F__)
// The accumulators are named variables, not an array: GCC keeps a vector array on the stack and
// stores it back on every k. Each lane computes its column exactly as the AVX2 block below does
// (one FMA per k, in k order), so both give the same bits.
#define JSERVE_ROW(r)                                                 \
  if constexpr (MR > r) {                                             \
    const __m512 b = _mm512_set1_ps(x[r * ldx + k]);                  \
    a##r##0 = _mm512_fmadd_ps(b, w0, a##r##0);                        \
    if constexpr (NP > 1) a##r##1 = _mm512_fmadd_ps(b, w1, a##r##1);  \
  }
#define JSERVE_STORE(r)                                               \
  if constexpr (MR > r) {                                             \
    _mm512_storeu_ps(out + r * ldo, a##r##0);                         \
    if constexpr (NP > 1) _mm512_storeu_ps(out + r * ldo + kPanel, a##r##1); \
  }
template <int MR, int NP>
void block(const float* x, int64_t ldx, const float* panel, int64_t K, float* out, int64_t ldo,
           const float* next) {
  static_assert(NP == 1 || NP == 2);
  const float* panel1 = panel + K * kPanel;  // the block's second panel, when NP is 2
  __m512 a00 = _mm512_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00;
  __m512 a30 = a00, a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;
  __m512 a60 = a00, a61 = a00, a70 = a00, a71 = a00, a80 = a00, a81 = a00;
  __m512 a90 = a00, a91 = a00, a100 = a00, a101 = a00, a110 = a00, a111 = a00;
  for (int64_t k = 0; k < K; ++k) {
    if (next) {
      __builtin_prefetch(next + k * kPanel, 0, 2);
      if constexpr (NP > 1) __builtin_prefetch(next + (K + k) * kPanel, 0, 2);
    }
    const __m512 w0 = _mm512_loadu_ps(panel + k * kPanel);
    const __m512 w1 = NP > 1 ? _mm512_loadu_ps(panel1 + k * kPanel) : w0;
    JSERVE_ROW(0) JSERVE_ROW(1) JSERVE_ROW(2) JSERVE_ROW(3) JSERVE_ROW(4) JSERVE_ROW(5)
    JSERVE_ROW(6) JSERVE_ROW(7) JSERVE_ROW(8) JSERVE_ROW(9) JSERVE_ROW(10) JSERVE_ROW(11)
  }
  JSERVE_STORE(0) JSERVE_STORE(1) JSERVE_STORE(2) JSERVE_STORE(3) JSERVE_STORE(4)
  JSERVE_STORE(5) JSERVE_STORE(6) JSERVE_STORE(7) JSERVE_STORE(8) JSERVE_STORE(9)
  JSERVE_STORE(10) JSERVE_STORE(11)
}
#undef JSERVE_ROW
#undef JSERVE_STORE
#elif defined(__AVX2__) && defined(__FMA__)
// The accumulators are named variables, not an array: GCC keeps a __m256 array on the stack and
// stores it back on every k.
#define JSERVE_ROW(r)                                          \
  if constexpr (MR > r) {                                      \
    const __m256 b = _mm256_broadcast_ss(x + r * ldx + k);     \
    a##r##0 = _mm256_fmadd_ps(b, w0, a##r##0);                 \
    a##r##1 = _mm256_fmadd_ps(b, w1, a##r##1);                 \
  }
#define JSERVE_STORE(r)                                        \
  if constexpr (MR > r) {                                      \
    _mm256_storeu_ps(out + r * ldo, a##r##0);                  \
    _mm256_storeu_ps(out + r * ldo + 8, a##r##1);              \
  }
template <int MR, int NP>
void block(const float* x, int64_t ldx, const float* panel, int64_t K, float* out, int64_t ldo,
           const float* next) {
  static_assert(NP == 1);
  __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00;
  __m256 a30 = a00, a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;
  __m256 a60 = a00, a61 = a00, a70 = a00, a71 = a00;
  for (int64_t k = 0; k < K; ++k, panel += kPanel) {
    if (next) __builtin_prefetch(next + k * kPanel, 0, 2);
    const __m256 w0 = _mm256_loadu_ps(panel), w1 = _mm256_loadu_ps(panel + 8);
    JSERVE_ROW(0) JSERVE_ROW(1) JSERVE_ROW(2) JSERVE_ROW(3)
    JSERVE_ROW(4) JSERVE_ROW(5) JSERVE_ROW(6) JSERVE_ROW(7)
  }
  JSERVE_STORE(0) JSERVE_STORE(1) JSERVE_STORE(2) JSERVE_STORE(3)
  JSERVE_STORE(4) JSERVE_STORE(5) JSERVE_STORE(6) JSERVE_STORE(7)
}
#undef JSERVE_ROW
#undef JSERVE_STORE
#else
#include "k_order.h"  // the sums in k order, as the vector paths' FMAs
template <int MR, int NP>
void block(const float* x, int64_t ldx, const float* panel, int64_t K, float* out, int64_t ldo,
           const float* next) {
  static_assert(NP == 1);
  (void)next;
  float acc[MR][kPanel] = {};
  for (int64_t k = 0; k < K; ++k, panel += kPanel) {
    for (int r = 0; r < MR; ++r) {
      const float xr = x[r * ldx + k];
      for (int c = 0; c < kPanel; ++c) acc[r][c] += xr * panel[c];
    }
  }
  for (int r = 0; r < MR; ++r) std::copy(acc[r], acc[r] + kPanel, out + r * ldo);
}
#endif

// block<rows, NP>, for the last block of a chunk, which may be short.
template <int MR, int NP>
void block_of_rows(int64_t rows, const float* x, int64_t ldx, const float* panel, int64_t K,
                   float* out, int64_t ldo, const float* next) {
  if (rows == MR) {
    block<MR, NP>(x, ldx, panel, K, out, ldo, next);
  } else if constexpr (MR > 1) {
    block_of_rows<MR - 1, NP>(rows, x, ldx, panel, K, out, ldo, next);
  }
}

}  // namespace jserve::f32
