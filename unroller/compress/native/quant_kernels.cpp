// Native CPU kernels of the `quant` compressor (unroller/compress/quant.py).
//
// Why: the pure-PyTorch fast path reads and writes each block several times (min/max,
// subtract, divide, round, clamp, cast, pack); these kernels do quantise + pack and
// unpack + dequantise in one pass over each group, which stays in the cache. They are
// compiled on demand by unroller/compress/native/__init__.py (no PyTorch headers: a plain
// shared library called through ctypes) and are an optional accelerator: every result is
// bit-identical to the PyTorch formulations, which is why
//   - it is built with -ffp-contract=off and without -ffast-math: every operation below is
//     one IEEE-754 operation in the work dtype, in the order the PyTorch code performs it;
//   - per-group constants use only exact scalars (0.5, 0.25 * max, 2**bits - 1);
//   - the order of the min/max reduction does not matter: NaN is tracked apart and a zero
//     min or max is +0, as in the PyTorch formulations.
// The layout and formulas are those documented on `Quant`: codes of a sample are
// contiguous, code i of a byte in bits bits*i .. bits*i + bits - 1, the last group of a
// sample padded (with its last element, which changes no min/max; padded codes not stored).

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "native_common.h"

// GCC 12+ and Clang: lane shuffles of vector types, for the short-group paths below.
#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define UQ_SHUFFLE 1
#endif
#endif

