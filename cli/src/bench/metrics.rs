//! Reading the servers' Prometheus `/metrics` text: counter sums and histogram quantiles.

use std::borrow::Cow;

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

/// One sample line of the Prometheus text format: `name{label="value",...} value [timestamp]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample<'a> {
    pub name: &'a str,
    /// Label names and values in their order on the line, values unescaped.
    pub labels: Vec<(&'a str, Cow<'a, str>)>,
    pub value: f64,
}

impl Sample<'_> {
    /// The value of label `name`, if the sample carries it.
    pub fn label(&self, name: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.as_ref())
    }
}

/// Every sample in `text`, in order. Comments (`# HELP`, `# TYPE`), blank lines and lines that do
/// not parse are skipped.
pub fn parse(text: &str) -> impl Iterator<Item = Sample<'_>> + '_ {
    text.lines().filter_map(|line| parse_line(line, None))
}

/// The samples of metric `name` (any labels). Labels are parsed only on lines of that name.
pub fn samples<'a>(text: &'a str, name: &'a str) -> impl Iterator<Item = Sample<'a>> + 'a {
    text.lines()
        .filter_map(move |line| parse_line(line, Some(name)))
}

/// One line as a sample (`None`: a comment, a blank line, a line that does not parse, or, with
/// `only`, another metric). Label values may hold any character, `}` and `,` included; `\\`,
/// `\"` and `\n` are unescaped. The value may be `+Inf`, `-Inf` or `NaN`; a timestamp after it is
/// ignored.
fn parse_line<'a>(line: &'a str, only: Option<&str>) -> Option<Sample<'a>> {
    let line = line.trim_start();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let name_end = line
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
        .unwrap_or(line.len());
    let name = &line[..name_end];
    if name.is_empty() || name.starts_with(|c: char| c.is_ascii_digit()) {
        return None;
    }
    if only.is_some_and(|only| only != name) {
        return None;
    }
    let mut rest = line[name_end..].trim_start();
    let mut labels = Vec::new();
    if let Some(after) = rest.strip_prefix('{') {
        rest = parse_labels(after, &mut labels)?;
    } else if rest.len() == line.len() - name_end {
        // No whitespace between the name and the value: not a sample line.
        return None;
    }
    let value = parse_value(rest.split_whitespace().next()?)?;
    Some(Sample {
        name,
        labels,
        value,
    })
}

/// Parses `name="value", ...}` (the text after `{`) into `out`; returns the text after `}`.
fn parse_labels<'a>(mut rest: &'a str, out: &mut Vec<(&'a str, Cow<'a, str>)>) -> Option<&'a str> {
    loop {
        rest = rest.trim_start();
        if let Some(after) = rest.strip_prefix('}') {
            return Some(after);
        }
        let name_end = rest.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))?;
        let name = &rest[..name_end];
        if name.is_empty() {
            return None;
        }
        rest = rest[name_end..].trim_start().strip_prefix('=')?;
        rest = rest.trim_start().strip_prefix('"')?;
        // The value runs to the first quote that no backslash escapes.
        let mut escaped = false;
        let mut has_escapes = false;
        let mut end = None;
        for (i, c) in rest.char_indices() {
            match c {
                _ if escaped => escaped = false,
                '\\' => {
                    escaped = true;
                    has_escapes = true;
                }
                '"' => {
                    end = Some(i);
                    break;
                }
                _ => {}
            }
        }
        let end = end?;
        let raw = &rest[..end];
        let value = if has_escapes {
            Cow::Owned(unescape(raw))
        } else {
            Cow::Borrowed(raw)
        };
        out.push((name, value));
        rest = rest[end + 1..].trim_start();
        if let Some(after) = rest.strip_prefix(',') {
            rest = after;
        } else if !rest.starts_with('}') {
            return None;
        }
    }
}

/// A label value's escapes: `\\` backslash, `\"` quote, `\n` newline; any other escaped
/// character stands for itself.
fn unescape(raw: &str) -> String {
    let mut out = String::with_capacity(raw.len());
    let mut chars = raw.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('n') => out.push('\n'),
            Some(other) => out.push(other),
            None => out.push('\\'),
        }
    }
    out
}

/// A sample value: a float, `+Inf`, `-Inf` or `NaN` (any case, as Rust parses them).
fn parse_value(text: &str) -> Option<f64> {
    text.parse().ok()
}

/// Sum of every sample of metric `name`.
pub fn sum(text: &str, name: &str) -> f64 {
    samples(text, name).map(|s| s.value).sum()
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
        for sample in samples(text, &bucket_name) {
            let (Some(le), value) = (sample.label("le"), sample.value) else {
                continue;
            };
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
    fn parses_names_escaped_labels_and_special_values() {
        let text = "# HELP m_total a \"help\" line\n\
            # TYPE m_total counter\n\
            \n\
            m_total{a=\"x\\\"}, y\",b=\"back\\\\slash\",c=\"line\\nbreak\",} 12 1700000000000\n\
            m_total { a = \"sp\" } +Inf\n\
            plain 3.5e2\n\
            nan_one NaN\n\
            broken{a=\"unterminated} 1\n\
            nolabelvalue{a=x} 1\n\
            novalue{a=\"x\"}\n\
            glued1\n";
        let all: Vec<Sample> = parse(text).collect();
        assert_eq!(all.len(), 4, "{all:?}");
        assert_eq!(all[0].name, "m_total");
        assert_eq!(all[0].label("a"), Some("x\"}, y"));
        assert_eq!(all[0].label("b"), Some("back\\slash"));
        assert_eq!(all[0].label("c"), Some("line\nbreak"));
        assert_eq!(all[0].label("d"), None);
        assert_eq!(all[0].value, 12.0, "the timestamp is not the value");
        assert_eq!(all[1].label("a"), Some("sp"));
        assert_eq!(all[1].value, f64::INFINITY);
        assert_eq!((all[2].name, all[2].value), ("plain", 350.0));
        assert!(all[3].value.is_nan());
        assert_eq!(sum(text, "m_total"), f64::INFINITY);
        assert_eq!(samples(text, "plain").count(), 1);
        assert_eq!(samples(text, "plai").count(), 0);
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
