//! The exact prefix index of one PREFIX_AWARE variant: the KV blocks each engine holds, from the
//! engines' own KV-cache events (vLLM's `--kv-events-config`, decoded and subscribed to by the
//! `kv-events` crate; [`crate::kv`] runs the subscribers).
//!
//! An engine names its blocks by its own hashes, which a router cannot reproduce (vLLM's default
//! is sha256 over pickled Python objects), so each block is re-keyed, as Dynamo and llm-d do: the
//! router's key of a block is xxh3 over its token ids (little-endian u32), seeded with the key of
//! the block before it (the first block: with the LoRA adapter's name hashed, or 0). A
//! `BlockStored` event carries the token ids of its blocks and the engine hash of the parent, so
//! the keys chain from the parent's key; the engine hash of each block maps to its key for the
//! `BlockRemoved` that will name it. A prompt's keys come from its tokens
//! ([`chat_tokens::ChatTokenizer`]) by the same chain ([`block_keys`]); an instance then holds
//! the prompt's leading blocks up to the first key it lacks, exactly as the engine's prefix
//! cache will find them.
//!
//! An instance is *exact* once its stream delivered an event since it was last reset; until then
//! (an engine that publishes nothing, a stream that just had a gap it could not fill) placement
//! uses the inferred index ([`crate::prefix_index`]) for it. A reset forgets the instance's
//! blocks.
//!
//! Bounded: at most [`MAX_BLOCKS`] (block, instance) pairs per variant; stores past it are
//! dropped and counted, as are stores whose parent the index does not know (a stream joined
//! mid-sequence) and events whose token ids do not fill their blocks. Only the full-attention
//! group (`group_idx` 0 or absent) on the GPU tier (`medium` "GPU" or absent) is indexed: that is
//! where a prompt's prefix hits.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use kv_events::{Counters, Event};
use smallvec::SmallVec;
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use crate::prefix_index::Map;

/// (block, instance) pairs one variant's exact index holds at most.
pub const MAX_BLOCKS: usize = 1 << 21;

/// The router's keys of a prompt's full blocks of `block_size` tokens, chained from `lora`'s
/// seed, into `out`.
pub fn block_keys(tokens: &[u32], block_size: usize, lora: Option<&str>, out: &mut Vec<u64>) {
    out.clear();
    extend_block_keys(tokens, block_size, lora, out);
}

/// [`block_keys`] for the full blocks of `tokens` past the `out.len()` already keyed (`tokens`
/// having grown since).
pub fn extend_block_keys(
    tokens: &[u32],
    block_size: usize,
    lora: Option<&str>,
    out: &mut Vec<u64>,
) {
    if block_size == 0 {
        return;
    }
    let mut key = out.last().copied().unwrap_or_else(|| lora_seed(lora));
    let mut bytes = [0u8; 4 * 64];
    for block in tokens.chunks_exact(block_size).skip(out.len()) {
        key = chain(key, block, &mut bytes);
        out.push(key);
    }
}

fn lora_seed(lora: Option<&str>) -> u64 {
    lora.map_or(0, |name| xxh3_64(name.as_bytes()))
}

/// The key of `block` after the block keyed `parent`: xxh3 over its token ids' little-endian
/// bytes (through `buf` in pieces of 64 tokens, chained), seeded with `parent`.
fn chain(parent: u64, block: &[u32], buf: &mut [u8; 4 * 64]) -> u64 {
    let mut key = parent;
    for piece in block.chunks(64) {
        for (dst, t) in buf.chunks_exact_mut(4).zip(piece) {
            dst.copy_from_slice(&t.to_le_bytes());
        }
        key = xxh3_64_with_seed(&buf[..4 * piece.len()], key);
    }
    key
}

/// What the index knows of one instance.
#[derive(Debug, Default)]
struct Slot {
    /// The table's instance id hash (0: a free slot).
    id: u64,
    /// The engine's hash of each block held -> the router's key.
    by_engine: HashMap<u64, u64>,
    /// Whether an event arrived since the last reset (see the module doc).
    live: bool,
    /// The instance's subscriber's counters, for metrics.
    counters: Option<Arc<Counters>>,
    /// Table position (`u32::MAX`: not in the table the index was last synced to).
    at: u32,
}

