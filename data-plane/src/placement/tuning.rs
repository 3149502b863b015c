//! Every constant of PREFIX_AWARE placement, in one struct. [`Tuning::default`] is what users
//! get (two of its fields have data-plane flags); unit tests run at it. What each value was
//! measured to do is in BENCHMARKS.md, not here.

use crate::feedback::FeedbackTuning;

/// PREFIX_AWARE's constants. See the module doc of [`crate::placement`] for the objective each
/// mechanism serves.
#[derive(Debug, Clone, PartialEq)]
pub struct Tuning {
    /// Bounded-load factor c in percent (`--hash-balance-factor`): an instance takes a key while
    /// its in-flight count is under `ceil(c * (variant_in_flight + 1) / n) + 1`. It guards
    /// bursts; request rates are evened by hot-key replicas and weights.
    pub balance_percent: u32,
    /// A key is hot when its share of the variant's requests times the instance count reaches
    /// this (a quarter of an instance's fair share).
    pub hot_share: f64,
    /// A hot key of share `s` of n instances is served by `ceil(s * n * spread)` of them
    /// (`--hot-key-spread`; 0: hot keys are not spread).
    pub spread: f64,
    /// A key under `hot_share` but with share times n at least this is warm.
    pub warm_share: f64,
    /// How far over its fair share (relative) a warm key's instance may be before the key's
    /// next request goes to the next instance of its ranking if that one has had fewer.
    pub warm_slack: f64,
    /// Keys are treated as warm only once the window holds this many requests: in a smaller
    /// sample a conversation's few turns look warm.
    pub warm_min_window: f64,
    /// A head-only chat key (a shared system prompt longer than `prefix_length`) is deepened to
    /// the conversation when its share times n reaches this.
    pub deepen_share: f64,
    /// Shares are estimated only once the window holds this many of the variant's requests.
    pub min_window: f64,
    /// Instance weights stay within `[1 / max_weight, max_weight]`.
    pub max_weight: f64,
    /// A request share within this of 1/n leaves the instance's weight as it is.
    pub dead_zone: f64,
    /// Exponent of each re-weighing step: `w *= (fair / share) ^ gain`.
    pub gain: f64,
    /// A reused key's home (see [`crate::placement`]'s homes) is one of this many of its first
    /// rendezvous instances.
    pub home_choices: usize,
    /// A key gets a home when its share of the variant's recent requests times the instance
    /// count reaches this...
    pub home_share: f64,
    /// ...and this router placed it at least this many times in the window (a conversation's
    /// two turns are no reason to move it).
    pub home_min_requests: f64,
    /// A key leaves its top choice for a home only when the top choice holds more than this
    /// times the mean number of reused keys per instance (and at least one) more than the home.
    pub home_slack: f64,
    /// Once an instance's cache overflowed holding more than an even spread of the reused keys,
    /// passes give no instance more than it was seen to hold (see [`crate::placement`]'s homes); after this many passes with no overflow
    /// they try one more (caches can grow, and the overflow may have had another cause).
    pub home_probe_passes: u32,
    /// An overflow at an even spread of the reused keys or less bounds the caches to the even
    /// spread only once the last pass counted at least this share of today's reused keys; and a
    /// router that shares its reused keys with others keeps a home only from such a pass.
    pub home_settled_share: f64,
    /// ...and its revisits missed more than this times the feedback's `miss_limit` (rare keys
    /// evicted by age miss a little on caches with room).
    pub home_even_overflow: f64,
    /// Besides at every half-window, a router assigns homes when its request count in the
    /// variant reaches each of these (a fresh router learns them in its first seconds).
    pub home_early: [u64; 2],
    /// And once its last pass is this old (milliseconds) and this many of its requests back
    /// (a router that sees a small part of a slow fleet's traffic would otherwise count again
    /// only every 256 or more requests).
    pub home_interval_ms: u64,
    pub home_interval_requests: u64,
    /// When the engines' reports close a rule (see [`crate::feedback`]).
    pub feedback: FeedbackTuning,
}

/// The bounded-load factor users get.
pub const DEFAULT_BALANCE_PERCENT: u32 = 400;
/// The hot-key spread users get.
pub const DEFAULT_SPREAD: f64 = 8.0;

impl Default for Tuning {
    fn default() -> Self {
        Tuning {
            balance_percent: DEFAULT_BALANCE_PERCENT,
            hot_share: 0.25,
            spread: DEFAULT_SPREAD,
            warm_share: 0.125,
            warm_slack: 0.05,
            warm_min_window: 1024.0,
            deepen_share: 0.5,
            min_window: 64.0,
            max_weight: 4.0,
            dead_zone: 0.004,
            gain: 0.5,
            home_choices: 3,
            home_share: 1.0 / 32.0,
            home_min_requests: 4.0,
            home_slack: 0.5,
            home_probe_passes: 16,
            home_settled_share: 0.9,
            home_even_overflow: 1.5,
            home_early: [64, 256],
            home_interval_ms: 15_000,
            home_interval_requests: 64,
            feedback: FeedbackTuning::default(),
        }
    }
}

impl Tuning {
    /// How many instances serve a key of `share` of the traffic of `n` instances (1 for a key
    /// that is not hot, or when hot keys are not spread).
    pub fn replicas(&self, share: f64, n: usize) -> usize {
        let load = share * n as f64;
        if load < self.hot_share || self.spread <= 0.0 {
            1
        } else {
            ((load * self.spread).ceil() as usize).clamp(1, n)
        }
    }

    /// The fewest instances that can serve a key of `share` of the traffic of `n` instances
    /// without one of them taking more than its fair share: `ceil(share * n)`. What hot keys
    /// get while wider replica sets do not pay (the caches cannot hold them): at most n - 1
    /// copies over the whole variant, since the shares add up to 1.
    pub fn least_replicas(&self, share: f64, n: usize) -> usize {
        let load = share * n as f64;
        if load <= 1.0 || self.spread <= 0.0 {
            1
        } else {
            (load.ceil() as usize).clamp(1, n)
        }
    }
}
