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
//
// How it is fast: the code width is a template parameter, so the edges and the table are
// fixed-size arrays and the loops have fixed trip counts. On x86-64 CPUs with AVX2 (looked
// up once), float32 chunks take explicit AVX2 steps: 32 values to 32 code bytes by one
// compare-and-count per edge, each plane by a shift and a movemask (1 bit) or shift-or
// steps and a pack (2 and 4 bits); back, 8 codes per step by per-lane shifts and one
// permute of the table held in a register. Elsewhere (other CPUs, float64, tails) the
// portable chunks run: eight code bytes in a 64-bit word to p bits each and back by
// shift-and-mask steps, and a table lookup. Both give the same bits (the tests compare
// them through ufb_set_generic).

#include <cstdint>
#include <cstring>

#include "native_common.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define UFB_X86 1
#define UFB_AVX2 __attribute__((target("avx2"))) static
#else
#define UFB_X86 0
#endif

namespace {

using unroller_native::cpu_has_avx2;
using unroller_native::run_split;

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

// Eight codes of `bits` bits, one per byte of w (byte s holds code s), packed into the low
// 8 * bits bits: code s at bits bits*s .. (the layout of base.pack_codes, little-endian).
UQ_INLINE uint64_t pack8(uint64_t w, int bits) {
    if (bits == 1) {
        w &= 0x0101010101010101ull;
        w = (w | (w >> 7)) & 0x0003000300030003ull;
        w = (w | (w >> 14)) & 0x0000000F0000000Full;
        return (w | (w >> 28)) & 0xFFull;
    }
    if (bits == 2) {
        w &= 0x0303030303030303ull;
        w = (w | (w >> 6)) & 0x000F000F000F000Full;
        w = (w | (w >> 12)) & 0x000000FF000000FFull;
        return (w | (w >> 24)) & 0xFFFFull;
    }
    if (bits == 4) {
        w &= 0x0F0F0F0F0F0F0F0Full;
        w = (w | (w >> 4)) & 0x00FF00FF00FF00FFull;
        w = (w | (w >> 8)) & 0x0000FFFF0000FFFFull;
        return (w | (w >> 16)) & 0xFFFFFFFFull;
    }
    return w;  // 8 bits: the bytes themselves
}

// The inverse of pack8: 8 * bits packed bits to eight codes, one per byte.
UQ_INLINE uint64_t spread8(uint64_t v, int bits) {
    if (bits == 1) {
        v = (v | (v << 28)) & 0x0000000F0000000Full;
        v = (v | (v << 14)) & 0x0003000300030003ull;
        return (v | (v << 7)) & 0x0101010101010101ull;
    }
    if (bits == 2) {
        v = (v | (v << 24)) & 0x000000FF000000FFull;
        v = (v | (v << 12)) & 0x000F000F000F000Full;
        return (v | (v << 6)) & 0x0303030303030303ull;
    }
    if (bits == 4) {
        v = (v | (v << 16)) & 0x0000FFFF0000FFFFull;
        v = (v | (v << 8)) & 0x00FF00FF00FF00FFull;
        return (v | (v << 4)) & 0x0F0F0F0F0F0F0F0Full;
    }
    return v;
}

// Pack `len` codes (bytes; codes past len are zero) of plane bits `shift .. shift + p - 1`
// into out (bytes_of(len, p) bytes; the last one zero-padded).
template <int P>
UQ_INLINE void pack_plane_p(const uint8_t* __restrict codes, int64_t len, int shift,
                            uint8_t* __restrict out) {
    constexpr int p = P;
    const int64_t groups = len / 8;
    for (int64_t g = 0; g < groups; ++g) {
        uint64_t w;
        std::memcpy(&w, codes + 8 * g, 8);
        const uint64_t v = pack8(w >> shift, p);  // bits crossing a byte are masked off
        std::memcpy(out + g * p, &v, static_cast<size_t>(p));  // little-endian
    }
    if (len % 8) {
        uint64_t w;
        std::memcpy(&w, codes + 8 * groups, 8);
        const uint64_t v = pack8(w >> shift, p);
        std::memcpy(out + groups * p, &v, static_cast<size_t>(bytes_of(len % 8, p)));
    }
}

// The first `len` codes of a packed plane of p bits (from its first byte), ORed into codes
// at bit `shift` (the word past len may get the plane's zero padding bits; never read).
template <int P, bool First>
UQ_INLINE void unpack_plane_p(const uint8_t* __restrict b, int64_t len, int shift,
                              uint8_t* __restrict codes) {
    constexpr int p = P;
    const int64_t groups = len / 8;
    for (int64_t g = 0; g < groups; ++g) {
        uint64_t v = 0;
        std::memcpy(&v, b + g * p, static_cast<size_t>(p));
        const uint64_t w = spread8(v, p) << shift;
        if (First) {
            std::memcpy(codes + 8 * g, &w, 8);
        } else {
            uint64_t c;
            std::memcpy(&c, codes + 8 * g, 8);
            c |= w;
            std::memcpy(codes + 8 * g, &c, 8);
        }
    }
    if (len % 8) {
        uint64_t v = 0;
        std::memcpy(&v, b + groups * p, static_cast<size_t>(bytes_of(len % 8, p)));
        const uint64_t w = spread8(v, p) << shift;
        uint64_t c = 0;
        if (!First) std::memcpy(&c, codes + 8 * groups, 8);
        c |= w;
        std::memcpy(codes + 8 * groups, &c, 8);
    }
}

UQ_INLINE void pack_plane(const uint8_t* __restrict codes, int64_t len, int shift, int p,
                          uint8_t* __restrict out) {
    switch (p) {
        case 1: pack_plane_p<1>(codes, len, shift, out); break;
        case 2: pack_plane_p<2>(codes, len, shift, out); break;
        case 4: pack_plane_p<4>(codes, len, shift, out); break;
        default: pack_plane_p<8>(codes, len, shift, out); break;
    }
}

template <bool First>
UQ_INLINE void unpack_plane(const uint8_t* __restrict in, int64_t len, int shift,
                            int p, uint8_t* __restrict codes) {
    switch (p) {
        case 1: unpack_plane_p<1, First>(in, len, shift, codes); break;
        case 2: unpack_plane_p<2, First>(in, len, shift, codes); break;
        case 4: unpack_plane_p<4, First>(in, len, shift, codes); break;
        default: unpack_plane_p<8, First>(in, len, shift, codes); break;
    }
}

// One chunk of a sample: `len` values to their codes, and the codes' planes into out0
// (bits 0 .. p0 - 1) and out1 (bits p0 .. p0 + p1 - 1). Bits = 0: any number of edges (a
// loop bound the compiler does not know; the codes must fit the planes).
template <typename T, int Bits>
UQ_INLINE void encode_chunk(const T* __restrict x, int64_t len, const T* __restrict edges,
                            int nedges, int p0, int p1, uint8_t* __restrict out0,
                            uint8_t* __restrict out1) {
    const int kEdges = Bits ? (1 << Bits) - 1 : nedges;
    alignas(64) uint8_t codes[kChunk + 8];
    T local[15];  // Bits > 0: the edges in a fixed-size array
    const T* e = edges;
    if (Bits) {
        for (int k = 0; k < kEdges; ++k) local[k] = edges[k];
        e = local;
    }
    for (int64_t i = 0; i < len; ++i) {
        const T v = x[i];
        int c = kEdges;
        for (int k = 0; k < kEdges; ++k) c -= v <= e[k] ? 1 : 0;
        codes[i] = static_cast<uint8_t>(c);
    }
    std::memset(codes + len, 0, 8);
    pack_plane(codes, len, 0, p0, out0);
    if (p1) pack_plane(codes, len, p0, p1, out1);
}

// One chunk back: the codes of planes in0 / in1 (from the chunk's first byte) through the
// table into out.
template <typename T, int Bits>
UQ_INLINE void decode_chunk(const uint8_t* __restrict in0, const uint8_t* __restrict in1,
                            int64_t len, int p0, int p1, const T* __restrict table,
                            T* __restrict out) {
    constexpr int kLevels = 1 << Bits;
    alignas(64) uint8_t codes[kChunk + 8];
    unpack_plane<true>(in0, len, 0, p0, codes);
    if (p1) unpack_plane<false>(in1, len, p0, p1, codes);
    for (int64_t i = 0; i < len; ++i) out[i] = table[codes[i] & (kLevels - 1)];
}

#if UFB_X86
// AVX2 chunks (float32): 32 values per step to 32 code bytes, each plane by a byte shift
// and a movemask (1 bit) or shift-or-and steps and a pack (2 and 4 bits); back, 8 codes per
// step by per-lane variable shifts and one permute of the table held in registers. Only
// compares, bit fields and a table lookup, so the same bits as the generic chunks; the
// tail (len % 32, len % 8) goes through those.

UFB_AVX2 void pack32(__m256i codes, int shift, int p, uint8_t* out) {
    const __m128i s = _mm_cvtsi32_si128(shift);
    if (p == 1) {
        const int m = _mm256_movemask_epi8(_mm256_sll_epi16(codes, _mm_cvtsi32_si128(7 - shift)));
        std::memcpy(out, &m, 4);
    } else if (p == 2) {
        __m256i b = _mm256_and_si256(_mm256_srl_epi16(codes, s), _mm256_set1_epi8(3));
        b = _mm256_and_si256(_mm256_or_si256(b, _mm256_srli_epi16(b, 6)), _mm256_set1_epi16(0x0F));
        b = _mm256_and_si256(_mm256_or_si256(b, _mm256_srli_epi32(b, 12)), _mm256_set1_epi32(0xFF));
        b = _mm256_packus_epi32(b, b);
        b = _mm256_packus_epi16(b, b);  // [bytes 0-3 x4 | bytes 4-7 x4]
        const int lo = _mm256_extract_epi32(b, 0), hi = _mm256_extract_epi32(b, 4);
        std::memcpy(out, &lo, 4);
        std::memcpy(out + 4, &hi, 4);
    } else {  // 4
        __m256i b = _mm256_and_si256(_mm256_srl_epi16(codes, s), _mm256_set1_epi8(0x0F));
        b = _mm256_and_si256(_mm256_or_si256(b, _mm256_srli_epi16(b, 4)), _mm256_set1_epi16(0xFF));
        b = _mm256_packus_epi16(b, b);  // [bytes 0-7 x2 | bytes 8-15 x2]
        _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm256_castsi256_si128(b));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(out + 8), _mm256_extracti128_si256(b, 1));
    }
}

