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

#include "float_block.h"
#include "parallel_units.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

namespace f32 = jserve::f32;
using f32::block_of_rows;
using f32::kBlockPanels;
using f32::kPanel;
using f32::kRows;
constexpr int64_t kChunkBytes = 512 << 10;  // a row chunk of x stays within L2 next to a panel
constexpr int64_t kUnitsPerThread = 4;      // slack, so a late pool thread costs little

struct Problem {
  const float* x;  // [T, K]
  const float* w;  // [P, K, 16] of this layer
  float* y;        // [T, N]
  int64_t t, k, n, panels;
};

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
