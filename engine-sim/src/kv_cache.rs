//! The prefix KV cache model, pure (no time, no I/O), mirroring vLLM's automatic prefix caching.
//!
//! - The prompt's bytes are cut into blocks of `block_bytes` (= block size in tokens x 4 bytes).
//!   Block `i`'s hash is `xxh3_64_with_seed(block_i_bytes, hash_{i-1})` with `hash_{-1} = 0`, so a
//!   block's hash covers every byte before it: equal hashes mean equal prefixes.
//! - Only full blocks are cacheable; a trailing partial block never is.
//! - A request's cached tokens are the longest run of leading blocks present in the cache.
//! - Blocks referenced by running requests are pinned (reference count > 0) and never evicted.
//!   Unpinned blocks stay cached and are evicted least-recently-used when space is needed. When a
//!   request releases its blocks they join the LRU list in reverse order, so its tail blocks are
//!   evicted before its head blocks (as vLLM's free block queue does).
//! - The cache never holds more than its capacity: blocks that do not fit even after evicting
//!   every unpinned block are simply not cached.
//!
//! - With a tokenizer (`--tokenizer`) the prompt is token ids instead: blocks of `block_size` ids,
//!   block `i`'s hash `xxh3_64_with_seed(little-endian u32 ids of block i, hash_{i-1})`
//!   ([`PromptBlocks::from_token_ids`]); the rules above are the same.
//! - The cache can record what it stores and evicts ([`PrefixCache::record_changes`]), in order,
//!   for the KV events an engine publishes.
//!
//! Cost: a lookup or insertion is O(blocks of the prompt) (hash map + intrusive LRU list over a
//! slab); nothing ever scans the whole cache.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Cuts a prompt, fed in pieces, into chained block hashes without copying it whole.
#[derive(Debug, Clone)]
pub struct BlockHasher {
    block_bytes: usize,
    /// Bytes of the current partial block (always < block_bytes).
    partial: Vec<u8>,
    prev: u64,
    hashes: Vec<u64>,
    total_bytes: u64,
}

/// The cache-relevant digest of one prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromptBlocks {
    /// Chained hashes of the prompt's full blocks, in order.
    pub hashes: Vec<u64>,
    /// Length of the prompt in bytes.
    pub prompt_bytes: u64,
    /// A hash of the whole prompt including its trailing partial block (seeds the filler text).
    pub prompt_hash: u64,
}

impl PromptBlocks {
    /// Prompt length in tokens: 4 bytes make a token, rounded up.
    pub fn prompt_tokens(&self) -> u64 {
        self.prompt_bytes.div_ceil(crate::BYTES_PER_TOKEN as u64)
    }
}

impl PromptBlocks {
    /// The digest of a prompt of token ids, in blocks of `block_size` ids (at least 1); its
    /// `prompt_bytes` are 4 per id, so [`PromptBlocks::prompt_tokens`] is the number of ids.
    pub fn from_token_ids(ids: &[u32], block_size: usize) -> Self {
        let block_size = block_size.max(1);
        let mut hashes = Vec::with_capacity(ids.len() / block_size);
        let mut prev = 0;
        let mut bytes = Vec::with_capacity(block_size * 4);
        let mut blocks = ids.chunks_exact(block_size);
        for block in &mut blocks {
            bytes.clear();
            bytes.extend(block.iter().flat_map(|id| id.to_le_bytes()));
            prev = xxh3_64_with_seed(&bytes, prev);
            hashes.push(prev);
        }
        bytes.clear();
        bytes.extend(blocks.remainder().iter().flat_map(|id| id.to_le_bytes()));
        PromptBlocks {
            prompt_hash: xxh3_64_with_seed(&bytes, prev),
            hashes,
            prompt_bytes: ids.len() as u64 * crate::BYTES_PER_TOKEN as u64,
        }
    }
}

/// One change to the cache's contents, as [`PrefixCache::take_changes`] reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheChange {
    /// `hashes[i]` of the `insert_and_pin` call was stored.
    Stored(usize),
    /// The block with this hash was evicted.
    Evicted(u64),
}

