// The bookkeeping of a paged KV cache with prefix sharing, after vLLM's block
// pool: KV memory is num_blocks blocks of block_size token positions, named
// by ids in [0, num_blocks). The pool tracks ids only; the tensors live with
// the model.
//
// A block has a reference count (the sequences whose block table holds it)
// and may have a registration: the content it holds in full, that is its
// parent (the previous block of the sequence, -1 for the first), its
// block_size token ids and a caller-chosen 64-bit key (e.g. a hash of the
// activation the KV was computed under), summed up in a chain hash.
// Registered blocks are found again by Match(), so a sequence whose prompt
// starts like an earlier one's reuses that one's KV.
//
// Policy: a block whose last reference is released stays registered, at the
// most recently released end of an LRU list; Allocate() takes a block that
// holds nothing first, and only then evicts the least recently released
// registered block, which drops its registration (its descendants can then
// no longer be matched). Release a sequence's blocks last-first, as vLLM
// does, so its tail is evicted before the prefix others may share. Every
// match is verified against the stored parent, key and tokens: a hash
// collision never returns a wrong block. All operations are O(1) but
// Register() and Match(), which are linear in the tokens they read.
//
// A block holds block_size positions of a sequence whose KV is stored at full
// width, or block_size * fold positions of one stored narrower (the ratio
// ceiling: a request that can never read the routed KV heads stores only
// the shared ones, so a block holds `fold` times as many of its positions).
// A registration records its fold; blocks of different folds hold different
// layouts and never match each other, nor chain after each other.
//
// Pure: no tensors, no threads. One owner, the engine loop's planner; not
// thread-safe.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/types/span.h"

namespace moh {

class KvBlockPool {
 public:
  // H(parent's chain hash, key, the block's tokens); the first block of a
  // sequence takes kChainSeed as its parent's hash.
  using ChainHashFn = uint64_t (*)(uint64_t parent_hash, uint64_t key,
                                   absl::Span<const int32_t> tokens);
  static constexpr uint64_t kChainSeed = 0x6d6f682d6b762d31;  // "moh-kv-1"
  // absl::HashOf over the three; tests pass a weaker one to force collisions.
  static uint64_t DefaultChainHash(uint64_t parent_hash, uint64_t key,
                                   absl::Span<const int32_t> tokens);

  // num_blocks >= 1 and block_size >= 1: the caller checks the ranges. Every
  // block starts free and unregistered.
  KvBlockPool(int32_t num_blocks, int32_t block_size,
              ChainHashFn chain_hash = &DefaultChainHash);

  // Below, `block` and `parent` are ids in [0, num_blocks) (parent may be
  // -1); an id out of that range is a caller bug the pool does not check.

  // A block with refcount 1, or -1 when every block is in use (num_free() is
  // 0). An unregistered block first, else the least recently released
  // registered one, whose registration is dropped.
  int32_t Allocate();
  // One more reference, e.g. on a block Match() returned; a free block
  // (refcount 0) leaves the free count.
  void Acquire(int32_t block);
  // Drops one reference. At 0 the block is free: a registered one stays
  // matchable until Allocate() evicts it. Releasing a block of refcount 0 is
  // a caller bug: returns false and changes nothing.
  bool Release(int32_t block);

  // Records that `block` (refcount > 0, not registered) now holds
  // `tokens[0..block_size * fold)` after `parent` (-1 for a sequence's first
  // block, else a registered block of the same fold) under `key`. False,
  // changing nothing, when those conditions fail or when another block already
  // holds the same content (the caller then stops registering that sequence's
  // later blocks), or, at odds of 2^-64, when another block's chain hash
  // collides. A registered block whose parent was evicted can never be matched
  // again: it gives way when `block` has its chain hash.
  bool Register(int32_t block, int32_t parent, const int32_t* tokens,
                uint64_t key, int32_t fold = 1);

  // The longest chain of registered blocks of `fold` holding the first whole
  // blocks of `tokens[0..num_tokens)` under `key`: element i holds tokens
  // [i * span, (i + 1) * span) (span = block_size * fold), and follows
  // element i - 1. At most max_blocks elements. Takes no reference and leaves
  // the LRU order alone: the caller Acquire()s what it uses before the next
  // Allocate().
  std::vector<int32_t> Match(const int32_t* tokens, int64_t num_tokens,
                             uint64_t key, int64_t max_blocks,
                             int32_t fold = 1) const;

  int32_t num_blocks() const { return static_cast<int32_t>(blocks_.size()); }
  int32_t block_size() const { return block_size_; }
  // Blocks with refcount > 0.
  int32_t num_used() const { return num_used_; }
  // Blocks with refcount 0, registered or not: what Allocate() can return.
  int32_t num_free() const { return free_.size + cached_.size; }
  // Registered blocks with refcount 0 (a subset of num_free()).
  int32_t num_cached() const { return cached_.size; }
  int32_t refcount(int32_t block) const { return blocks_[block].refcount; }
  bool registered(int32_t block) const { return blocks_[block].serial != 0; }

 private:
  struct Block {
    int32_t refcount = 0;
    // Neighbours on free_ or cached_, where the block is while refcount is 0.
    int32_t prev = -1;
    int32_t next = -1;
    // The registration; serial 0 = none. Serials are never reused, so a
    // child whose parent was evicted (parent_serial no longer the parent's
    // serial) is never matched, even after the parent id is reused.
    uint64_t serial = 0;
    int32_t parent = -1;
    uint64_t parent_serial = 0;
    uint64_t key = 0;
    uint64_t hash = 0;
    int32_t fold = 1;  // positions held: block_size * fold
  };
  // A doubly linked list threaded through Block::prev and next.
  struct BlockList {
    int32_t head = -1;  // the oldest
    int32_t tail = -1;
    int32_t size = 0;
  };

  uint64_t serial_of(int32_t block) const {
    return block < 0 ? 0 : blocks_[block].serial;
  }
  // Whether registered `block` holds `tokens` after `parent` under `key`,
  // at `fold`.
  bool Holds(int32_t block, int32_t parent, uint64_t key, int32_t fold,
             const int32_t* tokens) const;
  // Whether registered `block` can no longer be matched: its parent's
  // registration it was made after is gone.
  bool Orphaned(int32_t block) const;
  void DropRegistration(int32_t block);
  void PushBack(BlockList& list, int32_t block);
  void Remove(BlockList& list, int32_t block);
  BlockList& list_of(int32_t block) {
    return registered(block) ? cached_ : free_;
  }

  const int32_t block_size_;
  const ChainHashFn chain_hash_;
  std::vector<Block> blocks_;
  // Per block, while registered: its block_size_ * fold tokens.
  std::vector<std::vector<int32_t>> tokens_;
  absl::flat_hash_map<uint64_t, int32_t> by_hash_;  // chain hash -> block
  BlockList free_;                                  // refcount 0, unregistered
  BlockList cached_;  // refcount 0, registered: least recently released first
  int32_t num_used_ = 0;
  uint64_t next_serial_ = 1;
};

}  // namespace moh
