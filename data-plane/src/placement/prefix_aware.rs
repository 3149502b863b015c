//! PREFIX_AWARE's choice: the cost of [`crate::placement`]'s module doc, per instance.

use super::basic::least_loaded;
use super::rendezvous::{rendezvous_score, rendezvous_top};
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
            let top = rendezvous_top(ids, prompt.key).0;
            // what instance i is taken to hold: its match, and on the key's rendezvous top (where
            // every replica sends the key) at least the key
            let held = |i: usize| -> f64 {
                let known = depth[i] as f64 * block;
                let assumed = if i == top {
                    prompt.key_bytes as f64
                } else {
                    0.0
                };
                known.max(assumed).min(total)
            };
            let mut best: Option<(usize, Standing)> = None;
            let mut most_held = 0.0f64;
            for (i, inst) in instances.iter().enumerate() {
                let state = inst.state();
                if state.is_ejected(now) {
                    continue;
                }
                let score = rendezvous_score(prompt.key, ids[i]);
                let h = held(i);
                most_held = most_held.max(h);
                let (used, capacity) = index.room(i);
                let new_blocks = (prompt.blocks.len() - depth[i] as usize) as f64;
                let evict = (used as f64 + new_blocks - capacity.floor()).max(0.0) * block;
                let queue = state.outstanding() as f64 * request;
                let standing = Standing {
                    over: state.outstanding() >= limit,
                    cost: (total - h) + evict + queue,
                    score: std::cmp::Reverse(score),
                };
                if best.is_none_or(|(_, b)| standing < b) {
                    best = Some((i, standing));
                }
            }
            // the decision: the instance taken to hold the most of the prompt (by the index:
            // prefix_match; by the key's ranking: prefix_hash), else a bypass of it (its queue
            // cost more, or it was over the threshold)
            let (i, decision) = match best {
                Some((i, s)) => {
                    let decision = if s.over || held(i) < most_held {
                        Decision::OverloadBypass
                    } else if depth[i] > 0 && depth[i] as f64 * block >= held(i) {
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
