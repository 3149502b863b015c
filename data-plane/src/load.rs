//! Per-instance load and health, shared by every table that lists the instance.
//!
//! These structs live behind `Arc`s keyed by instance id; a new routing table reuses the ones of
//! instances that are still there, so in-flight counts and ejections survive a table swap.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;

use crate::feedback::{Feedback, InstanceCache};
use crate::queue::Queue;
use crate::upstream::Pool;

/// Consecutive failures (connect errors, 5xx) after which an instance is ejected.
pub const EJECT_AFTER_FAILURES: u32 = 3;
/// First ejection length; each further ejection without a success in between doubles it.
pub const EJECT_BASE: Duration = Duration::from_secs(5);
/// Longest ejection.
pub const EJECT_MAX: Duration = Duration::from_secs(60);

/// Milliseconds on a monotonic clock that starts at 1 (0 means "never").
pub fn now_ms() -> u64 {
    static START: OnceLock<Instant> = OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_millis() as u64 + 1
}

/// Requests of a variant per half-window of the recent-rate estimates: a window is the last
/// 2,048 to 4,096 requests this router placed in the variant, so the estimates of replicas that
/// each see a random sample of the same traffic agree.
pub const HALF_WINDOW_REQUESTS: u64 = 2048;
/// A half-window also ends once it has lasted this long and holds at least
/// [`HALF_WINDOW_MIN_REQUESTS`]: on a slow fleet (a router placing 20 requests a second takes
/// 100 s for 2,048) the estimates, and the re-weighing at each new half-window, follow within a
/// minute instead of several.
pub const HALF_WINDOW_MS: u64 = 15_000;
pub const HALF_WINDOW_MIN_REQUESTS: u64 = 256;

/// Where a variant's request sequence stands: the half-window number and how far into it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Epoch {
    pub number: u64,
    /// Fraction of the current half-window gone, in [0, 1).
    pub progress: f64,
}

impl Epoch {
    pub fn of(sequence: u64) -> Self {
        Epoch {
            number: sequence / HALF_WINDOW_REQUESTS,
            progress: (sequence % HALF_WINDOW_REQUESTS) as f64 / HALF_WINDOW_REQUESTS as f64,
        }
    }
}

/// A count over a sliding window of two half-windows: the current one, plus the previous one
/// weighted by the part of it still inside the window. Lock-free; increments racing a rotation
/// may land in either half (an estimate, not a ledger).
#[derive(Debug, Default)]
pub struct RecentCount {
    epoch: AtomicU64,
    halves: [AtomicU32; 2],
}

impl RecentCount {
    pub fn add(&self, e: Epoch) {
        rotate(&self.epoch, e.number, |slot| {
            self.halves[slot].store(0, Relaxed)
        });
        self.halves[(e.number % 2) as usize].fetch_add(1, Relaxed);
    }

    pub fn value(&self, e: Epoch) -> f64 {
        windowed(self.epoch.load(Relaxed), e, |n| {
            self.halves[(n % 2) as usize].load(Relaxed) as f64
        })
    }
}

/// The sliding-window value at `e` of counts kept in two half-windows, the newest of which is
/// number `last`: `half(n)` reads half-window n (its slot is n % 2).
fn windowed(last: u64, e: Epoch, half: impl Fn(u64) -> f64) -> f64 {
    if last == e.number {
        half(e.number) + half(e.number + 1) * (1.0 - e.progress)
    } else if last + 1 == e.number {
        half(last) * (1.0 - e.progress)
    } else {
        0.0
    }
}

/// Moves `epoch` forward to `now` and clears the half-windows that `now` reuses (`clear(slot)`
/// for slot 0 and/or 1). One thread wins the move; the others carry on.
fn rotate(epoch: &AtomicU64, now: u64, clear: impl Fn(usize)) {
    let last = epoch.load(Relaxed);
    if last >= now || epoch.compare_exchange(last, now, Relaxed, Relaxed).is_err() {
        return;
    }
    if now == last + 1 {
        clear((now % 2) as usize);
    } else {
        clear(0);
        clear(1);
    }
}

/// Cells per row of the key-rate sketch.
const SKETCH_WIDTH: usize = 4096;
/// Rows (independent hashes) of the key-rate sketch.
const SKETCH_ROWS: usize = 2;

/// Recent request counts per prompt key in bounded memory: a count-min sketch (each key counted
/// in one cell per row, read as the smallest of its cells, so an estimate is never below the
/// truth and collisions only raise it) over the same two half-windows as [`RecentCount`].
/// 2 windows x 2 rows x 4,096 cells x 4 bytes = 64 KiB per PREFIX_AWARE variant.
pub struct KeyRates {
    epoch: AtomicU64,
    /// `[half][row * SKETCH_WIDTH + cell]`
    cells: [Box<[AtomicU32]>; 2],
}

impl std::fmt::Debug for KeyRates {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyRates").finish_non_exhaustive()
    }
}

impl Default for KeyRates {
    fn default() -> Self {
        let half = || {
            (0..SKETCH_WIDTH * SKETCH_ROWS)
                .map(|_| AtomicU32::new(0))
                .collect()
        };
        KeyRates {
            epoch: AtomicU64::new(0),
            cells: [half(), half()],
        }
    }
}

