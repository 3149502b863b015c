//! PREFIX_AWARE's rules held to what the engines report about their own caches.
//!
//! Every placement names the [`Rule`] that made it. When the response ends, the engine's report
//! ([`crate::usage::CacheReport`]) says how much of the prompt it served from cache. The report
//! is evidence about the placement's premise only when the router had sent the same prefix to the
//! same instance before (a *revisit*): the prefix should then be in that cache, and a miss means
//! the cache evicted it. Revisit misses are what copies cost: a prefix on k instances takes k
//! times its size out of the fleet's cache, and where the popular set does not fit k times,
//! every copy evicts something that a later revisit misses.
//!
//! So each variant keeps a [`Gate`] per rule and one for the whole variant, each counting
//! revisits and revisit misses over windows of [`FeedbackTuning::window`] revisits. A window
//! whose miss rate passes [`FeedbackTuning::miss_limit`] closes its gate for a hold time that doubles with
//! each repeated strike (as Envoy's outlier detection ejects a host on observed failures), and
//! the rule stays out of placement until then:
//! - a rule's own gate closes when the revisits it placed miss (a deepened head that is not
//!   cached where first turns go, a hot key's replica that keeps being evicted, a spill copy);
//! - the variant's gate closes when revisits miss whatever placed them: the caches have no room
//!   for more copies, so every rule that copies or moves a prefix (hot replicas, deepened heads,
//!   warm moves, re-weighing, bounded-load spills) stands down, and placement is rendezvous
//!   hashing with whole keys moved only by relief (an instance's own misses).
//!
//! Engines that report nothing (no usage in their responses) teach nothing: the gates stay open.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::Relaxed};

use crate::usage::CacheReport;

/// The feedback's constants (part of [`crate::placement::Tuning`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FeedbackTuning {
    /// Revisits per window of a gate. 64 revisits take a few seconds on a fleet serving
    /// 20 req/s, so a rule that thrashes small caches is stopped within seconds.
    pub window: u32,
    /// A window whose revisits missed more than this fraction closes the gate. Where caches
    /// have room a revisit misses rarely (a prefix evicted by age); where copies overflow them,
    /// a third or more of revisits miss.
    pub miss_limit: f64,
    /// First hold of a closed gate, in milliseconds; each further strike doubles it.
    pub hold_ms: u64,
    /// Strikes come at most this often: windows end every few seconds, and a gate's hold (and
    /// an instance's relief) should escalate by the quarter minute, not by the window.
    pub strike_interval_ms: u64,
    /// The same for an instance whose cache overflows (each strike moves another eighth of its
    /// keys). At 5 s, on 4 llama-servers with small caches, the moves came faster than the caches
    /// settled and hit fell (76.1% against 79.9% at 15 s, one run each).
    pub relief_interval_ms: u64,
    /// An instance's own gate (relief) closes when a window of its revisits missed more than
    /// this, a line of its own under `miss_limit`: a cache given a few keys more than it holds
    /// loses its coldest ones at every visit while the hotter ones stay, and those are a tenth of
    /// its revisits or so. At the rules' 0.2, an engine-sim instance given 22 keys where its cache
    /// holds 17 missed 11.5% for a whole run (four routers, 97.2%), and a llama-server given 3
    /// documents where it holds 2 missed 8-13% for 40 s or more; at 0.1, four routers on
    /// engine-sim's long-context shape hit 97.47% against 96.78% (nine runs each, in turn), and
    /// one router on that llama cell 93.7% against 89.4% (BENCHMARKS.md).
    pub relief_miss_limit: f64,
    /// Longest hold.
    pub max_hold_ms: u64,
}

impl Default for FeedbackTuning {
    fn default() -> Self {
        FeedbackTuning {
            window: 64,
            miss_limit: 0.2,
            hold_ms: 60_000,
            strike_interval_ms: 15_000,
            relief_interval_ms: 15_000,
            relief_miss_limit: 0.1,
            max_hold_ms: 16 * 60_000,
        }
    }
}

