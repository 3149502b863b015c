//! Request counters of one route (endpoint, variant, instance) by front door, decision and
//! status, and the prompt tokens its engine reported by the rule that placed them: kept by the
//! table's instances, rendered by [`crate::metrics`].

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use crate::decision::{Decision, FrontDoor};
use crate::usage::CacheReport;

/// Status codes with their own counter; others are counted by class.
const STATUS_CODES: [u16; 11] = [200, 400, 404, 405, 408, 413, 429, 500, 502, 503, 504];
const STATUS_CLASSES: [&str; 5] = ["1xx", "2xx", "3xx", "4xx", "5xx"];
pub const STATUS_SLOTS: usize = STATUS_CODES.len() + STATUS_CLASSES.len();

pub(crate) fn status_slot(code: u16) -> usize {
    match STATUS_CODES.iter().position(|&c| c == code) {
        Some(i) => i,
        None => STATUS_CODES.len() + (code / 100).clamp(1, 5) as usize - 1,
    }
}

pub(crate) fn slot_label(slot: usize, out: &mut String) {
    if slot < STATUS_CODES.len() {
        let _ = write!(out, "{}", STATUS_CODES[slot]);
    } else {
        out.push_str(STATUS_CLASSES[slot - STATUS_CODES.len()]);
    }
}

/// Request counters of one (endpoint, variant, instance) route, by front door, decision and
/// status (one flat array, indexed: no allocation per request), and the prompt tokens its
/// engine reported, by the rule that placed them.
#[derive(Debug)]
pub struct RouteStats {
    counts: Box<[AtomicU64]>,
    prompt_tokens: [AtomicU64; Decision::ALL.len()],
    cached_tokens: [AtomicU64; Decision::ALL.len()],
}

impl Default for RouteStats {
    fn default() -> Self {
        RouteStats {
            counts: (0..FrontDoor::ALL.len() * Decision::ALL.len() * STATUS_SLOTS)
                .map(|_| AtomicU64::new(0))
                .collect(),
            prompt_tokens: Default::default(),
            cached_tokens: Default::default(),
        }
    }
}

impl RouteStats {
    fn slot(door: FrontDoor, decision: Decision, status_slot: usize) -> usize {
        (door as usize * Decision::ALL.len() + decision as usize) * STATUS_SLOTS + status_slot
    }

    pub fn record(&self, door: FrontDoor, decision: Decision, status: u16) {
        self.counts[Self::slot(door, decision, status_slot(status))].fetch_add(1, Relaxed);
    }

    pub fn get(&self, door: FrontDoor, decision: Decision, status: u16) -> u64 {
        self.counts[Self::slot(door, decision, status_slot(status))].load(Relaxed)
    }

    /// The count of `decision` through `door` in status slot `slot` (below [`STATUS_SLOTS`]).
    pub(crate) fn count_at(&self, door: FrontDoor, decision: Decision, slot: usize) -> u64 {
        self.counts[Self::slot(door, decision, slot)].load(Relaxed)
    }

    /// Counts what the engine reported of one request placed by `decision`.
    pub fn record_usage(&self, decision: Decision, report: CacheReport) {
        self.prompt_tokens[decision as usize].fetch_add(report.prompt_tokens, Relaxed);
        self.cached_tokens[decision as usize].fetch_add(report.cached_tokens, Relaxed);
    }

    /// Prompt tokens and cached prompt tokens the engine reported for requests placed by
    /// `decision`.
    pub fn usage(&self, decision: Decision) -> (u64, u64) {
        (
            self.prompt_tokens[decision as usize].load(Relaxed),
            self.cached_tokens[decision as usize].load(Relaxed),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_slots_cover_every_code() {
        assert_eq!(status_slot(200), 0);
        assert_eq!(status_slot(504), STATUS_CODES.len() - 1);
        for code in [0u16, 100, 201, 302, 418, 599, 999] {
            assert!(status_slot(code) < STATUS_SLOTS);
        }
        let mut s = String::new();
        slot_label(status_slot(201), &mut s);
        assert_eq!(s, "2xx");
    }

    #[test]
    fn each_front_door_counts_apart() {
        let stats = RouteStats::default();
        stats.record(FrontDoor::ExtProc, Decision::PrefixHash, 200);
        stats.record(FrontDoor::ExtProc, Decision::PrefixHash, 200);
        stats.record(FrontDoor::Http, Decision::PrefixHash, 200);
        stats.record(FrontDoor::ExtProc, Decision::OverloadBypass, 504);
        assert_eq!(stats.get(FrontDoor::ExtProc, Decision::PrefixHash, 200), 2);
        assert_eq!(stats.get(FrontDoor::Http, Decision::PrefixHash, 200), 1);
        assert_eq!(stats.get(FrontDoor::Http, Decision::OverloadBypass, 504), 0);
        assert_eq!(
            stats.get(FrontDoor::ExtProc, Decision::OverloadBypass, 504),
            1
        );
        // every (door, decision, status) has a counter of its own
        let mut seen = std::collections::HashSet::new();
        for door in FrontDoor::ALL {
            for decision in Decision::ALL {
                for slot in 0..STATUS_SLOTS {
                    assert!(seen.insert(RouteStats::slot(door, decision, slot)));
                }
            }
        }
        assert_eq!(seen.len(), stats.counts.len());
    }
}
