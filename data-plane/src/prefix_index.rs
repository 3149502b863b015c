//! `PrefixIndex`: what each instance of a PREFIX_AWARE variant is believed to hold in its prompt
//! cache, and what a request costs there. The two inputs of the placement cost
//! ([`crate::placement`]); one per variant, kept across table versions.
//!
//! - **Blocks.** A prompt's whole canonical text ([`crate::prompt::prompt_blocks`]) is cut into
//!   [`BLOCK_BYTES`]-byte blocks, each named by a hash chained over every block before it, so a
//!   block names its whole prefix. An instance is taken to hold a block from the moment a request
//!   whose prompt has it is placed there; its match for a prompt is the run of leading blocks it
//!   holds (an engine can serve no later block from its cache without the earlier ones).
//! - **LRU to a learnt capacity.** Each instance's blocks are evicted least recently used first
//!   once they pass its capacity. The capacity is learnt from the engines' own reports of cached
//!   prompt tokens ([`crate::usage`]): a report of fewer cached tokens than the index predicted
//!   (it evicted what the index still lists) shrinks it to below what the index holds; a report
//!   of more while the index is at capacity (the index evicted what the engine still holds)
//!   grows it. A router that sees a quarter of an instance's traffic learns a quarter of its
//!   cache: its own share, which is what it can place by.
//! - **What a queued request costs.** A fit of each request's time in flight against the prompt
//!   bytes it had to prefill and the requests in flight before it ([`LatencyFit`]) gives what
//!   one queued request costs in prefill bytes: the unit that makes a queue and an uncached
//!   prompt comparable, for engines that serve one request at a time and for those that batch.
//!
//! Memory is bounded: at most [`Tuning::index_blocks`] (block, instance) pairs per variant (an
//! instance's capacity is at most its even share of them), each about 100 bytes with its LRU
//! entry. One mutex per variant, held for one decision's lookups and insertions (microseconds)
//! and for one report's update; never across an `.await`.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Mutex;

use smallvec::SmallVec;

use crate::placement::Tuning;
pub use crate::prompt::PREFIX_BLOCK_BYTES as BLOCK_BYTES;

/// Keys are already xxh3 hashes: pass them through.
#[derive(Default)]
pub(crate) struct KeyHasher(u64);

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

pub(crate) type Map<V> = HashMap<u64, V, BuildHasherDefault<KeyHasher>>;

/// The smallest capacity a report can shrink an instance to, in blocks.
const MIN_CAPACITY: f64 = 4.0;
/// No table position (an instance slot of a departed instance, or not yet placed).
const NOWHERE: u32 = u32::MAX;

/// One instance holding a block: its slot, and its touch count when the block was last queued.
#[derive(Debug, Clone, Copy)]
struct Holder {
    slot: u32,
    touch: u32,
}

/// One instance's blocks.
#[derive(Debug, Default)]
struct Slot {
    /// The instance's id hash (0: a free slot).
    id: u64,
    /// Its position in the table the index last synced to.
    at: u32,
    /// (block, touch) in least-recently-used order; an entry whose touch is not the holder's
    /// current one is stale (the block was touched again later, or evicted) and is skipped.
    queue: VecDeque<(u64, u32)>,
    /// Blocks queued so far (wrapping).
    touches: u32,
    /// Blocks held.
    used: usize,
    /// Blocks it is believed to hold at most.
    capacity: f64,
}

/// One reported request's time in flight (seconds) and this router's requests in flight on its
/// instance when it started.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Timing {
    pub seconds: f64,
    pub queued: u64,
}

/// What the index predicted for one placed request, held until its engine reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Prediction {
    /// The instance's id hash.
    pub instance: u64,
    /// Prompt bytes the index said the instance held.
    pub cached_bytes: u32,
    /// The prompt's length (characters of its canonical text; bytes for raw bodies).
    pub prompt_bytes: u32,
}

/// The least-squares plane `seconds = fixed + per_byte * miss_bytes + per_queued * queued` over
/// the requests whose engines reported (`queued`: this router's requests in flight on the
/// instance when the request started), each weighing less as newer ones come (exponential decay
/// over [`Tuning::fit_window`] requests). `per_queued / per_byte` is what one queued request
/// costs in prefill bytes: near a whole request's time on an engine that serves one at a time,
/// far less on one that batches.
#[derive(Debug, Default, Clone)]
pub struct LatencyFit {
    /// Weighted sums of `v v^T` and `v * seconds` for `v = (1, miss_bytes / BLOCK, queued)`.
    vv: [[f64; 3]; 3],
    vy: [f64; 3],
}