#[derive(Debug, Default)]
struct Inner {
    /// Router key -> the slots holding it.
    blocks: Map<SmallVec<[u32; 2]>>,
    slots: Vec<Slot>,
    pairs: usize,
    /// Tokens per block, from the events (0 until one arrives).
    block_size: u32,
    ids: Vec<u64>,
    /// Instance id hash -> its slot (every event looks it up).
    slot_of: Map<u32>,
}

/// Counts of what the index refused, for metrics.
#[derive(Debug, Default)]
pub struct Refused {
    /// Stores dropped at [`MAX_BLOCKS`].
    pub full: AtomicU64,
    /// Stores whose parent block the instance was not known to hold.
    pub unknown_parent: AtomicU64,
    /// Events whose token ids did not make whole blocks of their block size.
    pub malformed: AtomicU64,
}

/// The exact index of one variant (see the module doc).
#[derive(Debug, Default)]
pub struct KvIndex {
    inner: Mutex<Inner>,
    refused: Refused,
}

impl KvIndex {
    /// Makes room for instance `id` (before its subscriber starts).
    pub fn attach_slot(&self, id: u64) {
        self.lock().slot(id);
    }

    /// The counters of instance `id`'s subscriber, for metrics.
    pub fn attach(&self, id: u64, counters: Arc<Counters>) {
        let mut inner = self.lock();
        let s = inner.slot(id);
        inner.slots[s].counters = Some(counters);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Applies one event of instance `id`.
    pub fn apply(&self, id: u64, event: &Event) {
        let mut inner = self.lock();
        let s = inner.slot(id);
        inner.slots[s].live = true;
        match event {
            Event::Stored {
                hashes,
                parent,
                token_ids,
                block_size,
                lora_name,
                medium,
                group_idx,
            } => {
                if !indexed(medium.as_deref(), *group_idx) {
                    return;
                }
                let size = *block_size as usize;
                if size == 0 || token_ids.len() != hashes.len() * size {
                    self.refused.malformed.fetch_add(1, Relaxed);
                    return;
                }
                let mut key = match parent {
                    None => lora_seed(lora_name.as_deref()),
                    Some(p) => match inner.slots[s].by_engine.get(p) {
                        Some(&k) => k,
                        None => {
                            self.refused.unknown_parent.fetch_add(1, Relaxed);
                            return;
                        }
                    },
                };
                inner.block_size = *block_size;
                let mut buf = [0u8; 4 * 64];
                for (hash, block) in hashes.iter().zip(token_ids.chunks_exact(size)) {
                    key = chain(key, block, &mut buf);
                    if !inner.store(s, *hash, key) {
                        self.refused.full.fetch_add(1, Relaxed);
                        return;
                    }
                }
            }
            Event::Removed {
                hashes,
                medium,
                group_idx,
            } => {
                if !indexed(medium.as_deref(), *group_idx) {
                    return;
                }
                for hash in hashes {
                    inner.remove(s, *hash);
                }
            }
            Event::Cleared => inner.clear(s),
        }
    }

    /// Forgets instance `id`'s blocks; it is inferred again until its next event.
    pub fn reset(&self, id: u64) {
        let mut inner = self.lock();
        let s = inner.slot(id);
        inner.clear(s);
        inner.slots[s].live = false;
    }

    /// Forgets instance `id` altogether (it left the table).
    pub fn remove(&self, id: u64) {
        let mut inner = self.lock();
        if let Some(s) = inner.slot_of.remove(&id) {
            let s = s as usize;
            inner.clear(s);
            inner.slots[s] = Slot::default();
        }
    }

    /// Tokens per block, once an event told (0 before).
    pub fn block_size(&self) -> u32 {
        self.lock().block_size
    }

    /// For each table instance (`ids`, the table's id hashes), `Some(leading blocks of `keys`
    /// it holds)` when it is exact, `None` when inferred, into `depth`.
    pub fn matches(&self, ids: &[u64], keys: &[u64], depth: &mut Vec<Option<u32>>) {
        let mut inner = self.lock();
        if inner.ids != ids {
            inner.sync(ids);
        }
        depth.clear();
        depth.resize(ids.len(), None);
        for slot in inner.slots.iter().filter(|s| s.live && s.at != u32::MAX) {
            depth[slot.at as usize] = Some(0);
        }
        for (j, key) in keys.iter().enumerate() {
            let Some(holders) = inner.blocks.get(key) else {
                break;
            };
            let mut still = false;
            for &h in holders {
                let slot = &inner.slots[h as usize];
                if slot.at == u32::MAX {
                    continue;
                }
                if let Some(d) = &mut depth[slot.at as usize] {
                    if *d == j as u32 {
                        *d += 1;
                        still = true;
                    }
                }
            }
            if !still {
                break;
            }
        }
    }

    /// Whether an exact instance holds the block keyed `key`.
    pub fn held_anywhere(&self, key: u64) -> bool {
        let inner = self.lock();
        inner
            .blocks
            .get(&key)
            .is_some_and(|holders| holders.iter().any(|&h| inner.slots[h as usize].live))
    }

    /// Per instance id hash: whether it is exact, its blocks, and its subscriber's counters.
    pub fn instances(&self) -> Vec<(u64, bool, usize, Option<Arc<Counters>>)> {
        let inner = self.lock();
        inner
            .slots
            .iter()
            .filter(|s| s.id != 0)
            .map(|s| (s.id, s.live, s.by_engine.len(), s.counters.clone()))
            .collect()
    }

    /// What the index refused.
    pub fn refused(&self) -> &Refused {
        &self.refused
    }
}

/// Whether an event's blocks are the ones a prompt's prefix hits (see the module doc).
fn indexed(medium: Option<&str>, group: Option<u32>) -> bool {
    medium.is_none_or(|m| m.eq_ignore_ascii_case("GPU")) && group.is_none_or(|g| g == 0)
}

impl Inner {
    fn slot(&mut self, id: u64) -> usize {
        if let Some(&s) = self.slot_of.get(&id) {
            return s as usize;
        }
        let at = self
            .ids
            .iter()
            .position(|&i| i == id)
            .map_or(u32::MAX, |p| p as u32);
        let slot = Slot {
            id,
            at,
            ..Slot::default()
        };
        let s = match self.slots.iter().position(|slot| slot.id == 0) {
            Some(s) => {
                self.slots[s] = slot;
                s
            }
            None => {
                self.slots.push(slot);
                self.slots.len() - 1
            }
        };
        self.slot_of.insert(id, s as u32);
        s
    }

