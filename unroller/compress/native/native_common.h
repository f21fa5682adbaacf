// What the native kernels share (quant, dct and fewbit kernels): the per-ISA clones of each
// entry point, the run-time AVX2 check, the split of work over threads and the code packers.
#pragma once

#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
// One copy of each entry point per instruction-set level, chosen when the library loads:
// the cached library stays valid on any x86-64 machine.
#define UQ_CLONES \
    __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "arch=x86-64-v2", "default")))
#else
#define UQ_CLONES
#endif

#define UQ_INLINE inline __attribute__((always_inline))

namespace unroller_native {

// Whether this CPU has AVX2 (asked once): the kernels that pick a wider formulation at run
// time (one source serves every clone) ask here.
inline bool cpu_has_avx2() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    static const bool yes = __builtin_cpu_supports("avx2");
    return yes;
#else
    return false;
#endif
}

// Split rows 0 .. rows into `threads` ranges (each a multiple of `unit` rows) and run fn.
template <typename A>
void run_split(void (*fn)(const A*, int64_t, int64_t), const A* args, int64_t rows,
               int64_t unit, int threads) {
    const int64_t units = rows / unit;
    if (threads > units) threads = static_cast<int>(units);
    if (threads <= 1) {
        fn(args, 0, rows);
        return;
    }
    // Nothing may throw out of an extern "C" entry point: a range whose thread cannot be
    // started (a resource limit) runs here instead.
    std::vector<std::thread> pool;
    try {
        pool.reserve(static_cast<size_t>(threads - 1));
    } catch (...) {
        fn(args, 0, rows);
        return;
    }
    for (int t = 1; t < threads; ++t) {
        const int64_t u0 = units * t / threads, u1 = units * (t + 1) / threads;
        try {
            pool.emplace_back(fn, args, u0 * unit, u1 * unit);
        } catch (...) {
            fn(args, u0 * unit, u1 * unit);
        }
    }
    fn(args, 0, (units / threads) * unit);
    for (auto& th : pool) th.join();
}

// Codes of 1, 2, 4 or 8 bits, code i of a byte in bits bits*i .. bits*i + bits - 1 (the
// layout of base.pack_codes).

// Pack len codes into bytes starting at a byte boundary (the last byte zero-padded).
UQ_INLINE void pack_aligned(const uint8_t* __restrict c, int64_t len, int bits,
                            uint8_t* __restrict out) {
    if (bits == 8) {
        std::memcpy(out, c, static_cast<size_t>(len));
        return;
    }
    const int per = 8 / bits;
    const int64_t whole = len / per;
    if (bits == 4) {
        for (int64_t k = 0; k < whole; ++k) {
            out[k] = static_cast<uint8_t>(c[2 * k] | (c[2 * k + 1] << 4));
        }
    } else if (bits == 1) {
        for (int64_t k = 0; k < whole; ++k) {
            const uint8_t* b = c + 8 * k;
            out[k] = static_cast<uint8_t>(b[0] | (b[1] << 1) | (b[2] << 2) | (b[3] << 3) |
                                          (b[4] << 4) | (b[5] << 5) | (b[6] << 6) | (b[7] << 7));
        }
    } else {
        for (int64_t k = 0; k < whole; ++k) {
            out[k] = static_cast<uint8_t>(c[4 * k] | (c[4 * k + 1] << 2) | (c[4 * k + 2] << 4) |
                                          (c[4 * k + 3] << 6));
        }
    }
    const int64_t rest = len - whole * per;
    if (rest) {
        uint8_t b = 0;
        for (int64_t t = 0; t < rest; ++t) {
            b |= static_cast<uint8_t>(c[whole * per + t] << (bits * t));
        }
        out[whole] = b;
    }
}

// OR len codes into bytes at code position j0 (any alignment; the bytes start zeroed).
UQ_INLINE void pack_any(const uint8_t* __restrict c, int64_t len, int bits, int64_t j0,
                        uint8_t* __restrict out) {
    const int per = 8 / bits;
    for (int64_t t = 0; t < len; ++t) {
        const int64_t j = j0 + t;
        out[j / per] |= static_cast<uint8_t>(c[t] << (bits * (j % per)));
    }
}

template <int Bits>
UQ_INLINE void unpack_bytes(const uint8_t* __restrict b, int64_t nbytes,
                            uint8_t* __restrict codes) {
    constexpr int per = 8 / Bits, mask = (1 << Bits) - 1;
    for (int64_t k = 0; k < nbytes; ++k) {
        const int v = b[k];
        for (int s = 0; s < per; ++s) {
            codes[k * per + s] = static_cast<uint8_t>((v >> (Bits * s)) & mask);
        }
    }
}

// Codes t0 .. t0 + len - 1 of a sample's packed bytes (any t0; bits 1, 2, 4 or 8).
UQ_INLINE void unpack_any(const uint8_t* __restrict in, int64_t t0, int64_t len, int bits,
                          uint8_t* __restrict codes) {
    if (bits == 8) {
        std::memcpy(codes, in + t0, static_cast<size_t>(len));
        return;
    }
    const int per = 8 / bits, mask = (1 << bits) - 1;
    int64_t done = 0;
    if (t0 % per == 0) {  // whole bytes first
        const int64_t whole = len / per;
        const uint8_t* b = in + t0 / per;
        if (bits == 1) unpack_bytes<1>(b, whole, codes);
        if (bits == 2) unpack_bytes<2>(b, whole, codes);
        if (bits == 4) unpack_bytes<4>(b, whole, codes);
        done = whole * per;
    }
    for (int64_t t = done; t < len; ++t) {
        const int64_t j = t0 + t;
        codes[t] = static_cast<uint8_t>((in[j / per] >> (bits * (j % per))) & mask);
    }
}

}  // namespace unroller_native
