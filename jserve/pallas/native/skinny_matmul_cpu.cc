// y = x @ w[layer] for a few rows of x, float32, as an XLA FFI custom call: the CPU model's
// projections on steps of a few tokens.
//
// x is [T, K], w is [L, K, N] (row-major, one layer's [K, N] weight after another) and y is
// [T, N]. A step of a few tokens is bound by reading the weights, so:
// - the weight is read where it lies, at `layer`'s offset: under the model's lax.scan, a dot
//   would first copy each layer's slice out of the stacked weight (a second pass over it);
// - each work unit streams one contiguous block of w's rows, in order, four rows at a time, so
//   the hardware prefetcher runs ahead, into its own partial [T, N] output (which stays in L1
//   or L2); the partial outputs are summed at the end;
// - the units run over XLA's intra-op threads through jserve::run_units (parallel_units.h).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include "parallel_units.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kUnitsPerThread = 2;  // slack, so a late pool thread costs little
constexpr int64_t kRowAlign = 4;        // row blocks are whole 4-row steps
constexpr int64_t kTileFloats = 4096;   // output floats per column tile (16 KiB, half of L1)

struct Problem {
  const float* x;  // [T, K]
  const float* w;  // [K, N] of this layer
  float* y;        // [T, N]
  int64_t t, k, n;
};

// out[:, n0:n1] += x[:, k0:k1] @ w[k0:k1, n0:n1].
void tile(const Problem& p, int64_t k0, int64_t k1, int64_t n0, int64_t n1, float* out) {
  const int64_t K = p.k, N = p.n;
  int64_t k = k0;
#if defined(__AVX2__) && defined(__FMA__)
  const int64_t vec_end = n0 + (n1 - n0) / 8 * 8;
  for (; k + 4 <= k1; k += 4) {
    const float* w0 = p.w + k * N;
    const float* w1 = w0 + N;
    const float* w2 = w1 + N;
    const float* w3 = w2 + N;
    int64_t t = 0;
    for (; t + 2 <= p.t; t += 2) {  // two rows share each load of w
      const float* xa = p.x + t * K + k;
      const float* xb = xa + K;
      const __m256 a0 = _mm256_set1_ps(xa[0]), a1 = _mm256_set1_ps(xa[1]);
      const __m256 a2 = _mm256_set1_ps(xa[2]), a3 = _mm256_set1_ps(xa[3]);
      const __m256 b0 = _mm256_set1_ps(xb[0]), b1 = _mm256_set1_ps(xb[1]);
      const __m256 b2 = _mm256_set1_ps(xb[2]), b3 = _mm256_set1_ps(xb[3]);
      float* ya = out + t * N;
      float* yb = ya + N;
      int64_t c = n0;
      for (; c < vec_end; c += 8) {
        const __m256 v0 = _mm256_loadu_ps(w0 + c), v1 = _mm256_loadu_ps(w1 + c);
        const __m256 v2 = _mm256_loadu_ps(w2 + c), v3 = _mm256_loadu_ps(w3 + c);
        __m256 s = _mm256_fmadd_ps(a1, v1, _mm256_mul_ps(a0, v0));
        s = _mm256_fmadd_ps(a3, v3, _mm256_fmadd_ps(a2, v2, s));
        _mm256_storeu_ps(ya + c, _mm256_add_ps(_mm256_loadu_ps(ya + c), s));
        __m256 u = _mm256_fmadd_ps(b1, v1, _mm256_mul_ps(b0, v0));
        u = _mm256_fmadd_ps(b3, v3, _mm256_fmadd_ps(b2, v2, u));
        _mm256_storeu_ps(yb + c, _mm256_add_ps(_mm256_loadu_ps(yb + c), u));
      }
      for (; c < n1; ++c) {
        ya[c] += xa[0] * w0[c] + xa[1] * w1[c] + xa[2] * w2[c] + xa[3] * w3[c];
        yb[c] += xb[0] * w0[c] + xb[1] * w1[c] + xb[2] * w2[c] + xb[3] * w3[c];
      }
    }
    for (; t < p.t; ++t) {
      const float* xt = p.x + t * K + k;
      const __m256 x0 = _mm256_set1_ps(xt[0]), x1 = _mm256_set1_ps(xt[1]);
      const __m256 x2 = _mm256_set1_ps(xt[2]), x3 = _mm256_set1_ps(xt[3]);
      float* yt = out + t * N;
      int64_t c = n0;
      for (; c < vec_end; c += 8) {
        __m256 s = _mm256_fmadd_ps(x1, _mm256_loadu_ps(w1 + c), _mm256_mul_ps(x0, _mm256_loadu_ps(w0 + c)));
        s = _mm256_fmadd_ps(x3, _mm256_loadu_ps(w3 + c), _mm256_fmadd_ps(x2, _mm256_loadu_ps(w2 + c), s));
        _mm256_storeu_ps(yt + c, _mm256_add_ps(_mm256_loadu_ps(yt + c), s));
      }
      for (; c < n1; ++c) yt[c] += xt[0] * w0[c] + xt[1] * w1[c] + xt[2] * w2[c] + xt[3] * w3[c];
    }
  }
#endif
  for (; k < k1; ++k) {  // the rest, and machines without AVX2
    const float* wk = p.w + k * N;
    for (int64_t t = 0; t < p.t; ++t) {
      const float xk = p.x[t * K + k];
      float* yt = out + t * N;
      for (int64_t c = n0; c < n1; ++c) yt[c] += xk * wk[c];
    }
  }
}