impl BlockHasher {
    /// A hasher for blocks of `block_bytes` bytes (at least 1).
    pub fn new(block_bytes: usize) -> Self {
        let block_bytes = block_bytes.max(1);
        Self {
            block_bytes,
            partial: Vec::new(),
            prev: 0,
            hashes: Vec::new(),
            total_bytes: 0,
        }
    }

    /// Appends the next piece of the prompt.
    pub fn update(&mut self, mut data: &[u8]) {
        self.total_bytes += data.len() as u64;
        if !self.partial.is_empty() {
            let take = (self.block_bytes - self.partial.len()).min(data.len());
            self.partial.extend_from_slice(&data[..take]);
            data = &data[take..];
            if self.partial.len() == self.block_bytes {
                self.prev = xxh3_64_with_seed(&self.partial, self.prev);
                self.hashes.push(self.prev);
                self.partial.clear();
            }
        }
        while data.len() >= self.block_bytes {
            let (block, rest) = data.split_at(self.block_bytes);
            self.prev = xxh3_64_with_seed(block, self.prev);
            self.hashes.push(self.prev);
            data = rest;
        }
        if !data.is_empty() {
            if self.partial.capacity() == 0 {
                self.partial.reserve_exact(self.block_bytes);
            }
            self.partial.extend_from_slice(data);
        }
    }

    /// The digest of everything fed so far.
    pub fn finish(self) -> PromptBlocks {
        PromptBlocks {
            prompt_hash: xxh3_64_with_seed(&self.partial, self.prev),
            hashes: self.hashes,
            prompt_bytes: self.total_bytes,
        }
    }

    /// Digest of a prompt given whole.
    pub fn hash_prompt(prompt: &[u8], block_bytes: usize) -> PromptBlocks {
        let mut h = Self::new(block_bytes);
        h.update(prompt);
        h.finish()
    }
}

/// Block hashes are already uniformly distributed: the map uses them as they are.
#[derive(Default)]
struct IdentityHasher(u64);

impl Hasher for IdentityHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // Only u64 keys are hashed; keep a correct fallback anyway.
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone)]
struct Slot {
    hash: u64,
    refs: u32,
    /// LRU neighbours; meaningful only while `refs == 0` (the slot is in the LRU list).
    prev: u32,
    next: u32,
}

/// The set of cached blocks of one engine. See the module documentation for the rules.
pub struct PrefixCache {
    capacity: usize,
    index: HashMap<u64, u32, BuildHasherDefault<IdentityHasher>>,
    slots: Vec<Slot>,
    /// Least recently used unpinned block (evicted first).
    lru_head: u32,
    /// Most recently used unpinned block.
    lru_tail: u32,
    pinned: usize,
    /// What changed since the last `take_changes`, when recording.
    changes: Option<Vec<CacheChange>>,
}

impl std::fmt::Debug for PrefixCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefixCache")
            .field("capacity", &self.capacity)
            .field("cached", &self.index.len())
            .field("pinned", &self.pinned)
            .finish()
    }
}

impl PrefixCache {
    /// An empty cache holding at most `capacity_blocks` blocks (0 disables caching).
    pub fn new(capacity_blocks: usize) -> Self {
        // The slab is indexed by u32; a cache beyond 4 billion blocks is not a real configuration.
        let capacity = capacity_blocks.min(NIL as usize - 1);
        Self {
            capacity,
            index: HashMap::default(),
            slots: Vec::new(),
            lru_head: NIL,
            lru_tail: NIL,
            pinned: 0,
            changes: None,
        }
    }

    /// From now on, records every block stored and evicted, for [`PrefixCache::take_changes`].
    pub fn record_changes(&mut self) {
        self.changes.get_or_insert_with(Vec::new);
    }

    /// The changes recorded since the last call, in order (empty when not recording).
    pub fn take_changes(&mut self) -> Vec<CacheChange> {
        self.changes
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// Capacity in blocks.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Blocks currently cached (pinned or not).
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// Whether no block is cached.
    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// Blocks referenced by at least one running request.
    pub fn pinned_blocks(&self) -> usize {
        self.pinned
    }

    /// Share of the capacity held by running requests, 0..=1, like vLLM's `kv_cache_usage_perc`
    /// (cached blocks that no request references count as free: they are evictable).
    pub fn usage(&self) -> f64 {
        if self.capacity == 0 {
            0.0
        } else {
            self.pinned as f64 / self.capacity as f64
        }
    }

    /// Whether the block with this hash is cached.
    pub fn contains(&self, hash: u64) -> bool {
        self.index.contains_key(&hash)
    }

    /// Number of leading blocks of `hashes` present, without touching anything.
    pub fn matched_blocks(&self, hashes: &[u64]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.index.contains_key(h))
            .count()
    }

