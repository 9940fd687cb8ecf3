// Issue #23, item 3: how fast can a decode step's K/V be read at all through scattered KV blocks? No
// attention arithmetic: each variant only loads (and adds up) the K and V rows that the CPU decode op reads,
// in a given order, beside a plain sequential read of the same memory, all alternated in one process (this
// VM's bandwidth drifts up to 1.5x within minutes) on 2 MiB pages, as a worker's KV cache. A measurement,
// not a test.
//
//   g++ -O3 -march=native -fopenmp scripts/paged_read.cpp -o /tmp/paged_read && OMP_NUM_THREADS=2 /tmp/paged_read
//
// The batch is `bench attention-op --num-seqs 256 --context-len 270`'s shape: 256 sequences of 270 +-25%
// tokens, blocks of 16 slots of 3 KV heads x 64 float32 channels (12 KiB of K and 12 KiB of V a block),
// 8 layers' caches called in turn so the reads come from DRAM. Variants (GB/s: median over the rounds):
//   sequential      every byte of K then V of a layer, in address order (what the memory gives)
//   op order        block by block: per KV head, its K rows of the block's 16 slots, then its V rows (the
//                   op's order), the next block's lines prefetched into L2 while this one is read (as the op)
//   slot order      block by block: each slot's whole K row (all heads, 768 B), then the V rows; prefetched
//                   the same way
//   head layout     the op's order on blocks laid out [KV heads, slots, D] (vLLM's CPU cache): each KV
//                   head's K rows of a block are 4 KiB in a row; prefetched the same way
// each with the blocks of every sequence scattered one by one (shuffled, as in a long-running server) and
// in runs of 8 consecutive blocks (what 128-token blocks would give).
#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <vector>

constexpr int kBlock = 16, kHeads = 3, kDim = 64, kSlot = kHeads * kDim;
constexpr long kBlockFloats = kBlock * kSlot;
constexpr int kLines = kBlockFloats * 4 / 64;  // cache lines of K (or V) in a block

enum Order { kSequential, kOpOrder, kSlotOrder, kHeadLayout };
struct Variant { const char* name; Order order; int run; };

std::vector<std::vector<int>> block_tables(const std::vector<int>& lens, long num_blocks, int run, std::mt19937& rng) {
  std::vector<long> starts;  // runs of `run` consecutive block ids, shuffled
  for (long b = 0; b < num_blocks; b += run) starts.push_back(b);
  std::shuffle(starts.begin(), starts.end(), rng);
  std::vector<int> ids;
  for (long s : starts) for (long b = s; b < std::min(num_blocks, s + run); ++b) ids.push_back(b);
  std::vector<std::vector<int>> tables(lens.size());
  size_t next = 0;
  for (size_t i = 0; i < lens.size(); ++i)
    for (int b = 0; b < (lens[i] + kBlock - 1) / kBlock; ++b) tables[i].push_back(ids[next++]);
  return tables;
}

// Reads one block's K and V rows of the first n slots in `order`, prefetching the next block's lines into L2.
inline __m512 read_block(const float* k, const float* v, const float* next_k, const float* next_v, int n, Order order,
                         __m512 acc) {
  int line = 0;
  auto prefetch = [&](int count) {
    for (int x = 0; x < count && next_k && line < kLines; ++x, ++line) {
      _mm_prefetch(reinterpret_cast<const char*>(next_k) + line * 64, _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(next_v) + line * 64, _MM_HINT_T1);
    }
  };
  if (order == kSlotOrder) {
    for (int j = 0; j < n; ++j, prefetch(kSlot / 16))
      for (int c = 0; c < kSlot; c += 16) acc = _mm512_add_ps(acc, _mm512_loadu_ps(k + j * kSlot + c));
    for (int j = 0; j < n; ++j)
      for (int c = 0; c < kSlot; c += 16) acc = _mm512_add_ps(acc, _mm512_loadu_ps(v + j * kSlot + c));
    return acc;
  }
  const int slot = order == kHeadLayout ? kDim : kSlot, head = order == kHeadLayout ? kBlock * kDim : kDim;
  for (int h = 0; h < kHeads; ++h) {
    for (int j = 0; j < n; ++j, prefetch(kDim / 16))
      for (int c = 0; c < kDim; c += 16) acc = _mm512_add_ps(acc, _mm512_loadu_ps(k + j * slot + h * head + c));
    for (int j = 0; j < n; ++j)
      for (int c = 0; c < kDim; c += 16) acc = _mm512_add_ps(acc, _mm512_loadu_ps(v + j * slot + h * head + c));
  }
  return acc;
}

