//! Every constant of PREFIX_AWARE placement, in one struct. [`Tuning::default`] is what users
//! get; unit tests run at it. What each value was measured to do is in BENCHMARKS.md, not here.

/// PREFIX_AWARE's constants. See the module doc of [`crate::placement`] for the cost each one
/// enters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tuning {
    /// The queue term, until the router has learnt it: what one request queued on an instance
    /// costs a request sent there, in prompt bytes of prefill.
    pub request_bytes: f64,
    /// The queue term's fit (see [`crate::prefix_index::LatencyFit`]) weighs about the last
    /// this many requests the engines reported on...
    pub fit_window: f64,
    /// ...and is used once it has about this many of them (and they vary in misses and queue).
    pub fit_min_samples: f64,
    /// The prefill and eviction terms: how far one engine report that contradicts the prefix
    /// index moves the instance's capacity estimate (relative).
    pub capacity_step: f64,
    /// Memory: (block, instance) pairs the prefix index of one variant holds at most (about 100
    /// bytes each); an instance's capacity is at most its even share.
    pub index_blocks: usize,
}

impl Default for Tuning {
    fn default() -> Self {
        Tuning {
            request_bytes: 4096.0,
            fit_window: 256.0,
            fit_min_samples: 16.0,
            capacity_step: 0.1,
            index_blocks: 1 << 18,
        }
    }
}
