//! `prefixctl bench`'s timeline: a strategy's whole run (warm-up included) cut into windows of
//! [`WINDOW_S`] simulated seconds from its first request, each with the engines' own hit rate,
//! the requests served and the largest share deviation, so how fast a fresh fleet of routers
//! reaches its steady state is read from the engines, not guessed from one window.

use std::time::{Duration, Instant};

use serde::Serialize;

use super::engines::{self, share_deviation};
use super::fleet::EngineReading;
use super::load::{PromptUsage, Sample};

/// A window's length in simulated seconds.
pub const WINDOW_S: f64 = 10.0;

/// How far below the steady hit rate (the run's last half) a window may be and count as
/// converged: 2 points.
pub const CONVERGED_WITHIN: f64 = 0.02;

/// One window of the run.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct TimelineWindow {
    /// The window's end, simulated seconds since the run's first request.
    pub end_s: f64,
    /// Requests that finished in the window without an error.
    pub requests: usize,
    pub throughput_rps: f64,
    /// Token-level, the engines' own counters (or their responses' `usage`) over the window.
    pub kv_hit_rate: f64,
    /// max |share - 1/n| over the engines that served in the window.
    pub max_share_deviation: f64,
}

/// The run's windows and when the hit rate reached its steady state.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Timeline {
    pub window_s: f64,
    pub windows: Vec<TimelineWindow>,
    /// Simulated seconds from the first request to the start of the first window whose hit
    /// rate came within [`CONVERGED_WITHIN`] of the run's last half (or above it); `None` with
    /// fewer than two windows.
    pub converged_s: Option<f64>,
    /// The hit rate over the run's last half of windows (token-weighted).
    pub steady_kv_hit_rate: f64,
    /// Windows after that one that fell more than [`CONVERGED_WITHIN`] below it again.
    pub dips: usize,
    /// The lowest hit rate of the windows after that one.
    pub lowest_after_kv_hit_rate: Option<f64>,
}

/// Scrapes the engines every window while a strategy runs.
pub struct TimelineRun {
    start: Instant,
    every: Duration,
    time_scale: f64,
    next: Instant,
    scrapes: Vec<(Instant, Vec<EngineReading>)>,
}

impl TimelineRun {
    pub fn new(start: Instant, time_scale: f64) -> Self {
        TimelineRun {
            start,
            every: Duration::from_secs_f64(WINDOW_S * time_scale),
            time_scale,
            next: start,
            scrapes: Vec::new(),
        }
    }

    /// Whether a scrape is due at `now`.
    pub fn due(&self, now: Instant) -> bool {
        now >= self.next
    }

    pub fn record(&mut self, at: Instant, readings: Vec<EngineReading>) {
        self.scrapes.push((at, readings));
        self.next = self.start + self.every * self.scrapes.len() as u32;
    }

    /// The run's last scrape, taken as it ended: one less than half a window after the scrape
    /// before replaces it, so no window at the end is a sliver.
    pub fn record_end(&mut self, at: Instant, readings: Vec<EngineReading>) {
        if self.scrapes.len() >= 2
            && self
                .scrapes
                .last()
                .is_some_and(|(last, _)| at.duration_since(*last) < self.every / 2)
        {
            self.scrapes.pop();
        }
        self.scrapes.push((at, readings));
    }

    /// The timeline of the scrapes taken, the requests that finished between them and what their
    /// responses said.
    pub fn finish(self, samples: &[Sample], usages: &[PromptUsage]) -> Timeline {
        let mut windows = Vec::new();
        let mut tokens = Vec::new();
        for pair in self.scrapes.windows(2) {
            let ((from, begin), (to, end)) = (&pair[0], &pair[1]);
            let in_window: Vec<(&Sample, PromptUsage)> = samples
                .iter()
                .zip(usages.iter().copied())
                .filter(|(s, _)| s.done > *from && s.done <= *to)
                .collect();
            let engines = engines::windows(begin, end, &in_window);
            let prompt: f64 = engines.iter().map(|w| w.prompt_tokens).sum();
            let cached: f64 = engines.iter().map(|w| w.cached_tokens).sum();
            let requests = in_window.iter().filter(|(s, _)| s.error.is_none()).count();
            // an engine that served nothing in the window is not in the variant then
            let serving: Vec<f64> = engines
                .iter()
                .map(|w| w.request_share)
                .filter(|&s| s > 0.0)
                .collect();
            let simulated = to.duration_since(*from).as_secs_f64() / self.time_scale;
            windows.push(TimelineWindow {
                end_s: to.duration_since(self.start).as_secs_f64() / self.time_scale,
                requests,
                throughput_rps: requests as f64 / simulated.max(1e-9),
                kv_hit_rate: if prompt > 0.0 { cached / prompt } else { 0.0 },
                max_share_deviation: share_deviation(&serving),
            });
            tokens.push((prompt, cached));
        }
        let half = windows.len() / 2;
        let (prompt, cached) = tokens[half..]
            .iter()
            .fold((0.0, 0.0), |a, t| (a.0 + t.0, a.1 + t.1));
        let steady = if prompt > 0.0 { cached / prompt } else { 0.0 };
        let near = |w: &TimelineWindow| w.kv_hit_rate >= steady - CONVERGED_WITHIN;
        let first = (windows.len() >= 2)
            .then(|| windows.iter().position(near))
            .flatten();
        let converged_s = first.map(|i| match i {
            0 => 0.0,
            i => windows[i - 1].end_s,
        });
        let later = first.map_or(&windows[..0], |i| &windows[i + 1..]);
        let dips = later.iter().filter(|w| !near(w)).count();
        let lowest_after = later.iter().map(|w| w.kv_hit_rate).reduce(f64::min);
        Timeline {
            window_s: WINDOW_S,
            windows,
            converged_s,
            steady_kv_hit_rate: steady,
            dips,
            lowest_after_kv_hit_rate: lowest_after,
        }
    }
}

