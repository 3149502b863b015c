//! PREFIX_AWARE's instance choice for one key (the mechanisms of the objective in
//! [`crate::placement`], in the order they are tried).

use super::basic::least_loaded;
use super::rendezvous::{fmix64, rendezvous_top, RendezvousWalk};
use super::reweigh::weighted_first;
use super::{Choice, Decision, Placement};
use crate::feedback::Rule;
use crate::load::Epoch;
use crate::table::{PrefixAware, Variant};

/// A hot key with more replicas than this in a variant of more than 64 instances is served by its
/// top choice and this many instances drawn by its hashes, not by a sorted ranking.
pub const WIDE_REPLICAS: usize = 16;
/// Variants larger than this rank wide replica sets by hash draws (see [`WIDE_REPLICAS`]).
const LARGE_VARIANT: usize = 64;

/// A request keyed by its conversation under a hot shared head.
#[derive(Debug, Clone, Copy)]
pub(super) struct Conversation {
    /// The head-only key it was deepened from.
    pub(super) head: u64,
    pub(super) first_turn: bool,
}

impl Placement {
    /// A conversation under a hot shared head (deepening is allowed only while the engines'
    /// reports show the head cached where first turns go): its first turn takes the less
    /// recently loaded of its key's first two instances (the power of two choices, which evens
    /// out what hashing alone leaves uneven), and this router remembers the choice for the later
    /// turns. A later turn this router has not seen (the conversation moved between routers)
    /// takes the key's ranking like any other key.
    pub(super) fn conversation(
        &self,
        v: &Variant,
        key: u64,
        c: Conversation,
        pa: PrefixAware,
        now: u64,
    ) -> Option<Choice> {
        let hashes = v.id_hashes();
        if hashes.is_empty() {
            return None;
        }
        let index_key = key ^ v.salt();
        let instances = v.instances();
        let limit = self.limit(v, pa, now);
        let ok = |i: usize| instances[i].state().takes(limit, now);
        if c.first_turn {
            let e = v.load().epoch();
            let (top, top_score) = rendezvous_top(hashes, key);
            let second = RendezvousWalk::new(hashes, key, top, top_score).next();
            let recent = |i: usize| instances[i].state().recent().value(e);
            let pick = match second {
                Some(s) if ok(s) && (!ok(top) || recent(s) < recent(top)) => {
                    Some((s, Decision::PrefixMatch))
                }
                _ if ok(top) => Some((top, Decision::PrefixHash)),
                _ => None,
            };
            if let Some((i, d)) = pick {
                self.index.insert(index_key, hashes[i]);
                return Some((i, d, Rule::DeepenedHead));
            }
        } else if let Some(remembered) = self.index.get(index_key) {
            if let Some(j) = hashes.iter().position(|&h| h == remembered) {
                if ok(j) {
                    return Some((j, Decision::PrefixMatch, Rule::DeepenedHead));
                }
            }
        }
        self.prefix_aware(v, key, pa, None, now)
    }

    /// The in-flight bound of an instance of `v`: the bounded-load cap (while spilling pays, see
    /// [`crate::feedback`]) and the concurrency threshold, whichever is lower.
    fn limit(&self, v: &Variant, pa: PrefixAware, now: u64) -> u64 {
        let threshold = pa.concurrency_threshold as u64;
        if !v.load().feedback().allows(Rule::Spill, now) {
            return threshold;
        }
        let n = v.id_hashes().len() as u64;
        let cap = (self.tuning.balance_percent as u64 * (v.load().outstanding() + 1))
            .div_ceil(100 * n)
            + 1;
        cap.min(threshold)
    }