impl KeyRates {
    #[inline]
    fn cells(key: u64) -> [usize; SKETCH_ROWS] {
        // Keys are xxh3 hashes already: two disjoint bit ranges index the two rows.
        [
            (key as usize) % SKETCH_WIDTH,
            SKETCH_WIDTH + ((key >> 32) as usize) % SKETCH_WIDTH,
        ]
    }

    pub fn add(&self, key: u64, e: Epoch) {
        self.add_counted(key, e);
    }

    /// Counts `key` like [`KeyRates::add`] and returns its count in the current half-window
    /// before this one (an over-estimate when cells collide).
    pub fn add_counted(&self, key: u64, e: Epoch) -> u32 {
        rotate(&self.epoch, e.number, |slot| {
            for c in self.cells[slot].iter() {
                c.store(0, Relaxed);
            }
        });
        let half = &self.cells[(e.number % 2) as usize];
        Self::cells(key)
            .into_iter()
            .map(|c| half[c].fetch_add(1, Relaxed))
            .min()
            .unwrap_or(0)
    }

    /// The key's requests in the window (an over-estimate when cells collide).
    pub fn value(&self, key: u64, e: Epoch) -> f64 {
        let last = self.epoch.load(Relaxed);
        Self::cells(key)
            .into_iter()
            .map(|c| {
                windowed(last, e, |n| {
                    self.cells[(n % 2) as usize][c].load(Relaxed) as f64
                })
            })
            .fold(f64::INFINITY, f64::min)
    }
}

/// Slots of [`ServedPrefixes`].
const SERVED_SLOTS: usize = 8192;

/// The (prefix, instance) pairs whose requests finished recently, as a direct-mapped table of
/// their hashes (a newer pair overwrites an older one in its slot): a request placed where its
/// prefix was served before (a revisit, whose prefix the engine should hold) is told from a
/// first placement without a lock and without false matches; a forgotten pair only means one
/// fewer sample. A pair counts once a request finished, not when it was placed: a request placed
/// while another with the same prefix is still computing it finds nothing cached yet, and that
/// says nothing of evictions. 8,192 x 8 bytes = 64 KiB per PREFIX_AWARE variant.
pub struct ServedPrefixes {
    slots: Box<[AtomicU64]>,
}

impl std::fmt::Debug for ServedPrefixes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServedPrefixes").finish_non_exhaustive()
    }
}

impl Default for ServedPrefixes {
    fn default() -> Self {
        ServedPrefixes {
            slots: (0..SERVED_SLOTS).map(|_| AtomicU64::new(0)).collect(),
        }
    }
}

impl ServedPrefixes {
    #[inline]
    fn slot(&self, placed: u64) -> &AtomicU64 {
        // placed is a mixed hash already; the high bits pick the slot
        &self.slots[(placed >> 51) as usize % SERVED_SLOTS]
    }

    /// A request whose prefix and instance hash to `placed` finished.
    pub fn insert(&self, placed: u64) {
        let slot = self.slot(placed);
        if slot.load(Relaxed) != placed {
            slot.store(placed, Relaxed);
        }
    }

    pub fn contains(&self, placed: u64) -> bool {
        placed != 0 && self.slot(placed).load(Relaxed) == placed
    }
}

/// Slots of [`Homes`]' candidate table...
const HOME_CANDIDATES: usize = 1024;
/// ...in sets of this many: a key may take any slot of its set.
const HOME_WAYS: usize = 4;

/// PREFIX_AWARE's homes for a variant's reused keys (assigned by `placement::homes`): the keys
/// this router placed most often (a table of key hashes in sets of `HOME_WAYS` slots: a key
/// takes a free slot of its set, else the slot of the set's least used key if it is used more;
/// direct-mapped, two of 8 documents fell in one slot on one text draw of the small-cache bench,
/// and the pass never counted the one that lost) and the last assignment of those keys to
/// instances, swapped whole once per half-window. 1,024 x 8 bytes = 8 KiB of candidates per
/// PREFIX_AWARE variant, plus at most as many assigned homes. With them, what the engines'
/// reports taught the passes about how many reused keys an instance's cache holds.
pub struct Homes {
    candidates: Box<[AtomicU64]>,
    assignment: ArcSwap<Vec<Home>>,
    /// Reused keys each instance (by id hash) took at the last pass.
    held: ArcSwap<Vec<(u64, u32)>>,
    /// The reused keys the last pass counted (sorted).
    reused: ArcSwap<Vec<u64>>,
    /// Those of them it found in this router's own traffic, which it reports to the control
    /// plane (sorted).
    own_reused: ArcSwap<Vec<u64>>,
    /// The union of the other routers' own reused keys, as the control plane last pushed it
    /// (sorted): the pass counts them too.
    fleet_reused: ArcSwap<Vec<u64>>,
    /// The hot keys the last pass gave room for their copies (sorted).
    copied: ArcSwap<Vec<u64>>,
    /// The most reused keys an instance's cache was seen to hold (0: no instance overflowed).
    capacity: AtomicU32,
    /// Passes since an instance last overflowed.
    calm: AtomicU32,
    /// The bound was taken from the fleet's (see [`Homes::fleet_bound`]), not learnt from this
    /// router's own revisits, and has not fallen on them since: it is not reported back.
    adopted: AtomicBool,
    /// The least bound the routers on the control plane learnt for this variant, as it last
    /// pushed it (0: none known).
    fleet_bound: AtomicU32,
    /// While no bound is known: the most reused keys a pass's copies may give one instance
    /// (0: not probing yet; `u32::MAX`: the engines showed room, copies go by share). See
    /// [`crate::placement`]'s homes pass.
    probe_level: AtomicU32,
    /// A pass after the router's first has run (see [`Homes::spreads`]).
    past_first_pass: AtomicBool,
    /// The variant gate's closings the last pass had seen.
    closings_seen: AtomicU64,
    /// The request sequence number and the time (monotonic ms) of the last pass.
    last_pass_sequence: AtomicU64,
    last_pass_ms: AtomicU64,
}

