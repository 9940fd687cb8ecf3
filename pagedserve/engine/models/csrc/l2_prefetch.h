// The weight prefetch of pagedserve's GEMM kernels (few_rows_bf16.cpp, panel_gemm_f32.cpp include this and
// call it where built with the L2-prefetch flag, cpu_op.kernel_defines). Part of each kernel's build:
// cpu_op.py hashes every header in this folder with the source.
#pragma once

#include <immintrin.h>

#include <cstdint>

// A kernel that streams a weight line by line prefetches the line kL2PrefetchBytes ahead into L2 as it loads
// the current one, where cpu_features.l2_prefetches_preferred (AMD with AVX-512): 16 lines (1 KiB) ahead,
// measured on a Zen 4 EPYC with the few-row bfloat16 GEMM (8 or 32 lines ahead and into L1 were slower, into
// L3 gained nothing; docs/benchmarks.md, "Batch 1 on Zen 4: weight prefetches in the GEMMs"). Elsewhere the
// hardware's prefetchers alone (Intel's not measured).
constexpr int64_t kL2PrefetchBytes = 16 * 64;

inline void prefetch_ahead_to_l2(const void* line) {  // an address, not a pointer: past the end only a hint
  const uintptr_t ahead = reinterpret_cast<uintptr_t>(line) + kL2PrefetchBytes;
  _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_T1);
}
