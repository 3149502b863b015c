//! PREFIX_AWARE's choice: the cost of [`crate::placement`]'s module doc, per instance.

use super::basic::least_loaded;
use super::rendezvous::rendezvous_score;
use super::{Choice, Decision, Placement};
use crate::prefix_index::{Prediction, BLOCK_BYTES};
use crate::table::{PrefixAware, Variant};

/// The prompt as placement sees it.
pub(super) struct Prompt<'a> {
    /// The affinity key (the first `prefix_length` characters): the rendezvous ranking.
    pub(super) key: u64,
    /// Its length in characters.
    pub(super) key_bytes: u32,
    /// The whole prompt's chained block hashes ([`crate::prompt::prompt_blocks`]).
    pub(super) blocks: &'a [u64],
    /// The whole prompt's length.
    pub(super) bytes: u32,
    /// Per instance, from the engines' KV events: `Some(leading blocks held)` where the index is
    /// exact, `None` where inferred (empty: no events for this variant).
    pub(super) exact: &'a [Option<u32>],
    /// Prompt bytes per exact block.
    pub(super) exact_block_bytes: f64,
}

/// One candidate's standing: over the threshold last, then the cost, then the rendezvous score
/// (highest first), so equal costs go by the ranking every replica shares.
#[derive(Clone, Copy, PartialEq, PartialOrd)]
struct Standing {
    over: bool,
    cost: f64,
    score: std::cmp::Reverse<u64>,
}

impl Placement {
    /// The cheapest instance for `prompt` (see the module doc of [`crate::placement`]), and the
    /// prefix index's prediction for it; the prompt's blocks are recorded as placed there.
    pub(super) fn prefix_aware(
        &self,
        v: &Variant,
        pa: PrefixAware,
        prompt: &Prompt<'_>,
        depth: &mut Vec<u32>,
        now: u64,
    ) -> Option<(Choice, Option<Prediction>)> {
        let ids = v.id_hashes();
        let instances = v.instances();
        if ids.is_empty() {
            return None;
        }
        depth.clear();
        depth.resize(ids.len(), 0);
        let limit = pa.concurrency_threshold as u64;
        let block = BLOCK_BYTES as f64;
        let total = prompt.bytes as f64;
        v.load().index().with(ids, &self.tuning, |index| {
            index.matches(prompt.blocks, depth);
            let request = index.request_bytes();
            // Each instance's cost on what the index knows; the key's rendezvous top is then
            // taken to hold at least the key: that only lowers the top's cost, so it is weighed
            // after the others.
            let exact = |i: usize| prompt.exact.get(i).copied().flatten();
            let known = |i: usize| match exact(i) {
                Some(d) => (d as f64 * prompt.exact_block_bytes).min(total),
                None => (depth[i] as f64 * block).min(total),
            };
            let standing = |i: usize, held: f64, score: u64| {
                let state = instances[i].state();
                let (used, capacity) = index.room(i);
                let new_blocks = (prompt.blocks.len() - depth[i] as usize) as f64;
                let evict = (used as f64 + new_blocks - capacity.floor()).max(0.0) * block;
                Standing {
                    over: state.outstanding() >= limit,
                    cost: (total - held) + evict + state.outstanding() as f64 * request,
                    score: std::cmp::Reverse(score),
                }
            };
            let mut best: Option<(usize, Standing)> = None;
            let mut most_known = 0.0f64;
            // no cost is below the prompt's miss: an instance that would not beat the best even
            // with no queue and room to spare is looked at no further (most of a large fleet)
            let mut weigh = |i: usize, score: u64| {
                let h = known(i);
                if let Some((_, b)) = best {
                    if !b.over && (total - h, std::cmp::Reverse(score)) > (b.cost, b.score) {
                        return;
                    }
                }
                if instances[i].state().is_ejected(now) {
                    return;
                }
                most_known = most_known.max(h);
                let s = standing(i, h, score);
                if best.is_none_or(|(_, b)| s < b) {
                    best = Some((i, s));
                }
            };
            let mut top: Option<(usize, u64)> = None;
            for (i, &id) in ids.iter().enumerate() {
                let score = rendezvous_score(prompt.key, id);
                if top.is_none_or(|(_, s)| score > s) {
                    top = Some((i, score));
                }
                weigh(i, score);
            }
            let (top, top_score) = top?;
            let top_held = known(top).max((prompt.key_bytes as f64).min(total));
            let held = |i: usize| if i == top { top_held } else { known(i) };
            let mut most_held = most_known;
            if !instances[top].state().is_ejected(now) {
                most_held = most_held.max(top_held);
                let s = standing(top, top_held, top_score);
                if best.is_none_or(|(_, b)| s < b) {
                    best = Some((top, s));
                }
            }
            // the decision: the instance taken to hold the most of the prompt (by the index:
            // prefix_match; by the key's ranking: prefix_hash), else a bypass of it (its queue
            // cost more, or it was over the threshold)
            let (i, decision) = match best {
                Some((i, s)) => {
                    let decision = if s.over || held(i) < most_held {
                        Decision::OverloadBypass
                    } else if known(i) > 0.0 && known(i) >= held(i) {
                        Decision::PrefixMatch
                    } else {
                        Decision::PrefixHash
                    };
                    (i, decision)
                }
                // every instance ejected: the least loaded of them
                _ => (least_loaded(v, None, now)?, Decision::OverloadBypass),
            };
            index.place(i, prompt.blocks);
            let prediction = Prediction {
                instance: ids[i],
                cached_bytes: (depth[i] as f64 * block).min(total) as u32,
                prompt_bytes: prompt.bytes,
            };
            Some(((i, decision), Some(prediction)))
        })
    }
}