/// One key's home: the instance's index in the variant when the home was assigned, and its id
/// hash (a table with another instance set finds it again by the id, or not at all).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Home {
    pub key: u64,
    pub index: u32,
    pub id_hash: u64,
}

impl Home {
    /// The home's index among `hashes` (the variant's instance id hashes), if it is still there.
    #[inline]
    pub fn locate(&self, hashes: &[u64]) -> Option<usize> {
        let i = self.index as usize;
        if hashes.get(i) == Some(&self.id_hash) {
            Some(i)
        } else {
            hashes.iter().position(|&h| h == self.id_hash)
        }
    }
}

impl std::fmt::Debug for Homes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Homes")
            .field("assigned", &self.assignment.load().len())
            .finish_non_exhaustive()
    }
}

impl Default for Homes {
    fn default() -> Self {
        Homes {
            candidates: (0..HOME_CANDIDATES).map(|_| AtomicU64::new(0)).collect(),
            assignment: ArcSwap::from_pointee(Vec::new()),
            held: ArcSwap::from_pointee(Vec::new()),
            reused: ArcSwap::from_pointee(Vec::new()),
            own_reused: ArcSwap::from_pointee(Vec::new()),
            fleet_reused: ArcSwap::from_pointee(Vec::new()),
            copied: ArcSwap::from_pointee(Vec::new()),
            capacity: AtomicU32::new(0),
            calm: AtomicU32::new(0),
            adopted: AtomicBool::new(false),
            fleet_bound: AtomicU32::new(0),
            probe_level: AtomicU32::new(0),
            past_first_pass: AtomicBool::new(false),
            closings_seen: AtomicU64::new(0),
            last_pass_sequence: AtomicU64::new(0),
            last_pass_ms: AtomicU64::new(0),
        }
    }
}

impl Homes {
    /// Offers `key` (just counted in `rates`) as a candidate.
    #[inline]
    pub fn observe(&self, key: u64, e: Epoch, rates: &KeyRates) {
        if key == 0 {
            return;
        }
        // bits the sketch's rows do not index by
        let set = ((key >> 48) as usize) % (HOME_CANDIDATES / HOME_WAYS) * HOME_WAYS;
        let set = &self.candidates[set..set + HOME_WAYS];
        let mut free = None;
        for slot in set {
            match slot.load(Relaxed) {
                k if k == key => return,
                0 => free = free.or(Some(slot)),
                _ => {}
            }
        }
        if let Some(slot) = free {
            slot.store(key, Relaxed);
            return;
        }
        let value = rates.value(key, e);
        let (slot, least) = set
            .iter()
            .map(|s| (s, rates.value(s.load(Relaxed), e)))
            .min_by(|a, b| a.1.total_cmp(&b.1))
            .expect("a set has slots");
        if least < value {
            slot.store(key, Relaxed);
        }
    }

