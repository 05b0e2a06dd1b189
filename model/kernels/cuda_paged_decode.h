// Decode attention over the paged KV cache in place, on CUDA: one query per
// row attends to the row's first `len` keys, read where they lie through the
// row's block table (no gathered copy of the context, no mask, no padding
// to the widest row). The heads of one KV group share a thread block, so
// each key and value is read once per group (GQA without repeating keys),
// and a row's keys are split into chunks of at most kPagedDecodeSplit keys,
// each a thread block of its own (flash-decoding), whose partial softmax
// sums a second kernel combines.
//
// Plain pointers and strides: this header and its .cu see no ATen (the
// wrapper is model/core/paged_decode_attention.cc).
#pragma once

#include <cstdint>

#include "model/kernels/cuda_element.h"

namespace moh {

// Keys one thread block reads, at most.
inline constexpr int kPagedDecodeSplit = 256;

// Keys a thread block reads for `rows` rows of `kv_heads` KV heads and up
// to `kv_len` keys: kPagedDecodeSplit, halved (down to 32) while the launch
// would have fewer than 512 thread blocks, so that a small batch still
// gives every multiprocessor of a large GPU several blocks (an H200 has 132;
// at batch 1 and 4k keys, 8 KV heads: 64 keys, 512 blocks, where 256 keys
// gave 128 blocks of mostly waiting loads).
inline int PagedDecodeSplitKeys(int64_t rows, int64_t kv_heads,
                                int64_t kv_len) {
  int keys = kPagedDecodeSplit;
  while (keys > 32 && rows * kv_heads * ((kv_len + keys - 1) / keys) < 512) {
    keys /= 2;
  }
  return keys;
}

struct PagedDecodeArgs {
  CudaElement type = CudaElement::kFloat32;
  // [rows, heads, head_dim] contiguous, the rotated queries.
  const void* queries = nullptr;
  // [blocks, block_size, kv_heads (or more), head_dim] with the last
  // dimension contiguous; the same strides (elements) for both.
  const void* key_cache = nullptr;
  const void* value_cache = nullptr;
  int64_t stride_block = 0, stride_position = 0, stride_head = 0;
  int block_size = 0;
  // [rows, table_stride] int64: row r's key j lies in block
  // block_table[r * table_stride + j / block_size].
  const int64_t* block_table = nullptr;
  int64_t table_stride = 0;
  // [rows] int64 each: row r reads keys j <= positions[r] and j < row_len[r].
  const int64_t* positions = nullptr;
  const int64_t* row_len = nullptr;
  int rows = 0, heads = 0, kv_heads = 0, head_dim = 0;
  // [rows, heads] in the queries' type (rows gate_stride apart), or nullptr:
  // MoH's gates. Each head's output is multiplied by its gate (rounded to
  // the type first, as ATen's mul_ of the two), and a (row, KV group) whose
  // heads' gates are all 0 reads no key and outputs 0: the work list of the
  // groups none of a row's active heads uses.
  const void* gates = nullptr;
  int64_t gate_stride = 0;
  // Keys per split (at most kPagedDecodeSplit: PagedDecodeSplitKeys), and
  // splits per row: ceil(max keys any row reads / split_keys).
  int split_keys = kPagedDecodeSplit;
  int splits = 0;
  float scale = 1.0f;
  // Workspace, float32: rows * heads * splits * head_dim partial outputs and
  // rows * heads * splits * 2 (max, sum) pairs.
  float* partial_out = nullptr;
  float* partial_max_sum = nullptr;
  // [rows, heads, head_dim] contiguous, the queries' type.
  void* out = nullptr;
  void* stream = nullptr;  // cudaStream_t
};

// Whether the kernels take this shape: head_dim 8, 16, 32, 64, 128 or 256;
// 1, 2, 4 or 8 query heads per KV head.
bool PagedDecodeShapeSupported(int heads, int kv_heads, int head_dim);

// Launches both kernels on args.stream. Returns nullptr, or the CUDA error's
// text.
const char* LaunchPagedDecode(const PagedDecodeArgs& args);

}  // namespace moh