    /// Finds the longest run of leading blocks present and pins them. Returns its length `m`;
    /// the caller later passes `hashes` and `m` to [`PrefixCache::insert_and_pin`].
    pub fn lookup_and_pin(&mut self, hashes: &[u64]) -> usize {
        let mut matched = 0;
        for h in hashes {
            match self.index.get(h) {
                Some(&slot) => {
                    self.pin(slot);
                    matched += 1;
                }
                None => break,
            }
        }
        matched
    }

    /// After prefill: makes every block of `hashes` from `already_pinned` on cached and pinned,
    /// evicting unpinned blocks LRU-first for room. Stops at the first block that cannot fit
    /// (the blocks after it would be unreachable anyway). Returns how many leading blocks of
    /// `hashes` are now pinned by the caller; pass exactly that prefix to [`PrefixCache::release`].
    pub fn insert_and_pin(&mut self, hashes: &[u64], already_pinned: usize) -> usize {
        let mut pinned = already_pinned.min(hashes.len());
        for (i, &h) in hashes.iter().enumerate().skip(pinned) {
            if let Some(&slot) = self.index.get(&h) {
                // Another request computed and cached it meanwhile.
                self.pin(slot);
            } else {
                let Some(slot) = self.allocate() else { break };
                let s = &mut self.slots[slot as usize];
                s.hash = h;
                s.refs = 1;
                s.prev = NIL;
                s.next = NIL;
                self.pinned += 1;
                self.index.insert(h, slot);
                if let Some(changes) = &mut self.changes {
                    changes.push(CacheChange::Stored(i));
                }
            }
            pinned += 1;
        }
        pinned
    }

    /// Unpins blocks pinned by one request (the prefix returned by `insert_and_pin`, or by
    /// `lookup_and_pin` if the request ended before its prefill). Blocks whose last reference
    /// goes become evictable, most recently used, tail blocks first in eviction order.
    pub fn release(&mut self, pinned_prefix: &[u64]) {
        for h in pinned_prefix.iter().rev() {
            let Some(&slot) = self.index.get(h) else {
                debug_assert!(false, "released a block that is not cached");
                continue;
            };
            let s = &mut self.slots[slot as usize];
            if s.refs == 0 {
                debug_assert!(false, "released a block that is not pinned");
                continue;
            }
            s.refs -= 1;
            if s.refs == 0 {
                self.pinned -= 1;
                self.push_mru(slot);
            }
        }
    }

    fn pin(&mut self, slot: u32) {
        if self.slots[slot as usize].refs == 0 {
            self.unlink(slot);
            self.pinned += 1;
        }
        self.slots[slot as usize].refs += 1;
    }

    /// A slot for a new block: a new one within capacity, else the LRU unpinned block's.
    /// (Blocks leave the cache only by eviction, whose slot is reused at once: no free list.)
    fn allocate(&mut self) -> Option<u32> {
        if self.slots.len() < self.capacity {
            self.slots.push(Slot {
                hash: 0,
                refs: 0,
                prev: NIL,
                next: NIL,
            });
            return Some((self.slots.len() - 1) as u32);
        }
        let victim = self.lru_head;
        if victim == NIL {
            return None;
        }
        self.unlink(victim);
        let hash = self.slots[victim as usize].hash;
        self.index.remove(&hash);
        if let Some(changes) = &mut self.changes {
            changes.push(CacheChange::Evicted(hash));
        }
        Some(victim)
    }

    fn unlink(&mut self, slot: u32) {
        let (prev, next) = {
            let s = &self.slots[slot as usize];
            (s.prev, s.next)
        };
        if prev == NIL {
            self.lru_head = next;
        } else {
            self.slots[prev as usize].next = next;
        }
        if next == NIL {
            self.lru_tail = prev;
        } else {
            self.slots[next as usize].prev = prev;
        }
        let s = &mut self.slots[slot as usize];
        s.prev = NIL;
        s.next = NIL;
    }

