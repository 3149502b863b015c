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

pub async fn get_text(client: &HttpClient, url: &str) -> anyhow::Result<String> {
    let req = http::Request::get(url).body(Full::new(Bytes::new()))?;
    let resp = client
        .request(req)
        .await
        .with_context(|| format!("GET {url}"))?;
    anyhow::ensure!(
        resp.status().is_success(),
        "GET {url}: HTTP {}",
        resp.status()
    );
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