/// Which rule of a strategy chose the instance: the `decision` label of the token counters,
/// finer than the `x-prefix-router-decision` header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Rule {
    /// RANDOM.
    Random = 0,
    /// LEAST_OUTSTANDING_REQUESTS.
    LeastOutstanding = 1,
    /// PREFIX_AWARE: the key's rendezvous top choice.
    PrefixHash = 2,
    /// PREFIX_AWARE: one of a hot key's replicas.
    HotReplica = 3,
    /// PREFIX_AWARE: a conversation under a hot shared head, keyed by the conversation.
    DeepenedHead = 4,
    /// PREFIX_AWARE: a warm key moved off an instance over its fair share.
    WarmMove = 5,
    /// PREFIX_AWARE: a cold key on another of its first choices by re-weighed instance weights.
    Reweighed = 6,
    /// PREFIX_AWARE: the instance a key spilled to before, remembered by the prefix index.
    Spill = 7,
    /// PREFIX_AWARE: the key's choices were over their in-flight bound, ejected or excluded.
    OverloadBypass = 8,
    /// PREFIX_AWARE: a key moved off an instance whose cache overflows ([`InstanceCache`]).
    Relief = 9,
    /// PREFIX_AWARE: a reused key on the home its variant's occupancy gave it (not its
    /// rendezvous top choice; see `placement::homes`).
    Home = 10,
}

impl Rule {
    pub const COUNT: usize = 11;
    pub const ALL: [Rule; Rule::COUNT] = [
        Rule::Random,
        Rule::LeastOutstanding,
        Rule::PrefixHash,
        Rule::HotReplica,
        Rule::DeepenedHead,
        Rule::WarmMove,
        Rule::Reweighed,
        Rule::Spill,
        Rule::OverloadBypass,
        Rule::Relief,
        Rule::Home,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Rule::Random => "random",
            Rule::LeastOutstanding => "least_outstanding",
            Rule::PrefixHash => "prefix_hash",
            Rule::HotReplica => "hot_replica",
            Rule::DeepenedHead => "deepened_head",
            Rule::WarmMove => "warm_move",
            Rule::Reweighed => "reweighed",
            Rule::Spill => "spill",
            Rule::OverloadBypass => "overload_bypass",
            Rule::Relief => "relief",
            Rule::Home => "home",
        }
    }

    /// The rule puts a prefix where plain hashing would not, so the fleet may hold it twice (a
    /// copy in another cache, or two routers whose weights differ placing one key apart): it is
    /// held to its own revisits, and stands down while the variant's caches have no room.
    /// Re-weighing is one: it moves whole keys every half-window, and where caches are small each
    /// move is a cold prefill (on 4 llama-servers with small caches, re-weighing left open evened
    /// the shares, 21-29% against 18-29%, and cost hit, 80% against 92%, and throughput, 40
    /// against 50 req/s, one run each).
    pub fn spends_cache(self) -> bool {
        matches!(
            self,
            Rule::HotReplica | Rule::DeepenedHead | Rule::WarmMove | Rule::Reweighed | Rule::Spill
        )
    }
}

/// What the router knew of a request's prefix on the instance it chose, for what the engine's
/// report of it can teach.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Visit {
    /// Not served there before (or forgotten): a miss is no evidence, nothing was there to evict.
    #[default]
    First,
    /// Served there before: the engine should hold the prefix.
    Revisit,
    /// A revisit of one of the keys the last homes pass counted onto instances (a reused key):
    /// its miss says the cache holds fewer reused keys than the pass gave it. A rarely used
    /// key's miss says less: a cache with room for every reused key still evicts by age what
    /// comes back once a minute.
    ReusedRevisit,
}

impl Visit {
    pub fn is_revisit(self) -> bool {
        self != Visit::First
    }
}

/// Revisits and revisit misses of one rule (or of a whole variant), and whether the rule is held
/// out of placement.
#[derive(Debug, Default)]
pub struct Gate {
    revisits: AtomicU32,
    misses: AtomicU32,
    /// Monotonic milliseconds until which the rule is closed (0: open).
    closed_until_ms: AtomicU64,
    /// Windows over the limit, at most one per strike interval (each doubles the hold), decayed
    /// by good windows.
    strikes: AtomicU32,
    /// When the last strike was given (0: never).
    last_strike_ms: AtomicU64,
    /// Windows that closed the gate or kept it closed (for the metrics).
    closings: AtomicU64,
}