impl LatencyFit {
    fn add(&mut self, miss_bytes: f64, queued: f64, seconds: f64, window: f64) {
        let keep = 1.0 - 1.0 / window.max(1.0);
        let v = [1.0, miss_bytes / BLOCK_BYTES as f64, queued];
        for (r, row) in self.vv.iter_mut().enumerate() {
            for (c, x) in row.iter_mut().enumerate() {
                *x = *x * keep + v[r] * v[c];
            }
            self.vy[r] = self.vy[r] * keep + v[r] * seconds;
        }
    }

    /// The plane as far as the samples determine it: `None` until there are `min_samples` and
    /// their misses spread (by a block or so); without a spread in queues (a tenth of a
    /// request), the line over misses alone (`per_queued` `None`).
    fn model(&self, min_samples: f64) -> Option<Model> {
        let n = self.vv[0][0];
        if n < min_samples {
            return None;
        }
        let var = |i: usize| self.vv[i][i] / n - (self.vv[0][i] / n).powi(2);
        if var(1) < 1.0 {
            return None;
        }
        if var(2) >= 0.01 {
            let [fixed, per_block, per_queued] = solve3(self.vv, self.vy)?;
            return Some(Model {
                fixed,
                per_block,
                per_queued: Some(per_queued),
            });
        }
        let (a, y) = (
            [
                [self.vv[0][0], self.vv[0][1]],
                [self.vv[1][0], self.vv[1][1]],
            ],
            [self.vy[0], self.vy[1]],
        );
        let det = a[0][0] * a[1][1] - a[0][1] * a[1][0];
        if det.abs() < 1e-12 {
            return None;
        }
        Some(Model {
            fixed: (y[0] * a[1][1] - a[0][1] * y[1]) / det,
            per_block: (a[0][0] * y[1] - a[1][0] * y[0]) / det,
            per_queued: None,
        })
    }

    /// One queued request's cost in prefill bytes: `per_queued / per_byte` once the samples
    /// spread in both misses and queues; before any queue was seen (a router that never had to
    /// queue), `fixed / per_byte` of the line over misses alone, as an engine that serves one
    /// request at a time would make a queued request cost; `None` until the misses spread.
    pub fn queued_bytes(&self, min_samples: f64) -> Option<f64> {
        self.model(min_samples)?.queued_bytes()
    }
}

/// The latency fit's coefficients (seconds; per block of misses; per request queued before).
#[derive(Debug, Clone, Copy)]
struct Model {
    fixed: f64,
    per_block: f64,
    per_queued: Option<f64>,
}

impl Model {
    /// See [`LatencyFit::queued_bytes`]: a queued request's time (the fixed time when no queue
    /// was fitted) in prefill bytes; `None` where the fit makes prefill free or time negative.
    fn queued_bytes(&self) -> Option<f64> {
        let seconds = self.per_queued.unwrap_or(self.fixed);
        (self.per_block > 0.0 && seconds >= 0.0)
            .then(|| (seconds / self.per_block * BLOCK_BYTES as f64).clamp(0.0, 1e9))
    }
}

/// `a x = y` by Gaussian elimination with partial pivoting; `None` when `a` is singular.
fn solve3(mut a: [[f64; 3]; 3], mut y: [f64; 3]) -> Option<[f64; 3]> {
    for col in 0..3 {
        let pivot = (col..3).max_by(|&i, &j| a[i][col].abs().total_cmp(&a[j][col].abs()))?;
        if a[pivot][col].abs() < 1e-12 {
            return None;
        }
        a.swap(col, pivot);
        y.swap(col, pivot);
        for row in col + 1..3 {
            let f = a[row][col] / a[col][col];
            let pivot_row = a[col];
            for (x, p) in a[row].iter_mut().zip(pivot_row).skip(col) {
                *x -= f * p;
            }
            y[row] -= f * y[col];
        }
    }
    let mut x = [0.0; 3];
    for row in (0..3).rev() {
        let rest: f64 = (row + 1..3).map(|k| a[row][k] * x[k]).sum();
        x[row] = (y[row] - rest) / a[row][row];
    }
    Some(x)
}

#[derive(Debug, Default)]
struct Inner {
    blocks: Map<SmallVec<[Holder; 2]>>,
    slots: Vec<Slot>,
    /// The table's instance id hashes the slots were last synced to, and each one's slot.
    ids: Vec<u64>,
    slot_of: Vec<u32>,
    fit: LatencyFit,
    /// `fit`'s coefficients as of its last sample.
    model: Option<Model>,
}

