//! Failed requests during a bench run: counted by status, the first kept verbatim, and the run
//! stopped early (exit code 1) when most requests fail, with a hint where the cause is known.

use std::collections::BTreeMap;

/// A run stops once this many requests finished and more than half of them failed.
pub const STOP_AFTER: usize = 20;

/// The failures of one strategy's run.
#[derive(Debug, Default)]
pub struct Failures {
    finished: usize,
    by_status: BTreeMap<String, usize>,
    first: Option<String>,
}

impl Failures {
    /// Counts a finished request (`error`: what failed, e.g. `HTTP 400 Bad Request: {...}`).
    pub fn count(&mut self, error: Option<&str>) {
        self.finished += 1;
        let Some(e) = error else { return };
        *self.by_status.entry(status_of(e)).or_default() += 1;
        if self.first.is_none() {
            self.first = Some(e.to_string());
        }
    }

    pub fn errors(&self) -> usize {
        self.by_status.values().sum()
    }

    /// More than half of the requests failed, with at least `at_least` finished.
    pub fn most_failed(&self, at_least: usize) -> bool {
        self.finished >= at_least.max(1) && self.errors() * 2 > self.finished
    }

    /// Why the run stopped: counts by status, the first error verbatim, and a hint.
    pub fn explain(&self, strategy: &str, token_scale: f64) -> String {
        let counts = self
            .by_status
            .iter()
            .map(|(s, n)| format!("{s}: {n}"))
            .collect::<Vec<_>>()
            .join(", ");
        let first = self.first.as_deref().unwrap_or("");
        let mut text = format!(
            "{strategy}: {} of {} requests failed ({counts}); the first error: {first}",
            self.errors(),
            self.finished
        );
        if context_exceeded(first) {
            text.push_str(&format!(
                "\nhint: the prompts are longer than the engines' context: start the engines with a \
                 larger context, or shorten every prompt with --token-scale (now {token_scale}; \
                 try {})",
                token_scale / 2.0
            ));
        } else if first.contains("HTTP 404") || first.contains("model") && first.contains("not") {
            text.push_str(
                "\nhint: the engines or router do not serve the model the clients name: pass --model",
            );
        }
        text
    }
}

/// `HTTP 400` from `HTTP 400 Bad Request: ...`; `connection` for failures without a response.
fn status_of(error: &str) -> String {
    match error.strip_prefix("HTTP ") {
        Some(rest) => format!("HTTP {}", rest.split(' ').next().unwrap_or("")),
        None if error.contains("stream") => "broken stream".into(),
        None => "no response".into(),
    }
}

/// An engine's answer that the prompt does not fit its context (llama.cpp, vLLM, OpenAI).
fn context_exceeded(error: &str) -> bool {
    let e = error.to_ascii_lowercase();
    e.contains("exceed_context_size")
        || e.contains("exceeds the available context size")
        || e.contains("maximum context length")
        || e.contains("context_length_exceeded")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn most_failed_needs_enough_requests_and_a_majority() {
        let mut f = Failures::default();
        for _ in 0..10 {
            f.count(Some("HTTP 400 Bad Request: too long"));
        }
        assert!(
            !f.most_failed(STOP_AFTER),
            "10 finished is too few to judge"
        );
        for _ in 0..10 {
            f.count(None);
        }
        assert!(!f.most_failed(STOP_AFTER), "half is not most");
        f.count(Some("error sending request: connection refused"));
        assert!(f.most_failed(STOP_AFTER));
        let text = f.explain("PREFIX_AWARE", 1.0);
        assert!(
            text.starts_with(
                "PREFIX_AWARE: 11 of 21 requests failed (HTTP 400: 10, no response: 1)"
            ),
            "{text}"
        );
        assert!(
            text.contains("the first error: HTTP 400 Bad Request: too long"),
            "{text}"
        );
    }

    #[test]
    fn a_context_too_short_for_the_prompts_is_named_with_the_flag_that_shortens_them() {
        let mut f = Failures::default();
        f.count(Some(
            r#"HTTP 400 Bad Request: {"error":{"code":400,"message":"the request exceeds the available context size, try increasing it","type":"exceed_context_size_error"}}"#,
        ));
        let text = f.explain("RANDOM", 0.5);
        assert!(text.contains("--token-scale (now 0.5; try 0.25)"), "{text}");
        let mut vllm = Failures::default();
        vllm.count(Some(
            "HTTP 400 Bad Request: This model's maximum context length is 2048 tokens.",
        ));
        assert!(vllm.explain("RANDOM", 1.0).contains("--token-scale"));
    }
}