impl Gate {
    pub fn is_open(&self, now_ms: u64) -> bool {
        now_ms >= self.closed_until_ms.load(Relaxed)
    }

    pub fn closings(&self) -> u64 {
        self.closings.load(Relaxed)
    }

    /// Strikes not yet taken away by good windows (0: the gate has nothing against it).
    pub fn strikes(&self) -> u32 {
        self.strikes.load(Relaxed)
    }

    /// Counts one revisit; at the end of a window, closes the gate when its misses passed the
    /// limit. `Some(true)` when this call ended a window and closed the gate, `Some(false)` when
    /// it ended a good window, `None` inside a window.
    fn observe(&self, miss: bool, now_ms: u64, t: &FeedbackTuning) -> Option<bool> {
        if miss {
            self.misses.fetch_add(1, Relaxed);
        }
        let n = self.revisits.fetch_add(1, Relaxed) + 1;
        if n < t.window
            || self
                .revisits
                .compare_exchange(n, 0, Relaxed, Relaxed)
                .is_err()
        {
            return None;
        }
        let misses = self.misses.swap(0, Relaxed);
        let strikes = self.strikes.load(Relaxed);
        if f64::from(misses) > t.miss_limit * f64::from(n) {
            // At most one strike per strike interval; between strikes, misses only keep the
            // gate closed.
            let last = self.last_strike_ms.load(Relaxed);
            let strike = last == 0 || now_ms >= last.saturating_add(t.strike_interval_ms);
            let hold = if strike {
                self.strikes.store((strikes + 1).min(MAX_STRIKES), Relaxed);
                self.last_strike_ms.store(now_ms, Relaxed);
                t.hold_ms
                    .saturating_mul(1 << strikes.min(16))
                    .min(t.max_hold_ms)
            } else {
                t.hold_ms
            };
            let until = now_ms + hold;
            if until > self.closed_until_ms.load(Relaxed) {
                self.closed_until_ms.store(until, Relaxed);
            }
            self.closings.fetch_add(1, Relaxed);
            Some(true)
        } else {
            // A good window after the gate has been open as long as its last hold takes one
            // strike away: a rule that pays again is trusted again, step by step.
            let last_hold = t
                .hold_ms
                .saturating_mul(1 << strikes.saturating_sub(1).min(16));
            if strikes > 0 && now_ms >= self.closed_until_ms.load(Relaxed).saturating_add(last_hold)
            {
                self.strikes.store(strikes - 1, Relaxed);
            }
            Some(false)
        }
    }
}

/// Most eighths of an overflowing instance's keys that go elsewhere.
const MAX_RELIEF: u32 = 6;
/// Fewest revisits in an [`InstanceCache::take_miss_rate`] verdict.
const MIN_SAMPLE: u32 = 8;
/// How far above the miss limit, in standard errors of a sample at the limit, the other
/// routers' revisits must put a sample to ask for the homes pass
/// ([`InstanceCache::take_fleet_evidence`]). They come a second's worth at a time, and on the
/// one-miss slack of [`Sample::add`] one chunk with 3 misses of 8 ran a pass that taught
/// engine-sim's long-context fleet (7 caches of 15, 60-70 reused keys; the instance then held
/// 14, missing 13-16% in the samples before and after) a bound of an even spread that its caches
/// did not have, and the hot documents lost their copies. At 2, 8 revisits need 4 misses, 32 need
/// 11.
const FLEET_MARGIN: f64 = 2.0;
/// Strikes a gate remembers (its hold stops doubling well before: see `max_hold_ms`).
const MAX_STRIKES: u32 = 8;