/// The per-instance prefix index of one PREFIX_AWARE variant (see the module doc).
#[derive(Debug, Default)]
pub struct PrefixIndex {
    inner: Mutex<Inner>,
}

/// One decision's view of the index: every instance's match, capacity and use, read under the
/// variant's lock (see [`PrefixIndex::with`]).
pub struct View<'a> {
    inner: &'a mut Inner,
    tuning: &'a Tuning,
}

impl PrefixIndex {
    /// Runs `f` on the index synced to the table's instances `ids` (instances gone from the
    /// table lose their blocks; new ones start empty at the largest capacity).
    pub fn with<R>(&self, ids: &[u64], tuning: &Tuning, f: impl FnOnce(&mut View<'_>) -> R) -> R {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if inner.ids != ids {
            inner.sync(ids, tuning);
        }
        f(&mut View {
            inner: &mut inner,
            tuning,
        })
    }

    /// What the engine reported for a request the index predicted: its capacity estimate
    /// follows (see the module doc), and the request's time in flight with the requests queued
    /// before it ([`Timing`]) joins the latency fit; the fit is solved again for the decisions.
    pub fn learn(&self, p: Prediction, cached_bytes: u32, timing: Option<Timing>, tuning: &Tuning) {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(t) = timing {
            let miss = p.prompt_bytes.saturating_sub(cached_bytes) as f64;
            inner
                .fit
                .add(miss, t.queued as f64, t.seconds, tuning.fit_window);
            inner.model = inner.fit.model(tuning.fit_min_samples);
        }
        let Some(s) = inner.slots.iter().position(|s| s.id == p.instance) else {
            return;
        };
        let bound = inner.bound(tuning);
        let slot = &mut inner.slots[s];
        let block = BLOCK_BYTES as u32;
        if p.cached_bytes >= cached_bytes + block {
            // the engine no longer had what the index lists: it holds less than that
            let held = slot.capacity.min(slot.used as f64);
            slot.capacity = (held * (1.0 - tuning.capacity_step)).max(MIN_CAPACITY);
            inner.evict(s);
        } else if cached_bytes >= p.cached_bytes + block && slot.used as f64 + 1.0 >= slot.capacity
        {
            // the engine still had what the index evicted: it holds more
            slot.capacity = (slot.capacity * (1.0 + tuning.capacity_step) + 1.0).min(bound);
        }
    }

    /// Forgets what instance `id` was believed to hold (its engine restarted, or its event
    /// stream lost track): its capacity estimate stays.
    pub fn forget(&self, id: u64) {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let Some(s) = inner.slots.iter().position(|slot| slot.id == id) else {
            return;
        };
        let capacity = inner.slots[s].capacity;
        inner.slots[s].capacity = 0.0;
        inner.evict(s);
        inner.slots[s].queue.clear();
        inner.slots[s].capacity = capacity;
    }

    /// Blocks held, over all instances.
    pub fn len(&self) -> usize {
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        inner.slots.iter().map(|s| s.used).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Per instance id hash: blocks held and the capacity estimate (blocks).
    pub fn instances(&self) -> Vec<(u64, usize, f64)> {
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        inner
            .slots
            .iter()
            .filter(|s| s.id != 0)
            .map(|s| (s.id, s.used, s.capacity))
            .collect()
    }

    /// One queued request's cost in prefill bytes: learnt, else the tuning's prior.
    pub fn request_bytes(&self, tuning: &Tuning) -> f64 {
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        inner.request_bytes(tuning)
    }
}

impl Inner {
    fn bound(&self, tuning: &Tuning) -> f64 {
        (tuning.index_blocks as f64 / self.ids.len().max(1) as f64).max(MIN_CAPACITY)
    }

    fn request_bytes(&self, tuning: &Tuning) -> f64 {
        self.model
            .and_then(|m| m.queued_bytes())
            .unwrap_or(tuning.request_bytes)
    }

    fn sync(&mut self, ids: &[u64], tuning: &Tuning) {
        self.ids = ids.to_vec();
        let bound = self.bound(tuning);
        for s in 0..self.slots.len() {
            let slot = &mut self.slots[s];
            slot.at = NOWHERE;
            if slot.id != 0 && !ids.contains(&slot.id) {
                slot.capacity = 0.0;
                self.evict(s);
                self.slots[s] = Slot::default();
            }
        }
        self.slot_of.clear();
        for (at, &id) in ids.iter().enumerate() {
            let s = match self.slots.iter().position(|s| s.id == id) {
                Some(s) => s,
                None => {
                    let s = match self.slots.iter().position(|s| s.id == 0) {
                        Some(s) => s,
                        None => {
                            self.slots.push(Slot::default());
                            self.slots.len() - 1
                        }
                    };
                    self.slots[s] = Slot {
                        id,
                        capacity: bound,
                        ..Slot::default()
                    };
                    s
                }
            };
            self.slots[s].at = at as u32;
            self.slots[s].capacity = self.slots[s].capacity.min(bound);
            self.slot_of.push(s as u32);
        }
        for s in 0..self.slots.len() {
            self.evict(s);
        }
    }

