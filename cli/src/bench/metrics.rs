//! Reading the servers' Prometheus `/metrics` text: counter sums and histogram quantiles.

use anyhow::Context;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// A pooled HTTP/1 client.
pub fn http_client() -> HttpClient {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(1024)
        .build(connector)
}

/// A server answered with an error status.
#[derive(Debug, thiserror::Error)]
#[error("GET {url}: HTTP {status}")]
pub struct HttpStatus {
    pub url: String,
    pub status: http::StatusCode,
}

/// `GET url` as text. A request that fails before any answer is sent once more: servers such
/// as llama-server close idle keep-alive connections without notice, so a pooled connection may
/// be dead.
pub async fn get_text(client: &HttpClient, url: &str) -> anyhow::Result<String> {
    let get = || -> anyhow::Result<_> {
        Ok(client.request(http::Request::get(url).body(Full::new(Bytes::new()))?))
    };
    let resp = match get()?.await {
        Ok(r) => r,
        Err(_) => get()?.await.with_context(|| format!("GET {url}"))?,
    };
    if !resp.status().is_success() {
        return Err(HttpStatus {
            url: url.to_string(),
            status: resp.status(),
        }
        .into());
    }
    let body = resp
        .into_body()
        .collect()
        .await
        .with_context(|| format!("reading {url}"))?
        .to_bytes();
    Ok(String::from_utf8_lossy(&body).into_owned())
}

/// The samples of `name` (any labels), as (labels, value).
fn samples<'a>(text: &'a str, name: &'a str) -> impl Iterator<Item = (&'a str, f64)> + 'a {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(move |line| {
            let rest = line.strip_prefix(name)?;
            let (labels, value) = if let Some(r) = rest.strip_prefix('{') {
                let end = r.find('}')?;
                (&r[..end], r[end + 1..].trim())
            } else if rest.starts_with(' ') {
                ("", rest.trim())
            } else {
                return None;
            };
            let value = value.split_whitespace().next()?.parse().ok()?;
            Some((labels, value))
        })
}

/// Sum of every sample of metric `name`.
pub fn sum(text: &str, name: &str) -> f64 {
    samples(text, name).map(|(_, v)| v).sum()
}

/// Whether the text has at least one sample of metric `name`.
pub fn has(text: &str, name: &str) -> bool {
    samples(text, name).next().is_some()
}

/// Whose metric names an engine's `/metrics` carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum EngineMetrics {
    /// vLLM (and engine-sim): `vllm:prefix_cache_queries_total` / `vllm:prefix_cache_hits_total`.
    #[serde(rename = "vllm")]
    Vllm,
    /// llama.cpp's llama-server (`--metrics`): `llamacpp:prompt_tokens_total` counts the prompt
    /// tokens it computed, `llamacpp:prompt_tokens_cached_total` those it took from its cache.
    #[serde(rename = "llama.cpp")]
    LlamaCpp,
    /// SGLang: `sglang:prompt_tokens_total` (every prompt token) / `sglang:cached_tokens_total`.
    #[serde(rename = "sglang")]
    Sglang,
}

impl EngineMetrics {
    pub fn name(self) -> &'static str {
        match self {
            EngineMetrics::Vllm => "vllm",
            EngineMetrics::LlamaCpp => "llama.cpp",
            EngineMetrics::Sglang => "sglang",
        }
    }
}

/// An engine's own prefix-cache counters, in tokens, as read from one scrape.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CacheCounters {
    /// Prompt tokens the engine was asked to prefill (taken from the cache or computed).
    pub prompt_tokens: f64,
    /// Of those, the tokens it found in its cache.
    pub cached_tokens: f64,
    /// Requests served, when the engine counts them (llama-server does not).
    pub requests: Option<f64>,
}