    fn push_mru(&mut self, slot: u32) {
        let tail = self.lru_tail;
        {
            let s = &mut self.slots[slot as usize];
            s.prev = tail;
            s.next = NIL;
        }
        if tail == NIL {
            self.lru_head = slot;
        } else {
            self.slots[tail as usize].next = slot;
        }
        self.lru_tail = slot;
    }

    /// Hashes of the unpinned blocks from least to most recently used (tests only: O(n)).
    #[cfg(test)]
    fn lru_order(&self) -> Vec<u64> {
        let mut out = Vec::new();
        let mut cur = self.lru_head;
        while cur != NIL {
            out.push(self.slots[cur as usize].hash);
            cur = self.slots[cur as usize].next;
        }
        out
    }

    /// Checks every internal invariant (tests only: O(n)).
    #[cfg(test)]
    fn check_invariants(&self) {
        assert!(self.index.len() <= self.capacity, "over capacity");
        let lru = self.lru_order();
        let pinned = self
            .index
            .values()
            .filter(|&&s| self.slots[s as usize].refs > 0)
            .count();
        assert_eq!(pinned, self.pinned);
        assert_eq!(lru.len() + pinned, self.index.len());
        for h in &lru {
            let slot = self.index[h];
            assert_eq!(self.slots[slot as usize].refs, 0);
        }
        for (h, &s) in &self.index {
            assert_eq!(self.slots[s as usize].hash, *h);
        }
        assert_eq!(self.index.len(), self.slots.len());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};

    const BB: usize = 64; // 16 tokens x 4 bytes

    fn text(blocks: &[u8], tail: usize) -> Vec<u8> {
        let mut v = Vec::new();
        for &b in blocks {
            v.extend(std::iter::repeat_n(b, BB));
        }
        v.extend(std::iter::repeat_n(b'~', tail));
        v
    }

    /// Runs one request through the cache: lookup, insert, release. Returns matched blocks.
    fn serve(cache: &mut PrefixCache, p: &PromptBlocks) -> usize {
        let m = cache.lookup_and_pin(&p.hashes);
        let pinned = cache.insert_and_pin(&p.hashes, m);
        cache.release(&p.hashes[..pinned]);
        cache.check_invariants();
        m
    }

    #[test]
    fn hashes_are_chained_and_piece_boundaries_do_not_matter() {
        let prompt = text(b"abcde", 10);
        let whole = BlockHasher::hash_prompt(&prompt, BB);
        assert_eq!(whole.hashes.len(), 5, "only full blocks are hashed");
        assert_eq!(whole.prompt_bytes, 5 * 64 + 10);
        assert_eq!(whole.prompt_tokens(), (5 * 64 + 10_u64).div_ceil(4));
        for split in [1, 3, 63, 64, 65, 200] {
            let mut h = BlockHasher::new(BB);
            for piece in prompt.chunks(split) {
                h.update(piece);
            }
            assert_eq!(h.finish(), whole, "pieces of {split} bytes");
        }
        // The same block content after a different prefix hashes differently.
        let other = BlockHasher::hash_prompt(&text(b"xbcde", 0), BB);
        assert!(other.hashes.iter().zip(&whole.hashes).all(|(a, b)| a != b));
        // And the first block uses seed 0, as documented for the router.
        assert_eq!(whole.hashes[0], xxh3_64_with_seed(&prompt[..64], 0));
        assert_eq!(
            whole.hashes[1],
            xxh3_64_with_seed(&prompt[64..128], whole.hashes[0])
        );
    }

    #[test]
    fn full_hit_partial_hit_and_miss() {
        let mut cache = PrefixCache::new(100);
        let a = BlockHasher::hash_prompt(&text(b"abcd", 30), BB);
        assert_eq!(serve(&mut cache, &a), 0, "cold cache: miss");
        assert_eq!(cache.len(), 4, "the partial tail block is not cached");
        assert_eq!(serve(&mut cache, &a), 4, "full hit");
        let partial = BlockHasher::hash_prompt(&text(b"abXY", 0), BB);
        assert_eq!(
            serve(&mut cache, &partial),
            2,
            "shares the first two blocks"
        );
        let miss = BlockHasher::hash_prompt(&text(b"zbcd", 0), BB);
        assert_eq!(
            serve(&mut cache, &miss),
            0,
            "differs in block 0: nothing matches"
        );
        assert_eq!(cache.len(), 4 + 2 + 4);
        assert_eq!(cache.pinned_blocks(), 0);
    }

