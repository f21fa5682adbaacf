// Native CPU kernels of the `dct` compressor (unroller/compress/dct.py), int8 storage and
// float32 work: pad, transform, chop and quantise one plane at a time, and back.
//
// Why: the PyTorch fast path is two matrix products plus a dozen full-size passes (padding,
// |max|, divide, round, clamp, NaN fix, cast) and as many dispatches per call; on the small
// maps of a CNN at CIFAR size the dispatches alone cost more than the arithmetic. Here each
// plane stays in the cache from its first read to its last write.
//
// Not bit-identical to the PyTorch formulations, unlike the quant kernels: those products go
// through BLAS, whose summation order is its own. What holds instead (tests check it):
//   - the same formulas and layout as `Dct` (edge-replicated padding, Tk B Tk^T / 2**e, the
//     symmetric per-(sample, channel) scale amax / 127, round half to even, clamp to +-127,
//     NaN -> 0; the inverse Tk^T C Tk * 2**e, cropped);
//   - each coefficient and each output value is one fixed sequence of IEEE operations (built
//     with -ffp-contract=off, no fast-math; vector lanes run independent outputs), so the
//     results do not depend on the thread count or the instruction-set clone;
//   - they differ from the PyTorch path's by float rounding only: coefficients by a few
//     units in the last place, so a code can differ by one where a scaled coefficient lies
//     within rounding of a half-integer.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>
#include <vector>

#include "native_common.h"

// GCC 12+ and Clang: vector types with lane shuffles, for the two-tiles-per-vector step.
#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define UD_SHUFFLE 1
#endif
#endif

