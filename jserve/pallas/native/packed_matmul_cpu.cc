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
// - a register block of MR rows of x times one panel keeps MR x 16 accumulators in registers
//   over all of K: per k, two vector loads of the panel feed 2 * MR FMAs, enough to be bound by
//   the FMA units rather than by loads once T reaches MR;
// - rows of x are taken in chunks whose [rows, K] block fits in L2, so a panel is reused from L1
//   or L2 by every row block of the chunk;
// - while the first row block of a chunk streams one panel, it asks for the unit's next panel
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
// Rows per register block: MR x 2 accumulators, two panel vectors and a broadcast must fit the
// vector registers (32 with AVX-512VL, 16 with AVX2 alone).
#if defined(__AVX512VL__)
constexpr int kRows = 8;
#else
constexpr int kRows = 6;
#endif

struct Problem {
  const float* x;  // [T, K]
  const float* w;  // [P, K, 16] of this layer
  float* y;        // [T, N]
  int64_t t, k, n, panels;
};

// out[r, 0:16] = x[r, :] @ panel for r < MR (out has row stride ldo); with `next`, the K rows
// of the next panel are prefetched into L2 on the way.
#if defined(__AVX2__) && defined(__FMA__)
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
template <int MR>
void block(const float* x, int64_t ldx, const float* panel, int64_t K, float* out, int64_t ldo,
           const float* next) {
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
template <int MR>
void block(const float* x, int64_t ldx, const float* panel, int64_t K, float* out, int64_t ldo,
           const float* next) {
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

// block<rows>, for the last block of a chunk, which may be short.
template <int MR>
void block_of_rows(int64_t rows, const float* x, int64_t ldx, const float* panel, int64_t K,
                   float* out, int64_t ldo, const float* next) {
  if (rows == MR) {
    block<MR>(x, ldx, panel, K, out, ldo, next);
  } else if constexpr (MR > 1) {
    block_of_rows<MR - 1>(rows, x, ldx, panel, K, out, ldo, next);
  }
}

// y[t0:t1, cols of panel j] = x[t0:t1] @ panel j. A panel padded past N goes through a local
// buffer so only y's own columns are written.
template <int MR>
void rows_of_panel(const Problem& p, int64_t j, int64_t t0, int64_t t1, const float* next) {
  const float* panel = p.w + j * p.k * kPanel;
  const int64_t c0 = j * kPanel, width = std::min(kPanel, p.n - c0);
  float padded[MR * kPanel];
  for (int64_t t = t0; t < t1; t += MR) {
    const float* x = p.x + t * p.k;
    const int64_t rows = std::min<int64_t>(MR, t1 - t);
    float* out = width == kPanel ? p.y + t * p.n + c0 : padded;
    const int64_t ldo = width == kPanel ? p.n : kPanel;
    block_of_rows<MR>(rows, x, p.k, panel, p.k, out, ldo, t == t0 ? next : nullptr);
    if (width != kPanel) {
      for (int64_t r = 0; r < rows; ++r) {
        std::copy(padded + r * kPanel, padded + r * kPanel + width, p.y + (t + r) * p.n + c0);
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
  const int64_t group = (p.panels + groups_wanted - 1) / groups_wanted;  // panels per unit
  const int64_t groups = (p.panels + group - 1) / group;
  jserve::run_units(pool, chunks * groups, [&](int64_t u) {
    const int64_t t0 = u / groups * chunk_rows, t1 = std::min(p.t, t0 + chunk_rows);
    const int64_t j0 = u % groups * group, j1 = std::min(p.panels, j0 + group);
    for (int64_t j = j0; j < j1; ++j) {
      const float* next = j + 1 < j1 ? p.w + (j + 1) * p.k * kPanel : nullptr;
      rows_of_panel<kRows>(p, j, t0, t1, next);
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