UFB_AVX2 __m256i codes8(__m256 v, const __m256* e, int nedges) {
    __m256i c = _mm256_set1_epi32(nedges);
    for (int k = 0; k < nedges; ++k) {  // minus one per edge e with v <= e (false for NaN)
        c = _mm256_add_epi32(c, _mm256_castps_si256(_mm256_cmp_ps(v, e[k], _CMP_LE_OQ)));
    }
    return c;
}

template <int Bits>
UFB_AVX2 void encode_chunk_avx2(const float* x, int64_t len, const float* edges, int p0, int p1,
                                uint8_t* out0, uint8_t* out1) {
    constexpr int kEdges = (1 << Bits) - 1;
    __m256 e[kEdges];
    for (int k = 0; k < kEdges; ++k) e[k] = _mm256_set1_ps(edges[k]);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const int64_t groups = len / 32;
    for (int64_t g = 0; g < groups; ++g) {
        const float* v = x + 32 * g;
        const __m256i c0 = codes8(_mm256_loadu_ps(v), e, kEdges);
        const __m256i c1 = codes8(_mm256_loadu_ps(v + 8), e, kEdges);
        const __m256i c2 = codes8(_mm256_loadu_ps(v + 16), e, kEdges);
        const __m256i c3 = codes8(_mm256_loadu_ps(v + 24), e, kEdges);
        const __m256i b = _mm256_packus_epi16(_mm256_packs_epi32(c0, c1), _mm256_packs_epi32(c2, c3));
        const __m256i codes = _mm256_permutevar8x32_epi32(b, order);
        pack32(codes, 0, p0, out0 + 4 * p0 * g);
        if (p1) pack32(codes, p0, p1, out1 + 4 * p1 * g);
    }
    if (len % 32) {
        encode_chunk<float, Bits>(x + 32 * groups, len % 32, edges, kEdges, p0, p1,
                                  out0 + 4 * p0 * groups, p1 ? out1 + 4 * p1 * groups : nullptr);
    }
}