    /// Evicts slot `s`'s least recently used blocks down to its capacity.
    fn evict(&mut self, s: usize) {
        while self.slots[s].used as f64 > self.slots[s].capacity.floor() {
            let Some((block, touch)) = self.slots[s].queue.pop_front() else {
                break;
            };
            let Some(holders) = self.blocks.get_mut(&block) else {
                continue;
            };
            let Some(h) = holders
                .iter()
                .position(|h| h.slot == s as u32 && h.touch == touch)
            else {
                continue; // stale: touched again since
            };
            holders.swap_remove(h);
            if holders.is_empty() {
                self.blocks.remove(&block);
            }
            self.slots[s].used -= 1;
        }
    }

    /// Queues `block` as slot `s`'s most recent.
    fn touch(slot: &mut Slot, s: usize, block: u64, holder: &mut Holder) {
        debug_assert_eq!(holder.slot, s as u32);
        holder.touch = slot.touches;
        slot.queue.push_back((block, slot.touches));
        slot.touches = slot.touches.wrapping_add(1);
    }
}

impl View<'_> {
    /// Each table instance's match for a prompt of `blocks`: how many of its leading blocks the
    /// instance holds, into `depth` (one entry per table instance).
    pub fn matches(&self, blocks: &[u64], depth: &mut [u32]) {
        depth.fill(0);
        let inner = &*self.inner;
        for (j, block) in blocks.iter().enumerate() {
            let Some(holders) = inner.blocks.get(block) else {
                break;
            };
            // an instance still matches when it held every block before this one
            let mut still = false;
            for h in holders {
                let at = inner.slots[h.slot as usize].at;
                if at != NOWHERE && depth[at as usize] == j as u32 {
                    depth[at as usize] = j as u32 + 1;
                    still = true;
                }
            }
            if !still {
                break;
            }
        }
    }

    /// Blocks instance `at` holds, and at most.
    pub fn room(&self, at: usize) -> (usize, f64) {
        let slot = &self.inner.slots[self.inner.slot_of[at] as usize];
        (slot.used, slot.capacity)
    }

    /// One queued request's cost in prefill bytes.
    pub fn request_bytes(&self) -> f64 {
        self.inner.request_bytes(self.tuning)
    }