    /// The candidate keys (a key stored twice by two threads at once may appear twice).
    pub fn candidates(&self) -> impl Iterator<Item = u64> + '_ {
        self.candidates
            .iter()
            .map(|c| c.load(Relaxed))
            .filter(|&k| k != 0)
    }

    /// The key's home, if it has one.
    #[inline]
    pub fn get(&self, key: u64) -> Option<Home> {
        let homes = self.assignment.load();
        homes
            .binary_search_by_key(&key, |h| h.key)
            .ok()
            .map(|i| homes[i])
    }

    /// The assignment in force (sorted by key).
    pub fn assignment(&self) -> Arc<Vec<Home>> {
        self.assignment.load_full()
    }

    /// Replaces the assignment; `homes` must be sorted by key.
    pub fn store(&self, homes: Vec<Home>) {
        debug_assert!(homes.windows(2).all(|w| w[0].key < w[1].key));
        self.assignment.store(Arc::new(homes));
    }

    /// Reused keys each instance (by id hash) took at the last pass.
    pub fn held(&self) -> Arc<Vec<(u64, u32)>> {
        self.held.load_full()
    }

    pub fn store_held(&self, held: Vec<(u64, u32)>) {
        self.held.store(Arc::new(held));
    }

    /// The last pass counted `key` (its revisits' misses are evidence of what the caches hold,
    /// see [`crate::feedback::Visit::ReusedRevisit`]).
    #[inline]
    pub fn is_reused(&self, key: u64) -> bool {
        self.reused.load().binary_search(&key).is_ok()
    }

    /// How many reused keys the last pass counted.
    pub fn reused_count(&self) -> usize {
        self.reused.load().len()
    }

    /// The last pass gave room for `key`'s copies (a hot key spread over its replicas).
    #[inline]
    pub fn is_copied(&self, key: u64) -> bool {
        self.copied.load().binary_search(&key).is_ok()
    }

    /// Replaces the keys given room for copies; `keys` must be sorted.
    pub fn store_copied(&self, keys: Vec<u64>) {
        debug_assert!(keys.windows(2).all(|w| w[0] < w[1]));
        self.copied.store(Arc::new(keys));
    }

    /// Replaces the counted keys; `keys` must be sorted.
    pub fn store_reused(&self, keys: Vec<u64>) {
        debug_assert!(keys.windows(2).all(|w| w[0] < w[1]));
        self.reused.store(Arc::new(keys));
    }

    /// The reused keys the last pass found in this router's own traffic (sorted).
    pub fn own_reused(&self) -> Arc<Vec<u64>> {
        self.own_reused.load_full()
    }

    /// Replaces the keys found in this router's own traffic; `keys` must be sorted.
    pub fn store_own_reused(&self, keys: Vec<u64>) {
        debug_assert!(keys.windows(2).all(|w| w[0] < w[1]));
        self.own_reused.store(Arc::new(keys));
    }

    /// The other routers' reused keys, as last pushed (sorted).
    pub fn fleet_reused(&self) -> Arc<Vec<u64>> {
        self.fleet_reused.load_full()
    }

    /// Stores the other routers' reused keys (sorted and deduplicated here: they come from the
    /// wire).
    pub fn store_fleet_reused(&self, mut keys: Vec<u64>) {
        keys.sort_unstable();
        keys.dedup();
        self.fleet_reused.store(Arc::new(keys));
    }

    /// Reused keys an instance's cache holds, as learnt (`None` until one overflowed).
    pub fn capacity(&self) -> Option<u32> {
        Some(self.capacity.load(Relaxed)).filter(|&c| c > 0)
    }

    /// Sets what [`Homes::capacity`] says, and the passes since an overflow.
    pub fn store_capacity(&self, capacity: Option<u32>, calm: u32) {
        self.capacity.store(capacity.unwrap_or(0), Relaxed);
        self.calm.store(calm, Relaxed);
    }

    pub fn calm(&self) -> u32 {
        self.calm.load(Relaxed)
    }

    /// The bound, when this router learnt it from its own revisits (what it reports to the
    /// control plane for the fleet).
    pub fn own_capacity(&self) -> Option<u32> {
        self.capacity().filter(|_| !self.adopted.load(Relaxed))
    }

    /// Whether the bound as stored was taken from the fleet's.
    pub fn adopted(&self) -> bool {
        self.adopted.load(Relaxed)
    }

    pub fn store_adopted(&self, adopted: bool) {
        self.adopted.store(adopted, Relaxed);
    }

    /// The least bound the fleet's routers learnt (see the field).
    pub fn fleet_bound(&self) -> Option<u32> {
        Some(self.fleet_bound.load(Relaxed)).filter(|&c| c > 0)
    }

    /// Stores the fleet's bound; true when it changed.
    pub fn store_fleet_bound(&self, bound: Option<u32>) -> bool {
        self.fleet_bound.swap(bound.unwrap_or(0), Relaxed) != bound.unwrap_or(0)
    }

    /// The probe's level as stored (0: not started; `u32::MAX`: room shown).
    pub fn probe_level(&self) -> u32 {
        self.probe_level.load(Relaxed)
    }

    pub fn store_probe_level(&self, level: u32) {
        self.probe_level.store(level, Relaxed);
    }

    /// Whether the copies probe for room: no bound is known, the engines report, and none has
    /// yet shown room for more than an even spread of the reused keys.
    #[inline]
    pub fn probing(&self) -> bool {
        self.capacity().is_none() && (1..u32::MAX).contains(&self.probe_level())
    }

    /// Whether only the keys the last pass gave room for their copies are spread (under a
    /// bound, or while probing for one): a key this router's estimate calls hot since then
    /// stays in its one place, as it does on the routers whose estimates did not move.
    #[inline]
    pub fn copies_by_pass(&self) -> bool {
        self.capacity().is_some() || self.probing()
    }

    /// Whether a hot key may have the copies its share asks for: from the router's second pass
    /// on (its first places keys before any engine has reported on them, and an overflow that
    /// placement causes is a bound by the next). Until then a hot key gets only as many places
    /// as its load needs ([`crate::placement::Tuning::least_replicas`]). Under a bound the
    /// copies take only the room it leaves.
    #[inline]
    pub fn spreads(&self) -> bool {
        self.past_first_pass.load(Relaxed) || self.capacity().is_some()
    }

    /// Whether a pass after the router's first has run.
    pub fn past_first_pass(&self) -> bool {
        self.past_first_pass.load(Relaxed)
    }

    /// Records the variant gate's closings a pass has seen; true when there are new ones.
    pub fn take_closings(&self, closings: u64) -> bool {
        self.closings_seen.swap(closings, Relaxed) < closings
    }

    pub fn store_past_first_pass(&self, past: bool) {
        self.past_first_pass.store(past, Relaxed);
    }

    /// Records that the pass runs at request `sequence`, time `now`.
    pub fn mark_pass(&self, sequence: u64, now: u64) {
        self.last_pass_sequence.store(sequence, Relaxed);
        self.last_pass_ms.store(now, Relaxed);
    }

    /// True (for one caller) when the last pass is `interval_ms` old and `requests` requests
    /// back: a router that sees a small part of a slow fleet's traffic reaches a half-window's
    /// requests only after a minute or more, and its homes would wait as long for the engines'
    /// reports since its last pass.
    pub fn pass_overdue(&self, sequence: u64, now: u64, interval_ms: u64, requests: u64) -> bool {
        let last = self.last_pass_ms.load(Relaxed);
        last != 0
            && now >= last.saturating_add(interval_ms)
            && sequence
                >= self
                    .last_pass_sequence
                    .load(Relaxed)
                    .saturating_add(requests)
            && self
                .last_pass_ms
                .compare_exchange(last, now, Relaxed, Relaxed)
                .is_ok()
    }
}