template <int P>
UFB_AVX2 __m256i field8(const uint8_t* in, int64_t g) {
    uint32_t v = 0;
    std::memcpy(&v, in + P * g, P);
    const __m256i lanes = _mm256_setr_epi32(0, P, 2 * P, 3 * P, 4 * P, 5 * P, 6 * P, 7 * P);
    return _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(v)), lanes),
                            _mm256_set1_epi32((1 << P) - 1));
}

template <int Bits>
UFB_AVX2 void decode_chunk_avx2(const uint8_t* in0, const uint8_t* in1, int64_t len,
                                const float* table, float* out) {
    constexpr int P0 = Bits == 3 ? 2 : Bits, P1 = Bits == 3 ? 1 : 0;
    const __m256 lo = _mm256_loadu_ps(table);  // the table has 2**Bits entries: pad to 8
    const __m256 hi = Bits == 4 ? _mm256_loadu_ps(table + 8) : lo;
    const int64_t groups = len / 8;
    for (int64_t g = 0; g < groups; ++g) {
        __m256i idx = field8<P0>(in0, g);
        if (P1) idx = _mm256_or_si256(idx, _mm256_slli_epi32(field8<P1 ? P1 : 1>(in1, g), P0));
        __m256 v = _mm256_permutevar8x32_ps(lo, idx);
        if (Bits == 4) {
            const __m256 w = _mm256_permutevar8x32_ps(hi, idx);
            v = _mm256_blendv_ps(v, w, _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
        }
        _mm256_storeu_ps(out + 8 * g, v);
    }
    if (len % 8) {
        decode_chunk<float, Bits>(in0 + P0 * groups, P1 ? in1 + P1 * groups : nullptr, len % 8,
                                  P0, P1, table, out + 8 * groups);
    }
}
#endif

int generic_only = 0;  // ufb_set_generic(1): the portable chunks even where AVX2 runs (tests)

template <typename T, int Bits>
UQ_INLINE void encode_rows(const EncodeArgs<T>& a, int64_t r0, int64_t r1) {
    const int64_t b0 = bytes_of(a.m, a.p0), b1 = a.p1 ? bytes_of(a.m, a.p1) : 0;
#if UFB_X86
    const bool avx2 = Bits && sizeof(T) == 4 && cpu_has_avx2() && !generic_only;
#endif
    for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c0 = 0; c0 < a.m; c0 += kChunk) {
            const int64_t len = (a.m - c0) < kChunk ? (a.m - c0) : kChunk;
            const T* x = a.x + r * a.m + c0;
            uint8_t* o0 = a.out0 + r * b0 + c0 * a.p0 / 8;
            uint8_t* o1 = a.p1 ? a.out1 + r * b1 + c0 * a.p1 / 8 : nullptr;
#if UFB_X86
            if constexpr (Bits != 0 && sizeof(T) == 4) {
                if (avx2) {
                    encode_chunk_avx2<Bits>(reinterpret_cast<const float*>(x), len,
                                            reinterpret_cast<const float*>(a.edges), a.p0, a.p1,
                                            o0, o1);
                    continue;
                }
            }
#endif
            encode_chunk<T, Bits>(x, len, a.edges, a.nedges, a.p0, a.p1, o0, o1);
        }
    }
}

