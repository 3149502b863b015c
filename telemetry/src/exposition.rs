//! Prometheus text exposition for every server, written by the `prometheus` crate's encoder
//! (`# HELP`/`# TYPE`, label escaping, histogram `_bucket`/`_sum`/`_count` with `le="+Inf"`).
//!
//! The servers keep their numbers in their own atomics (nothing on a request path takes a lock or
//! allocates for metrics); at scrape time they describe them here as metric families, and
//! [`Exposition::render`] encodes them. Families without a sample are left out.

use prometheus::proto::{
    Bucket, Counter, Gauge, Histogram, LabelPair, Metric, MetricFamily, MetricType,
};

/// The metric families of one scrape.
#[derive(Debug, Default)]
pub struct Exposition {
    families: Vec<MetricFamily>,
}

/// One family being filled in.
#[derive(Debug)]
pub struct Family<'a> {
    family: &'a mut MetricFamily,
}

impl Exposition {
    pub fn new() -> Self {
        Self::default()
    }

    fn family(&mut self, name: &str, help: &str, kind: MetricType) -> Family<'_> {
        let mut family = MetricFamily::default();
        family.set_name(name.to_string());
        family.set_help(help.to_string());
        family.set_field_type(kind);
        self.families.push(family);
        let family = self.families.last_mut().expect("just pushed");
        Family { family }
    }

    /// A counter family (`name` ends in `_total`, as Prometheus names counters).
    pub fn counter(&mut self, name: &str, help: &str) -> Family<'_> {
        self.family(name, help, MetricType::COUNTER)
    }

    pub fn gauge(&mut self, name: &str, help: &str) -> Family<'_> {
        self.family(name, help, MetricType::GAUGE)
    }

    pub fn histogram(&mut self, name: &str, help: &str) -> Family<'_> {
        self.family(name, help, MetricType::HISTOGRAM)
    }

    /// The Prometheus text format (`text/plain; version=0.0.4`).
    pub fn render(mut self) -> String {
        self.families.retain(|f| !f.get_metric().is_empty());
        let mut out = String::new();
        // Cannot fail: every family has a name and at least one sample.
        let _ = prometheus::TextEncoder::new().encode_utf8(&self.families, &mut out);
        out
    }
}

fn labelled(labels: &[(&str, &str)]) -> Metric {
    let mut m = Metric::default();
    m.set_label(
        labels
            .iter()
            .map(|(name, value)| {
                let mut l = LabelPair::default();
                l.set_name((*name).to_string());
                l.set_value((*value).to_string());
                l
            })
            .collect(),
    );
    m
}

impl Family<'_> {
    /// A counter's or gauge's sample.
    pub fn sample(&mut self, labels: &[(&str, &str)], value: f64) -> &mut Self {
        let mut m = labelled(labels);
        match self.family.get_field_type() {
            MetricType::COUNTER => {
                let mut c = Counter::default();
                c.set_value(value);
                m.set_counter(c);
            }
            _ => {
                let mut g = Gauge::default();
                g.set_value(value);
                m.set_gauge(g);
            }
        }
        self.family.mut_metric().push(m);
        self
    }

    /// A histogram's sample: `(upper bound, count in that bucket alone)` for each finite bucket in
    /// order, the count above the last bound, and the sum of the observations.
    pub fn buckets(
        &mut self,
        labels: &[(&str, &str)],
        bounds: impl IntoIterator<Item = (f64, u64)>,
        above: u64,
        sum: f64,
    ) -> &mut Self {
        let mut cumulative = 0;
        let buckets = bounds
            .into_iter()
            .map(|(le, n)| {
                cumulative += n;
                let mut b = Bucket::default();
                b.set_upper_bound(le);
                b.set_cumulative_count(cumulative);
                b
            })
            .collect();
        let mut h = Histogram::default();
        h.set_bucket(buckets);
        h.set_sample_count(cumulative + above);
        h.set_sample_sum(sum);
        let mut m = labelled(labels);
        m.set_histogram(h);
        self.family.mut_metric().push(m);
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_render_in_the_text_format_with_escaping_and_inf() {
        let mut e = Exposition::new();
        e.counter("x_requests_total", "Requests.")
            .sample(&[("path", "/a\"b\\c\nd")], 3.0)
            .sample(&[], 1.0);
        e.gauge("x_empty", "Left out: no sample.");
        e.histogram("x_seconds", "Latency.").buckets(
            &[("route", "r")],
            [(0.001, 2), (0.01, 1)],
            4,
            0.5,
        );
        let text = e.render();
        assert_eq!(
            text,
            "# HELP x_requests_total Requests.\n\
             # TYPE x_requests_total counter\n\
             x_requests_total{path=\"/a\\\"b\\\\c\\nd\"} 3\n\
             x_requests_total 1\n\
             # HELP x_seconds Latency.\n\
             # TYPE x_seconds histogram\n\
             x_seconds_bucket{route=\"r\",le=\"0.001\"} 2\n\
             x_seconds_bucket{route=\"r\",le=\"0.01\"} 3\n\
             x_seconds_bucket{route=\"r\",le=\"+Inf\"} 7\n\
             x_seconds_sum{route=\"r\"} 0.5\n\
             x_seconds_count{route=\"r\"} 7\n"
        );
    }
}