    fn sync(&mut self, ids: &[u64]) {
        self.ids = ids.to_vec();
        let at: Map<u32> = ids
            .iter()
            .enumerate()
            .map(|(p, &id)| (id, p as u32))
            .collect();
        for slot in &mut self.slots {
            slot.at = match slot.id {
                0 => u32::MAX,
                id => at.get(&id).copied().unwrap_or(u32::MAX),
            };
        }
    }

    /// Records that slot `s` holds `key` under the engine's `hash`; false when full.
    fn store(&mut self, s: usize, hash: u64, key: u64) -> bool {
        let slot = &mut self.slots[s];
        if let Some(old) = slot.by_engine.get(&hash).copied() {
            if old == key {
                return true;
            }
            self.remove(s, hash);
        }
        if self.pairs >= MAX_BLOCKS {
            return false;
        }
        let holders = self.blocks.entry(key).or_default();
        if !holders.contains(&(s as u32)) {
            holders.push(s as u32);
        }
        self.slots[s].by_engine.insert(hash, key);
        self.pairs += 1;
        true
    }

    fn remove(&mut self, s: usize, hash: u64) {
        let Some(key) = self.slots[s].by_engine.remove(&hash) else {
            return;
        };
        self.pairs -= 1;
        // (two engine hashes of one key, the same tokens under other extra keys, share one
        // holder entry: removing either forgets the key, an underestimate that costs a miss)
        if let Some(holders) = self.blocks.get_mut(&key) {
            holders.retain(|h| *h != s as u32);
            if holders.is_empty() {
                self.blocks.remove(&key);
            }
        }
    }