template <typename T, int Bits>
UQ_INLINE void decode_rows(const DecodeArgs<T>& a, int64_t r0, int64_t r1) {
    constexpr int kLevels = 1 << Bits;
    T table[16] = {};  // 2**Bits entries, zero-padded
    for (int k = 0; k < kLevels; ++k) table[k] = a.reps[k];
    const int64_t b0 = bytes_of(a.m, a.p0), b1 = a.p1 ? bytes_of(a.m, a.p1) : 0;
#if UFB_X86
    constexpr int P0 = Bits == 3 ? 2 : Bits, P1 = Bits == 3 ? 1 : 0;  // fewbit's planes
    const bool avx2 =
        sizeof(T) == 4 && a.p0 == P0 && a.p1 == P1 && cpu_has_avx2() && !generic_only;
#endif
    for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c0 = 0; c0 < a.m; c0 += kChunk) {
            const int64_t len = (a.m - c0) < kChunk ? (a.m - c0) : kChunk;
            const uint8_t* i0 = a.in0 + r * b0 + c0 * a.p0 / 8;
            const uint8_t* i1 = a.p1 ? a.in1 + r * b1 + c0 * a.p1 / 8 : nullptr;
            T* o = a.out + r * a.m + c0;
#if UFB_X86
            if constexpr (sizeof(T) == 4) {
                if (avx2) {
                    decode_chunk_avx2<Bits>(i0, i1, len, reinterpret_cast<const float*>(table),
                                            reinterpret_cast<float*>(o));
                    continue;
                }
            }
#endif
            decode_chunk<T, Bits>(i0, i1, len, a.p0, a.p1, table, o);
        }
    }
}