/// One instance's prefix cache as the revisits of plain placements on it show it (a copy's
/// misses are the copying rule's; see [`Rule::spends_cache`]). When a window of them misses more
/// than [`FeedbackTuning::relief_miss_limit`], it holds more prefixes than fit (by hash luck one
/// instance of a few can be given more documents than its cache holds while another idles): each
/// strike against it sends one more eighth of its keys (at most three quarters; which ones is a
/// function of the key, the same on every router) to an instance whose last window hit (the
/// least loaded), until good windows take the strikes away.
/// Nothing is copied for it: the keys move, and the overflowing cache is left with fewer.
#[derive(Debug)]
pub struct InstanceCache {
    gate: Gate,
    /// The last window of revisits hit (true until one is seen).
    hitting: AtomicBool,
    /// Revisits of reused keys and their misses since the homes pass last took them (see
    /// [`InstanceCache::take_miss_rate`]).
    plain: Sample,
    /// The same for the revisits of copies (placed by rules that spend cache), apart: they are
    /// evidence only once the variant's revisits miss (see
    /// [`InstanceCache::take_copy_miss_rate`]).
    copies: Sample,
    /// This router's own revisits of reused keys and their misses since it started: what it
    /// reports to the control plane (see [`InstanceCache::own_evidence`]).
    own: Totals,
    /// The other routers' totals, as this router last took them (see
    /// [`InstanceCache::take_fleet_evidence`]).
    fleet: Totals,
}

/// Revisits and misses counted since a router started.
#[derive(Debug, Default)]
struct Totals {
    revisits: AtomicU64,
    misses: AtomicU64,
}

/// Revisits and their misses since a verdict last took them.
#[derive(Debug, Default)]
struct Sample {
    revisits: AtomicU32,
    misses: AtomicU32,
}

impl Sample {
    /// Counts one revisit; true when this one completes a first [`MIN_SAMPLE`] whose misses
    /// already pass the limit (once per sample).
    fn add(&self, miss: bool, t: &FeedbackTuning) -> bool {
        let revisits = self.revisits.fetch_add(1, Relaxed) + 1;
        let misses = match miss {
            true => self.misses.fetch_add(1, Relaxed) + 1,
            false => self.misses.load(Relaxed),
        };
        // one miss of slack: an early pass on 2 misses of 8 (one rare key evicted by age, one
        // copy) taught engine-sim's long-context fleet bounds its caches did not have
        revisits == MIN_SAMPLE && f64::from(misses) > t.miss_limit * f64::from(revisits) + 1.0
    }

    /// Counts revisits seen elsewhere (the other routers', see
    /// [`InstanceCache::take_fleet_evidence`]); true when the sample, with them, holds at least
    /// [`MIN_SAMPLE`] whose misses pass the limit by [`FLEET_MARGIN`], and did not before.
    fn add_many(&self, revisits: u32, misses: u32, t: &FeedbackTuning) -> bool {
        let overflows = |revisits: u32, misses: u32| {
            let (n, p) = (f64::from(revisits), t.miss_limit);
            revisits >= MIN_SAMPLE
                && f64::from(misses) > p * n + FLEET_MARGIN * (n * p * (1.0 - p)).sqrt()
        };
        let before = (
            self.revisits.fetch_add(revisits, Relaxed),
            self.misses.fetch_add(misses, Relaxed),
        );
        let after = (before.0 + revisits, before.1 + misses);
        overflows(after.0, after.1) && !overflows(before.0, before.1)
    }

    /// The share that missed (`None`: fewer than [`MIN_SAMPLE`] yet; they are kept).
    fn take(&self) -> Option<f64> {
        if self.revisits.load(Relaxed) < MIN_SAMPLE {
            return None;
        }
        let revisits = self.revisits.swap(0, Relaxed);
        let misses = self.misses.swap(0, Relaxed);
        Some(f64::from(misses) / f64::from(revisits.max(1)))
    }
}

impl Default for InstanceCache {
    fn default() -> Self {
        InstanceCache {
            gate: Gate::default(),
            hitting: AtomicBool::new(true),
            plain: Sample::default(),
            copies: Sample::default(),
            own: Totals::default(),
            // no base yet: the first totals taken are one
            fleet: Totals {
                revisits: AtomicU64::new(u64::MAX),
                misses: AtomicU64::new(u64::MAX),
            },
        }
    }
}