    fn clear(&mut self, s: usize) {
        let by_engine = std::mem::take(&mut self.slots[s].by_engine);
        self.pairs -= by_engine.len();
        for key in by_engine.into_values() {
            if let Some(holders) = self.blocks.get_mut(&key) {
                holders.retain(|h| *h != s as u32);
                if holders.is_empty() {
                    self.blocks.remove(&key);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: u64 = 11;
    const B: u64 = 22;

    /// A `BlockStored` as an engine publishes it: `tokens` in blocks of 4, engine hashes
    /// `first..`, after the engine's `parent`.
    fn stored(first: u64, parent: Option<u64>, tokens: &[u32]) -> Event {
        Event::Stored {
            hashes: (first..).take(tokens.len() / 4).collect(),
            parent,
            token_ids: tokens.to_vec(),
            block_size: 4,
            lora_name: None,
            medium: Some("GPU".into()),
            group_idx: None,
        }
    }

    fn depth(index: &KvIndex, prompt: &[u32]) -> Vec<Option<u32>> {
        let mut keys = Vec::new();
        block_keys(prompt, 4, None, &mut keys);
        let mut depth = Vec::new();
        index.matches(&[A, B], &keys, &mut depth);
        depth
    }

    #[test]
    fn an_engine_holds_the_leading_blocks_its_events_stored_under_the_routers_keys() {
        let index = KvIndex::default();
        let prompt: Vec<u32> = (0..14).collect();
        assert_eq!(depth(&index, &prompt), [None, None], "no events: inferred");
        // two events chained by the engine's parent hash: the router's keys chain the same way
        index.apply(A, &stored(100, None, &prompt[..4]));
        index.apply(A, &stored(101, Some(100), &prompt[4..12]));
        index.apply(B, &stored(500, None, &[9, 9, 9, 9]));
        assert_eq!(depth(&index, &prompt), [Some(3), Some(0)]);
        // a prompt that differs in its second block matches only the first
        let mut other = prompt.clone();
        other[5] = 77;
        assert_eq!(depth(&index, &other), [Some(1), Some(0)]);
        // evicting the middle block ends the match there (the engine's prefix cache stops too)
        index.apply(
            A,
            &Event::Removed {
                hashes: vec![101],
                medium: None,
                group_idx: None,
            },
        );
        assert_eq!(depth(&index, &prompt), [Some(1), Some(0)]);
        index.apply(A, &Event::Cleared);
        assert_eq!(depth(&index, &prompt), [Some(0), Some(0)]);
        // a reset (a gap the replay could not fill) makes the instance inferred again
        index.reset(B);
        assert_eq!(depth(&index, &prompt), [Some(0), None]);
    }

    #[test]
    fn what_cannot_be_chained_or_does_not_fit_is_refused_and_counted() {
        let index = KvIndex::default();
        let prompt: Vec<u32> = (0..8).collect();
        // a parent the index never saw (the subscriber joined mid-sequence)
        index.apply(A, &stored(101, Some(999), &prompt[4..8]));
        assert_eq!(index.refused().unknown_parent.load(Relaxed), 1);
        // token ids that do not fill the blocks
        let Event::Stored { hashes, .. } = stored(100, None, &prompt) else {
            unreachable!()
        };
        index.apply(
            A,
            &Event::Stored {
                hashes,
                parent: None,
                token_ids: prompt[..7].to_vec(),
                block_size: 4,
                lora_name: None,
                medium: None,
                group_idx: None,
            },
        );
        assert_eq!(index.refused().malformed.load(Relaxed), 1);
        // another tier or group is not where a prompt hits
        let Event::Stored {
            hashes, token_ids, ..
        } = stored(100, None, &prompt)
        else {
            unreachable!()
        };
        for (medium, group_idx) in [(Some("CPU".to_string()), None), (None, Some(1))] {
            index.apply(
                A,
                &Event::Stored {
                    hashes: hashes.clone(),
                    parent: None,
                    token_ids: token_ids.clone(),
                    block_size: 4,
                    lora_name: None,
                    medium,
                    group_idx,
                },
            );
        }
        assert_eq!(depth(&index, &prompt), [Some(0), None]);
        // a LoRA adapter's blocks are other blocks
        index.apply(
            A,
            &Event::Stored {
                hashes,
                parent: None,
                token_ids,
                block_size: 4,
                lora_name: Some("sql".into()),
                medium: None,
                group_idx: None,
            },
        );
        assert_eq!(depth(&index, &prompt), [Some(0), None]);
        let mut keys = Vec::new();
        block_keys(&prompt, 4, Some("sql"), &mut keys);
        let mut d = Vec::new();
        index.matches(&[A, B], &keys, &mut d);
        assert_eq!(d, [Some(2), None]);
    }

    #[test]
    fn a_flood_of_stores_stays_within_the_bound() {
        let index = KvIndex::default();
        let tokens: Vec<u32> = (0..4 * 4096).collect();
        let mut parent = None;
        let mut first = 0u64;
        while index.refused().full.load(Relaxed) == 0 {
            index.apply(A, &stored(first, parent, &tokens));
            first += 4096;
            parent = Some(first - 1);
        }
        assert_eq!(index.instances()[0].2, MAX_BLOCKS);
        index.reset(A);
        assert_eq!(index.instances()[0].2, 0);
        assert!(index.lock().blocks.is_empty());
    }
}