// out[T, N] = x[:, k0:k1] @ w[k0:k1, :]: one contiguous block of w's rows, read in order, in
// column tiles narrow enough that the T output rows of a tile stay in L1.
void row_block(const Problem& p, int64_t k0, int64_t k1, float* out) {
  std::memset(out, 0, sizeof(float) * p.t * p.n);
  const int64_t width = std::max<int64_t>(8, kTileFloats / p.t / 8 * 8);
  for (int64_t n0 = 0; n0 < p.n; n0 += width) tile(p, k0, k1, n0, std::min(p.n, n0 + width), out);
}

ffi::Error SkinnyMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                            ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::S32> layer,
                            ffi::Result<ffi::Buffer<ffi::F32>> y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[1] != xd[1]) {
    return ffi::Error::InvalidArgument("skinny matmul: x must be [T, K] and w [L, K, N]");
  }
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= wd[0]) return ffi::Error::InvalidArgument("skinny matmul: layer out of range");
  Problem p;
  p.t = xd[0];
  p.k = xd[1];
  p.n = wd[2];
  p.x = x.typed_data();
  p.w = w.typed_data() + l * p.k * p.n;
  p.y = y->typed_data();
  const int64_t workers = std::max<int64_t>(1, pool.num_threads());  // the caller among them
  const int64_t wanted = workers * kUnitsPerThread;
  // Unit i takes rows [i * rows, (i + 1) * rows) of w into its own partial product.
  const int64_t rows = ((p.k + wanted - 1) / wanted + kRowAlign - 1) / kRowAlign * kRowAlign;
  const int64_t units = (p.k + rows - 1) / rows;
  std::vector<float> parts(units * p.t * p.n);  // [units, T, N]
  jserve::run_units(pool, units, [&](int64_t i) {
    row_block(p, i * rows, std::min(p.k, (i + 1) * rows), parts.data() + i * p.t * p.n);
  });
  const int64_t size = p.t * p.n;
  std::copy(parts.begin(), parts.begin() + size, p.y);
  for (int64_t u = 1; u < units; ++u) {
    const float* part = parts.data() + u * size;
    for (int64_t i = 0; i < size; ++i) p.y[i] += part[i];
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JserveSkinnyMatmulF32, SkinnyMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y
