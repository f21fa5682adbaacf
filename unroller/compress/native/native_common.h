// What the native kernels share (quant_kernels.cpp, dct_kernels.cpp): the per-ISA clones
// of each entry point and the split of work over threads.
#pragma once

#include <cstdint>
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

}  // namespace unroller_native
