//! `PrefixIndex`: a bounded map from a spilled key to the instance this router sent it to.
//!
//! When a hot key's rendezvous top choice is over its load cap, the router remembers where the
//! key went, so the next spill goes to the SAME second instance (which now holds the KV cache)
//! instead of scattering copies over the fleet.
//!
//! Memory is bounded whatever the traffic: an approximate LRU made of two generations per shard
//! (a hit in the old generation moves the entry to the new one; when the new one is full the old
//! one is dropped). At most `capacity` entries in total. Only the spill path touches it, and it is
//! sharded, so no global lock sits on the request path.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Mutex;

const SHARDS: usize = 16;

/// Keys are already xxh3 hashes: pass them through.
#[derive(Default)]
struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ b as u64;
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

type Map = HashMap<u64, u64, BuildHasherDefault<KeyHasher>>;

#[derive(Default)]
struct Shard {
    young: Map,
    old: Map,
}

/// Key hash -> instance id hash, bounded by a hard entry cap.
pub struct PrefixIndex {
    shards: Box<[Mutex<Shard>]>,
    /// Entries per generation per shard.
    generation_cap: usize,
}

impl std::fmt::Debug for PrefixIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefixIndex")
            .field("capacity", &self.capacity())
            .field("len", &self.len())
            .finish()
    }
}

impl PrefixIndex {
    /// An index of at most `capacity` entries (0 disables it).
    pub fn new(capacity: usize) -> Self {
        PrefixIndex {
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            generation_cap: capacity / (2 * SHARDS),
        }
    }

    pub fn capacity(&self) -> usize {
        self.generation_cap * 2 * SHARDS
    }

    fn shard(&self, key: u64) -> &Mutex<Shard> {
        // Middle bits: hashbrown uses the low ones for buckets and the top 7 as tags.
        &self.shards[(key >> 32) as usize % SHARDS]
    }

    pub fn get(&self, key: u64) -> Option<u64> {
        if self.generation_cap == 0 {
            return None;
        }
        let mut shard = self.shard(key).lock().unwrap_or_else(|e| e.into_inner());
        if let Some(&v) = shard.young.get(&key) {
            return Some(v);
        }
        let v = shard.old.remove(&key)?;
        self.insert_young(&mut shard, key, v);
        Some(v)
    }

    pub fn insert(&self, key: u64, instance: u64) {
        if self.generation_cap == 0 {
            return;
        }
        let mut shard = self.shard(key).lock().unwrap_or_else(|e| e.into_inner());
        shard.old.remove(&key);
        self.insert_young(&mut shard, key, instance);
    }

    fn insert_young(&self, shard: &mut Shard, key: u64, instance: u64) {
        if shard.young.len() >= self.generation_cap && !shard.young.contains_key(&key) {
            // Rotate: the old generation goes, the young one becomes old (capacity is kept).
            let Shard { young, old } = shard;
            std::mem::swap(young, old);
            young.clear();
        }
        shard.young.insert(key, instance);
    }

    pub fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| {
                let s = s.lock().unwrap_or_else(|e| e.into_inner());
                s.young.len() + s.old.len()
            })
            .sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mix(i: u64) -> u64 {
        xxhash_rust::xxh3::xxh3_64(&i.to_le_bytes())
    }

    #[test]
    fn remembers_and_bounds_memory() {
        let index = PrefixIndex::new(3200);
        index.insert(mix(1), 11);
        assert_eq!(index.get(mix(1)), Some(11));
        index.insert(mix(1), 12);
        assert_eq!(index.get(mix(1)), Some(12));
        assert_eq!(index.get(mix(2)), None);
        for i in 0..1_000_000 {
            index.insert(mix(i), i);
        }
        assert!(index.len() <= 3200, "{}", index.len());
        assert!(index.len() >= 1600);
        // recent keys are still there
        for i in 1_000_000 - 50..1_000_000 {
            assert_eq!(index.get(mix(i)), Some(i));
        }
    }

    #[test]
    fn a_hit_keeps_an_entry_alive() {
        let index = PrefixIndex::new(64); // 2 per generation per shard
        let hot = mix(7);
        index.insert(hot, 1);
        for i in 100..10_000 {
            index.insert(mix(i), i);
            assert_eq!(index.get(hot), Some(1), "lost after {i}");
        }
    }

    #[test]
    fn zero_capacity_disables() {
        let index = PrefixIndex::new(0);
        index.insert(1, 2);
        assert_eq!(index.get(1), None);
        assert!(index.is_empty());
    }
}
