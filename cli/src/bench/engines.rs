//! `prefixctl bench --engines`: what each engine that already runs did in a strategy's measured
//! window. Prompt and cached tokens come from the engine's own `/metrics` counters when it has
//! them (vLLM, llama.cpp, SGLang names), else from the `usage` its responses carried; requests
//! from its counters when it counts them, else from the router's `x-prefix-router-instance`
//! header on the responses (llama-server counts no requests).

use serde::Serialize;

use super::fleet::{EngineCounters, EngineReading};
use super::load::{PromptUsage, Sample};

/// One engine over one strategy's measured window.
#[derive(Debug, Clone, Serialize)]
pub struct EngineWindow {
    pub url: String,
    /// Where prompt and cached tokens come from: `vllm`, `llama.cpp`, `sglang` (the engine's
    /// `/metrics`) or `responses` (the responses' `usage`).
    pub tokens_from: &'static str,
    /// Where the request count comes from: `metrics` or `router-header`.
    pub requests_from: &'static str,
    pub requests: f64,
    pub prompt_tokens: f64,
    pub cached_tokens: f64,
    pub request_share: f64,
    pub prompt_token_share: f64,
    pub kv_hit_rate: f64,
}

/// Every engine's window for one strategy.
#[derive(Debug, Clone, Serialize)]
pub struct EngineShares {
    pub strategy: String,
    /// The workload's text salt in this strategy's run (fresh texts per strategy).
    pub text_salt: u64,
    pub engines: Vec<EngineWindow>,
}

/// max |share - 1/n| over the `serving` engines' shares (those above zero); 0 when none served.
pub fn share_deviation(serving: &[f64]) -> f64 {
    let n = serving.len().max(1) as f64;
    serving
        .iter()
        .map(|s| (s - 1.0 / n).abs())
        .fold(0.0, f64::max)
}

/// Each engine's window between two scrapes (`begin` empty: from zero), with `measured` the
/// requests that finished in the window and what their responses said.
pub fn windows(
    begin: &[EngineReading],
    end: &[EngineReading],
    measured: &[(&Sample, PromptUsage)],
) -> Vec<EngineWindow> {
    let mut out: Vec<EngineWindow> = end
        .iter()
        .enumerate()
        .map(|(i, e)| {
            let served = || {
                measured
                    .iter()
                    .filter(move |(s, _)| s.error.is_none() && s.instance == e.url)
            };
            let before = match begin.get(i) {
                Some(b) => b.counters,
                None if begin.is_empty() => e.counters.map(|(m, _)| (m, Default::default())),
                None => None,
            };
            let counted = match (before, e.counters) {
                (Some((m0, b)), Some((m1, a))) if m0 == m1 => Some((m1, b, a)),
                _ => None,
            };
            let (tokens_from, prompt_tokens, cached_tokens) = match counted {
                Some((m, b, a)) => (
                    m.name(),
                    a.prompt_tokens - b.prompt_tokens,
                    a.cached_tokens - b.cached_tokens,
                ),
                None => (
                    "responses",
                    served()
                        .map(|(_, u)| u.prompt_tokens.unwrap_or(0) as f64)
                        .sum(),
                    served()
                        .map(|(_, u)| u.cached_tokens.unwrap_or(0) as f64)
                        .sum(),
                ),
            };
            let (requests_from, requests) = match counted {
                Some((_, b, a)) if a.requests.is_some() => (
                    "metrics",
                    a.requests.unwrap_or(0.0) - b.requests.unwrap_or(0.0),
                ),
                _ => ("router-header", served().count() as f64),
            };
            EngineWindow {
                url: e.url.clone(),
                tokens_from,
                requests_from,
                requests,
                prompt_tokens,
                cached_tokens,
                request_share: 0.0,
                prompt_token_share: 0.0,
                kv_hit_rate: if prompt_tokens > 0.0 {
                    cached_tokens / prompt_tokens
                } else {
                    0.0
                },
            }
        })
        .collect();
    let requests: f64 = out.iter().map(|w| w.requests).sum();
    let prompt: f64 = out.iter().map(|w| w.prompt_tokens).sum();
    for w in &mut out {
        w.request_share = if requests > 0.0 {
            w.requests / requests
        } else {
            0.0
        };
        w.prompt_token_share = if prompt > 0.0 {
            w.prompt_tokens / prompt
        } else {
            0.0
        };
    }
    out
}

/// The windows as the report's engine counters (the window's end, counted from zero).
pub fn counters(windows: &[EngineWindow]) -> (Vec<EngineCounters>, Vec<EngineCounters>) {
    let end = windows
        .iter()
        .map(|w| EngineCounters {
            queries: w.prompt_tokens,
            hits: w.cached_tokens,
            requests: w.requests,
        })
        .collect::<Vec<_>>();
    (vec![EngineCounters::default(); end.len()], end)
}

