// Where the prefill attention op's context rows are (prefill_attention_cpu.cpp includes this inside its
// anonymous namespace): in strided [L, Hkv, D] tensors, or read in place from one layer's cache through a
// sequence's block ids. Part of the op's build: cpu_op.py hashes every header in this folder with the source.
#pragma once

// Where each context position's K and V rows are: key[p] + h * key_head_stride is position p's row of KV
// head h (D floats), the same for V; from strided [L, Hkv, D] tensors or through a block table.
struct KvRows {
  std::vector<const float*> key, value;
  int64_t key_head_stride, value_head_stride;
};

KvRows strided_rows(const at::Tensor& key, const at::Tensor& value) {
  KvRows rows{{}, {}, key.stride(1), value.stride(1)};
  rows.key.reserve(key.size(0)), rows.value.reserve(key.size(0));
  for (int64_t p = 0; p < key.size(0); ++p) {
    rows.key.push_back(key.data_ptr<float>() + p * key.stride(0));
    rows.value.push_back(value.data_ptr<float>() + p * value.stride(0));
  }
  return rows;
}

KvRows paged_rows(const at::Tensor& key_cache, const at::Tensor& value_cache, const int64_t* block_ids, int64_t L) {
  const int64_t block_size = key_cache.size(1), slot = key_cache.size(2) * key_cache.size(3);
  KvRows rows{{}, {}, key_cache.size(3), value_cache.size(3)};
  rows.key.reserve(L), rows.value.reserve(L);
  for (int64_t p = 0; p < L; ++p) {
    const int64_t offset = (block_ids[p / block_size] * block_size + p % block_size) * slot;
    rows.key.push_back(key_cache.data_ptr<float>() + offset);
    rows.value.push_back(value_cache.data_ptr<float>() + offset);
  }
  return rows;
}