impl Timeline {
    /// One line for the report: each window's hit rate and when it converged.
    pub fn summary(&self) -> Option<String> {
        let converged = self.converged_s?;
        let hits: Vec<String> = self
            .windows
            .iter()
            .map(|w| format!("{:.0}", w.kv_hit_rate * 100.0))
            .collect();
        let dips = match (self.dips, self.lowest_after_kv_hit_rate) {
            (0, _) | (_, None) => "none below it later".to_string(),
            (n, Some(low)) => format!("{n} later window(s) below it (lowest {:.0}%)", low * 100.0),
        };
        Some(format!(
            "hit per {:.0} s {}%; within {:.0} pt of the last half's {:.1}% from {:.0} s, {dips}",
            self.window_s,
            hits.join(", "),
            CONVERGED_WITHIN * 100.0,
            self.steady_kv_hit_rate * 100.0,
            converged
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::metrics::{CacheCounters, EngineMetrics};

    fn reading(url: &str, prompt: f64, cached: f64, requests: f64) -> EngineReading {
        EngineReading {
            url: url.into(),
            counters: Some((
                EngineMetrics::Vllm,
                CacheCounters {
                    prompt_tokens: prompt,
                    cached_tokens: cached,
                    requests: Some(requests),
                },
            )),
        }
    }

    #[test]
    fn windows_read_the_engines_between_scrapes_and_convergence_is_the_first_window_near_the_last_half(
    ) {
        let start = Instant::now();
        let mut run = TimelineRun::new(start, 0.01);
        assert!(run.due(start));
        // cumulative counters of two engines at 0, 10, 20, 30, 40 simulated seconds: the hit
        // rate per window 20%, 90%, 60% (a dip), 95%, 95%
        let steps = [
            (0.2, 10.0, 10.0),
            (0.9, 10.0, 10.0),
            (0.6, 15.0, 5.0),
            (0.95, 10.0, 10.0),
            (0.95, 10.0, 10.0),
        ];
        let (mut p, mut c, mut r0, mut r1) = (0.0, 0.0, 0.0, 0.0);
        run.record(
            start,
            vec![reading("a", 0.0, 0.0, 0.0), reading("b", 0.0, 0.0, 0.0)],
        );
        for (i, (hit, a, b)) in steps.iter().enumerate() {
            p += 1000.0;
            c += 1000.0 * hit;
            r0 += a;
            r1 += b;
            let at = start + Duration::from_millis(100 * (i as u64 + 1));
            assert!(!run.due(at - Duration::from_millis(1)));
            run.record(
                at,
                vec![
                    reading("a", p / 2.0, c / 2.0, r0),
                    reading("b", p / 2.0, c / 2.0, r1),
                ],
            );
        }
        // the run ends 2 simulated seconds after the last scrape: a sliver folded into the last window
        p += 100.0;
        c += 95.0;
        run.record_end(
            start + Duration::from_millis(520),
            vec![
                reading("a", p / 2.0, c / 2.0, r0 + 1.0),
                reading("b", p / 2.0, c / 2.0, r1 + 1.0),
            ],
        );
        let t = run.finish(&[], &[]);
        assert_eq!(t.windows.len(), 5);
        let hits: Vec<f64> = t
            .windows
            .iter()
            .map(|w| (w.kv_hit_rate * 100.0).round())
            .collect();
        assert_eq!(hits, [20.0, 90.0, 60.0, 95.0, 95.0]);
        assert!(
            (t.windows[2].max_share_deviation - 0.25).abs() < 1e-9,
            "{:?}",
            t.windows[2]
        );
        assert!(
            (t.windows[4].end_s - 52.0).abs() < 1e-6,
            "{:?}",
            t.windows[4]
        );
        // the last half (windows 3-5, the sliver's tokens in the last) hit 83.7%: the second
        // window (from 10 s) is the first within 2 pt of it; the third dips below it again
        assert!((t.steady_kv_hit_rate - 2595.0 / 3100.0).abs() < 1e-9);
        assert_eq!(t.converged_s, Some(10.0));
        let lowest = t.lowest_after_kv_hit_rate.map(|h| (h * 100.0).round());
        assert_eq!((t.dips, lowest), (1, Some(60.0)));
        let line = t.summary().unwrap();
        assert!(
            line.contains(
                "20, 90, 60, 95, 95%; within 2 pt of the last half's 83.7% from 10 s, \
                 1 later window(s) below it (lowest 60%)"
            ),
            "{line}"
        );
    }

    #[test]
    fn a_run_shorter_than_two_windows_has_no_convergence() {
        let start = Instant::now();
        let mut run = TimelineRun::new(start, 1.0);
        run.record(start, vec![reading("a", 0.0, 0.0, 0.0)]);
        run.record(
            start + Duration::from_secs(10),
            vec![reading("a", 100.0, 50.0, 3.0)],
        );
        let t = run.finish(&[], &[]);
        assert_eq!(t.windows.len(), 1);
        assert_eq!(t.converged_s, None);
        assert_eq!(t.summary(), None);
    }
}