    pub(super) fn prefix_aware(
        &self,
        v: &Variant,
        key: u64,
        pa: PrefixAware,
        exclude: Option<usize>,
        now: u64,
    ) -> Option<Choice> {
        let hashes = v.id_hashes();
        let n = hashes.len() as u64;
        if n == 0 {
            return None;
        }
        let t = &self.tuning;
        let feedback = v.load().feedback();
        let limit = self.limit(v, pa, now);
        let instances = v.instances();
        let ok = |i: usize| Some(i) != exclude && instances[i].state().takes(limit, now);
        let (top, top_score) = rendezvous_top(hashes, key);
        let key_share = share(v, key, t.min_window);
        // A reused key's home (see [`super::homes`]): a hot key has one only where the caches
        // have no room for its copies.
        let homes = v.load().homes();
        let home = homes.get(key).and_then(|h| h.locate(hashes));
        // A hot key gets replicas by its share from the router's second homes pass on (its
        // first has no report from the engines yet) and while they pay, else only as many as
        // its load needs (a key with more traffic than one instance's share cannot stay on
        // one).
        let r = if home.is_some() {
            1
        } else if homes.copies_by_pass() && !homes.is_copied(key) {
            // Under a bound or while probing for one, copies only where the last pass gave
            // them room (see [`super::homes`]): this router's estimate of the key may have
            // moved since, other routers' not.
            1
        } else if homes.spreads() && feedback.allows(Rule::HotReplica, now) {
            t.replicas(key_share, hashes.len())
        } else {
            t.least_replicas(key_share, hashes.len())
        };
        if r > 1 {
            // A hot key: the least recently loaded of its first r instances.
            let e = v.load().epoch();
            let mut best: Option<(usize, f64, usize)> = None;
            let mut consider = |rank: usize, i: usize| {
                if ok(i) {
                    let recent = instances[i].state().recent().value(e);
                    if best.is_none_or(|b| recent < b.1) {
                        best = Some((i, recent, rank));
                    }
                }
            };
            if r > WIDE_REPLICAS && hashes.len() > LARGE_VARIANT {
                // Many replicas in a large variant: ranking them all would sort the whole
                // variant per request. The top choice plus WIDE_REPLICAS instances drawn by the
                // key's own hashes (a fixed set per key, so the copies stay bounded).
                consider(0, top);
                for j in 1..=WIDE_REPLICAS as u64 {
                    consider(j as usize, (fmix64(key ^ j) % hashes.len() as u64) as usize);
                }
            } else {
                let walk = RendezvousWalk::new(hashes, key, top, top_score);
                for (rank, i) in std::iter::once(top).chain(walk).take(r).enumerate() {
                    consider(rank, i);
                }
            }
            if let Some((i, _, rank)) = best {
                let d = match rank {
                    0 => Decision::PrefixHash,
                    _ => Decision::PrefixMatch,
                };
                return Some((i, d, Rule::HotReplica));
            }
        } else {
            // Under a bound (the caches are full), a key the last pass counted stays where the
            // pass counted it: on its top choice unless it has a home. Re-weighing and warm
            // moves are for keys the pass did not count: one they move lands on an instance
            // whose room the pass gave to other keys, and evicts one of them (on 4
            // llama-servers whose caches held 2 of 8 documents, one router's weights drifted
            // with the uneven request shares a bound leaves, and 60 s into the run hit fell
            // from 94% to 86-88% for 10-20 s).
            let counted = home.is_none() && homes.capacity().is_some() && homes.is_reused(key);
            // The key's home, else its (weighted) top choice.
            let first = match home {
                Some(h) => h,
                None if counted => top,
                None if feedback.allows(Rule::Reweighed, now) => weighted_first(v, key, top),
                None => top,
            };
            // A key whose instance's cache overflows, among the share of its keys it sheds: the
            // instance it was moved to before (the prefix index remembers it) while that one's
            // cache has room, else the first instance of its ranking with room (the same on
            // every router: one that picked by its own recent counts disagreed with the others,
            // and each disagreement is a copy).
            // (Once the homes pass knows how many keys a cache holds it places by that bound,
            // the same on every router, and relief stands down: its moves, each router's own,
            // broke the agreed homes and overflowed the instances they went to.)
            if instances[first].state().cache().relieves(key) && homes.capacity().is_none() {
                let room =
                    |j: usize| j != first && instances[j].state().cache().has_room() && ok(j);
                let index_key = key ^ v.salt();
                let remembered = self
                    .index
                    .get(index_key)
                    .and_then(|h| hashes.iter().position(|&x| x == h))
                    .filter(|&j| room(j));
                let to = remembered.or_else(|| {
                    let j = std::iter::once(top)
                        .chain(RendezvousWalk::new(hashes, key, top, top_score))
                        .find(|&j| room(j))?;
                    self.index.insert(index_key, hashes[j]);
                    Some(j)
                });
                if let Some(j) = to {
                    return Some((j, Decision::PrefixMatch, Rule::Relief));
                }
            }
            // A warm key (just under the hot threshold, where an estimate can fall on either
            // side) whose instance is over its fair share of requests goes to the less recently
            // loaded of that instance and the next in the key's ranking: otherwise a key that a
            // router happens to estimate as cold keeps its whole share on one busy instance
            // until re-weighing moves it.
            // (A key with a home was placed by the homes pass; a warm move would move it twice.)
            if t.spread > 0.0
                && home.is_none()
                && !counted
                && key_share * n as f64 >= t.warm_share
                && ok(first)
                && feedback.allows(Rule::WarmMove, now)
            {
                let e = v.load().epoch();
                let total = v.load().recent(e);
                let recent = |i: usize| instances[i].state().recent().value(e);
                if total >= t.warm_min_window
                    && recent(first) > total * (1.0 + t.warm_slack) / n as f64
                {
                    let next = if first == top {
                        RendezvousWalk::new(hashes, key, top, top_score).next()
                    } else {
                        Some(top)
                    };
                    if let Some(j) = next.filter(|&j| ok(j) && recent(j) < recent(first)) {
                        return Some((j, Decision::PrefixMatch, Rule::WarmMove));
                    }
                }
            }
            if ok(first) {
                let rule = if first == top {
                    Rule::PrefixHash
                } else if home.is_some() {
                    Rule::Home
                } else {
                    Rule::Reweighed
                };
                return Some((first, Decision::PrefixHash, rule));
            }
        }
        let index_key = key ^ v.salt();
        if let Some(remembered) = self.index.get(index_key) {
            if let Some(j) = hashes.iter().position(|&h| h == remembered) {
                if j != top && ok(j) {
                    return Some((j, Decision::PrefixMatch, Rule::Spill));
                }
            }
        }
        for i in RendezvousWalk::new(hashes, key, top, top_score) {
            if ok(i) {
                self.index.insert(index_key, hashes[i]);
                return Some((i, Decision::OverloadBypass, Rule::OverloadBypass));
            }
        }
        // Every instance at the limit: the key's own instance while it is among the least
        // loaded (a request that then waits for a place, see [`crate::flow`], waits for the one
        // whose cache has its prefix), else the least loaded.
        let least = least_loaded(v, exclude, now)?;
        let own = home.unwrap_or(top);
        let state = |i: usize| instances[i].state();
        let i = if Some(own) != exclude
            && !state(own).is_ejected(now)
            && state(own).outstanding() <= state(least).outstanding()
        {
            own
        } else {
            least
        };
        Some((i, Decision::OverloadBypass, Rule::OverloadBypass))
    }
}

/// The key's share of the variant's recent requests (0 until the window holds `min_window`).
pub(super) fn share(v: &Variant, key: u64, min_window: f64) -> f64 {
    let load = v.load();
    let e: Epoch = load.epoch();
    let total = load.recent(e);
    if total < min_window {
        return 0.0;
    }
    (load.key_rates().value(key, e) / total).min(1.0)
}