fn rows(shares: &[EngineShares]) -> Vec<Vec<String>> {
    let mut rows = Vec::new();
    for s in shares {
        for (i, w) in s.engines.iter().enumerate() {
            rows.push(vec![
                if i == 0 {
                    s.strategy.clone()
                } else {
                    String::new()
                },
                w.url.clone(),
                format!("{:.1}%", w.request_share * 100.0),
                format!("{:.1}%", w.prompt_token_share * 100.0),
                format!("{:.1}%", w.kv_hit_rate * 100.0),
                format!("{:.0}", w.requests),
                format!("{:.0}", w.prompt_tokens),
                format!("{}, {}", w.tokens_from, w.requests_from),
            ]);
        }
    }
    rows
}

const HEADER: [&str; 8] = [
    "strategy",
    "engine",
    "requests",
    "prompt tokens",
    "KV hit",
    "n requests",
    "n prompt tokens",
    "counted from",
];

/// The per-engine table printed after the summary.
pub fn print_table(shares: &[EngineShares]) {
    println!("per engine (share of requests, share of prompt tokens, hit rate):");
    for line in super::table::aligned(&HEADER, rows(shares)) {
        println!("{line}");
    }
}

/// The per-engine table in Markdown.
pub fn markdown(shares: &[EngineShares]) -> String {
    let mut s =
        String::from("\nPer engine (share of requests, share of prompt tokens, hit rate):\n\n");
    s.push_str(&format!("| {} |\n", HEADER.join(" | ")));
    s.push_str(&format!("|{}\n", "---|".repeat(HEADER.len())));
    for r in rows(shares) {
        s.push_str(&format!("| {} |\n", r.join(" | ")));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::metrics::{CacheCounters, EngineMetrics};
    use std::time::{Duration, Instant};

    fn sample(instance: &str) -> Sample {
        Sample {
            client: 0,
            done: Instant::now(),
            ttft: Duration::from_millis(5),
            latency: Duration::from_millis(9),
            output_tokens: 4,
            instance: instance.into(),
            affinity: 0,
            error: None,
        }
    }

    fn llama(prompt: f64, cached: f64) -> Option<(EngineMetrics, CacheCounters)> {
        Some((
            EngineMetrics::LlamaCpp,
            CacheCounters {
                prompt_tokens: prompt,
                cached_tokens: cached,
                requests: None,
            },
        ))
    }

    #[test]
    fn engine_counters_first_then_responses() {
        let reading = |url: &str, counters| EngineReading {
            url: url.into(),
            counters,
        };
        let begin = vec![
            reading("http://a", llama(100.0, 50.0)),
            reading("http://b", None),
        ];
        let end = vec![
            reading("http://a", llama(1100.0, 850.0)),
            reading("http://b", None),
        ];
        let (a, b) = (sample("http://a"), sample("http://b"));
        let mut failed = sample("http://b");
        failed.error = Some("HTTP 502".into());
        let usage = |p, c| PromptUsage {
            prompt_tokens: Some(p),
            cached_tokens: Some(c),
        };
        let measured = vec![
            (&a, usage(7, 7)),
            (&a, usage(7, 7)),
            (&a, usage(7, 7)),
            (&b, usage(600, 300)),
            (&failed, usage(900, 900)),
        ];
        let w = windows(&begin, &end, &measured);
        // a: its own counters for tokens (not the responses' 21), the router's header for requests.
        assert_eq!(
            (w[0].tokens_from, w[0].requests_from),
            ("llama.cpp", "router-header")
        );
        assert_eq!(
            (w[0].prompt_tokens, w[0].cached_tokens, w[0].requests),
            (1000.0, 800.0, 3.0)
        );
        assert!((w[0].kv_hit_rate - 0.8).abs() < 1e-12);
        // b: no counters, so the usage of its successful responses.
        assert_eq!(w[1].tokens_from, "responses");
        assert_eq!(
            (w[1].prompt_tokens, w[1].cached_tokens, w[1].requests),
            (600.0, 300.0, 1.0)
        );
        assert_eq!((w[0].request_share, w[1].request_share), (0.75, 0.25));
        assert!((w[0].prompt_token_share - 1000.0 / 1600.0).abs() < 1e-12);
        let (zero, end) = counters(&w);
        assert_eq!(zero, vec![EngineCounters::default(); 2]);
        assert_eq!(
            end[0],
            EngineCounters {
                queries: 1000.0,
                hits: 800.0,
                requests: 3.0
            }
        );
    }
}