    #[test]
    fn evicts_least_recently_used_tail_blocks_first() {
        let mut cache = PrefixCache::new(4);
        let a = BlockHasher::hash_prompt(&text(b"aa", 0), BB);
        let b = BlockHasher::hash_prompt(&text(b"bb", 0), BB);
        let c = BlockHasher::hash_prompt(&text(b"c", 0), BB);
        serve(&mut cache, &a);
        serve(&mut cache, &b);
        // Released in reverse: each request's tail block is older than its head block.
        assert_eq!(
            cache.lru_order(),
            vec![a.hashes[1], a.hashes[0], b.hashes[1], b.hashes[0]]
        );
        assert_eq!(
            serve(&mut cache, &a),
            2,
            "touch a: b is now least recently used"
        );
        serve(&mut cache, &c);
        assert!(!cache.contains(b.hashes[1]), "b's tail block went first");
        assert!(cache.contains(b.hashes[0]));
        assert_eq!(cache.matched_blocks(&a.hashes), 2);
        assert_eq!(cache.matched_blocks(&b.hashes), 1);
        assert_eq!(cache.len(), 4);
    }

    #[test]
    fn pinned_blocks_are_never_evicted_and_overflow_is_not_cached() {
        let mut cache = PrefixCache::new(3);
        let a = BlockHasher::hash_prompt(&text(b"aa", 0), BB);
        let m = cache.lookup_and_pin(&a.hashes);
        let a_pinned = cache.insert_and_pin(&a.hashes, m);
        assert_eq!(a_pinned, 2);
        // b needs 3 blocks, only 1 slot is free and a's blocks are pinned.
        let b = BlockHasher::hash_prompt(&text(b"bbb", 0), BB);
        let m = cache.lookup_and_pin(&b.hashes);
        assert_eq!(m, 0);
        let b_pinned = cache.insert_and_pin(&b.hashes, m);
        assert_eq!(b_pinned, 1, "only the block that fits is cached");
        cache.check_invariants();
        assert_eq!(cache.len(), 3);
        assert!(cache.contains(a.hashes[0]) && cache.contains(a.hashes[1]));
        assert_eq!(cache.usage(), 1.0);
        // Nothing can be evicted while everything is pinned: a third request is not cached.
        let c = BlockHasher::hash_prompt(&text(b"c", 0), BB);
        assert_eq!(cache.insert_and_pin(&c.hashes, 0), 0);
        cache.release(&b.hashes[..b_pinned]);
        cache.release(&a.hashes[..a_pinned]);
        cache.check_invariants();
        assert_eq!(cache.pinned_blocks(), 0);
        assert_eq!(cache.usage(), 0.0);
        // Now there is room again, by eviction.
        assert_eq!(serve(&mut cache, &c), 0);
        assert!(cache.contains(c.hashes[0]));
        assert_eq!(cache.len(), 3);
    }

    #[test]
    fn token_blocks_chain_and_changes_are_recorded_in_order() {
        let ids: Vec<u32> = (0..70).collect();
        let p = PromptBlocks::from_token_ids(&ids, 32);
        assert_eq!(p.hashes.len(), 2);
        assert_eq!(p.prompt_tokens(), 70);
        let le = |ids: &[u32]| {
            ids.iter()
                .flat_map(|i| i.to_le_bytes())
                .collect::<Vec<u8>>()
        };
        assert_eq!(p.hashes[0], xxh3_64_with_seed(&le(&ids[..32]), 0));
        assert_eq!(
            p.hashes[1],
            xxh3_64_with_seed(&le(&ids[32..64]), p.hashes[0])
        );
        let mut cache = PrefixCache::new(2);
        cache.record_changes();
        serve(&mut cache, &p);
        assert_eq!(
            cache.take_changes(),
            [CacheChange::Stored(0), CacheChange::Stored(1)]
        );
        let q = PromptBlocks::from_token_ids(&ids[1..], 32);
        serve(&mut cache, &q);
        // Released tail first, so block 1 is evicted first.
        assert_eq!(
            cache.take_changes(),
            [
                CacheChange::Evicted(p.hashes[1]),
                CacheChange::Stored(0),
                CacheChange::Evicted(p.hashes[0]),
                CacheChange::Stored(1)
            ]
        );
    }