/// Load and passive-health state of one model-server instance.
#[derive(Debug, Default)]
pub struct InstanceState {
    outstanding: AtomicU64,
    /// Requests this router placed on the instance recently (PREFIX_AWARE's balance measure: the
    /// request rate, which cache hits do not hide the way they hide in-flight counts).
    recent: RecentCount,
    /// f64 bits of [`InstanceState::weight`]; 0 means 1.0.
    weight: AtomicU64,
    failures: AtomicU32,
    ejections: AtomicU32,
    ejected_until_ms: AtomicU64,
    /// Idle keep-alive connections to the instance.
    pool: Pool,
    /// Its prefix cache as PREFIX_AWARE's revisits show it.
    cache: InstanceCache,
}

impl InstanceState {
    /// The instance's id, as flow control's waiters name their home and a freed place: the
    /// address of its state (the same `Arc` across tables that keep the instance; never 0).
    #[inline]
    pub fn id(&self) -> usize {
        std::ptr::from_ref(self) as usize
    }

    pub(crate) fn pool(&self) -> &Pool {
        &self.pool
    }

    pub fn cache(&self) -> &InstanceCache {
        &self.cache
    }

    /// Requests sent to the instance whose response body has not ended yet.
    pub fn outstanding(&self) -> u64 {
        self.outstanding.load(Relaxed)
    }

    pub fn recent(&self) -> &RecentCount {
        &self.recent
    }

    /// PREFIX_AWARE's weight of the instance among a cold key's first choices (1.0 until the
    /// first re-weighing).
    pub fn weight(&self) -> f64 {
        match self.weight.load(Relaxed) {
            0 => 1.0,
            bits => f64::from_bits(bits),
        }
    }

    pub fn set_weight(&self, w: f64) {
        self.weight.store(w.to_bits(), Relaxed);
    }

    pub fn is_ejected(&self, now_ms: u64) -> bool {
        now_ms < self.ejected_until_ms.load(Relaxed)
    }

    /// Whether the instance would take one more request now: fewer than `limit` in flight and
    /// not ejected (a read: [`InFlight::try_start`] is what takes the place).
    #[inline]
    pub fn takes(&self, limit: u64, now_ms: u64) -> bool {
        self.outstanding() < limit && !self.is_ejected(now_ms)
    }

    pub fn record_success(&self) {
        // Read first: no write (and no cache-line bouncing) on the common path.
        if self.failures.load(Relaxed) != 0 {
            self.failures.store(0, Relaxed);
        }
        if self.ejections.load(Relaxed) != 0 {
            self.ejections.store(0, Relaxed);
        }
    }

    /// Counts a failure; returns the ejection length if this failure ejected the instance.
    /// Failures are not reset by an ejection: once it runs out, one more failure ejects again,
    /// for twice as long.
    pub fn record_failure(&self, now_ms: u64) -> Option<Duration> {
        let failures = self.failures.fetch_add(1, Relaxed) + 1;
        if failures < EJECT_AFTER_FAILURES || self.is_ejected(now_ms) {
            return None;
        }
        let k = self.ejections.fetch_add(1, Relaxed).min(16);
        let length = EJECT_BASE.saturating_mul(1 << k).min(EJECT_MAX);
        self.ejected_until_ms
            .store(now_ms + length.as_millis() as u64, Relaxed);
        Some(length)
    }
}

/// Load of one production variant: requests in flight (the `m` of the bounded-load cap), and
/// the recent request rates of the variant and of its prompt keys (PREFIX_AWARE).
#[derive(Debug, Default)]
pub struct VariantLoad {
    outstanding: AtomicU64,
    /// Requests placed in the variant by this router (drives the half-windows).
    sequence: AtomicU64,
    /// The current half-window's number, and the sequence number and time it began at (time 0:
    /// no request yet).
    half: AtomicU64,
    half_start: AtomicU64,
    half_start_ms: AtomicU64,
    recent: RecentCount,
    keys: OnceLock<KeyRates>,
    /// Some instance of the variant has a weight other than 1.
    weighted: std::sync::atomic::AtomicBool,
    /// What the engines' reports say of PREFIX_AWARE's rules on this variant.
    feedback: Feedback,
    served: OnceLock<ServedPrefixes>,
    homes: OnceLock<Homes>,
    /// Requests waiting for an instance below its in-flight limit ([`crate::flow`]).
    flow: Queue,
}

