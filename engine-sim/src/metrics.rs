//! `GET /metrics`: Prometheus text exposition (format 0.0.4) with vLLM's metric names, each
//! labelled `model_name="..."` as vLLM does.
//!
//! TTFT is observed in wall-clock seconds as a client sees it, i.e. after `--time-scale`.

use telemetry::exposition::Exposition;

use crate::engine::Engine;

/// The whole exposition of one engine (encoded by the `prometheus` crate, see
/// [`telemetry::exposition`]).
pub(crate) fn render(engine: &Engine) -> String {
    let s = engine.stats();
    let model = engine.config().model_name.as_str();
    let labels = [("model_name", model)];
    let mut out = Exposition::new();
    let gauges: [(&str, &str, f64); 4] = [
        (
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            s.running as f64,
        ),
        (
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            s.waiting as f64,
        ),
        (
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            s.kv_cache_usage,
        ),
        (
            "engine_sim_cached_blocks",
            "KV-cache blocks holding a cached prefix, pinned or evictable.",
            s.cached_blocks as f64,
        ),
    ];
    for (name, help, value) in gauges {
        out.gauge(name, help).sample(&labels, value);
    }
    let counters: [(&str, &str, u64); 7] = [
        (
            "vllm:prefix_cache_queries_total",
            "Prefix cache queries, in terms of number of queried tokens.",
            s.prefix_cache_queries,
        ),
        (
            "vllm:prefix_cache_hits_total",
            "Prefix cache hits, in terms of number of cached tokens.",
            s.prefix_cache_hits,
        ),
        (
            "vllm:prompt_tokens_total",
            "Number of prefill tokens processed.",
            s.prompt_tokens,
        ),
        (
            "vllm:generation_tokens_total",
            "Number of generation tokens processed.",
            s.generation_tokens,
        ),
        (
            "vllm:request_success_total",
            "Count of successfully processed requests.",
            s.requests_succeeded,
        ),
        (
            "engine_sim_requests_total",
            "Completion requests received by this engine, any outcome.",
            s.requests_total,
        ),
        (
            "engine_sim_injected_failures_total",
            "Completion requests answered 500 by --fail-rate.",
            s.failures_injected,
        ),
    ];
    for (name, help, value) in counters {
        out.counter(name, help).sample(&labels, value as f64);
    }
    if let Some(outbox) = &engine.kv_events {
        let c = &outbox.counters;
        let kv: [(&str, &str, u64); 2] = [
            (
                "engine_sim_kv_events_published_total",
                "KV-event batches published (--kv-events-endpoint).",
                c.published_batches
                    .load(std::sync::atomic::Ordering::Relaxed),
            ),
            (
                "engine_sim_kv_events_dropped_total",
                "KV-event batches dropped because the publisher's queue was full.",
                c.dropped_batches.load(std::sync::atomic::Ordering::Relaxed),
            ),
        ];
        for (name, help, value) in kv {
            out.counter(name, help).sample(&labels, value as f64);
        }
    }
    let h = &engine.ttft;
    let counts = h.counts();
    out.histogram(
        "vllm:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
    )
    .buckets(
        &labels,
        h.bounds().iter().copied().zip(counts.iter().copied()),
        counts[h.bounds().len()],
        h.sum_seconds(),
    );
    out.render()
}
