//! RANDOM and LEAST_OUTSTANDING_REQUESTS, also PREFIX_AWARE's last resort.

use rand::Rng;

use crate::table::Variant;

/// Fewest in-flight requests, uniform among ties (reservoir sampling with a cheap generator
/// seeded once per decision); ejected instances only if all are ejected.
pub fn least_loaded(v: &Variant, exclude: Option<usize>, now: u64) -> Option<usize> {
    let mut x = rand::rng().random::<u64>() | 1;
    for allow_ejected in [false, true] {
        let mut best: Option<usize> = None;
        let mut best_load = u64::MAX;
        let mut ties = 0u64;
        for (i, inst) in v.instances().iter().enumerate() {
            if Some(i) == exclude || (!allow_ejected && inst.state().is_ejected(now)) {
                continue;
            }
            let load = inst.state().outstanding();
            if load < best_load {
                best = Some(i);
                best_load = load;
                ties = 1;
            } else if load == best_load {
                ties += 1;
                // xorshift64, then keep this one with probability 1/ties
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                if ((x >> 32) * ties) >> 32 == 0 {
                    best = Some(i);
                }
            }
        }
        if best.is_some() {
            return best;
        }
    }
    None
}

/// Uniform; an ejected pick moves on to the next healthy instance.
pub fn random(v: &Variant, exclude: Option<usize>, now: u64) -> Option<usize> {
    let n = v.instances().len();
    let available = n - usize::from(exclude.is_some_and(|x| x < n));
    if available == 0 {
        return None;
    }
    let mut r = rand::rng().random_range(0..available);
    if exclude.is_some_and(|x| r >= x) {
        r += 1;
    }
    if !v.instances()[r].state().is_ejected(now) {
        return Some(r);
    }
    (1..n)
        .map(|d| (r + d) % n)
        .find(|&i| Some(i) != exclude && !v.instances()[i].state().is_ejected(now))
        .or(Some(r))
}