/// What [`VariantLoad::record`] saw of one placed request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Recorded {
    /// The request opened a new half-window (once per half-window): the caller re-weighs.
    pub new_window: bool,
    /// A request with the same prefix finished on the same instance before.
    pub revisit: bool,
    /// The request's number in the variant's sequence (0 for the router's first).
    pub sequence: u64,
}

impl VariantLoad {
    pub fn outstanding(&self) -> u64 {
        self.outstanding.load(Relaxed)
    }

    /// Where the variant's request sequence stands now.
    pub fn epoch(&self) -> Epoch {
        self.epoch_at(self.sequence.load(Relaxed), now_ms())
    }

    /// The half-window and how far into it (by requests or by time, whichever is further) at
    /// request `sequence` and time `now`.
    fn epoch_at(&self, sequence: u64, now: u64) -> Epoch {
        let by_requests = sequence.saturating_sub(self.half_start.load(Relaxed)) as f64
            / HALF_WINDOW_REQUESTS as f64;
        let by_time = match self.half_start_ms.load(Relaxed) {
            0 => 0.0,
            started => now.saturating_sub(started) as f64 / HALF_WINDOW_MS as f64,
        };
        Epoch {
            number: self.half.load(Relaxed),
            progress: by_requests.max(by_time).min(0.999),
        }
    }

    /// Counts request `sequence` at `now` against the half-window; true for the request that
    /// ends it and opens the next (one per half-window).
    fn advance(&self, sequence: u64, now: u64) -> bool {
        if self.half_start_ms.load(Relaxed) == 0 {
            let _ = self
                .half_start_ms
                .compare_exchange(0, now, Relaxed, Relaxed);
        }
        let start = self.half_start.load(Relaxed);
        let held = sequence.saturating_sub(start);
        let due = held >= HALF_WINDOW_REQUESTS
            || (held >= HALF_WINDOW_MIN_REQUESTS
                && now >= self.half_start_ms.load(Relaxed) + HALF_WINDOW_MS);
        let number = self.half.load(Relaxed);
        if due
            && self
                .half
                .compare_exchange(number, number + 1, Relaxed, Relaxed)
                .is_ok()
        {
            self.half_start.store(sequence, Relaxed);
            self.half_start_ms.store(now, Relaxed);
            return true;
        }
        false
    }

    /// Counts one placed request for `key` (and, when the request was keyed deeper, for the
    /// shallow key it was deepened from) on `instance`.
    ///
    /// `placed` is the cached prefix's key combined with the instance's id: served there before
    /// ([`ServedPrefixes`]), the request is a revisit.
    pub fn record(&self, instance: &InstanceState, keys: &[u64], placed: u64) -> Recorded {
        let sequence = self.sequence.fetch_add(1, Relaxed);
        let now = now_ms();
        let new_window = self.advance(sequence, now);
        let e = self.epoch_at(sequence, now);
        self.recent.add(e);
        instance.recent.add(e);
        let rates = self.key_rates();
        let homes = self.homes();
        for &k in keys {
            rates.add(k, e);
            homes.observe(k, e, rates);
        }
        Recorded {
            new_window,
            revisit: self.served().contains(placed),
            sequence,
        }
    }

    pub fn feedback(&self) -> &Feedback {
        &self.feedback
    }

    pub fn served(&self) -> &ServedPrefixes {
        self.served.get_or_init(ServedPrefixes::default)
    }

    /// Requests placed in the variant within the window.
    pub fn recent(&self, e: Epoch) -> f64 {
        self.recent.value(e)
    }

    pub fn is_weighted(&self) -> bool {
        self.weighted.load(Relaxed)
    }

    pub fn set_weighted(&self) {
        if !self.is_weighted() {
            self.weighted.store(true, Relaxed);
        }
    }

    /// The variant's flow-control queue.
    #[inline]
    pub fn flow(&self) -> &Queue {
        &self.flow
    }

    pub fn key_rates(&self) -> &KeyRates {
        self.keys.get_or_init(KeyRates::default)
    }

    pub fn homes(&self) -> &Homes {
        self.homes.get_or_init(Homes::default)
    }

    /// The cache bound this router learnt from its own revisits, if a homes pass ever ran (what
    /// it reports for the fleet; asking creates no homes for a variant that has none).
    pub fn own_cache_bound(&self) -> Option<u32> {
        self.homes.get().and_then(Homes::own_capacity)
    }

    /// The reused keys this router's last homes pass found in its own traffic (what it reports
    /// for the fleet; none if no pass ran).
    pub fn own_reused_keys(&self) -> Option<Arc<Vec<u64>>> {
        self.homes.get().map(Homes::own_reused)
    }

    /// Stores the union of the other routers' reused keys (see `crate::watch`), which this
    /// router's next homes pass counts with its own.
    pub fn store_fleet_reused(&self, keys: &[u64]) {
        if keys.is_empty() && self.homes.get().is_none() {
            return; // (no homes pass ran: nothing to forget)
        }
        self.homes().store_fleet_reused(keys.to_vec());
    }