namespace {

using unroller_native::cpu_has_avx2;
using unroller_native::pack_aligned;
using unroller_native::pack_any;
using unroller_native::run_split;

constexpr int64_t kChunk = 2048;  // codes per step of a group: a stack buffer in L1

template <typename T>
struct Stats {
    T lo, hi;
};

// B bytes of T as one GCC/Clang vector. 32 bytes where the CPU has AVX2 (one register;
// wider vectors of compares and selects are lowered badly by GCC 12 for AVX2), else 16
// (SSE, NEON): ``cpu_has_avx2()`` chooses at run time, since one source serves every clone.
template <typename T, int B>
struct Wide {
    typedef T type __attribute__((vector_size(B)));
};

template <typename T, int B>
UQ_INLINE Stats<T> min_max(const T* __restrict x, int64_t len) {
    typedef typename Wide<T, B>::type W;
    constexpr int lanes = sizeof(W) / sizeof(T);
    T lo_s = x[0], hi_s = x[0], z_s = T(0);
    int64_t i = 0;
    if (len >= 2 * lanes) {
        // Four running vectors each: one would be a chain of dependent min/max/add
        // instructions, bound by their latency (min and max are exact, and z only tells
        // whether a NaN or inf was seen, so any order gives the same result).
        W lo, hi, z = {};
        std::memcpy(&lo, x, sizeof(W));
        hi = lo;
        W lo1 = lo, lo2 = lo, lo3 = lo, hi1 = lo, hi2 = lo, hi3 = lo, z1 = z, z2 = z, z3 = z;
        for (; i + 4 * lanes <= len; i += 4 * lanes) {
            W v0, v1, v2, v3;
            std::memcpy(&v0, x + i, sizeof(W));
            std::memcpy(&v1, x + i + lanes, sizeof(W));
            std::memcpy(&v2, x + i + 2 * lanes, sizeof(W));
            std::memcpy(&v3, x + i + 3 * lanes, sizeof(W));
            lo = v0 < lo ? v0 : lo;
            lo1 = v1 < lo1 ? v1 : lo1;
            lo2 = v2 < lo2 ? v2 : lo2;
            lo3 = v3 < lo3 ? v3 : lo3;
            hi = v0 > hi ? v0 : hi;
            hi1 = v1 > hi1 ? v1 : hi1;
            hi2 = v2 > hi2 ? v2 : hi2;
            hi3 = v3 > hi3 ? v3 : hi3;
            z += v0 - v0;
            z1 += v1 - v1;
            z2 += v2 - v2;
            z3 += v3 - v3;
        }
        for (; i + lanes <= len; i += lanes) {
            W v;
            std::memcpy(&v, x + i, sizeof(W));
            lo = v < lo ? v : lo;
            hi = v > hi ? v : hi;
            z += v - v;
        }
        lo1 = lo1 < lo ? lo1 : lo;
        lo3 = lo3 < lo2 ? lo3 : lo2;
        lo = lo3 < lo1 ? lo3 : lo1;
        hi1 = hi1 > hi ? hi1 : hi;
        hi3 = hi3 > hi2 ? hi3 : hi2;
        hi = hi3 > hi1 ? hi3 : hi1;
        z = (z + z1) + (z2 + z3);
        for (int k = 0; k < lanes; ++k) {
            lo_s = lo[k] < lo_s ? lo[k] : lo_s;
            hi_s = hi[k] > hi_s ? hi[k] : hi_s;
            z_s += z[k];
        }
    }
    for (; i < len; ++i) {
        const T v = x[i];
        lo_s = v < lo_s ? v : lo_s;
        hi_s = v > hi_s ? v : hi_s;
        z_s += v - v;
    }
    Stats<T> s{lo_s, hi_s};
    if (z_s != z_s) {  // a NaN or an infinity: is there a NaN?
        for (int64_t j = 0; j < len; ++j) {
            if (x[j] != x[j]) {
                s.lo = s.hi = std::numeric_limits<T>::quiet_NaN();
                break;
            }
        }
    }
    if (s.lo == T(0)) s.lo = T(0);  // -0.0 -> +0.0
    if (s.hi == T(0)) s.hi = T(0);
    return s;
}

// codes[i] = clamp(round((x*s - ls) / ss)) (or floor(. + noise)), NaN -> 0, as uint8.
template <typename T>
UQ_INLINE void codes_of(const T* __restrict x, const T* __restrict noise, int64_t len, T s,
                        T ls, T ss, T levels, uint8_t* __restrict codes) {
    // A loop over len alone is vectorised 64 codes at a time (the uint8 output sets the
    // width), so a small group (16, 32 elements) ran entirely in its scalar remainder:
    // below 64, blocks of 16 with a fixed trip count, then the rest.
    constexpr int64_t kBlock = 16;
    const int64_t whole = len >= 64 ? 0 : len - len % kBlock;
    if (noise == nullptr && s == T(1)) {  // x * 1 is x, bit for bit: skip the multiply
        auto code = [&](int64_t i) {
            T v = std::rint((x[i] - ls) / ss);
            v = v >= T(0) ? (v <= levels ? v : levels) : T(0);  // NaN -> 0
            codes[i] = static_cast<uint8_t>(static_cast<int32_t>(v));
        };
        for (int64_t i = 0; i < whole; i += kBlock) {
            for (int64_t j = 0; j < kBlock; ++j) code(i + j);
        }
        for (int64_t i = whole; i < len; ++i) code(i);
    } else if (noise == nullptr) {
        auto code = [&](int64_t i) {
            T v = std::rint((x[i] * s - ls) / ss);
            v = v >= T(0) ? (v <= levels ? v : levels) : T(0);  // NaN -> 0
            codes[i] = static_cast<uint8_t>(static_cast<int32_t>(v));
        };
        for (int64_t i = 0; i < whole; i += kBlock) {
            for (int64_t j = 0; j < kBlock; ++j) code(i + j);
        }
        for (int64_t i = whole; i < len; ++i) code(i);
    } else {
        for (int64_t i = 0; i < len; ++i) {
            T v = std::floor((x[i] * s - ls) / ss + noise[i]);
            v = v >= T(0) ? (v <= levels ? v : levels) : T(0);
            codes[i] = static_cast<uint8_t>(static_cast<int32_t>(v));
        }
    }
}

template <typename T>
UQ_INLINE T dequant(T q, T a, T b, T t, T z, T fmax) {
    T v = (q * a + b) * t;
    v = v < -fmax ? -fmax : v;  // NaN stays NaN
    v = v > fmax ? fmax : v;
    return v + z;
}

#ifdef UQ_SHUFFLE
// Short groups (8 to 128 float32 elements, 8-bit codes, nearest rounding, AVX2): one group
// is one to sixteen 8-lane vectors, so the general loops spent most of their time outside
// the vector work (a scalar reduction of each lane vector, loop set-up, masked tails):
// 1024 groups of 16 took 36 us to encode and 18 to decode, now 11 and 6.5 (groups of 64:
// 8.5 -> 7.8 and 4.6 -> 4.1). Here a group is a few vector operations and a tree
// of lane shuffles, with the same results bit for bit:
//   - min and max are exact in any order, and the NaN test (a sum of x - x, NaN when any
//     x is NaN or infinite) does not depend on the order either;
//   - clamping before rounding gives the same integer code as rounding before clamping
//     (levels is an integer, and NaN goes to 0 either way), and on [0, levels] the sum and
//     difference with 2**23 is round-to-nearest-even, exactly std::rint.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"  // 32-byte vectors in always-inline helpers only
#endif
typedef float F8 __attribute__((vector_size(32)));
typedef uint8_t U8x8 __attribute__((vector_size(8)));
typedef uint8_t U8x32 __attribute__((vector_size(32)));
typedef uint32_t U32x8 __attribute__((vector_size(32)));

UQ_INLINE F8 lanes_min(F8 v) {  // every lane: the minimum of the 8 (NaN lanes ignored)
    F8 t = __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
    v = t < v ? t : v;
    t = __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
    v = t < v ? t : v;
    t = __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6);
    return t < v ? t : v;
}