template <typename T>
UQ_INLINE void encode_any(const EncodeArgs<T>& a, int64_t r0, int64_t r1) {
    switch (a.nedges) {
        case 1: encode_rows<T, 1>(a, r0, r1); break;
        case 3: encode_rows<T, 2>(a, r0, r1); break;
        case 7: encode_rows<T, 3>(a, r0, r1); break;
        case 15: encode_rows<T, 4>(a, r0, r1); break;
        default: encode_rows<T, 0>(a, r0, r1); break;
    }
}

template <typename T>
UQ_INLINE void decode_any(const DecodeArgs<T>& a, int64_t r0, int64_t r1) {
    switch (a.p0 + a.p1) {
        case 1: decode_rows<T, 1>(a, r0, r1); break;
        case 2: decode_rows<T, 2>(a, r0, r1); break;
        case 3: decode_rows<T, 3>(a, r0, r1); break;
        default: decode_rows<T, 4>(a, r0, r1); break;
    }
}

UQ_CLONES void encode_f32(const EncodeArgs<float>* a, int64_t r0, int64_t r1) {
    encode_any(*a, r0, r1);
}
UQ_CLONES void encode_f64(const EncodeArgs<double>* a, int64_t r0, int64_t r1) {
    encode_any(*a, r0, r1);
}
UQ_CLONES void decode_f32(const DecodeArgs<float>* a, int64_t r0, int64_t r1) {
    decode_any(*a, r0, r1);
}
UQ_CLONES void decode_f64(const DecodeArgs<double>* a, int64_t r0, int64_t r1) {
    decode_any(*a, r0, r1);
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

// 1: the portable chunks only, even where AVX2 runs (the tests compare both); 0: the fastest.
void ufb_set_generic(int on) { generic_only = on; }

}  // extern "C"
