// Native CPU kernels of the `fewbit` compressor (unroller/compress/fewbit.py): the interval
// code of each element and its bit planes, and back to the intervals' representatives.
//
// Why: the PyTorch fast path makes one full-size pass per edge (compare, subtract), one per
// bit plane (shift, mask, pack) and, to decode, unpacks each plane, widens, shifts, adds and
// gathers; here each chunk of a sample is coded and packed while it is in L1.
//
// Bit-identical to the PyTorch formulations: the code of x is the number of edges below
// it, len(edges) minus the edges e with x <= e (NaN: len(edges), as torch.bucketize
// gives), compared in the work dtype; the planes are the code's bits from the low end
// (plane sizes p0, then p1), packed as base.pack_codes packs; decoding looks the code up
// in the representatives' table, already in the output dtype. No arithmetic rounds.

#include <cstdint>

#include "native_common.h"

namespace {

using unroller_native::pack_aligned;
using unroller_native::run_split;
using unroller_native::unpack_any;

constexpr int64_t kChunk = 2048;  // codes per step: a stack buffer in L1 (a multiple of 8)

template <typename T>
struct EncodeArgs {
    const T* x;      // [n, m]
    int64_t n, m;
    const T* edges;  // ascending
    int nedges, p0, p1;
    uint8_t* out0;   // [n, bytes(m, p0)]
    uint8_t* out1;   // [n, bytes(m, p1)] or null when p1 == 0
};

template <typename T>
struct DecodeArgs {
    const uint8_t* in0;
    const uint8_t* in1;
    int64_t n, m;
    int p0, p1;
    const T* reps;  // [2**(p0 + p1)] in the output dtype
    T* out;         // [n, m]
};

int64_t bytes_of(int64_t m, int p) { return (m * p + 7) / 8; }

template <typename T>
UQ_INLINE void encode_rows(const EncodeArgs<T>& a, int64_t r0, int64_t r1) {
    uint8_t codes[kChunk], plane[kChunk];
    const int mask0 = (1 << a.p0) - 1, mask1 = (1 << a.p1) - 1;
    const int64_t b0 = bytes_of(a.m, a.p0), b1 = a.p1 ? bytes_of(a.m, a.p1) : 0;
    for (int64_t r = r0; r < r1; ++r) {
        const T* __restrict x = a.x + r * a.m;
        for (int64_t c0 = 0; c0 < a.m; c0 += kChunk) {
            const int64_t len = (a.m - c0) < kChunk ? (a.m - c0) : kChunk;
            for (int64_t i = 0; i < len; ++i) codes[i] = static_cast<uint8_t>(a.nedges);
            for (int k = 0; k < a.nedges; ++k) {
                const T e = a.edges[k];
                for (int64_t i = 0; i < len; ++i) {
                    codes[i] = static_cast<uint8_t>(codes[i] - (x[c0 + i] <= e));
                }
            }
            for (int64_t i = 0; i < len; ++i) plane[i] = static_cast<uint8_t>(codes[i] & mask0);
            pack_aligned(plane, len, a.p0, a.out0 + r * b0 + c0 * a.p0 / 8);
            if (a.p1) {
                for (int64_t i = 0; i < len; ++i) {
                    plane[i] = static_cast<uint8_t>((codes[i] >> a.p0) & mask1);
                }
                pack_aligned(plane, len, a.p1, a.out1 + r * b1 + c0 * a.p1 / 8);
            }
        }
    }
}

template <typename T>
UQ_INLINE void decode_rows(const DecodeArgs<T>& a, int64_t r0, int64_t r1) {
    uint8_t lo[kChunk], hi[kChunk];
    T table[16];  // at most 4 bits: 16 representatives
    const int p0 = a.p0, p1 = a.p1;
    for (int k = 0; k < (1 << (p0 + p1)); ++k) table[k] = a.reps[k];
    const int64_t b0 = bytes_of(a.m, p0), b1 = p1 ? bytes_of(a.m, p1) : 0;
    for (int64_t r = r0; r < r1; ++r) {
        T* __restrict out = a.out + r * a.m;
        for (int64_t c0 = 0; c0 < a.m; c0 += kChunk) {
            const int64_t len = (a.m - c0) < kChunk ? (a.m - c0) : kChunk;
            unpack_any(a.in0 + r * b0, c0, len, p0, lo);
            if (p1) {
                unpack_any(a.in1 + r * b1, c0, len, p1, hi);
                for (int64_t i = 0; i < len; ++i) {
                    lo[i] = static_cast<uint8_t>(lo[i] | (hi[i] << p0));
                }
            }
            T* __restrict o = out + c0;
            for (int64_t i = 0; i < len; ++i) o[i] = table[lo[i]];
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

}  // namespace

extern "C" {

void ufb_encode_f32(const float* x, int64_t n, int64_t m, const float* edges, int nedges, int p0,
                    int p1, uint8_t* out0, uint8_t* out1, int threads) {
    const EncodeArgs<float> args{x, n, m, edges, nedges, p0, p1, out0, out1};
    run_split(encode_f32, &args, n, 1, threads);
}

void ufb_encode_f64(const double* x, int64_t n, int64_t m, const double* edges, int nedges,
                    int p0, int p1, uint8_t* out0, uint8_t* out1, int threads) {
    const EncodeArgs<double> args{x, n, m, edges, nedges, p0, p1, out0, out1};
    run_split(encode_f64, &args, n, 1, threads);
}

void ufb_decode_f32(const uint8_t* in0, const uint8_t* in1, int64_t n, int64_t m, int p0, int p1,
                    const float* reps, float* out, int threads) {
    const DecodeArgs<float> args{in0, in1, n, m, p0, p1, reps, out};
    run_split(decode_f32, &args, n, 1, threads);
}

void ufb_decode_f64(const uint8_t* in0, const uint8_t* in1, int64_t n, int64_t m, int p0,
                    int p1, const double* reps, double* out, int threads) {
    const DecodeArgs<double> args{in0, in1, n, m, p0, p1, reps, out};
    run_split(decode_f64, &args, n, 1, threads);
}

}  // extern "C"
