#include "service/engine/kv_block_pool.h"

#include <algorithm>

#include "absl/hash/hash.h"

namespace moh {

uint64_t KvBlockPool::DefaultChainHash(uint64_t parent_hash, uint64_t key,
                                       absl::Span<const int32_t> tokens) {
  return absl::HashOf(parent_hash, key, tokens);
}

KvBlockPool::KvBlockPool(int32_t num_blocks, int32_t block_size,
                         ChainHashFn chain_hash)
    : block_size_(block_size),
      chain_hash_(chain_hash),
      blocks_(num_blocks),
      tokens_(num_blocks) {
  for (int32_t block = 0; block < num_blocks; ++block) PushBack(free_, block);
}

int32_t KvBlockPool::Allocate() {
  if (free_.size == 0) {
    if (cached_.size == 0) return -1;
    DropRegistration(cached_.head);  // moves it to free_
  }
  const int32_t block = free_.head;
  Remove(free_, block);
  blocks_[block].refcount = 1;
  ++num_used_;
  return block;
}

void KvBlockPool::Acquire(int32_t block) {
  if (blocks_[block].refcount == 0) {
    Remove(list_of(block), block);
    ++num_used_;
  }
  ++blocks_[block].refcount;
}

bool KvBlockPool::Release(int32_t block) {
  if (blocks_[block].refcount == 0) return false;
  if (--blocks_[block].refcount == 0) {
    PushBack(list_of(block), block);
    --num_used_;
  }
  return true;
}

bool KvBlockPool::Register(int32_t block, int32_t parent, const int32_t* tokens,
                           uint64_t key, int32_t fold) {
  if (blocks_[block].refcount == 0 || registered(block) || fold < 1) {
    return false;
  }
  if (parent >= 0 && (!registered(parent) || blocks_[parent].fold != fold)) {
    return false;
  }
  const int64_t span = int64_t{block_size_} * fold;
  const uint64_t parent_hash = parent < 0 ? kChainSeed : blocks_[parent].hash;
  const uint64_t hash =
      chain_hash_(parent_hash, key, absl::MakeConstSpan(tokens, span));
  if (auto it = by_hash_.find(hash); it != by_hash_.end()) {
    // The same content, or a collision: keep the one there. An orphan can
    // never be matched again; the new block takes its place (unless it is
    // the parent, which a collision alone could make it).
    if (!Orphaned(it->second) || it->second == parent) return false;
    DropRegistration(it->second);
  }
  Block& b = blocks_[block];
  b.serial = next_serial_++;
  b.parent = parent;
  b.parent_serial = serial_of(parent);
  b.key = key;
  b.hash = hash;
  b.fold = fold;
  // assign() keeps the vector's capacity: a block registered again
  // allocates nothing.
  tokens_[block].assign(tokens, tokens + span);
  by_hash_.emplace(hash, block);
  return true;
}

std::vector<int32_t> KvBlockPool::Match(const int32_t* tokens,
                                        int64_t num_tokens, uint64_t key,
                                        int64_t max_blocks,
                                        int32_t fold) const {
  std::vector<int32_t> chain;
  if (fold < 1) return chain;
  const int64_t span = int64_t{block_size_} * fold;
  const int64_t whole = std::min(num_tokens / span, max_blocks);
  int32_t parent = -1;
  uint64_t parent_hash = kChainSeed;
  for (int64_t i = 0; i < whole; ++i) {
    const int32_t* block_tokens = tokens + i * span;
    const uint64_t hash =
        chain_hash_(parent_hash, key, absl::MakeConstSpan(block_tokens, span));
    const auto it = by_hash_.find(hash);
    if (it == by_hash_.end() ||
        !Holds(it->second, parent, key, fold, block_tokens)) {
      break;
    }
    chain.push_back(it->second);
    parent = it->second;
    parent_hash = hash;
  }
  return chain;
}

bool KvBlockPool::Holds(int32_t block, int32_t parent, uint64_t key,
                        int32_t fold, const int32_t* tokens) const {
  const Block& b = blocks_[block];
  const std::vector<int32_t>& held = tokens_[block];
  return b.parent == parent && b.parent_serial == serial_of(parent) &&
         b.key == key && b.fold == fold &&
         std::equal(held.begin(), held.end(), tokens);
}

bool KvBlockPool::Orphaned(int32_t block) const {
  const Block& b = blocks_[block];
  return b.parent >= 0 && blocks_[b.parent].serial != b.parent_serial;
}

void KvBlockPool::DropRegistration(int32_t block) {
  const bool free = blocks_[block].refcount == 0;
  if (free) Remove(cached_, block);
  by_hash_.erase(blocks_[block].hash);
  blocks_[block].serial = 0;
  if (free) PushBack(free_, block);
}

void KvBlockPool::PushBack(BlockList& list, int32_t block) {
  Block& b = blocks_[block];
  b.prev = list.tail;
  b.next = -1;
  (list.tail < 0 ? list.head : blocks_[list.tail].next) = block;
  list.tail = block;
  ++list.size;
}

void KvBlockPool::Remove(BlockList& list, int32_t block) {
  Block& b = blocks_[block];
  (b.prev < 0 ? list.head : blocks_[b.prev].next) = b.next;
  (b.next < 0 ? list.tail : blocks_[b.next].prev) = b.prev;
  b.prev = b.next = -1;
  --list.size;
}

}  // namespace moh
