//! Re-weighing: instance weights that even out request shares where hashing alone leaves them
//! uneven (the balance term of the objective, see [`crate::placement`]).

use super::rendezvous::{rendezvous_score, RendezvousWalk};
use super::Tuning;
use crate::table::Variant;

/// Cold keys choose among this many of their first rendezvous instances by weight.
pub const WEIGHTED_CHOICES: usize = 3;

/// Re-weighs the variant's instances at the start of a half-window, from their shares of the
/// requests of the window that just ended: an instance over its fair share gets a lower weight,
/// one under it a higher weight, so cold keys at the margin of their first choices move (whole
/// keys, once, not request by request) until shares even out. This covers what hot-key spreading
/// cannot: traffic whose keys are all cold (flat popularity), where hashing alone leaves
/// instances several points apart. Replicas that see random samples of the same traffic measure
/// nearly the same shares and converge on nearly the same weights.
pub(super) fn reweigh(v: &Variant, t: &Tuning) {
    let load = v.load();
    let e = load.epoch();
    let total = load.recent(e);
    let n = v.instances().len();
    if total < t.min_window || n < 2 {
        return;
    }
    let fair = 1.0 / n as f64;
    for inst in v.instances() {
        let share = inst.state().recent().value(e) / total;
        if (share - fair).abs() < t.dead_zone {
            continue;
        }
        let step = (fair / share.max(fair / 4.0)).powf(t.gain);
        let w = (inst.state().weight() * step).clamp(1.0 / t.max_weight, t.max_weight);
        inst.state().set_weight(w);
        load.set_weighted();
    }
}

/// A cold key's instance: the best of its first [`WEIGHTED_CHOICES`] rendezvous instances by
/// weighted rendezvous score `w / -ln(u)` (u = the key's hash against the instance, in (0, 1)).
/// With equal weights that is the rendezvous top choice.
pub(super) fn weighted_first(v: &Variant, key: u64, top: usize) -> usize {
    let hashes = v.id_hashes();
    let instances = v.instances();
    if hashes.len() < 2 || !v.load().is_weighted() {
        return top;
    }
    let w_top = instances[top].state().weight();
    let weighted = |i: usize| {
        let u = ((rendezvous_score(key, hashes[i]) >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
        instances[i].state().weight() / -u.ln()
    };
    // Equal weights among the candidates keep the plain ranking (no logarithms).
    let walk = RendezvousWalk::new(hashes, key, top, rendezvous_score(key, hashes[top]));
    let mut candidates = [top; WEIGHTED_CHOICES];
    let mut len = 1;
    let mut equal = true;
    for i in walk.take(WEIGHTED_CHOICES - 1) {
        equal &= instances[i].state().weight() == w_top;
        candidates[len] = i;
        len += 1;
    }
    if equal {
        return top;
    }
    let mut best = (top, weighted(top));
    for &i in &candidates[1..len] {
        let s = weighted(i);
        if s > best.1 {
            best = (i, s);
        }
    }
    best.0
}