/// Reads the prefix-cache counters of whichever engine wrote `text`, or `None` when it carries
/// none this knows (then hit rates must come from the responses' `usage`).
pub fn cache_counters(text: &str) -> Option<(EngineMetrics, CacheCounters)> {
    let counted = |names: &[&str]| names.iter().find(|n| has(text, n)).map(|n| sum(text, n));
    if has(text, "vllm:prefix_cache_queries_total") {
        return Some((
            EngineMetrics::Vllm,
            CacheCounters {
                prompt_tokens: sum(text, "vllm:prefix_cache_queries_total"),
                cached_tokens: sum(text, "vllm:prefix_cache_hits_total"),
                requests: counted(&["engine_sim_requests_total", "vllm:request_success_total"]),
            },
        ));
    }
    if has(text, "llamacpp:prompt_tokens_total") && has(text, "llamacpp:prompt_tokens_cached_total")
    {
        let cached = sum(text, "llamacpp:prompt_tokens_cached_total");
        return Some((
            EngineMetrics::LlamaCpp,
            CacheCounters {
                prompt_tokens: sum(text, "llamacpp:prompt_tokens_total") + cached,
                cached_tokens: cached,
                requests: None,
            },
        ));
    }
    if has(text, "sglang:prompt_tokens_total") && has(text, "sglang:cached_tokens_total") {
        return Some((
            EngineMetrics::Sglang,
            CacheCounters {
                prompt_tokens: sum(text, "sglang:prompt_tokens_total"),
                cached_tokens: sum(text, "sglang:cached_tokens_total"),
                requests: counted(&["sglang:num_requests_total"]),
            },
        ));
    }
    None
}

/// A cumulative histogram: upper bounds (seconds) and counts, `+Inf` last.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Histogram {
    pub buckets: Vec<(f64, f64)>,
}