    /// Stores the fleet's cache bound (the least the control plane's other routers learnt, see
    /// `crate::watch`); a router with no bound, or one above the fleet's, runs its homes pass
    /// at its next request, where it takes it (see `placement::homes`).
    pub fn store_fleet_bound(&self, bound: Option<u32>) {
        if bound.is_none() && self.homes.get().is_none() {
            return; // (no homes pass ran: nothing to forget)
        }
        let homes = self.homes();
        let below = |b: u32| homes.capacity().is_none_or(|c| b < c);
        if homes.store_fleet_bound(bound) && bound.is_some_and(below) {
            self.feedback().request_pass();
        }
    }
}

/// One request in flight on an instance: counted from the routing decision until this guard drops
/// (the end of the response body, or the client going away).
#[derive(Debug)]
pub struct InFlight {
    instance: Arc<InstanceState>,
    variant: Arc<VariantLoad>,
}

impl InFlight {
    /// The instance the request is on.
    pub fn instance(&self) -> &Arc<InstanceState> {
        &self.instance
    }

    /// The variant the request is in.
    pub fn variant(&self) -> &Arc<VariantLoad> {
        &self.variant
    }

    pub fn start(instance: &Arc<InstanceState>, variant: &Arc<VariantLoad>) -> Self {
        instance.outstanding.fetch_add(1, Relaxed);
        variant.outstanding.fetch_add(1, Relaxed);
        InFlight {
            instance: instance.clone(),
            variant: variant.clone(),
        }
    }

