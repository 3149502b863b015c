//! Failed authentications, throttled per peer address: a peer that keeps presenting wrong
//! secrets (guessing) is refused for a while, doubling each time, before its secret is even
//! looked at; every other peer, and its correct secrets, goes on unslowed.
//!
//! A peer gets [`FREE_FAILURES`] failures; each failure after those refuses it for
//! [`FIRST_BLOCK`] doubled per further failure, at most [`MAX_BLOCK`]. A success while not
//! refused forgets the peer's failures, and so does [`FORGET_AFTER`] without one. At most
//! [`MAX_PEERS`] peers are remembered (the oldest forgotten first). The common case (no peer
//! refused) costs one atomic load.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Failures a peer may have before it is refused.
pub const FREE_FAILURES: u32 = 5;
/// How long the first refusal lasts; each further failure doubles it.
pub const FIRST_BLOCK: Duration = Duration::from_secs(1);
/// The longest refusal.
pub const MAX_BLOCK: Duration = Duration::from_secs(300);
/// Failures are forgotten this long after a peer's last one.
pub const FORGET_AFTER: Duration = Duration::from_secs(900);
/// Peers remembered at once.
pub const MAX_PEERS: usize = 16_384;

#[derive(Debug)]
struct Strikes {
    failures: u32,
    last: Instant,
    refused_until: Option<Instant>,
}

/// Failed authentications per peer address.
#[derive(Debug)]
pub struct Throttle {
    started: Instant,
    peers: Mutex<HashMap<IpAddr, Strikes>>,
    /// Peers with failures on record (0: nothing to forget on success).
    tracked: AtomicUsize,
    /// When the latest refusal ends, in ms since `started` (past: nobody is refused).
    refusing_until_ms: AtomicU64,
    /// Requests refused so far.
    refused: AtomicU64,
}

impl Default for Throttle {
    fn default() -> Self {
        Throttle {
            started: Instant::now(),
            peers: Mutex::default(),
            tracked: AtomicUsize::new(0),
            refusing_until_ms: AtomicU64::new(0),
            refused: AtomicU64::new(0),
        }
    }
}

impl Throttle {
    fn ms(&self, at: Instant) -> u64 {
        at.saturating_duration_since(self.started).as_millis() as u64
    }

    fn peers(&self) -> std::sync::MutexGuard<'_, HashMap<IpAddr, Strikes>> {
        self.peers.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `Err(retry_after)` while `peer` is refused; call before checking its secret.
    pub fn check(&self, peer: IpAddr) -> Result<(), Duration> {
        let now = Instant::now();
        if self.ms(now) >= self.refusing_until_ms.load(Ordering::Relaxed) {
            return Ok(());
        }
        let until = self.peers().get(&peer).and_then(|s| s.refused_until);
        match until {
            Some(until) if until > now => {
                self.refused.fetch_add(1, Ordering::Relaxed);
                Err(until - now)
            }
            _ => Ok(()),
        }
    }

    /// `peer` presented a wrong (or no) secret.
    pub fn failed(&self, peer: IpAddr) {
        let now = Instant::now();
        let mut peers = self.peers();
        if peers.len() >= MAX_PEERS && !peers.contains_key(&peer) {
            peers.retain(|_, s| now.saturating_duration_since(s.last) < FORGET_AFTER);
            if peers.len() >= MAX_PEERS {
                if let Some(oldest) = peers.iter().min_by_key(|(_, s)| s.last).map(|(k, _)| *k) {
                    peers.remove(&oldest);
                }
            }
        }
        let s = peers.entry(peer).or_insert(Strikes {
            failures: 0,
            last: now,
            refused_until: None,
        });
        if now.saturating_duration_since(s.last) >= FORGET_AFTER {
            s.failures = 0;
        }
        s.failures += 1;
        s.last = now;
        if s.failures > FREE_FAILURES {
            let doublings = (s.failures - FREE_FAILURES - 1).min(16);
            let block = FIRST_BLOCK.saturating_mul(1 << doublings).min(MAX_BLOCK);
            let until = now + block;
            s.refused_until = Some(until);
            self.refusing_until_ms
                .fetch_max(self.ms(until), Ordering::Relaxed);
        }
        self.tracked.store(peers.len(), Ordering::Relaxed);
    }

    /// `peer` presented a correct secret: its failures are forgotten.
    pub fn succeeded(&self, peer: IpAddr) {
        if self.tracked.load(Ordering::Relaxed) == 0 {
            return;
        }
        let mut peers = self.peers();
        peers.remove(&peer);
        self.tracked.store(peers.len(), Ordering::Relaxed);
    }

    /// Requests refused so far (for metrics).
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_guessing_peer_is_refused_with_growing_waits_and_others_are_not() {
        let t = Throttle::default();
        let guesser: IpAddr = "10.0.0.1".parse().unwrap();
        let other: IpAddr = "10.0.0.2".parse().unwrap();
        for _ in 0..FREE_FAILURES {
            assert!(t.check(guesser).is_ok());
            t.failed(guesser);
        }
        assert!(t.check(guesser).is_ok(), "the free failures refuse nothing");
        t.failed(guesser);
        let first = t.check(guesser).unwrap_err();
        assert!(first <= FIRST_BLOCK && first > FIRST_BLOCK / 2, "{first:?}");
        t.failed(guesser);
        let second = t.check(guesser).unwrap_err();
        assert!(second > FIRST_BLOCK, "doubled: {second:?}");
        assert!(t.check(other).is_ok(), "another peer is never refused");
        t.succeeded(other);
        assert!(
            t.check(guesser).is_err(),
            "another peer's success changes nothing"
        );
        assert_eq!(t.refused(), 3);
    }

    #[test]
    fn a_success_forgets_the_failures() {
        let t = Throttle::default();
        let peer: IpAddr = "::1".parse().unwrap();
        for _ in 0..FREE_FAILURES {
            t.failed(peer);
        }
        t.succeeded(peer);
        t.failed(peer);
        assert!(
            t.check(peer).is_ok(),
            "counting starts again after a success"
        );
    }

    #[test]
    fn waits_stop_growing_at_the_longest_refusal() {
        let t = Throttle::default();
        let peer: IpAddr = "10.0.0.3".parse().unwrap();
        for _ in 0..(FREE_FAILURES + 40) {
            t.failed(peer);
        }
        assert!(t.check(peer).unwrap_err() <= MAX_BLOCK);
    }
}