UQ_INLINE F8 lanes_max(F8 v) {
    F8 t = __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
    v = t > v ? t : v;
    t = __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
    v = t > v ? t : v;
    t = __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6);
    return t > v ? t : v;
}

UQ_INLINE F8 lanes_sum(F8 v) {  // used only as "is any lane NaN": any order will do
    v = v + __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
    v = v + __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
    return v + __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6);
}

UQ_INLINE F8 splat(float v) { return F8{v, v, v, v, v, v, v, v}; }

template <int G>
UQ_INLINE void encode_short_group(const float* __restrict x, float* mn, float* scale,
                                  uint8_t* __restrict out) {
    constexpr int kVecs = G / 8;
    const float levels = 255.0f;
    const float big_range = std::numeric_limits<float>::max() * 0.25f;
    F8 v[kVecs];
    for (int j = 0; j < kVecs; ++j) std::memcpy(&v[j], x + 8 * j, sizeof(F8));
    F8 lo = v[0], hi = v[0], z = v[0] - v[0];
    for (int j = 1; j < kVecs; ++j) {
        lo = v[j] < lo ? v[j] : lo;
        hi = v[j] > hi ? v[j] : hi;
        z = z + (v[j] - v[j]);
    }
    float st_lo = lanes_min(lo)[0], st_hi = lanes_max(hi)[0];
    const float z_s = lanes_sum(z)[0];
    if (z_s != z_s) {  // a NaN or an infinity: is there a NaN?
        for (int j = 0; j < G; ++j) {
            if (x[j] != x[j]) {
                st_lo = st_hi = std::numeric_limits<float>::quiet_NaN();
                break;
            }
        }
    }
    if (st_lo == 0.0f) st_lo = 0.0f;  // -0.0 -> +0.0
    if (st_hi == 0.0f) st_hi = 0.0f;
    // the group's constants, as encode_rows computes them
    const float d = st_hi * 0.5f - st_lo * 0.5f;
    const float s = d > big_range ? 0.5f : 1.0f;
    const float per_level = (st_hi * s - st_lo * s) / levels;
    const float sc = s == 1.0f ? per_level : per_level / s;
    const float safe = sc > 0.0f ? sc : 1.0f;
    *mn = st_lo;
    *scale = sc;
    const F8 ls = splat(st_lo * s), ss = splat(safe * s), zero = splat(0.0f);
    const F8 top = splat(levels), magic = splat(8388608.0f);  // 2**23
    for (int j = 0; j < kVecs; ++j) {
        F8 q = s == 1.0f ? (v[j] - ls) / ss : (v[j] * s - ls) / ss;  // x * 1 is x
        q = q >= zero ? (q <= top ? q : top) : zero;  // NaN -> 0
        // q + 2**23 on [0, levels] is 2**23 + rint(q), exactly: rint(q) is the low byte
        // of each lane's bits
        const F8 r = q + magic;
        U8x32 b;
        std::memcpy(&b, &r, sizeof(F8));
        const U8x8 code = __builtin_shufflevector(b, b, 0, 4, 8, 12, 16, 20, 24, 28);
        std::memcpy(out + 8 * j, &code, 8);
    }
}