impl Histogram {
    /// Parses `NAME_bucket{...,le="X"} N` lines, summing over the other labels.
    pub fn parse(text: &str, name: &str) -> Self {
        let bucket_name = format!("{name}_bucket");
        let mut buckets: Vec<(f64, f64)> = Vec::new();
        for (labels, value) in samples(text, &bucket_name) {
            let Some(le) = labels
                .split(',')
                .find_map(|kv| kv.trim().strip_prefix("le="))
            else {
                continue;
            };
            let le = le.trim_matches('"');
            let bound = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().unwrap_or(f64::INFINITY)
            };
            match buckets.iter_mut().find(|(b, _)| *b == bound) {
                Some((_, c)) => *c += value,
                None => buckets.push((bound, value)),
            }
        }
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        Histogram { buckets }
    }

    pub fn merge(&mut self, other: &Histogram) {
        for &(b, c) in &other.buckets {
            match self.buckets.iter_mut().find(|(x, _)| *x == b) {
                Some((_, n)) => *n += c,
                None => self.buckets.push((b, c)),
            }
        }
        self.buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    }

    /// `self - earlier`: the observations made between two scrapes.
    pub fn since(&self, earlier: &Histogram) -> Histogram {
        let buckets = self
            .buckets
            .iter()
            .map(|&(b, c)| {
                let before = earlier
                    .buckets
                    .iter()
                    .find(|(x, _)| *x == b)
                    .map(|x| x.1)
                    .unwrap_or(0.0);
                (b, (c - before).max(0.0))
            })
            .collect();
        Histogram { buckets }
    }

    pub fn count(&self) -> f64 {
        self.buckets.last().map(|b| b.1).unwrap_or(0.0)
    }

    /// The `q` quantile in seconds, interpolated linearly inside its bucket (Prometheus'
    /// `histogram_quantile`); `None` without observations.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        let total = self.count();
        if total <= 0.0 {
            return None;
        }
        let rank = q * total;
        let mut prev_bound = 0.0;
        let mut prev_count = 0.0;
        for &(bound, count) in &self.buckets {
            if count >= rank {
                if bound.is_infinite() {
                    return Some(prev_bound);
                }
                let in_bucket = count - prev_count;
                let frac = if in_bucket > 0.0 {
                    (rank - prev_count) / in_bucket
                } else {
                    1.0
                };
                return Some(prev_bound + (bound - prev_bound) * frac);
            }
            prev_bound = bound;
            prev_count = count;
        }
        Some(prev_bound)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "# HELP x\n# TYPE h histogram\n\
        h_bucket{router=\"a\",le=\"0.001\"} 10\nh_bucket{router=\"a\",le=\"0.002\"} 30\nh_bucket{router=\"a\",le=\"+Inf\"} 40\n\
        h_bucket{router=\"b\",le=\"0.001\"} 10\nh_bucket{router=\"b\",le=\"0.002\"} 10\nh_bucket{router=\"b\",le=\"+Inf\"} 10\n\
        c_total{m=\"a\"} 3\nc_total{m=\"b\"} 4.5\nc_total_other 100\n";

    #[test]
    fn sums_counters_over_labels_only_for_that_name() {
        assert_eq!(sum(TEXT, "c_total"), 7.5);
    }

    #[test]
    fn cache_counters_of_each_engine() {
        let vllm = "vllm:prefix_cache_queries_total{engine=\"0\"} 1000\n\
            vllm:prefix_cache_hits_total{engine=\"0\"} 600\n\
            vllm:request_success_total{finished_reason=\"stop\"} 7\n\
            vllm:request_success_total{finished_reason=\"length\"} 3\n";
        assert_eq!(
            cache_counters(vllm),
            Some((
                EngineMetrics::Vllm,
                CacheCounters {
                    prompt_tokens: 1000.0,
                    cached_tokens: 600.0,
                    requests: Some(10.0)
                }
            ))
        );
        // llama-server counts computed and cached prompt tokens apart, and no requests.
        let llama = "# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.\n\
            # TYPE llamacpp:prompt_tokens_total counter\n\
            llamacpp:prompt_tokens_total 400\n\
            llamacpp:prompt_tokens_cached_total 1200\n\
            llamacpp:prompt_tokens_seconds 99\n";
        assert_eq!(
            cache_counters(llama),
            Some((
                EngineMetrics::LlamaCpp,
                CacheCounters {
                    prompt_tokens: 1600.0,
                    cached_tokens: 1200.0,
                    requests: None
                }
            ))
        );
        let sglang = "sglang:prompt_tokens_total{model_name=\"m\"} 500\n\
            sglang:cached_tokens_total{model_name=\"m\"} 100\n\
            sglang:num_requests_total{model_name=\"m\"} 4\n";
        assert_eq!(
            cache_counters(sglang).map(|c| (
                c.0,
                c.1.cached_tokens / c.1.prompt_tokens,
                c.1.requests
            )),
            Some((EngineMetrics::Sglang, 0.2, Some(4.0)))
        );
        // A llama-server too old for the cached-token counter gives no hit rate.
        assert_eq!(cache_counters("llamacpp:prompt_tokens_total 400\n"), None);
        assert_eq!(cache_counters("# nothing\n"), None);
    }

    #[test]
    fn histogram_quantiles() {
        let h = Histogram::parse(TEXT, "h");
        assert_eq!(
            h.buckets,
            vec![(0.001, 20.0), (0.002, 40.0), (f64::INFINITY, 50.0)]
        );
        assert_eq!(h.quantile(0.4), Some(0.001));
        assert_eq!(
            h.quantile(0.2),
            Some(0.0005),
            "interpolated inside the first bucket"
        );
        assert!((h.quantile(0.6).unwrap() - 0.0015).abs() < 1e-12);
        assert_eq!(h.quantile(0.99), Some(0.002));
        let earlier = Histogram {
            buckets: vec![(0.001, 20.0), (0.002, 20.0), (f64::INFINITY, 20.0)],
        };
        let d = h.since(&earlier);
        assert_eq!(d.count(), 30.0);
        assert!(
            (d.quantile(0.5).unwrap() - 0.00175).abs() < 1e-12,
            "15th of 20 in (0.001, 0.002]"
        );
        assert_eq!(Histogram::default().quantile(0.5), None);
    }
}