int main() {
  const int num_seqs = 256, context = 270, layers = 8, rounds = 15;
  std::mt19937 rng(0);
  std::vector<int> lens(num_seqs);
  long num_blocks = 0;
  for (int& len : lens) {  // the context and the new token
    len = context * 3 / 4 + rng() % (context / 2 + 1) + 1;
    num_blocks += (len + kBlock - 1) / kBlock;
  }
  const size_t bytes = num_blocks * kBlockFloats * 4;
  std::vector<const float*> keys, values;
  for (int i = 0; i < 2 * layers; ++i) {
    void* mapped = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mapped == MAP_FAILED) return std::perror("mmap"), 1;
    auto* p = static_cast<float*>(mapped);
    madvise(p, bytes, MADV_HUGEPAGE);  // Linux's THP places huge pages where the range allows
    std::fill(p, p + num_blocks * kBlockFloats, 1.0f);
    (i % 2 ? values : keys).push_back(p);
  }
  const Variant variants[] = {
      {"sequential", kSequential, 1},         {"op order, scattered blocks", kOpOrder, 1},
      {"slot order, scattered blocks", kSlotOrder, 1}, {"head layout, scattered blocks", kHeadLayout, 1},
      {"op order, runs of 8 blocks", kOpOrder, 8},     {"slot order, runs of 8 blocks", kSlotOrder, 8},
      {"head layout, runs of 8 blocks", kHeadLayout, 8}};
  const int nv = sizeof variants / sizeof variants[0];
  std::vector<std::vector<std::vector<int>>> tables;
  for (const Variant& var : variants) tables.push_back(block_tables(lens, num_blocks, var.run, rng));
  long kv_bytes = 0;
  for (int len : lens) kv_bytes += 2L * len * kSlot * 4;
  std::vector<std::vector<double>> gbps(nv);
  float sink = 0;
  for (int r = 0; r < rounds + 1; ++r)
    for (int vi = 0; vi < nv; ++vi) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int l = 0; l < layers; ++l) {
#pragma omp parallel reduction(+ : sink)
        {
          __m512 acc = _mm512_setzero_ps();
          if (variants[vi].order == kSequential) {
#pragma omp for
            for (long i = 0; i < num_blocks * kBlockFloats; i += 16)
              acc = _mm512_add_ps(acc, _mm512_add_ps(_mm512_loadu_ps(keys[l] + i), _mm512_loadu_ps(values[l] + i)));
          } else {
#pragma omp for schedule(dynamic, 1)
            for (int s = 0; s < num_seqs; ++s) {
              const std::vector<int>& t = tables[vi][s];
              for (size_t b = 0; b < t.size(); ++b) {
                const bool last = b + 1 == t.size();
                acc = read_block(keys[l] + t[b] * kBlockFloats, values[l] + t[b] * kBlockFloats,
                                 last ? nullptr : keys[l] + t[b + 1] * kBlockFloats,
                                 last ? nullptr : values[l] + t[b + 1] * kBlockFloats,
                                 last ? lens[s] - kBlock * b : kBlock, variants[vi].order, acc);
              }
            }
          }
          sink += _mm512_reduce_add_ps(acc);
        }
      }
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const double moved = variants[vi].order == kSequential ? 2.0 * bytes : kv_bytes;
      if (r > 0) gbps[vi].push_back(layers * moved / s / 1e9);  // round 0 warms up
    }
  std::printf("%d threads, %d seqs x ~%d tokens, %d layers, %d rounds (sink %g)\n", omp_get_max_threads(), num_seqs,
              context, layers, rounds, sink);
  for (int vi = 0; vi < nv; ++vi) {
    std::sort(gbps[vi].begin(), gbps[vi].end());
    const double median = gbps[vi][gbps[vi].size() / 2];
    std::printf("%-30s %6.1f GB/s  %5.1f%% of sequential\n", variants[vi].name, median,
                100 * median / gbps[0][gbps[0].size() / 2]);
  }
}