template <int G>
UQ_INLINE void decode_short_group(const uint8_t* __restrict c, float mn, float sc,
                                  float* __restrict out) {
    // the group's terms, as decode_rows computes them (dequant, lane by lane)
    const float fmax = std::numeric_limits<float>::max();
    const bool big = static_cast<double>(sc) > static_cast<double>(fmax) / (2.0 * 255.0);
    const float s = big ? 0.5f : 1.0f;
    const F8 ga = splat(sc * s), gb = splat(mn * s), gt = splat(big ? 2.0f : 1.0f);
    const F8 gz = splat(sc - sc), hi = splat(fmax), lo = splat(-fmax);
    const F8 magic = splat(8388608.0f);  // 2**23
    const U32x8 shifts = {0, 8, 16, 24, 0, 8, 16, 24};
    for (int j = 0; j < G / 8; ++j) {
        uint32_t w0, w1;  // codes 8j .. 8j + 3 and 8j + 4 .. 8j + 7
        std::memcpy(&w0, c + 8 * j, 4);
        std::memcpy(&w1, c + 8 * j + 4, 4);
        const U32x8 w = {w0, w0, w0, w0, w1, w1, w1, w1};
        // code k in the low byte of lane k, beside the exponent of 2**23: 2**23 + code
        const U32x8 bits = ((w >> shifts) & 0xFFu) | 0x4B000000u;
        F8 q;
        std::memcpy(&q, &bits, sizeof(F8));
        q = q - magic;  // the code, exactly
        F8 v = (q * ga + gb) * gt;
        v = v < lo ? lo : v;  // NaN stays NaN
        v = v > hi ? hi : v;
        v = v + gz;
        std::memcpy(out + 8 * j, &v, sizeof(F8));
    }
}
#endif

template <typename T>
struct EncodeArgs {
    const T* x;      // [n, m]
    const T* noise;  // [n, groups * g] or null
    int64_t n, m, g, groups;
    int bits;
    uint8_t* out;  // [n, bytes]
    T* mn;         // [n, groups]
    T* scale;      // [n, groups]
    bool wide;     // cpu_has_avx2()
};

// Rows (sample, group) r0 .. r1 of the encoding; when groups are not byte-aligned the
// range covers whole samples, whose bytes are zeroed here first.
// Whether rows r0 .. r1 take a short-group path: float32, 8-bit codes, nearest rounding,
// AVX2, groups of exactly g in {8, 16, 32, 64, 128} elements (so group r starts at element r * g of
// the input and of the codes); ``fn`` runs it per group.
int generic_only = 0;  // uq_set_generic(1): the general loops even for short groups (tests)

template <typename T, typename A>
UQ_INLINE bool short_groups(const A& a) {
#ifdef UQ_SHUFFLE
    return sizeof(T) == 4 && a.bits == 8 && !generic_only && cpu_has_avx2() && a.m % a.g == 0 &&
           (a.g == 8 || a.g == 16 || a.g == 32 || a.g == 64 || a.g == 128);
#else
    (void)a;
    return false;
#endif
}

template <typename T>
UQ_INLINE void encode_rows(const EncodeArgs<T>& a, int64_t r0, int64_t r1) {
#ifdef UQ_SHUFFLE
    if constexpr (sizeof(T) == 4) {
        if (a.noise == nullptr && short_groups<T>(a)) {
            const int64_t g = a.g;
            for (int64_t r = r0; r < r1; ++r) {
                const float* x = a.x + r * g;
                uint8_t* out = a.out + r * g;
                if (g == 16) {
                    encode_short_group<16>(x, a.mn + r, a.scale + r, out);
                } else if (g == 8) {
                    encode_short_group<8>(x, a.mn + r, a.scale + r, out);
                } else if (g == 32) {
                    encode_short_group<32>(x, a.mn + r, a.scale + r, out);
                } else if (g == 64) {
                    encode_short_group<64>(x, a.mn + r, a.scale + r, out);
                } else {
                    encode_short_group<128>(x, a.mn + r, a.scale + r, out);
                }
            }
            return;
        }
    }
#endif
    const int per = 8 / a.bits;
    const int64_t bytes = (a.m + per - 1) / per;
    const bool aligned = a.g % per == 0;
    const T levels = static_cast<T>((1 << a.bits) - 1);
    const T big_range = std::numeric_limits<T>::max() * T(0.25);
    uint8_t codes[kChunk];
    int64_t i = r0 / a.groups, k = r0 % a.groups;  // then counted: no division per group
    for (int64_t r = r0; r < r1; ++r, k = k + 1 == a.groups ? (++i, 0) : k + 1) {
        const int64_t j0 = k * a.g;
        const int64_t len = (a.m - j0) < a.g ? (a.m - j0) : a.g;
        const T* x = a.x + i * a.m + j0;
        uint8_t* out = a.out + i * bytes;
        if (!aligned && k == 0) std::memset(out, 0, static_cast<size_t>(bytes));
        const Stats<T> st = a.wide ? min_max<T, 32>(x, len) : min_max<T, 16>(x, len);
        // s = 1/2 where mx - mn might not fit the dtype: (mx * s - mn * s) / levels / s
        const T d = st.hi * T(0.5) - st.lo * T(0.5);
        const T s = d > big_range ? T(0.5) : T(1);
        const T per_level = (st.hi * s - st.lo * s) / levels;
        const T scale = s == T(1) ? per_level : per_level / s;  // v / 1 is v: one division less
        const T safe = scale > T(0) ? scale : T(1);
        const T ls = st.lo * s, ss = safe * s;
        a.mn[r] = st.lo;
        a.scale[r] = scale;
        const T* noise = a.noise ? a.noise + i * a.groups * a.g + j0 : nullptr;
        for (int64_t c0 = 0; c0 < len; c0 += kChunk) {
            const int64_t cl = (len - c0) < kChunk ? (len - c0) : kChunk;
            if (a.bits == 8) {  // the codes are the bytes: straight into the output
                codes_of(x + c0, noise ? noise + c0 : nullptr, cl, s, ls, ss, levels,
                         out + j0 + c0);
                continue;
            }
            codes_of(x + c0, noise ? noise + c0 : nullptr, cl, s, ls, ss, levels, codes);
            if (aligned) {
                pack_aligned(codes, cl, a.bits, out + (j0 + c0) / per);
            } else {
                pack_any(codes, cl, a.bits, j0 + c0, out);
            }
        }
    }
}