    /// [`InFlight::start`] if the instance has fewer than `limit` requests in flight and the
    /// variant fewer than `variant_cap` (if any), each count raised only from below its bound
    /// (compare and swap): two requests that checked the counts first and then took places both
    /// took the last one (on two worker threads, a sheddable request took the place kept for
    /// critical ones). No count ever passes its bound, and a failed try wakes no one (a wake per
    /// failed try would pass a full fleet's waiters back and forth). With a cap, the variant's
    /// count is taken first and given back if the instance is full: a sheddable waiter that
    /// reads it in between sees no room and waits for the next place to free, or its deadline.
    pub fn try_start(
        instance: &Arc<InstanceState>,
        variant: &Arc<VariantLoad>,
        limit: u64,
        variant_cap: Option<u64>,
    ) -> Option<Self> {
        let below = |bound: u64| move |c: u64| (c < bound).then_some(c + 1);
        if let Some(cap) = variant_cap {
            variant
                .outstanding
                .fetch_update(Relaxed, Relaxed, below(cap))
                .ok()?;
            if instance
                .outstanding
                .fetch_update(Relaxed, Relaxed, below(limit))
                .is_err()
            {
                variant.outstanding.fetch_sub(1, Relaxed);
                return None;
            }
        } else {
            instance
                .outstanding
                .fetch_update(Relaxed, Relaxed, below(limit))
                .ok()?;
            variant.outstanding.fetch_add(1, Relaxed);
        }
        Some(InFlight {
            instance: instance.clone(),
            variant: variant.clone(),
        })
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.instance.outstanding.fetch_sub(1, Relaxed);
        self.variant.outstanding.fetch_sub(1, Relaxed);
        // its place may go to a request waiting for one (the fence pairs with the waiter's
        // after it queues: one of the two sees the other)
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        self.variant.flow.release(self.instance.id());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_half_window_ends_after_its_requests_or_its_time_whichever_comes_first() {
        let v = VariantLoad::default();
        let t0 = 1_000;
        assert!(!v.advance(0, t0));
        // 300 requests in 5 s: neither bound reached
        for s in 1..300 {
            assert!(!v.advance(s, t0 + 5_000));
        }
        assert_eq!(v.epoch_at(150, t0 + 7_500).progress, 0.5);
        // 15 s with more than 256 requests: a new half-window
        assert!(v.advance(300, t0 + HALF_WINDOW_MS));
        assert_eq!(v.epoch_at(301, t0 + HALF_WINDOW_MS).number, 1);
        // another 15 s with only 100 requests: too few to end it on time; the 256th does
        let t1 = t0 + 2 * HALF_WINDOW_MS + 1;
        for s in 301..556 {
            assert!(!v.advance(s, t1), "{s}");
        }
        assert!(v.advance(556, t1));
        // 2,048 requests end a half-window however short the time
        for s in 557..556 + HALF_WINDOW_REQUESTS {
            assert!(!v.advance(s, t1), "{s}");
        }
        assert!(v.advance(556 + HALF_WINDOW_REQUESTS, t1));
        assert_eq!(v.epoch_at(556 + HALF_WINDOW_REQUESTS, t1).number, 3);
    }

    #[test]
    fn in_flight_counts_until_dropped() {
        let i = Arc::new(InstanceState::default());
        let v = Arc::new(VariantLoad::default());
        let a = InFlight::start(&i, &v);
        let b = InFlight::start(&i, &v);
        assert_eq!((i.outstanding(), v.outstanding()), (2, 2));
        drop(a);
        drop(b);
        assert_eq!((i.outstanding(), v.outstanding()), (0, 0));
    }

    #[test]
    fn a_place_is_taken_as_it_is_counted_so_the_last_one_goes_to_one_request() {
        let (i, j) = (
            Arc::new(InstanceState::default()),
            Arc::new(InstanceState::default()),
        );
        let v = Arc::new(VariantLoad::default());
        // an instance that runs one request: the second asking for it gets none, and its try
        // leaves the counts as they were
        let a = InFlight::try_start(&i, &v, 1, None).expect("a free instance");
        assert!(InFlight::try_start(&i, &v, 1, None).is_none());
        assert_eq!((i.outstanding(), v.outstanding()), (1, 1));
        // the variant's cap holds across its instances
        assert!(InFlight::try_start(&j, &v, 1, Some(1)).is_none());
        let b = InFlight::try_start(&j, &v, 1, Some(2)).expect("under the cap");
        assert_eq!(v.outstanding(), 2);
        drop((a, b));
        // many threads after 3 places: exactly 3 get one
        let taken: Vec<bool> = std::thread::scope(|s| {
            let tries: Vec<_> = (0..8)
                .map(|_| {
                    s.spawn(|| {
                        let place = InFlight::try_start(&i, &v, 3, None);
                        let got = place.is_some();
                        std::mem::forget(place); // held until the count below
                        got
                    })
                })
                .collect();
            tries.into_iter().map(|t| t.join().unwrap()).collect()
        });
        assert_eq!(taken.iter().filter(|&&t| t).count(), 3);
        assert_eq!(i.outstanding(), 3);
    }

    #[test]
    fn recent_counts_slide_over_two_half_windows() {
        let c = RecentCount::default();
        let h = HALF_WINDOW_REQUESTS;
        for s in 0..h {
            c.add(Epoch::of(s));
        }
        assert_eq!(c.value(Epoch::of(h - 1)), h as f64);
        // half way into the next half-window, half of the previous one still counts
        assert_eq!(c.value(Epoch::of(h + h / 2)), h as f64 / 2.0);
        c.add(Epoch::of(h + h / 2));
        assert_eq!(c.value(Epoch::of(h + h / 2)), 1.0 + h as f64 / 2.0);
        // two half-windows with nothing: gone
        assert_eq!(c.value(Epoch::of(3 * h)), 0.0);
        c.add(Epoch::of(5 * h));
        assert_eq!(c.value(Epoch::of(5 * h)), 1.0);
    }

    #[test]
    fn popular_keys_whose_hashes_share_a_candidate_slot_are_all_candidates() {
        let rates = KeyRates::default();
        let homes = Homes::default();
        // five keys with the same top 16 bits (one set), four popular, and traffic mixed in
        let same =
            |i: u64| (0xABCD_u64 << 48) | (xxhash_rust::xxh3::xxh3_64(&i.to_le_bytes()) >> 16);
        let popular: Vec<u64> = (1..=4).map(same).collect();
        let rare = same(9);
        for s in 0..400u64 {
            let e = Epoch::of(s);
            let key = if s % 50 == 0 {
                rare
            } else {
                popular[s as usize % 4]
            };
            rates.add(key, e);
            homes.observe(key, e, &rates);
        }
        let mut got: Vec<u64> = homes.candidates().collect();
        got.sort_unstable();
        let mut want = popular.clone();
        want.sort_unstable();
        assert_eq!(
            got, want,
            "every popular key stays a candidate; the rare one does not"
        );
    }

    #[test]
    fn key_rates_estimate_each_key_and_forget_old_windows() {
        let k = KeyRates::default();
        let h = HALF_WINDOW_REQUESTS;
        let keys: Vec<u64> = (0..400u64)
            .map(|i| xxhash_rust::xxh3::xxh3_64(&i.to_le_bytes()))
            .collect();
        // key 0 is a tenth of the traffic, the rest spread
        for s in 0..2 * h {
            let key = if s % 10 == 0 {
                keys[0]
            } else {
                keys[1 + (s as usize % 399)]
            };
            k.add(key, Epoch::of(s));
        }
        // at the end of the second half-window, the window is that half (the first has slid out)
        let e = Epoch::of(2 * h - 1);
        let hot = k.value(keys[0], e);
        let expected = h as f64 / 10.0;
        assert!((expected - 1.0..expected + 8.0).contains(&hot), "{hot}");
        assert!(k.value(keys[7], e) < 12.0);
        assert!(k.value(keys[0], Epoch::of(4 * h)) == 0.0);
    }

    #[test]
    fn ejection_after_three_failures_doubles_and_resets_on_success() {
        let i = InstanceState::default();
        let t = 1000;
        assert_eq!(i.record_failure(t), None);
        assert_eq!(i.record_failure(t), None);
        assert_eq!(i.record_failure(t), Some(EJECT_BASE));
        assert!(i.is_ejected(t + 4999));
        assert!(!i.is_ejected(t + 5000));
        // once the ejection ran out, one more failure ejects for twice as long
        assert_eq!(i.record_failure(t + 5000), Some(EJECT_BASE * 2));
        i.record_success();
        let t2 = t + 20_000;
        assert_eq!(i.record_failure(t2), None);
        assert_eq!(i.record_failure(t2), None);
        assert_eq!(i.record_failure(t2), Some(EJECT_BASE));
    }
}