    /// The prompt of `blocks` was placed on instance `at`: the blocks it held become its most
    /// recent (unless already among its newer half, which keeps the queue short when one prefix
    /// is sent again and again) and the rest are added, evicting its least recent past its
    /// capacity.
    pub fn place(&mut self, at: usize, blocks: &[u64]) {
        let inner = &mut *self.inner;
        let s = inner.slot_of[at] as usize;
        let slot = &mut inner.slots[s];
        for &block in blocks {
            let holders = inner.blocks.entry(block).or_default();
            match holders.iter_mut().find(|h| h.slot == s as u32) {
                Some(h) => {
                    let age = slot.touches.wrapping_sub(h.touch) as usize;
                    if age * 2 >= slot.used {
                        Inner::touch(slot, s, block, h);
                    }
                }
                None => {
                    let mut h = Holder {
                        slot: s as u32,
                        touch: 0,
                    };
                    Inner::touch(slot, s, block, &mut h);
                    holders.push(h);
                    slot.used += 1;
                }
            }
        }
        if slot.queue.len() > 2 * slot.used + 1024 {
            // drop the stale entries (each live block has exactly one current entry)
            let blocks = &inner.blocks;
            slot.queue.retain(|&(b, t)| {
                blocks
                    .get(&b)
                    .is_some_and(|hs| hs.iter().any(|h| h.slot == s as u32 && h.touch == t))
            });
        }
        inner.evict(s);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(seed: u64, n: usize) -> Vec<u64> {
        (0..n as u64)
            .map(|j| xxhash_rust::xxh3::xxh3_64(&[seed, j].map(u64::to_le_bytes).concat()))
            .collect()
    }

    #[test]
    fn an_instance_matches_the_leading_blocks_it_was_sent_and_loses_the_oldest_past_capacity() {
        let t = Tuning::default();
        let index = PrefixIndex::default();
        let (a, b) = (chain(1, 8), chain(2, 8));
        let mut depth = [0u32; 2];
        index.with(&[11, 22], &t, |v| {
            v.place(0, &a);
            v.place(1, &b[..3]);
            v.matches(&a, &mut depth);
            assert_eq!(depth, [8, 0]);
            v.matches(&b, &mut depth);
            assert_eq!(depth, [0, 3]);
            // a prompt that shares only the first four blocks of a
            let mut c = a[..4].to_vec();
            c.extend(chain(3, 4));
            v.matches(&c, &mut depth);
            assert_eq!(depth, [4, 0]);
        });
        // the engine behind instance 11 held nothing of a's 8 predicted blocks: it holds less
        // than the index listed, and the oldest blocks go first
        let p = Prediction {
            instance: 11,
            cached_bytes: 8 * BLOCK_BYTES as u32,
            prompt_bytes: 8 * BLOCK_BYTES as u32,
        };
        index.learn(p, 0, None, &t);
        let (used, cap) = index.with(&[11, 22], &t, |v| v.room(0));
        assert!(used < 8 && cap < 8.0, "{used} {cap}");
        index.with(&[11, 22], &t, |v| {
            v.matches(&a, &mut depth);
            assert_eq!(depth[0], 0, "the first blocks were the least recent");
        });
        // an instance that leaves the table loses its blocks
        index.with(&[22], &t, |v| {
            let mut d = [0u32; 1];
            v.matches(&b, &mut d);
            assert_eq!(d, [3]);
        });
        assert_eq!(index.len(), 3);
    }

    #[test]
    fn the_capacity_grows_when_the_engine_held_what_the_index_evicted() {
        let t = Tuning::default();
        let index = PrefixIndex::default();
        let p = Prediction {
            instance: 7,
            cached_bytes: 4 * BLOCK_BYTES as u32,
            prompt_bytes: 4 * BLOCK_BYTES as u32,
        };
        index.with(&[7], &t, |v| v.place(0, &chain(1, 40)));
        index.learn(p, 0, None, &t); // shrinks to below 40
        let (_, small) = index.with(&[7], &t, |v| v.room(0));
        index.with(&[7], &t, |v| v.place(0, &chain(2, 40))); // fills it
        let p = Prediction {
            cached_bytes: 0,
            ..p
        };
        index.learn(p, 4 * BLOCK_BYTES as u32, None, &t);
        let (_, grown) = index.with(&[7], &t, |v| v.room(0));
        assert!(grown > small, "{small} -> {grown}");
    }

    #[test]
    fn memory_stays_bounded_whatever_is_placed() {
        let t = Tuning::default();
        let index = PrefixIndex::default();
        let ids: Vec<u64> = (1..=4).collect();
        index.with(&ids, &t, |v| {
            for p in 0..(t.index_blocks / 64 + 100) as u64 {
                v.place((p % 4) as usize, &chain(p, 128));
            }
        });
        assert!(index.len() <= t.index_blocks, "{}", index.len());
        let inner = index.inner.lock().unwrap();
        assert!(inner.blocks.len() <= t.index_blocks);
        for s in &inner.slots {
            assert!(s.queue.len() <= 2 * s.used + 1024 + 128);
        }
    }

    #[test]
    fn the_fit_gives_a_queued_requests_cost_in_prefill_bytes() {
        let mut f = LatencyFit::default();
        assert_eq!(f.queued_bytes(8.0), None);
        // 20 ms fixed, 10 us per missed byte, 5 ms per request queued before: a queued request
        // costs what 500 bytes of prefill do
        for i in 0..256u64 {
            let miss = (i % 8) as f64 * 1000.0;
            let queued = (i / 8 % 5) as f64;
            f.add(miss, queued, 0.02 + miss * 1e-5 + queued * 0.005, 256.0);
        }
        let r = f.queued_bytes(8.0).unwrap();
        assert!((r - 500.0).abs() < 1.0, "{r}");
        // misses that do not spread teach nothing
        let mut g = LatencyFit::default();
        for i in 0..64u64 {
            g.add(5000.0, (i % 3) as f64, 0.07, 256.0);
        }
        assert_eq!(g.queued_bytes(8.0), None);
        // a router that never queued: a queued request is taken to cost a whole request's
        // fixed time (20 ms at 10 us a byte: 2,000 bytes)
        let mut h = LatencyFit::default();
        for i in 0..64u64 {
            let miss = (i % 8) as f64 * 1000.0;
            h.add(miss, 0.0, 0.02 + miss * 1e-5, 256.0);
        }
        let r = h.queued_bytes(8.0).unwrap();
        assert!((r - 2000.0).abs() < 1.0, "{r}");
    }
}