template <typename T>
struct DecodeArgs {
    const uint8_t* codes;  // [n, bytes]
    const T* mn;           // [n, groups]
    const T* scale;        // [n, groups]
    int64_t n, m, g, groups;
    int bits;
    T* out;  // [n, m]
};

template <typename T>
UQ_INLINE void decode_rows(const DecodeArgs<T>& a, int64_t r0, int64_t r1) {
#ifdef UQ_SHUFFLE
    if constexpr (sizeof(T) == 4) {
        if (short_groups<T>(a)) {
            const int64_t g = a.g;
            for (int64_t r = r0; r < r1; ++r) {
                const uint8_t* c = a.codes + r * g;
                float* out = a.out + r * g;
                if (g == 16) {
                    decode_short_group<16>(c, a.mn[r], a.scale[r], out);
                } else if (g == 8) {
                    decode_short_group<8>(c, a.mn[r], a.scale[r], out);
                } else if (g == 32) {
                    decode_short_group<32>(c, a.mn[r], a.scale[r], out);
                } else if (g == 64) {
                    decode_short_group<64>(c, a.mn[r], a.scale[r], out);
                } else {
                    decode_short_group<128>(c, a.mn[r], a.scale[r], out);
                }
            }
            return;
        }
    }
#endif
    const int per = 8 / a.bits;
    const int64_t bytes = (a.m + per - 1) / per;
    const int mask = (1 << a.bits) - 1;
    const T fmax = std::numeric_limits<T>::max();
    const double big_scale = static_cast<double>(fmax) / (2.0 * ((1 << a.bits) - 1));
    const bool aligned = a.g % per == 0;
    int64_t i = r0 / a.groups, k = r0 % a.groups;  // then counted: no division per group
    for (int64_t r = r0; r < r1; ++r, k = k + 1 == a.groups ? (++i, 0) : k + 1) {
        const int64_t j0 = k * a.g;
        const int64_t len = (a.m - j0) < a.g ? (a.m - j0) : a.g;
        const uint8_t* in = a.codes + i * bytes;
        T* __restrict out = a.out + i * a.m + j0;
        // the group's terms, as the PyTorch path computes them: s = 1/2 where q * scale + mn
        // might overflow on the way (scale > max / (2 * levels)), a = scale * s, b = mn * s,
        // times 1/s (1 or 2), plus scale - scale (+0, or NaN for a non-finite group)
        const T sc = a.scale[r];
        const bool big = static_cast<double>(sc) > big_scale;
        const T s = big ? T(0.5) : T(1);
        const T ga = sc * s, gb = a.mn[r] * s, gt = big ? T(2) : T(1), gz = sc - sc;
        if (a.bits == 8) {
            // below 64, blocks of 16 with a fixed trip count (as codes_of, for the same reason)
            const uint8_t* __restrict c = in + j0;
            const int64_t whole = len >= 64 ? 0 : len - len % 16;
            for (int64_t t0 = 0; t0 < whole; t0 += 16) {
                for (int64_t t = t0; t < t0 + 16; ++t) {
                    out[t] = dequant(T(c[t]), ga, gb, gt, gz, fmax);
                }
            }
            for (int64_t t = whole; t < len; ++t) out[t] = dequant(T(c[t]), ga, gb, gt, gz, fmax);
        } else if (aligned) {
            const uint8_t* __restrict c = in + j0 / per;
            const int64_t whole = len / per;
            if (a.bits == 4) {
                for (int64_t kk = 0; kk < whole; ++kk) {
                    const int v = c[kk];
                    out[2 * kk] = dequant(T(v & 15), ga, gb, gt, gz, fmax);
                    out[2 * kk + 1] = dequant(T(v >> 4), ga, gb, gt, gz, fmax);
                }
            } else {
                for (int64_t kk = 0; kk < whole; ++kk) {
                    const int v = c[kk];
                    out[4 * kk] = dequant(T(v & 3), ga, gb, gt, gz, fmax);
                    out[4 * kk + 1] = dequant(T((v >> 2) & 3), ga, gb, gt, gz, fmax);
                    out[4 * kk + 2] = dequant(T((v >> 4) & 3), ga, gb, gt, gz, fmax);
                    out[4 * kk + 3] = dequant(T(v >> 6), ga, gb, gt, gz, fmax);
                }
            }
            for (int64_t t = whole * per; t < len; ++t) {
                const int v = (c[t / per] >> (a.bits * (t % per))) & mask;
                out[t] = dequant(T(v), ga, gb, gt, gz, fmax);
            }
        } else {
            for (int64_t t = 0; t < len; ++t) {
                const int64_t j = j0 + t;
                const int v = (in[j / per] >> (a.bits * (j % per))) & mask;
                out[t] = dequant(T(v), ga, gb, gt, gz, fmax);
            }
        }
    }
}