impl InstanceCache {
    /// Should `key`, ranked first on this instance, go elsewhere?
    pub fn relieves(&self, key: u64) -> bool {
        let level = self.gate.strikes().min(MAX_RELIEF);
        // the top three bits of a mix of the key pick its eighth
        level > 0 && ((key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 61) as u32) < level
    }

    /// Its last window of revisits hit: it may take keys from one that overflows.
    pub fn has_room(&self) -> bool {
        self.hitting.load(Relaxed)
    }

    /// The fraction of the reused keys' revisits since the last verdict that missed (`None`: too
    /// few to tell yet; they are kept for the next call). A router that sees a quarter of the
    /// traffic fills a gate's window four times slower; the homes pass, which asks once per
    /// half-window, needs a verdict soon.
    pub fn take_miss_rate(&self) -> Option<f64> {
        self.plain.take()
    }

    /// The same for the reused keys' revisits placed by rules that spend cache (a hot key's
    /// copies, a deepened head, a spill). The homes pass counts a copy as room taken on its
    /// instance, but asks for this only after the variant's revisits missed following a pass
    /// that spread copies: where every key had copies, no instance had a plain revisit to give a
    /// verdict, and the bound was never learnt (8 documents all hot, caches that held 2: one
    /// instance kept 3 for good, 94.4% hit against 100%); where copies fit (engine-sim's
    /// long-context fleet) their few misses are no bound.
    pub fn take_copy_miss_rate(&self) -> Option<f64> {
        self.copies.take()
    }

    /// This router's own revisits of reused keys placed by rules that do not spend cache, and
    /// how many missed, since it started (what it reports on its watch stream).
    pub fn own_evidence(&self) -> (u64, u64) {
        (
            self.own.revisits.load(Relaxed),
            self.own.misses.load(Relaxed),
        )
    }

    /// Takes the other routers' totals for this instance (the sum of their
    /// [`InstanceCache::own_evidence`], from the control plane): what they grew by since the last
    /// call joins this router's sample, so that the homes pass judges the cache on the fleet's
    /// revisits, not on the quarter of them that one of 4 routers sees (alone, each of 4 routers
    /// before 4 llama-servers whose caches held 2 of 8 documents had too few revisits for a
    /// verdict until 11-15 s after its first pass). The first totals taken, and totals that
    /// fell (a router gone or restarted), are a base and teach nothing. True when the sample now
    /// says the cache overflows, clearly past the limit (by `FLEET_MARGIN`): the homes pass
    /// should run, as when this router's own revisits show it.
    pub fn take_fleet_evidence(&self, revisits: u64, misses: u64, t: &FeedbackTuning) -> bool {
        let seen = (
            self.fleet.revisits.swap(revisits, Relaxed),
            self.fleet.misses.swap(misses, Relaxed),
        );
        if revisits < seen.0 || misses < seen.1 {
            return false;
        }
        let grown = |now: u64, then: u64| u32::try_from(now - then).unwrap_or(u32::MAX);
        let (r, m) = (grown(revisits, seen.0), grown(misses, seen.1));
        r > 0 && self.plain.add_many(r, m.min(r), t)
    }

    /// Samples a reused key's revisit placed by a rule that spends cache.
    fn sample_copy(&self, miss: bool, t: &FeedbackTuning) {
        // (a copies' overflow asks for no pass: the variant's gate closing does)
        let _ = self.copies.add(miss, t);
    }

    /// Learns from a revisit placed by a rule that does not spend cache (`reused`: of a key the
    /// homes pass counted); true when the reused keys' revisits since the last
    /// [`InstanceCache::take_miss_rate`] verdict already say the cache overflows (once per sample).
    fn learn(&self, miss: bool, reused: bool, now_ms: u64, t: &FeedbackTuning) -> bool {
        if reused {
            self.own.revisits.fetch_add(1, Relaxed);
            if miss {
                self.own.misses.fetch_add(1, Relaxed);
            }
        }
        let overflows = reused && self.plain.add(miss, t);
        let t = FeedbackTuning {
            strike_interval_ms: t.relief_interval_ms,
            miss_limit: t.relief_miss_limit,
            ..*t
        };
        match self.gate.observe(miss, now_ms, &t) {
            Some(true) => {
                self.hitting.store(false, Relaxed);
                tracing::debug!("an instance's cache overflows: some of its keys move");
            }
            Some(false) => self.hitting.store(true, Relaxed),
            None => {}
        }
        overflows
    }

