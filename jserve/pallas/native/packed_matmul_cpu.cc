// y = x @ w[layer] with the weight packed in column panels, float32, as an XLA FFI custom call:
// the CPU model's projections at every step size.
//
// x is [T, K]; w is [L, P, K, 16]: layer l's [K, N] weight cut into P = ceil(N / 16) panels of
// 16 columns, each panel's K rows of 16 floats contiguous (zero columns pad the last panel); y is
// [T, N], of which only the first `rows` rows are computed (the rest, a step's padding, are 0).
// Packing happens once, at load time (jserve.pallas.layer_matmul.pack_layer_weight), so:
// - a panel is one contiguous stream: the kernel reads the weight where it lies at `layer`'s
//   offset, in order, with no copy of the layer out of the stack and no per-step packing (a
//   general GEMM packs its operand on every call, which at a few tokens is a second pass over
//   the weights, the step's whole cost);
// - a register block of MR rows of x times one or two panels keeps its accumulators in
//   registers over all of K: per k, a broadcast of each row of x feeds the FMAs of every
//   panel column. With AVX-512 (16 floats a vector) a block is 12 rows x 2 panels: 24
//   accumulators, and 14 loads feed 24 FMAs per k. With AVX2 it is 8 (or 6) rows x 1 panel of
//   two vectors. The AVX-512 block ran the four projections of 30 layers at 32 / 128 / 512
//   tokens in 35 / 103 / 393 ms against the AVX2 block's 49 / 154 / 623 (interleaved, same bits);
// - rows of x are taken in chunks whose [rows, K] block fits in L2, so a panel is reused from L1
//   or L2 by every row block of the chunk;
// - while the first row block of a chunk streams its panels, it asks for the next block's panels
//   one cache line per k, into L2: the first pass over a panel otherwise waits on memory, which
//   is most of the time at 8 to 64 tokens (the projections of 30 layers at 8 and 32 tokens went
//   from 21.5-27.8 to 17.4-19.7 ms and from 54-57 to 38-54 ms, interleaved runs);
// - work units of (row chunk, group of panels) run over XLA's intra-op threads through
//   jserve::run_units (parallel_units.h); each writes its own columns of y, so nothing is summed.

#include <algorithm>
#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include "parallel_units.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kPanel = 16;              // columns per packed panel
constexpr int64_t kChunkBytes = 512 << 10;  // a row chunk of x stays within L2 next to a panel
constexpr int64_t kUnitsPerThread = 4;      // slack, so a late pool thread costs little
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

struct Problem {
  const float* x;  // [T, K]
  const float* w;  // [P, K, 16] of this layer
  float* y;        // [T, N]
  int64_t t, k, n, panels;
};

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

// y[t0:t1, columns of panels j to j + NP - 1] = x[t0:t1] @ those panels. A block whose columns
// run past N (the last panel is padded) goes through a local buffer so only y's own columns are
// written.
template <int MR, int NP>
void rows_of_panels(const Problem& p, int64_t j, int64_t t0, int64_t t1, const float* next) {
  const float* panel = p.w + j * p.k * kPanel;
  const int64_t c0 = j * kPanel, width = std::min(NP * kPanel, p.n - c0);
  const bool whole = width == NP * kPanel;
  float padded[MR * NP * kPanel];
  for (int64_t t = t0; t < t1; t += MR) {
    const float* x = p.x + t * p.k;
    const int64_t rows = std::min<int64_t>(MR, t1 - t);
    float* out = whole ? p.y + t * p.n + c0 : padded;
    const int64_t ldo = whole ? p.n : NP * kPanel;
    block_of_rows<MR, NP>(rows, x, p.k, panel, p.k, out, ldo, t == t0 ? next : nullptr);
    if (!whole) {
      for (int64_t r = 0; r < rows; ++r) {
        const float* row = padded + r * NP * kPanel;
        std::copy(row, row + width, p.y + (t + r) * p.n + c0);
      }
    }
  }
}

ffi::Error PackedMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                            ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::S32> layer,
                            ffi::Buffer<ffi::S32> rows, ffi::Result<ffi::Buffer<ffi::F32>> y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const auto yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 4 || yd.size() != 2 || wd[2] != xd[1] ||
      wd[3] != kPanel || yd[0] != xd[0] || yd[1] > wd[1] * kPanel ||
      yd[1] <= (wd[1] - 1) * kPanel) {
    return ffi::Error::InvalidArgument(
        "packed matmul: x must be [T, K], w [L, ceil(N / 16), K, 16] and y [T, N]");
  }
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= wd[0]) return ffi::Error::InvalidArgument("packed matmul: layer out of range");
  Problem p;
  // Rows past `rows` (a step's padding) are not computed: they are written as zeros.
  p.t = std::clamp<int64_t>(rows.typed_data()[0], 0, xd[0]);
  p.k = xd[1];
  p.n = yd[1];
  p.panels = wd[1];
  p.x = x.typed_data();
  p.w = w.typed_data() + l * p.panels * p.k * kPanel;
  p.y = y->typed_data();
  std::fill(p.y + p.t * p.n, p.y + xd[0] * p.n, 0.0f);
  if (p.t == 0) return ffi::Error::Success();
  const int64_t chunk_rows =
      std::max<int64_t>(kRows, kChunkBytes / (p.k * int64_t{sizeof(float)}) / kRows * kRows);
  const int64_t chunks = (p.t + chunk_rows - 1) / chunk_rows;
  const int64_t workers = std::max<int64_t>(1, pool.num_threads());  // the caller among them
  const int64_t groups_wanted = std::max<int64_t>(1, workers * kUnitsPerThread / chunks);
  // panels per unit, whole register blocks of them
  const int64_t group = (p.panels + groups_wanted * kBlockPanels - 1) /
                        (groups_wanted * kBlockPanels) * kBlockPanels;
  const int64_t groups = (p.panels + group - 1) / group;
  jserve::run_units(pool, chunks * groups, [&](int64_t u) {
    const int64_t t0 = u / groups * chunk_rows, t1 = std::min(p.t, t0 + chunk_rows);
    const int64_t j0 = u % groups * group, j1 = std::min(p.panels, j0 + group);
    for (int64_t j = j0; j < j1; j += kBlockPanels) {
      const int64_t np = std::min<int64_t>(kBlockPanels, j1 - j);
      const float* next = j + np < j1 ? p.w + (j + np) * p.k * kPanel : nullptr;
      if (np == kBlockPanels) {
        rows_of_panels<kRows, kBlockPanels>(p, j, t0, t1, next);
      } else {
        rows_of_panels<kRows, 1>(p, j, t0, t1, next);
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JservePackedMatmulF32, PackedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w, packed
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rows: leading rows of x computed
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y