UQ_CLONES void encode_f32(const EncodeArgs<float>* a, int64_t r0, int64_t r1) {
    encode_rows(*a, r0, r1);
}
UQ_CLONES void encode_f64(const EncodeArgs<double>* a, int64_t r0, int64_t r1) {
    encode_rows(*a, r0, r1);
}
UQ_CLONES void decode_f32(const DecodeArgs<float>* a, int64_t r0, int64_t r1) {
    decode_rows(*a, r0, r1);
}
UQ_CLONES void decode_f64(const DecodeArgs<double>* a, int64_t r0, int64_t r1) {
    decode_rows(*a, r0, r1);
}

template <typename T>
void encode(void (*fn)(const EncodeArgs<T>*, int64_t, int64_t), const T* x, const T* noise,
            int64_t n, int64_t m, int64_t g, int bits, uint8_t* out, T* mn, T* scale,
            int threads) {
    const int64_t groups = (m + g - 1) / g;
    const EncodeArgs<T> args{x, noise, n, m, g, groups, bits, out, mn, scale, cpu_has_avx2()};
    const int per = 8 / bits;
    run_split(fn, &args, n * groups, g % per == 0 ? 1 : groups, threads);
}

template <typename T>
void decode(void (*fn)(const DecodeArgs<T>*, int64_t, int64_t), const uint8_t* codes,
            const T* mn, const T* scale, int64_t n, int64_t m, int64_t g, int bits, T* out,
            int threads) {
    const int64_t groups = (m + g - 1) / g;
    const DecodeArgs<T> args{codes, mn, scale, n, m, g, groups, bits, out};
    run_split(fn, &args, n * groups, 1, threads);
}

}  // namespace

extern "C" {

// Bumped whenever an entry point's meaning or signature changes (checked by the loader).
int uq_abi_version() { return 5; }

// Tests: 1 makes every call take the general loops (the short-group paths off), 0 restores.
void uq_set_generic(int on) { generic_only = on; }

void uq_encode_f32(const float* x, const float* noise, int64_t n, int64_t m, int64_t g, int bits,
                   uint8_t* out, float* mn, float* scale, int threads) {
    encode(encode_f32, x, noise, n, m, g, bits, out, mn, scale, threads);
}

void uq_encode_f64(const double* x, const double* noise, int64_t n, int64_t m, int64_t g,
                   int bits, uint8_t* out, double* mn, double* scale, int threads) {
    encode(encode_f64, x, noise, n, m, g, bits, out, mn, scale, threads);
}

void uq_decode_f32(const uint8_t* codes, const float* mn, const float* scale, int64_t n,
                   int64_t m, int64_t g, int bits, float* out, int threads) {
    decode(decode_f32, codes, mn, scale, n, m, g, bits, out, threads);
}

void uq_decode_f64(const uint8_t* codes, const double* mn, const double* scale, int64_t n,
                   int64_t m, int64_t g, int bits, double* out, int threads) {
    decode(decode_f64, codes, mn, scale, n, m, g, bits, out, threads);
}

}  // extern "C"