    pub fn gate(&self) -> &Gate {
        &self.gate
    }
}

/// A variant's gates: one per rule, and one for every revisit.
#[derive(Debug, Default)]
pub struct Feedback {
    variant: Gate,
    rules: [Gate; Rule::COUNT],
    /// An instance's revisits since the homes pass last looked say its cache overflows: the
    /// next request runs the pass (see [`Feedback::take_pass_due`]).
    pass_due: AtomicBool,
    /// An engine has reported on a request's prompt cache.
    reported: AtomicBool,
}

impl Feedback {
    /// Learns from one PREFIX_AWARE request's outcome: what the router knew of its prefix on
    /// the instance (`visit`) and what the engine reported.
    pub fn learn(
        &self,
        rule: Rule,
        visit: Visit,
        report: CacheReport,
        now_ms: u64,
        t: &FeedbackTuning,
        instance: &InstanceCache,
    ) {
        if !self.reported.load(Relaxed) {
            self.reported.store(true, Relaxed);
        }
        if !visit.is_revisit() {
            return;
        }
        let miss = !report.hit();
        let reused = visit == Visit::ReusedRevisit;
        if !rule.spends_cache() && instance.learn(miss, reused, now_ms, t) {
            self.pass_due.store(true, Relaxed);
        }
        if rule.spends_cache() && reused {
            instance.sample_copy(miss, t);
        }
        // A rule that spends cache closing changes what the homes pass may place (a hot key's
        // copies, see `placement::homes`): the pass runs again now, not at the next half-window
        // or early count (on 4 routers that see a quarter of a slow fleet's traffic each, the
        // copies of the first pass stood for 20 s of thrashing before the next one).
        let mut closed = false;
        if self.rules[rule as usize].observe(miss, now_ms, t) == Some(true) {
            tracing::debug!(
                rule = rule.as_str(),
                "placement rule closed: its revisits miss"
            );
            closed = rule.spends_cache();
        }
        if self.variant.observe(miss, now_ms, t) == Some(true) {
            tracing::debug!("cache-spending rules closed: the variant's revisits miss");
            closed = true;
        }
        if closed {
            self.pass_due.store(true, Relaxed);
        }
    }

    /// May `rule` act now? A rule that spends cache needs both its own gate and the variant's
    /// open; the others always may.
    /// True once after an instance's revisits showed its cache overflowing: the homes pass
    /// should count again now, not at the next half-window (a router that sees a quarter of
    /// the traffic reaches a half-window every 20-30 s on a slow fleet).
    #[inline]
    pub fn take_pass_due(&self) -> bool {
        self.pass_due.load(Relaxed) && self.pass_due.swap(false, Relaxed)
    }

    /// Asks for the homes pass at the next request (news from elsewhere: the fleet's bound).
    pub fn request_pass(&self) {
        self.pass_due.store(true, Relaxed);
    }

    /// Whether any engine has reported on its prompt cache (engines that report nothing leave
    /// the homes pass as it was before the engines could be heard).
    #[inline]
    pub fn reported(&self) -> bool {
        self.reported.load(Relaxed)
    }

    pub fn allows(&self, rule: Rule, now_ms: u64) -> bool {
        !rule.spends_cache()
            || (self.variant.is_open(now_ms) && self.rules[rule as usize].is_open(now_ms))
    }

    pub fn rule(&self, rule: Rule) -> &Gate {
        &self.rules[rule as usize]
    }

    pub fn variant(&self) -> &Gate {
        &self.variant
    }

