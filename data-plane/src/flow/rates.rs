//! Tenants' rate limits: a token bucket per limit a key names (`rpm=`, `tpm=`), and the
//! OpenAI-style `x-ratelimit-*` headers that report them.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http::header::{HeaderMap, HeaderName, HeaderValue};

use super::Refused;
use crate::priority::Rates;

/// Token buckets of the tenants whose keys carry `rpm=`/`tpm=` (tenants come from the key file,
/// so the map stays as small as it). Each bucket holds a minute's worth and refills continuously.
#[derive(Debug, Default)]
pub struct RateLimits {
    buckets: Mutex<std::collections::HashMap<Arc<str>, [Bucket; 2]>>,
}

#[derive(Debug, Clone, Copy)]
struct Bucket {
    level: f64,
    at: Instant,
}

impl Bucket {
    fn full(limit: f64, now: Instant) -> Self {
        Bucket {
            level: limit,
            at: now,
        }
    }

    fn refill(&mut self, limit: f64, now: Instant) {
        let dt = now.saturating_duration_since(self.at).as_secs_f64();
        self.level = (self.level + limit * dt / 60.0).min(limit);
        self.at = now;
    }

    /// Until `need` is in the bucket (zero if it is).
    fn wait_for(&self, need: f64, limit: f64) -> Duration {
        Duration::from_secs_f64(((need - self.level).max(0.0) * 60.0 / limit).max(0.0))
    }
}

/// One limit's state after a request was let in or refused, for the `x-ratelimit-*` headers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RateState {
    pub limit: u32,
    pub remaining: u64,
    /// Until the bucket is full again.
    pub reset: Duration,
}

/// What the limits said of a request: the state of each limit the tenant has (requests, tokens).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct RateReport {
    pub requests: Option<RateState>,
    pub tokens: Option<RateState>,
}

impl RateLimits {
    /// Takes one request and `tokens` prompt tokens from `tenant`'s buckets, or neither:
    /// `Err((why, how long until it would pass, the state))`.
    pub fn charge(
        &self,
        tenant: &Arc<str>,
        rates: Rates,
        tokens: u64,
        now: Instant,
    ) -> Result<RateReport, (Refused, Duration, RateReport)> {
        let limits = [rates.requests_per_minute, rates.tokens_per_minute];
        let need = [1.0, tokens as f64];
        let mut map = self.buckets.lock().unwrap_or_else(|e| e.into_inner());
        let buckets = map.entry(tenant.clone()).or_insert_with(|| {
            let full = |l: Option<u32>| Bucket::full(f64::from(l.unwrap_or(0)), now);
            [full(limits[0]), full(limits[1])]
        });
        let mut refused = None;
        for i in 0..2 {
            let Some(limit) = limits[i].map(f64::from) else {
                continue;
            };
            buckets[i].refill(limit, now);
            if buckets[i].level < need[i] && refused.is_none() {
                let why = [Refused::Requests, Refused::Tokens][i];
                // a prompt larger than a minute's tokens passes once the bucket is full
                let wait = buckets[i].wait_for(need[i].min(limit), limit);
                if need[i] <= limit || wait > Duration::ZERO {
                    refused = Some((why, wait));
                }
            }
        }
        if refused.is_none() {
            for i in 0..2 {
                if let Some(limit) = limits[i] {
                    // a prompt over a minute's worth takes the whole bucket, no more: one huge
                    // body does not lock its tenant out for hours
                    buckets[i].level -= need[i].min(f64::from(limit));
                }
            }
        }
        let state = |i: usize| {
            limits[i].map(|limit| RateState {
                limit,
                remaining: buckets[i].level.max(0.0) as u64,
                reset: buckets[i].wait_for(f64::from(limit), f64::from(limit)),
            })
        };
        let report = RateReport {
            requests: state(0),
            tokens: state(1),
        };
        match refused {
            None => Ok(report),
            Some((why, wait)) => Err((why, wait, report)),
        }
    }
}

impl RateReport {
    /// OpenAI's `x-ratelimit-{limit,remaining,reset}-{requests,tokens}` headers.
    pub fn write(&self, headers: &mut HeaderMap) {
        for (state, names) in [
            (
                self.requests,
                [
                    "x-ratelimit-limit-requests",
                    "x-ratelimit-remaining-requests",
                    "x-ratelimit-reset-requests",
                ],
            ),
            (
                self.tokens,
                [
                    "x-ratelimit-limit-tokens",
                    "x-ratelimit-remaining-tokens",
                    "x-ratelimit-reset-tokens",
                ],
            ),
        ] {
            let Some(s) = state else { continue };
            headers.insert(
                HeaderName::from_static(names[0]),
                HeaderValue::from(s.limit),
            );
            headers.insert(
                HeaderName::from_static(names[1]),
                HeaderValue::from(s.remaining),
            );
            if let Ok(v) = HeaderValue::from_str(&duration_text(s.reset)) {
                headers.insert(HeaderName::from_static(names[2]), v);
            }
        }
    }
}

/// `20ms`, `1.5s`, `6m0s`: OpenAI's reset format.
fn duration_text(d: Duration) -> String {
    let ms = d.as_millis();
    if ms < 1_000 {
        format!("{ms}ms")
    } else if ms < 60_000 {
        format!("{:.1}s", d.as_secs_f64())
    } else {
        format!("{}m{}s", ms / 60_000, (ms % 60_000) / 1_000)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::priority::KeyPolicy;

    #[test]
    fn a_tenants_buckets_hold_a_minute_and_refill_continuously() {
        let limits = RateLimits::default();
        let t: Arc<str> = "t".into();
        let rates = KeyPolicy::parse(Some("tenant=t rpm=2 tpm=1000"))
            .unwrap()
            .rates;
        let t0 = Instant::now();
        let ok = limits.charge(&t, rates, 400, t0).unwrap();
        assert_eq!(ok.requests.unwrap().remaining, 1);
        assert_eq!(ok.tokens.unwrap().remaining, 600);
        // over the tokens: refused, and nothing taken
        let (why, wait, _) = limits.charge(&t, rates, 700, t0).unwrap_err();
        assert_eq!(why, Refused::Tokens);
        assert_eq!(wait, Duration::from_secs(6), "100 tokens at 1,000 a minute");
        limits.charge(&t, rates, 100, t0).unwrap();
        let (why, wait, report) = limits.charge(&t, rates, 1, t0).unwrap_err();
        assert_eq!((why, wait), (Refused::Requests, Duration::from_secs(30)));
        assert_eq!(report.requests.unwrap().remaining, 0);
        // half a minute later one request is back
        limits
            .charge(&t, rates, 1, t0 + Duration::from_secs(30))
            .unwrap();
        assert_eq!(duration_text(Duration::from_millis(20)), "20ms");
        assert_eq!(duration_text(Duration::from_millis(1500)), "1.5s");
        assert_eq!(duration_text(Duration::from_secs(360)), "6m0s");
        let e = KeyPolicy::parse(Some("rpm=5")).unwrap_err();
        assert!(e.contains("tenant=NAME"), "{e}");
        let e = KeyPolicy::parse(Some("tenant=t rpm=0")).unwrap_err();
        assert!(e.contains("rpm=\"0\""), "{e}");
    }
}
