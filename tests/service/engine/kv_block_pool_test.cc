// KvBlockPool: allocation and reference counts, the LRU cache of released
// registered blocks, prefix matching and its verification (forced hash
// collisions, reused parent ids), and a randomized run of sequences against a
// model of the pool.
#include "service/engine/kv_block_pool.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <vector>

#include "absl/hash/hash.h"

namespace moh {
namespace {

using Ids = std::vector<int32_t>;

std::vector<int32_t> Match(const KvBlockPool& pool, const Ids& tokens,
                           uint64_t key = 0, int64_t max_blocks = 100) {
  return pool.Match(tokens.data(), tokens.size(), key, max_blocks);
}

// Allocates the blocks of `tokens` (whole blocks) and registers them in order.
Ids AllocateChain(KvBlockPool& pool, const Ids& tokens, uint64_t key = 0) {
  Ids blocks;
  int32_t parent = -1;
  for (size_t i = 0; i + pool.block_size() <= tokens.size();
       i += pool.block_size()) {
    const int32_t block = pool.Allocate();
    EXPECT_GE(block, 0);
    EXPECT_TRUE(pool.Register(block, parent, tokens.data() + i, key));
    blocks.push_back(block);
    parent = block;
  }
  return blocks;
}

// Last-first, as a sequence releases its blocks.
void ReleaseAll(KvBlockPool& pool, const Ids& blocks) {
  for (auto it = blocks.rbegin(); it != blocks.rend(); ++it) {
    EXPECT_TRUE(pool.Release(*it));
  }
}

TEST(KvBlockPoolTest, AllocatesEveryBlockOnceThenReturnsMinusOne) {
  KvBlockPool pool(/*num_blocks=*/3, /*block_size=*/4);
  EXPECT_EQ(pool.num_blocks(), 3);
  EXPECT_EQ(pool.block_size(), 4);
  EXPECT_EQ(pool.num_free(), 3);
  Ids blocks;
  for (int i = 0; i < 3; ++i) blocks.push_back(pool.Allocate());
  std::sort(blocks.begin(), blocks.end());
  EXPECT_EQ(blocks, (Ids{0, 1, 2}));
  for (int32_t block : blocks) EXPECT_EQ(pool.refcount(block), 1);
  EXPECT_EQ(pool.Allocate(), -1);
  EXPECT_EQ(pool.num_used(), 3);
  EXPECT_EQ(pool.num_free(), 0);
}

TEST(KvBlockPoolTest, ReleasedBlocksAreReusable) {
  KvBlockPool pool(2, 4);
  const int32_t a = pool.Allocate();
  const int32_t b = pool.Allocate();
  EXPECT_TRUE(pool.Release(a));
  EXPECT_EQ(pool.num_used(), 1);
  EXPECT_EQ(pool.num_free(), 1);
  EXPECT_EQ(pool.num_cached(), 0);
  EXPECT_EQ(pool.Allocate(), a);
  EXPECT_EQ(pool.Allocate(), -1);
  EXPECT_TRUE(pool.Release(b));
  EXPECT_EQ(pool.Allocate(), b);
}

TEST(KvBlockPoolTest, ReleaseAtRefcountZeroChangesNothing) {
  KvBlockPool pool(2, 4);
  EXPECT_FALSE(pool.Release(1));
  const int32_t a = pool.Allocate();
  EXPECT_TRUE(pool.Release(a));
  EXPECT_FALSE(pool.Release(a));
  EXPECT_EQ(pool.refcount(a), 0);
  EXPECT_EQ(pool.num_used(), 0);
  EXPECT_EQ(pool.num_free(), 2);
  // Both blocks are handed out exactly once.
  const int32_t x = pool.Allocate();
  const int32_t y = pool.Allocate();
  EXPECT_NE(x, y);
  EXPECT_EQ(pool.Allocate(), -1);
}

TEST(KvBlockPoolTest, AcquireCountsReferences) {
  KvBlockPool pool(1, 4);
  const int32_t a = pool.Allocate();
  pool.Acquire(a);
  EXPECT_EQ(pool.refcount(a), 2);
  EXPECT_TRUE(pool.Release(a));
  EXPECT_EQ(pool.num_free(), 0);
  EXPECT_TRUE(pool.Release(a));
  EXPECT_EQ(pool.num_free(), 1);
}

TEST(KvBlockPoolTest, PrefersUnregisteredFreeBlocksOverCachedOnes) {
  KvBlockPool pool(3, 2);
  const int32_t plain = pool.Allocate();
  const Ids cached = AllocateChain(pool, {1, 2});
  // The cached block is released first, yet the plain one is reused first,
  // then the never used one.
  ReleaseAll(pool, cached);
  EXPECT_TRUE(pool.Release(plain));
  EXPECT_EQ(pool.num_cached(), 1);
  EXPECT_EQ(pool.num_free(), 3);
  const int32_t first = pool.Allocate();
  const int32_t second = pool.Allocate();
  EXPECT_NE(first, cached[0]);
  EXPECT_NE(second, cached[0]);
  EXPECT_TRUE(first == plain || second == plain);
  EXPECT_EQ(Match(pool, {1, 2}), cached);
  EXPECT_EQ(pool.Allocate(), cached[0]);
  EXPECT_FALSE(pool.registered(cached[0]));
}

TEST(KvBlockPoolTest, EvictsTheLeastRecentlyReleasedCachedBlockFirst) {
  KvBlockPool pool(3, 2);
  const int32_t a = AllocateChain(pool, {1, 2})[0];
  const int32_t b = AllocateChain(pool, {3, 4})[0];
  const int32_t c = AllocateChain(pool, {5, 6})[0];
  EXPECT_TRUE(pool.Release(a));
  EXPECT_TRUE(pool.Release(c));
  EXPECT_TRUE(pool.Release(b));
  EXPECT_EQ(pool.num_cached(), 3);

  EXPECT_EQ(pool.Allocate(), a);
  EXPECT_FALSE(pool.registered(a));
  EXPECT_EQ(pool.num_cached(), 2);
  EXPECT_TRUE(Match(pool, {1, 2}).empty());
  EXPECT_EQ(Match(pool, {5, 6}), Ids{c});
  EXPECT_EQ(Match(pool, {3, 4}), Ids{b});

  EXPECT_EQ(pool.Allocate(), c);
  EXPECT_TRUE(Match(pool, {5, 6}).empty());
  EXPECT_EQ(pool.Allocate(), b);
  EXPECT_EQ(pool.Allocate(), -1);
  EXPECT_EQ(pool.num_cached(), 0);
}

TEST(KvBlockPoolTest, ChildrenOfAnEvictedBlockAreNotMatched) {
  KvBlockPool pool(3, 2);
  const int32_t held = pool.Allocate();
  const Ids chain = AllocateChain(pool, {1, 2, 3, 4});
  // First-first: the parent is the least recently released.
  EXPECT_TRUE(pool.Release(chain[0]));
  EXPECT_TRUE(pool.Release(chain[1]));
  EXPECT_EQ(pool.Allocate(), chain[0]);
  EXPECT_TRUE(pool.registered(chain[1]));
  EXPECT_TRUE(Match(pool, {1, 2, 3, 4}).empty());
  EXPECT_TRUE(Match(pool, {3, 4}).empty());
  EXPECT_EQ(pool.refcount(held), 1);
}

TEST(KvBlockPoolTest, MatchFindsTheLongestPrefixOfWholeBlocks) {
  KvBlockPool pool(8, 2);
  const Ids p = AllocateChain(pool, {1, 2, 3, 4, 5, 6}, /*key=*/7);
  ASSERT_EQ(p.size(), 3u);
  EXPECT_EQ(Match(pool, {1, 2, 3, 4, 5, 6}, 7), p);
  EXPECT_EQ(Match(pool, {1, 2, 3, 4, 5, 6, 7, 8}, 7), p);
  EXPECT_EQ(Match(pool, {1, 2, 3, 4, 5}, 7), (Ids{p[0], p[1]}));
  EXPECT_EQ(Match(pool, {1, 2, 3, 9, 5, 6}, 7), Ids{p[0]});
  EXPECT_TRUE(Match(pool, {9, 2, 3, 4}, 7).empty());
  EXPECT_TRUE(Match(pool, {1}, 7).empty());
  EXPECT_TRUE(Match(pool, {}, 7).empty());
}

TEST(KvBlockPoolTest, MatchStopsAtMaxBlocks) {
  KvBlockPool pool(8, 2);
  const Ids p = AllocateChain(pool, {1, 2, 3, 4, 5, 6});
  EXPECT_EQ(Match(pool, {1, 2, 3, 4, 5, 6}, 0, 2), (Ids{p[0], p[1]}));
  EXPECT_EQ(Match(pool, {1, 2, 3, 4, 5, 6}, 0, 1), Ids{p[0]});
  EXPECT_TRUE(Match(pool, {1, 2, 3, 4, 5, 6}, 0, 0).empty());
}

TEST(KvBlockPoolTest, MatchRequiresTheSameKey) {
  KvBlockPool pool(8, 2);
  const Ids p = AllocateChain(pool, {1, 2, 3, 4}, /*key=*/7);
  EXPECT_TRUE(Match(pool, {1, 2, 3, 4}, 8).empty());
  // The same tokens under another key are other content.
  const Ids q = AllocateChain(pool, {1, 2, 3, 4}, /*key=*/8);
  EXPECT_EQ(Match(pool, {1, 2, 3, 4}, 8), q);
  EXPECT_EQ(Match(pool, {1, 2, 3, 4}, 7), p);
}

TEST(KvBlockPoolTest, MatchRequiresTheSameParent) {
  KvBlockPool pool(8, 2);
  const Ids p = AllocateChain(pool, {1, 2, 3, 4});
  const Ids q = AllocateChain(pool, {8, 8, 3, 4});
  EXPECT_EQ(Match(pool, {1, 2, 3, 4}), p);
  EXPECT_EQ(Match(pool, {8, 8, 3, 4}), q);
  EXPECT_TRUE(Match(pool, {3, 4}).empty());
  EXPECT_TRUE(Match(pool, {9, 9, 3, 4}).empty());
}

TEST(KvBlockPoolTest, MatchComparesEveryToken) {
  KvBlockPool pool(8, 4);
  const Ids p = AllocateChain(pool, {1, 2, 3, 4, 5, 6, 7, 8});
  EXPECT_EQ(Match(pool, {1, 2, 3, 4, 5, 6, 7, 9}), Ids{p[0]});
  EXPECT_TRUE(Match(pool, {1, 2, 3, 5}).empty());
}

TEST(KvBlockPoolTest, MatchTakesNoReferenceAndKeepsTheLruOrder) {
  KvBlockPool pool(2, 2);
  const int32_t a = AllocateChain(pool, {1, 2})[0];
  const int32_t b = AllocateChain(pool, {3, 4})[0];
  EXPECT_TRUE(pool.Release(a));
  EXPECT_TRUE(pool.Release(b));
  EXPECT_EQ(Match(pool, {1, 2}), Ids{a});
  EXPECT_EQ(pool.refcount(a), 0);
  EXPECT_EQ(pool.num_cached(), 2);
  EXPECT_EQ(pool.Allocate(), a);
}

TEST(KvBlockPoolTest, AcquireTakesACachedBlockOutOfTheFreeCount) {
  KvBlockPool pool(2, 2);
  const int32_t a = AllocateChain(pool, {1, 2})[0];
  EXPECT_TRUE(pool.Release(a));
  EXPECT_EQ(pool.num_free(), 2);
  EXPECT_EQ(pool.num_cached(), 1);

  pool.Acquire(a);
  EXPECT_EQ(pool.refcount(a), 1);
  EXPECT_EQ(pool.num_used(), 1);
  EXPECT_EQ(pool.num_free(), 1);
  EXPECT_EQ(pool.num_cached(), 0);
  EXPECT_NE(pool.Allocate(), a);
  EXPECT_EQ(pool.Allocate(), -1);
  EXPECT_EQ(Match(pool, {1, 2}), Ids{a});

  // Released again, it is cached again.
  EXPECT_TRUE(pool.Release(a));
  EXPECT_EQ(pool.num_cached(), 1);
  EXPECT_EQ(pool.Allocate(), a);
}

TEST(KvBlockPoolTest, AcquireTakesAPlainFreeBlockToo) {
  KvBlockPool pool(2, 2);
  pool.Acquire(1);
  EXPECT_EQ(pool.refcount(1), 1);
  EXPECT_EQ(pool.num_used(), 1);
  EXPECT_EQ(pool.Allocate(), 0);
  EXPECT_EQ(pool.Allocate(), -1);
}

TEST(KvBlockPoolTest, RegisterRefusesDuplicates) {
  KvBlockPool pool(8, 2);
  const Ids p = AllocateChain(pool, {1, 2, 3, 4});
  const int32_t b = pool.Allocate();
  const Ids first = {1, 2};
  EXPECT_FALSE(pool.Register(b, -1, first.data(), 0));
  EXPECT_FALSE(pool.registered(b));
  const Ids second = {3, 4};
  EXPECT_FALSE(pool.Register(b, p[0], second.data(), 0));
  EXPECT_FALSE(pool.registered(b));
  EXPECT_EQ(Match(pool, {1, 2, 3, 4}), p);
}

TEST(KvBlockPoolTest, RegisterRefusesBadArguments) {
  KvBlockPool pool(4, 2);
  const Ids tokens = {1, 2};
  const int32_t a = pool.Allocate();
  const int32_t b = pool.Allocate();
  // An unregistered parent.
  EXPECT_FALSE(pool.Register(b, a, tokens.data(), 0));
  EXPECT_FALSE(pool.registered(b));
  // A block no sequence holds.
  EXPECT_FALSE(pool.Register(3, -1, tokens.data(), 0));
  EXPECT_FALSE(pool.registered(3));
  // A block registered already, even with other content.
  EXPECT_TRUE(pool.Register(a, -1, tokens.data(), 0));
  const Ids other = {5, 6};
  EXPECT_FALSE(pool.Register(a, -1, other.data(), 0));
  EXPECT_TRUE(Match(pool, other).empty());
  EXPECT_EQ(Match(pool, tokens), Ids{a});
}

// Every chain hash collides: only the stored parents, keys and tokens tell
// blocks apart.
uint64_t ConstantHash(uint64_t, uint64_t, absl::Span<const int32_t>) {
  return 42;
}

TEST(KvBlockPoolTest, ACollidingHashNeverMatchesTheWrongBlock) {
  KvBlockPool pool(4, 2, &ConstantHash);
  const int32_t a = AllocateChain(pool, {1, 2})[0];
  EXPECT_EQ(Match(pool, {1, 2}), Ids{a});
  EXPECT_TRUE(Match(pool, {1, 3}).empty());
  EXPECT_TRUE(Match(pool, {0, 2}).empty());
  EXPECT_TRUE(Match(pool, {1, 2}, /*key=*/1).empty());
  // The second lookup finds `a` again, whose parent is not `a`.
  EXPECT_EQ(Match(pool, {1, 2, 1, 2}), Ids{a});

  // Colliding content is not stored.
  const int32_t b = pool.Allocate();
  const Ids other = {1, 3};
  EXPECT_FALSE(pool.Register(b, -1, other.data(), 0));
  const Ids same = {1, 2};
  EXPECT_FALSE(pool.Register(b, a, same.data(), 0));
  EXPECT_FALSE(pool.registered(b));
  EXPECT_TRUE(pool.registered(a));
}

// Blind to the parent: a child's hash survives its parent's eviction.
uint64_t ParentBlindHash(uint64_t, uint64_t key,
                         absl::Span<const int32_t> tokens) {
  return absl::HashOf(key, tokens);
}

TEST(KvBlockPoolTest, AChildIsNotMatchedAfterItsParentIdIsReused) {
  KvBlockPool pool(3, 2, &ParentBlindHash);
  const int32_t held = pool.Allocate();
  const Ids chain = AllocateChain(pool, {1, 2, 3, 4});
  EXPECT_TRUE(pool.Release(chain[0]));
  EXPECT_TRUE(pool.Release(chain[1]));
  // The parent's id now holds other content; the child still names it.
  const int32_t x = pool.Allocate();
  ASSERT_EQ(x, chain[0]);
  const Ids nines = {9, 9};
  EXPECT_TRUE(pool.Register(x, -1, nines.data(), 0));
  EXPECT_TRUE(pool.registered(chain[1]));
  EXPECT_EQ(Match(pool, {9, 9, 3, 4}), Ids{x});

  // A new child with the orphan's hash takes its place.
  EXPECT_TRUE(pool.Release(held));
  const int32_t y = pool.Allocate();
  EXPECT_EQ(y, held);
  const Ids tail = {3, 4};
  EXPECT_TRUE(pool.Register(y, x, tail.data(), 0));
  EXPECT_FALSE(pool.registered(chain[1]));
  EXPECT_EQ(pool.num_cached(), 0);
  EXPECT_EQ(pool.num_free(), 1);
  EXPECT_EQ(Match(pool, {9, 9, 3, 4}), (Ids{x, y}));
}

// Sequences come and go at random (prompts share prefixes often: two token
// values, two keys); after every operation the pool agrees with a model of
// the reference counts and of what each registered block holds.
TEST(KvBlockPoolTest, CountersStayConsistentThroughRandomOperations) {
  constexpr int32_t kBlocks = 8;
  constexpr int32_t kBlockSize = 2;
  KvBlockPool pool(kBlocks, kBlockSize);
  std::mt19937 rng(20240611);
  auto uniform = [&rng](int lo, int hi) {
    return std::uniform_int_distribution<int>(lo, hi)(rng);
  };
  struct Content {
    int32_t parent;
    uint64_t key;
    Ids tokens;
  };
  struct Sequence {
    Ids blocks;
  };
  std::map<int32_t, int32_t> refs;
  std::map<int32_t, Content> content;  // as last registered
  std::vector<Sequence> live;
  int64_t matched_blocks = 0;
  int64_t evictions = 0;

  auto check_chain = [&](const Ids& chain, const Ids& tokens, uint64_t key) {
    for (size_t i = 0; i < chain.size(); ++i) {
      ASSERT_TRUE(pool.registered(chain[i]));
      const Content& c = content.at(chain[i]);
      EXPECT_EQ(c.parent, i == 0 ? -1 : chain[i - 1]);
      EXPECT_EQ(c.key, key);
      EXPECT_TRUE(std::equal(c.tokens.begin(), c.tokens.end(),
                             tokens.begin() + i * kBlockSize));
    }
  };
  auto check_counters = [&] {
    int32_t used = 0;
    int32_t cached = 0;
    for (int32_t b = 0; b < kBlocks; ++b) {
      ASSERT_EQ(pool.refcount(b), refs[b]) << "block " << b;
      used += refs[b] > 0;
      cached += refs[b] == 0 && pool.registered(b);
    }
    EXPECT_EQ(pool.num_used(), used);
    EXPECT_EQ(pool.num_cached(), cached);
    EXPECT_EQ(pool.num_used() + pool.num_free(), kBlocks);
  };

  for (int step = 0; step < 3000; ++step) {
    const int op = uniform(0, 9);
    if (op < 5) {  // a sequence starts
      const int32_t num_tokens = uniform(1, 4) * kBlockSize;
      Ids tokens(num_tokens + uniform(0, 1));  // maybe a partial block
      for (int32_t& t : tokens) t = uniform(0, 1);
      const uint64_t key = uniform(0, 1);
      const int64_t whole = tokens.size() / kBlockSize;
      // Now and then a caller registers without matching (duplicates).
      const bool match = uniform(0, 3) != 0;
      Sequence seq;
      if (match) {
        seq.blocks = Match(pool, tokens, key, whole);
        check_chain(seq.blocks, tokens, key);
        matched_blocks += seq.blocks.size();
        for (int32_t b : seq.blocks) {
          pool.Acquire(b);
          ++refs[b];
        }
      }
      const size_t reused = seq.blocks.size();
      bool out_of_blocks = false;
      while (static_cast<int64_t>(seq.blocks.size()) < whole) {
        const bool any_plain =
            std::any_of(refs.begin(), refs.end(),
                        [&](const std::pair<int32_t, int32_t>& r) {
                          return r.second == 0 && !pool.registered(r.first);
                        });
        std::vector<bool> was_registered(kBlocks);
        for (int32_t b = 0; b < kBlocks; ++b) {
          was_registered[b] = pool.registered(b);
        }
        const int32_t b = pool.Allocate();
        const bool any_free = std::any_of(
            refs.begin(), refs.end(),
            [](const std::pair<int32_t, int32_t>& r) { return r.second == 0; });
        if (b < 0) {
          EXPECT_FALSE(any_free);
          out_of_blocks = true;
          break;
        }
        ASSERT_EQ(refs[b], 0);
        EXPECT_FALSE(pool.registered(b));
        if (any_plain) {
          EXPECT_FALSE(was_registered[b]);
        }
        evictions += was_registered[b];
        refs[b] = 1;
        seq.blocks.push_back(b);
      }
      if (out_of_blocks) {
        ReleaseAll(pool, seq.blocks);
        for (int32_t b : seq.blocks) --refs[b];
      } else {
        // Register after the matched prefix until the first refusal.
        size_t registered = reused;
        for (; registered < seq.blocks.size(); ++registered) {
          const int32_t b = seq.blocks[registered];
          const int32_t parent =
              registered == 0 ? -1 : seq.blocks[registered - 1];
          const int32_t* block_tokens = tokens.data() + registered * kBlockSize;
          const bool ok = pool.Register(b, parent, block_tokens, key);
          // After a full match the rest is new content.
          if (match) {
            EXPECT_TRUE(ok);
          }
          if (!ok) break;
          content[b] = Content{parent, key,
                               Ids(block_tokens, block_tokens + kBlockSize)};
        }
        const Ids prefix(seq.blocks.begin(), seq.blocks.begin() + registered);
        EXPECT_EQ(Match(pool, tokens, key, registered), prefix);
        live.push_back(seq);
      }
    } else if (op < 9 && !live.empty()) {  // a sequence ends
      const size_t i = uniform(0, live.size() - 1);
      Ids blocks = live[i].blocks;
      live.erase(live.begin() + i);
      // Mostly last-first; sometimes first-first, which orphans children.
      if (uniform(0, 3) == 0) std::reverse(blocks.begin(), blocks.end());
      ReleaseAll(pool, blocks);
      for (int32_t b : blocks) --refs[b];
    } else {  // a stray release of a free block changes nothing
      const int32_t b = uniform(0, kBlocks - 1);
      if (refs[b] == 0) {
        const int32_t cached = pool.num_cached();
        EXPECT_FALSE(pool.Release(b));
        EXPECT_EQ(pool.num_cached(), cached);
      }
    }
    check_counters();
    if (HasFatalFailure()) return;
  }
  // The run exercised sharing and eviction.
  EXPECT_GT(matched_blocks, 100);
  EXPECT_GT(evictions, 100);
}

}  // namespace
}  // namespace moh