    /// The variant's gate (named `variant`) and those of the rules that spend cache, by name.
    pub fn gates(&self) -> impl Iterator<Item = (&'static str, &Gate)> {
        std::iter::once(("variant", &self.variant)).chain(
            Rule::ALL
                .into_iter()
                .filter(|r| r.spends_cache())
                .map(|r| (r.as_str(), &self.rules[r as usize])),
        )
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// An engine's report of a request served mostly from its cache, and of one that was not.
    pub(crate) const HIT: CacheReport = CacheReport {
        prompt_tokens: 1000,
        cached_tokens: 950,
    };
    pub(crate) const MISS: CacheReport = CacheReport {
        prompt_tokens: 1000,
        cached_tokens: 10,
    };

    #[test]
    fn the_other_routers_revisits_join_this_ones_sample_once_each() {
        let t = FeedbackTuning::default();
        let (f, i) = (Feedback::default(), InstanceCache::default());
        // this router's own revisits of reused keys are what it reports; a plain revisit of a
        // key no pass counted, and a copy's, are not
        f.learn(Rule::PrefixHash, Visit::ReusedRevisit, MISS, 1, &t, &i);
        f.learn(Rule::PrefixHash, Visit::ReusedRevisit, HIT, 1, &t, &i);
        f.learn(Rule::PrefixHash, Visit::Revisit, MISS, 1, &t, &i);
        f.learn(Rule::HotReplica, Visit::ReusedRevisit, MISS, 1, &t, &i);
        assert_eq!(i.own_evidence(), (2, 1));
        assert_eq!(i.take_miss_rate(), None, "2 revisits are too few to judge");
        // the first totals taken are a base: the fleet's history before this router is not
        // evidence of the cache now
        assert!(!i.take_fleet_evidence(500, 400, &t));
        assert_eq!(i.take_miss_rate(), None);
        // what grew since joins the sample; once it says the cache overflows on enough
        // revisits, the pass is due (a second's chunk of a few revisits is judged at the next
        // pass, but asks for none)
        assert!(
            !i.take_fleet_evidence(503, 401, &t),
            "5 revisits, 2 missed: too few"
        );
        assert!(
            !i.take_fleet_evidence(509, 403, &t),
            "11 revisits, 4 missed: short of the margin"
        );
        assert!(
            i.take_fleet_evidence(512, 406, &t),
            "14 revisits, 7 missed: overflow"
        );
        assert!(!i.take_fleet_evidence(512, 406, &t), "nothing new");
        assert_eq!(i.take_miss_rate(), Some(7.0 / 14.0));
        // totals that fell (a router gone) are a new base; its own stay its own
        assert!(!i.take_fleet_evidence(100, 90, &t));
        assert!(!i.take_fleet_evidence(110, 90, &t));
        assert_eq!(i.take_miss_rate(), Some(0.0), "10 revisits, none missed");
        assert_eq!(i.own_evidence(), (2, 1));
    }

    #[test]
    fn a_rule_whose_revisits_miss_is_closed_and_its_hold_doubles() {
        let t = FeedbackTuning::default();
        let f = Feedback::default();
        let i = InstanceCache::default();
        let now = 1_000;
        for _ in 0..t.window {
            assert!(f.allows(Rule::HotReplica, now));
            assert!(
                !f.take_pass_due(),
                "no pass asked for before the gate closes"
            );
            f.learn(Rule::HotReplica, Visit::ReusedRevisit, MISS, now, &t, &i);
        }
        assert!(!f.allows(Rule::HotReplica, now));
        // the homes pass, which placed the copies, is asked to run again now
        assert!(f.take_pass_due());
        assert!(!f.take_pass_due(), "once");
        // the variant's gate closed too: every rule that spends cache stands down
        assert!(!f.allows(Rule::DeepenedHead, now));
        assert!(f.allows(Rule::PrefixHash, now));
        let reopened = now + t.hold_ms;
        assert!(f.allows(Rule::HotReplica, reopened));
        // missing again right after: closed for twice as long
        for _ in 0..t.window {
            f.learn(
                Rule::HotReplica,
                Visit::ReusedRevisit,
                MISS,
                reopened,
                &t,
                &i,
            );
        }
        assert!(!f.allows(Rule::HotReplica, reopened + t.hold_ms));
        assert!(f.allows(Rule::HotReplica, reopened + 2 * t.hold_ms));
        assert_eq!(f.rule(Rule::HotReplica).closings(), 2);
    }

    #[test]
    fn hits_first_placements_and_silent_engines_keep_rules_open() {
        let t = FeedbackTuning::default();
        let f = Feedback::default();
        let i = InstanceCache::default();
        for n in 0..10 * t.window {
            // one miss in ten revisits is below the limit
            let report = if n % 10 == 0 { MISS } else { HIT };
            f.learn(
                Rule::DeepenedHead,
                Visit::ReusedRevisit,
                report,
                1_000,
                &t,
                &i,
            );
            // a first placement's miss is no evidence: nothing was there to evict
            f.learn(Rule::DeepenedHead, Visit::First, MISS, 1_000, &t, &i);
        }
        assert!(f.allows(Rule::DeepenedHead, 1_000));
        assert_eq!(f.variant().closings(), 0);
    }

    #[test]
    fn one_rules_misses_close_that_rule_only_while_the_variant_still_hits() {
        let t = FeedbackTuning::default();
        let f = Feedback::default();
        let i = InstanceCache::default();
        for _ in 0..2 * t.window {
            f.learn(Rule::WarmMove, Visit::ReusedRevisit, MISS, 1_000, &t, &i);
            for _ in 0..9 {
                f.learn(Rule::PrefixHash, Visit::ReusedRevisit, HIT, 1_000, &t, &i);
            }
        }
        assert!(!f.allows(Rule::WarmMove, 1_000));
        assert!(f.allows(Rule::HotReplica, 1_000));
        assert_eq!(f.variant().closings(), 0);
    }

    #[test]
    fn an_instance_that_loses_a_tenth_of_its_revisits_is_relieved() {
        // A cache given a few keys more than it holds loses its coldest ones at every visit, a
        // tenth of its revisits or so: under the rules' limit, over the relief line. Such a
        // window strikes the instance (some of its keys go) and leaves the rules open; a window
        // under the line does neither.
        let t = FeedbackTuning::default();
        for (misses, relieved) in [(8u32, true), (5, false)] {
            let (f, i) = (Feedback::default(), InstanceCache::default());
            for j in 0..t.window {
                let report = if j < misses { MISS } else { HIT };
                f.learn(
                    Rule::PrefixHash,
                    Visit::ReusedRevisit,
                    report,
                    1_000,
                    &t,
                    &i,
                );
            }
            let window = t.window;
            assert_eq!(
                i.gate().strikes() > 0,
                relieved,
                "{misses} of {window} revisits missed"
            );
            assert_eq!(i.has_room(), !relieved, "{misses} of {window}");
            assert!(f.allows(Rule::HotReplica, 1_000), "{misses} of {window}");
        }
    }

    #[test]
    fn an_overflowing_instance_sends_an_eighth_more_of_its_keys_away_per_strike() {
        let t = FeedbackTuning::default();
        let f = Feedback::default();
        let i = InstanceCache::default();
        let keys: Vec<u64> = (0..8_000u64)
            .map(|k| k.wrapping_mul(0xA24B_AED4_963E_E407))
            .collect();
        let moved = |i: &InstanceCache| keys.iter().filter(|&&k| i.relieves(k)).count();
        assert_eq!(moved(&i), 0);
        assert!(i.has_room());
        let mut now = 1_000;
        for strikes in 1..=8u32 {
            for _ in 0..t.window {
                f.learn(Rule::PrefixHash, Visit::ReusedRevisit, MISS, now, &t, &i);
            }
            let share = moved(&i) as f64 / keys.len() as f64;
            let expected = f64::from(strikes.min(MAX_RELIEF)) / 8.0;
            assert!((share - expected).abs() < 0.02, "{strikes}: {share}");
            assert!(!i.has_room());
            now += t.max_hold_ms;
        }
        // good windows, each after the last hold ran out, take the strikes away one by one
        let mut level = moved(&i);
        while i.gate().strikes() > 0 {
            now += 2 * t.max_hold_ms;
            for _ in 0..t.window {
                f.learn(Rule::PrefixHash, Visit::ReusedRevisit, HIT, now, &t, &i);
            }
            assert!(moved(&i) <= level);
            assert!(i.has_room(), "its last window hit");
            level = moved(&i);
        }
        assert_eq!(moved(&i), 0);
    }
}