namespace {

using unroller_native::run_split;

struct DctArgs {
    const float* x;     // compress: planes [P, H, W]
    int8_t* q;          // codes, per plane [Hb, K, Wb, K] or folded [Hb, Wb, K(K+1)/2]
    float* scale;       // [P]
    float* out;         // decompress: planes [P, H, W]
    const float* down;  // [K, B]: Tk / 2**e (the forward's first product)
    const float* rows;  // [K, B]: Tk
    const float* up;    // [K, B]: Tk * 2**e (the inverse's last product)
    int64_t h, w, b, k, hb, wb;
    int fold;
    int* failed;  // set when scratch memory could not be had
};

int64_t kept_per_tile(const DctArgs& a) { return a.fold ? a.k * (a.k + 1) / 2 : a.k * a.k; }

// Forward transform of one plane into y [Hb, K, Wb, K] (float32).
// Rows: strip[i][col] = sum_p down[i][p] * row_p[col], p ascending, over the padded width,
// kCols columns at a time with the K sums held in registers (rows read straight from the
// plane unless the width needs edge padding, then from `padded`).
// Columns: y[i][j] = sum_q strip[i][q] * rows[j][q], q ascending, per tile.
constexpr int64_t kCols = 16;
constexpr int64_t kMaxRegK = 8;  // K up to this keeps its row sums in registers

UQ_INLINE void forward_plane(const DctArgs& a, const float* __restrict x, float* __restrict y,
                             float* __restrict strip, float* __restrict padded,
                             const float* __restrict rows_t, const int64_t B, const int64_t K) {
    const int64_t Wp = a.wb * B;
    const bool pad = a.w != Wp;
    for (int64_t r = 0; r < a.hb; ++r) {
        const float* src[64];  // B <= MAX_BLOCK (64) rows of this tile row, edge-replicated
        for (int64_t p = 0; p < B; ++p) {
            int64_t row = r * B + p;
            if (row > a.h - 1) row = a.h - 1;  // edge replication of the last row
            src[p] = x + row * a.w;
            if (pad) {
                float* dst = padded + p * Wp;
                std::memcpy(dst, src[p], static_cast<size_t>(a.w) * sizeof(float));
                const float last = src[p][a.w - 1];
                for (int64_t col = a.w; col < Wp; ++col) dst[col] = last;
                src[p] = dst;
            }
        }
        int64_t col0 = 0;
#ifdef UD_SHUFFLE
        if (K == 4) {  // the default codec: the four row sums as 16-lane vectors
            typedef float V16 __attribute__((vector_size(64)));
            for (; col0 + kCols <= Wp; col0 += kCols) {
                V16 v;
                std::memcpy(&v, src[0] + col0, 64);
                V16 s0 = a.down[0] * v, s1 = a.down[B] * v, s2 = a.down[2 * B] * v,
                    s3 = a.down[3 * B] * v;
                for (int64_t p = 1; p < B; ++p) {
                    std::memcpy(&v, src[p] + col0, 64);
                    s0 = s0 + a.down[p] * v;
                    s1 = s1 + a.down[B + p] * v;
                    s2 = s2 + a.down[2 * B + p] * v;
                    s3 = s3 + a.down[3 * B + p] * v;
                }
                std::memcpy(strip + col0, &s0, 64);
                std::memcpy(strip + Wp + col0, &s1, 64);
                std::memcpy(strip + 2 * Wp + col0, &s2, 64);
                std::memcpy(strip + 3 * Wp + col0, &s3, 64);
            }
        }
#endif
        if (K <= kMaxRegK) {
            for (; col0 + kCols <= Wp; col0 += kCols) {
                float acc[kMaxRegK][kCols];
                for (int64_t i = 0; i < K; ++i) {
                    const float t = a.down[i * B];
                    for (int64_t l = 0; l < kCols; ++l) acc[i][l] = t * src[0][col0 + l];
                }
                for (int64_t p = 1; p < B; ++p) {
                    const float* __restrict v = src[p] + col0;
                    for (int64_t i = 0; i < K; ++i) {
                        const float t = a.down[i * B + p];
                        for (int64_t l = 0; l < kCols; ++l) acc[i][l] = acc[i][l] + t * v[l];
                    }
                }
                for (int64_t i = 0; i < K; ++i) {
                    for (int64_t l = 0; l < kCols; ++l) strip[i * Wp + col0 + l] = acc[i][l];
                }
            }
        }
        for (int64_t i = 0; i < K; ++i) {  // the rest of the columns (or any K), same sums
            float* __restrict s = strip + i * Wp;
            const float t0 = a.down[i * B];
            for (int64_t col = col0; col < Wp; ++col) s[col] = t0 * src[0][col];
            for (int64_t p = 1; p < B; ++p) {
                const float t = a.down[i * B + p];
                const float* __restrict v = src[p];
                for (int64_t col = col0; col < Wp; ++col) s[col] = s[col] + t * v[col];
            }
        }
        for (int64_t i = 0; i < K; ++i) {
            for (int64_t c = 0; c < a.wb; ++c) {
                const float* __restrict s = strip + i * Wp + c * B;
                float* __restrict dst = y + ((r * K + i) * a.wb + c) * K;
                for (int64_t j = 0; j < K; ++j) dst[j] = s[0] * rows_t[j];
                for (int64_t q = 1; q < B; ++q) {
                    const float v = s[q];
                    const float* __restrict t = rows_t + q * K;
                    for (int64_t j = 0; j < K; ++j) dst[j] = dst[j] + v * t[j];
                }
            }
        }
    }
}

// The symmetric scale of a plane's kept coefficients and their int8 codes (as `Dct`:
// amax |y| over the kept ones with NaN propagated, 1 for an all-zero plane; rint, clamp,
// NaN -> 0). With fold the kept ones (i + j < K) are first gathered into `kept`, in the
// packed order [Hb, Wb, kept].
UQ_INLINE void quantise_plane(const DctArgs& a, const float* __restrict y, float* __restrict kept,
                              int8_t* __restrict q, float* __restrict scale_out,
                              const int64_t K) {
    int64_t len = a.hb * K * a.wb * K;
    if (a.fold) {
        int64_t o = 0;
        for (int64_t r = 0; r < a.hb; ++r) {
            for (int64_t c = 0; c < a.wb; ++c) {
                for (int64_t i = 0; i < K; ++i) {  // row i keeps its first K - i (one copy)
                    const float* __restrict src = y + ((r * K + i) * a.wb + c) * K;
                    std::memcpy(kept + o, src, static_cast<size_t>(K - i) * sizeof(float));
                    o += K - i;
                }
            }
        }
        len = o;
        y = kept;
    }
    // amax over running maxima in vectors (GCC/Clang vector types: a scalar loop is one
    // chain of dependent max instructions, and this one the compiler left scalar); max is
    // exact, so any order gives the same value, and NaN is tracked apart.
    typedef float V8 __attribute__((vector_size(32)));
    typedef int32_t M8 __attribute__((vector_size(32)));
    V8 m0 = {}, m1 = {};
    M8 bad0 = {}, bad1 = {};
    int64_t i0 = 0;
    for (; i0 + 16 <= len; i0 += 16) {
        V8 u0, u1;
        std::memcpy(&u0, y + i0, 32);
        std::memcpy(&u1, y + i0 + 8, 32);
        const V8 v0 = u0 < 0.0f ? -u0 : u0, v1 = u1 < 0.0f ? -u1 : u1;
        bad0 |= v0 != v0;
        bad1 |= v1 != v1;
        m0 = v0 > m0 ? v0 : m0;
        m1 = v1 > m1 ? v1 : m1;
    }
    m0 = m1 > m0 ? m1 : m0;
    bad0 |= bad1;
    float amax = 0.0f;
    bool nan = false;
    for (int j = 0; j < 8; ++j) {
        nan |= bad0[j] != 0;
        amax = m0[j] > amax ? m0[j] : amax;
    }
    for (; i0 < len; ++i0) {
        const float v = std::fabs(y[i0]);
        nan |= v != v;
        amax = v > amax ? v : amax;
    }
    if (nan) amax = std::numeric_limits<float>::quiet_NaN();
    const float scale = amax == 0.0f ? 1.0f : amax / 127.0f;
    *scale_out = scale;
    for (int64_t i = 0; i < len; ++i) {
        float v = std::rint(y[i] / scale);
        v = v >= -127.0f ? (v <= 127.0f ? v : 127.0f) : (v != v ? 0.0f : -127.0f);
        q[i] = static_cast<int8_t>(static_cast<int32_t>(v));
    }
}

// Inverse of one plane from its codes: y = code * scale (into [Hb, K, Wb, K], zeros where a
// fold dropped a coefficient); per tile row, first within each tile's K coefficient rows:
// strip[i][c*B + q] = sum_j y[r][i][c][j] * rows[j][q], j ascending (K rows of B-wide work,
// not B rows of K-wide: half the products of the other order); then across rows, written
// straight into the output: x[p][col] = sum_i up[i][p] * strip[i][col], i ascending, for
// the first W columns and H rows (the crop). The 2**e of `up` comes last, as in `Dct`, so
// no intermediate overflows where the output does not.
UQ_INLINE void inverse_plane(const DctArgs& a, const int8_t* __restrict q, float scale,
                             float* __restrict out, float* __restrict y, float* __restrict strip,
                             const int64_t B, const int64_t K) {
    const int64_t Wk = a.wb * K;
    const int64_t len = a.hb * K * Wk;
    if (!a.fold) {
        for (int64_t i = 0; i < len; ++i) y[i] = static_cast<float>(q[i]) * scale;
    } else {
        int64_t o = 0;
        for (int64_t r = 0; r < a.hb; ++r) {
            for (int64_t c = 0; c < a.wb; ++c) {
                for (int64_t i = 0; i < K; ++i) {  // row i: K - i codes, then zeros
                    float* __restrict dst = y + ((r * K + i) * a.wb + c) * K;
                    for (int64_t j = 0; j < K; ++j) {
                        dst[j] = j + i < K ? static_cast<float>(q[o + j]) * scale : 0.0f;
                    }
                    o += K - i;
                }
            }
        }
    }
    const int64_t Wp = a.wb * B;
#ifdef UD_SHUFFLE
    typedef float F8 __attribute__((vector_size(32)));
    typedef float F16 __attribute__((vector_size(64)));
    F16 pair_rows[4];  // K = 4, B = 8: rows[j][q] for two tiles side by side (lane 8t + q)
    for (int j = 0; j < 4 && K == 4 && B == 8; ++j) {
        for (int l = 0; l < 16; ++l) pair_rows[j][l] = a.rows[j * 8 + (l & 7)];
    }
#endif
    for (int64_t r = 0; r < a.hb; ++r) {
        const float* __restrict yr = y + r * K * Wk;
        for (int64_t i = 0; i < K; ++i) {  // within each tile's rows: K coefficients to B
            const float* __restrict yi = yr + i * Wk;
            float* __restrict s = strip + i * Wp;
            int64_t c = 0;
#ifdef UD_SHUFFLE
            // K = 4, B = 8 (the default codec): two tiles per 16-lane vector, each lane the
            // same products and sums, in the same order, as the loop below.
            for (; K == 4 && B == 8 && c + 2 <= a.wb; c += 2) {
                F8 v;  // coefficients 0..3 of tiles c and c + 1
                std::memcpy(&v, yi + c * 4, 32);
#define UD_SPREAD(j)                                                                          \
    __builtin_shufflevector(v, v, j, j, j, j, j, j, j, j, 4 + j, 4 + j, 4 + j, 4 + j, 4 + j, \
                            4 + j, 4 + j, 4 + j)
                F16 acc = UD_SPREAD(0) * pair_rows[0];
                acc = acc + UD_SPREAD(1) * pair_rows[1];
                acc = acc + UD_SPREAD(2) * pair_rows[2];
                acc = acc + UD_SPREAD(3) * pair_rows[3];
#undef UD_SPREAD
                std::memcpy(s + c * 8, &acc, 64);
            }
#endif
            for (; c < a.wb; ++c) {
                float* __restrict dst = s + c * B;
                const float* __restrict sc = yi + c * K;
                for (int64_t qq = 0; qq < B; ++qq) dst[qq] = sc[0] * a.rows[qq];
                for (int64_t j = 1; j < K; ++j) {
                    const float v = sc[j];
                    const float* __restrict u = a.rows + j * B;
                    for (int64_t qq = 0; qq < B; ++qq) dst[qq] = dst[qq] + v * u[qq];
                }
            }
        }
        const int64_t rows_here = (a.h - r * B) < B ? (a.h - r * B) : B;
        for (int64_t p = 0; p < rows_here; ++p) {  // across rows, straight into the output
            float* __restrict o = out + (r * B + p) * a.w;
            const float t0 = a.up[p];
            int64_t col0 = 0;
#ifdef UD_SHUFFLE
            if (K == 4) {
                const float t1 = a.up[B + p], t2 = a.up[2 * B + p], t3 = a.up[3 * B + p];
                for (; col0 + 16 <= a.w; col0 += 16) {
                    F16 s0, s1, s2, s3;
                    std::memcpy(&s0, strip + col0, 64);
                    std::memcpy(&s1, strip + Wp + col0, 64);
                    std::memcpy(&s2, strip + 2 * Wp + col0, 64);
                    std::memcpy(&s3, strip + 3 * Wp + col0, 64);
                    F16 acc = t0 * s0;
                    acc = acc + t1 * s1;
                    acc = acc + t2 * s2;
                    acc = acc + t3 * s3;
                    std::memcpy(o + col0, &acc, 64);
                }
            }
#endif
            for (int64_t col = col0; col < a.w; ++col) o[col] = t0 * strip[col];
            for (int64_t i = 1; i < K; ++i) {
                const float t = a.up[i * B + p];
                const float* __restrict si = strip + i * Wp;
                for (int64_t col = col0; col < a.w; ++col) o[col] = o[col] + t * si[col];
            }
        }
    }
}

// Planes p0 .. p1. B and K are passed as literals for the common sizes, so that the inner
// loops have fixed trip counts after inlining.
template <bool Compress>
UQ_INLINE void planes(const DctArgs& a, int64_t p0, int64_t p1, const int64_t B,
                      const int64_t K) {
    const int64_t plane_in = a.h * a.w;
    const int64_t plane_codes = a.hb * a.wb * kept_per_tile(a);
    const int64_t plane_y = a.hb * K * a.wb * K;
    std::vector<float> y, kept, strip, row, rows_t;
    try {
        y.resize(static_cast<size_t>(plane_y));
        if (Compress && a.fold) kept.resize(static_cast<size_t>(plane_codes));
        strip.resize(static_cast<size_t>(K * a.wb * B));  // [K, Wp]
        if (Compress && a.w != a.wb * B) row.resize(static_cast<size_t>(B * a.wb * B));
        if (Compress) rows_t.resize(static_cast<size_t>(B * K));
    } catch (...) {
        __atomic_store_n(a.failed, 1, __ATOMIC_RELAXED);
        return;
    }
    for (int64_t q = 0; Compress && q < B; ++q) {  // rows transposed: [B, K]
        for (int64_t j = 0; j < K; ++j) rows_t[q * K + j] = a.rows[j * B + q];
    }
    for (int64_t p = p0; p < p1; ++p) {
        if (Compress) {
            forward_plane(a, a.x + p * plane_in, y.data(), strip.data(), row.data(),
                          rows_t.data(), B, K);
            quantise_plane(a, y.data(), kept.data(), a.q + p * plane_codes, a.scale + p, K);
        } else {
            inverse_plane(a, a.q + p * plane_codes, a.scale[p], a.out + p * plane_in, y.data(),
                          strip.data(), B, K);
        }
    }
}

template <bool Compress>
UQ_INLINE void dispatch(const DctArgs* a, int64_t p0, int64_t p1) {
    if (a->b == 8 && a->k == 4) {
        planes<Compress>(*a, p0, p1, 8, 4);
    } else if (a->b == 8 && a->k == 8) {
        planes<Compress>(*a, p0, p1, 8, 8);
    } else if (a->b == 8 && a->k == 2) {
        planes<Compress>(*a, p0, p1, 8, 2);
    } else if (a->b == 4 && a->k == 2) {
        planes<Compress>(*a, p0, p1, 4, 2);
    } else {
        planes<Compress>(*a, p0, p1, a->b, a->k);
    }
}

UQ_CLONES void compress_range(const DctArgs* a, int64_t p0, int64_t p1) {
    dispatch<true>(a, p0, p1);
}
UQ_CLONES void decompress_range(const DctArgs* a, int64_t p0, int64_t p1) {
    dispatch<false>(a, p0, p1);
}

}  // namespace

extern "C" {

// Returns 0, or 1 when scratch memory could not be had (the caller then runs PyTorch).
int ud_compress_f32(const float* x, int64_t planes, int64_t h, int64_t w, int64_t b, int64_t k,
                    int fold, const float* down, const float* rows, int8_t* q, float* scale,
                    int threads) {
    int failed = 0;
    const int64_t hb = (h + b - 1) / b, wb = (w + b - 1) / b;
    const DctArgs args{x, q, scale, nullptr, down, rows, nullptr, h, w, b, k, hb, wb, fold,
                       &failed};
    run_split(compress_range, &args, planes, 1, threads);
    return failed;
}

int ud_decompress_f32(const int8_t* q, const float* scale, int64_t planes, int64_t h, int64_t w,
                      int64_t b, int64_t k, int fold, const float* rows, const float* up,
                      float* out, int threads) {
    int failed = 0;
    const int64_t hb = (h + b - 1) / b, wb = (w + b - 1) / b;
    const DctArgs args{nullptr, const_cast<int8_t*>(q), const_cast<float*>(scale), out, nullptr,
                       rows, up, h, w, b, k, hb, wb, fold, &failed};
    run_split(decompress_range, &args, planes, 1, threads);
    return failed;
}

}  // extern "C"