    #[test]
    fn zero_capacity_caches_nothing() {
        let mut cache = PrefixCache::new(0);
        let a = BlockHasher::hash_prompt(&text(b"aa", 0), BB);
        assert_eq!(serve(&mut cache, &a), 0);
        assert_eq!(serve(&mut cache, &a), 0);
        assert_eq!(cache.usage(), 0.0);
    }

    /// A slow, obviously correct model of the same rules, to compare against under random load.
    #[derive(Default)]
    struct NaiveCache {
        capacity: usize,
        /// (hash, refs, last unpinned tick)
        blocks: Vec<(u64, u32, u64)>,
        tick: u64,
    }

    impl NaiveCache {
        fn find(&self, h: u64) -> Option<usize> {
            self.blocks.iter().position(|b| b.0 == h)
        }
        fn lookup_and_pin(&mut self, hashes: &[u64]) -> usize {
            let mut m = 0;
            for &h in hashes {
                let Some(i) = self.find(h) else { break };
                self.blocks[i].1 += 1;
                m += 1;
            }
            m
        }
        fn insert_and_pin(&mut self, hashes: &[u64], from: usize) -> usize {
            let mut pinned = from;
            for &h in &hashes[from..] {
                if let Some(i) = self.find(h) {
                    self.blocks[i].1 += 1;
                } else if self.blocks.len() < self.capacity {
                    self.blocks.push((h, 1, 0));
                } else {
                    let victim = self
                        .blocks
                        .iter()
                        .enumerate()
                        .filter(|(_, b)| b.1 == 0)
                        .min_by_key(|(_, b)| b.2)
                        .map(|(i, _)| i);
                    let Some(v) = victim else { break };
                    self.blocks[v] = (h, 1, 0);
                }
                pinned += 1;
            }
            pinned
        }
        fn release(&mut self, hashes: &[u64]) {
            for &h in hashes.iter().rev() {
                let i = self.find(h).unwrap();
                self.blocks[i].1 -= 1;
                if self.blocks[i].1 == 0 {
                    self.tick += 1;
                    self.blocks[i].2 = self.tick;
                }
            }
        }
    }

    #[test]
    fn matches_a_naive_model_under_random_concurrent_requests() {
        let mut rng = SmallRng::seed_from_u64(42);
        let mut cache = PrefixCache::new(24);
        let mut naive = NaiveCache {
            capacity: 24,
            ..Default::default()
        };
        // Prompts built from a few shared prefixes so hits, partial hits and evictions all happen.
        let prompts: Vec<PromptBlocks> = (0..30)
            .map(|i| {
                let family = (i % 4) as u8;
                let mut blocks = vec![b'A' + family; 1 + i % 3];
                blocks.extend((0..rng.random_range(0..6)).map(|_| rng.random_range(b'a'..=b'e')));
                BlockHasher::hash_prompt(&text(&blocks, i % 5), BB)
            })
            .collect();
        // Requests in flight: (prompt index, pinned prefix length).
        let mut running: Vec<(usize, usize)> = Vec::new();
        for _ in 0..5_000 {
            if running.len() < 6 && (running.is_empty() || rng.random_bool(0.5)) {
                let p = rng.random_range(0..prompts.len());
                let hashes = &prompts[p].hashes;
                let m = cache.lookup_and_pin(hashes);
                assert_eq!(m, naive.lookup_and_pin(hashes));
                let pinned = cache.insert_and_pin(hashes, m);
                assert_eq!(pinned, naive.insert_and_pin(hashes, m));
                running.push((p, pinned));
            } else {
                let (p, pinned) = running.swap_remove(rng.random_range(0..running.len()));
                cache.release(&prompts[p].hashes[..pinned]);
                naive.release(&prompts[p].hashes[..pinned]);
            }
            cache.check_invariants();
            assert_eq!(cache.len(), naive.blocks.len());
            for b in &naive.blocks {
                assert!(cache.contains(b.0));
            }
        }
    }
}
