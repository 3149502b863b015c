//! Homes: where a variant's reused keys live, chosen by occupancy (the prefill and queueing
//! terms of the objective, see [`crate::placement`]).
//!
//! Rendezvous hashing places each key by its own hash, blind to what else an instance holds.
//! With few popular prefixes that is luck: 8 documents on 4 instances leave some instance with
//! none, or one with four, more often than not, and where caches hold 3 documents the crowded
//! instance thrashes while another idles. The peers avoid it by sending a new prefix to the
//! emptiest cache; a router that does so from its own history alone disagrees with its
//! replicas, and with small caches every disagreement is a copy.
//!
//! So once per half-window (and twice early, see [`Tuning::home_early`]) the keys this router
//! placed often ([`crate::load::Homes`]' candidates with at least [`Tuning::home_min_requests`]
//! requests in the window and `share * n >= home_share`) are counted onto instances in one
//! pass, each where it goes: a hot key spread over replicas takes room on each of them; any other
//! stays on its top choice unless that instance already holds more than `home_slack` times the
//! mean number of reused keys per instance (at least one) more than the emptiest of the key's
//! first [`Tuning::home_choices`] instances: then that one is the key's home. A key keeps a home
//! while its home holds no more keys than its top choice. Keys count alike (documents of a
//! workload are of a size) and are taken in hash order, so the pass depends only on the set of
//! reused keys: replicas that see samples of the same traffic estimate shares differently but
//! find the same set, and so assign the same homes, with no word between them. Request rates are
//! left to the rules below (hot replicas, re-weighing of keys without a home); where hashing is
//! even enough no key gets a home.
//!
//! A home is not a copy: the key leaves its top choice for the home, once. Its revisits there
//! are held to the engines' reports like plain hashing's (relief moves keys off a home whose
//! cache still overflows).

use std::collections::HashMap;

use super::rendezvous::{rendezvous_top, RendezvousWalk};
use super::Tuning;
use crate::feedback::Rule;
use crate::load::{now_ms, Home};
use crate::table::Variant;

/// Assigns homes to the variant's reused keys (see the module doc).
pub(super) fn assign_homes(v: &Variant, t: &Tuning) {
    let load = v.load();
    let homes = load.homes();
    let hashes = v.id_hashes();
    let n = hashes.len();
    let e = load.epoch();
    let total = load.recent(e);
    if n < 2 || total <= 0.0 {
        homes.store(Vec::new());
        return;
    }
    let rates = load.key_rates();
    let previous: HashMap<u64, Home> = homes.assignment().iter().map(|h| (h.key, *h)).collect();
    let mut keys: Vec<(f64, u64)> = homes
        .candidates()
        .filter_map(|k| {
            let count = rates.value(k, e);
            let s = (count / total).min(1.0);
            // a key with a home keeps it down to half the thresholds (an estimate near them
            // would otherwise move the key at every pass)
            let bar = if previous.contains_key(&k) { 0.5 } else { 1.0 };
            (count >= t.home_min_requests * bar && s * n as f64 >= t.home_share * bar)
                .then_some((s, k))
        })
        .collect();
    // In key order: the pass is then a function of the set of reused keys alone, which replicas
    // that see samples of the same traffic share (their share estimates differ; the set of keys
    // that clear the bars rarely does).
    keys.sort_unstable_by_key(|&(_, k)| k);
    let spread = load.feedback().allows(Rule::HotReplica, now_ms());
    let mut held = vec![0u32; n];
    let slack = (t.home_slack * keys.len() as f64 / n as f64).max(1.0);
    let mut out = Vec::new();
    for &(s, key) in &keys {
        let r = if spread {
            t.replicas(s, n)
        } else {
            t.least_replicas(s, n)
        };
        let (top, score) = rendezvous_top(hashes, key);
        let mut ranking = std::iter::once(top).chain(RendezvousWalk::new(hashes, key, top, score));
        if r > 1 {
            // spread over replicas: it takes room in each
            ranking.take(r).for_each(|i| held[i] += 1);
            continue;
        }
        ranking.next();
        // a home is kept while it is no more crowded than the top choice (moving back would
        // be a move too)
        if let Some(h) = previous.get(&key).and_then(|h| h.locate(hashes)) {
            if h != top && held[h] <= held[top] {
                held[h] += 1;
                out.push(Home {
                    key,
                    index: h as u32,
                    id_hash: hashes[h],
                });
                continue;
            }
        }
        let mut best = top;
        for i in ranking.take(t.home_choices.saturating_sub(1)) {
            if held[i] < held[best] {
                best = i;
            }
        }
        if held[top] as f64 <= held[best] as f64 + slack {
            held[top] += 1;
            continue;
        }
        held[best] += 1;
        out.push(Home {
            key,
            index: best as u32,
            id_hash: hashes[best],
        });
    }
    out.sort_unstable_by_key(|h| h.key);
    tracing::debug!(
        variant = v.name(),
        reused = keys.len(),
        homes = out.len(),
        ?held,
        "homes assigned"
    );
    homes.store(out);
}
