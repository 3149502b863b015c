//! Flags of the `engine-sim` binary, also the in-process configuration of an engine.

use std::time::Duration;

/// Configuration of one simulated engine. Every flag has a default calibrated to Llama 3.1 70B
/// served by vLLM (prefix caching on) on one 8xH100 node: ~60 ms TTFT on a full prefix hit,
/// ~280 ms on an 8,000-token miss, 25 ms between output tokens.
///
/// In-process users start from `Config::default()` (the flag defaults) and override fields.
#[derive(Debug, Clone, PartialEq, clap::Parser)]
#[command(
    name = "engine-sim",
    version,
    about = "vLLM-like simulated model server with a prefix KV cache (OpenAI-compatible HTTP API)",
    long_about = "vLLM-like simulated model server with a prefix KV cache.\n\n\
        Serves POST /v1/chat/completions and /v1/completions (streaming and not), GET /metrics \
        (vLLM metric names), GET /health and GET /v1/models. No model runs: the output is filler \
        text, and the timing follows vLLM's mechanics (FIFO admission up to --max-num-seqs, one \
        shared prefill lane that only computes uncached tokens, a per-token decode interval). \
        A token is 4 bytes of the prompt."
)]
pub struct Config {
    /// Address to listen on, HOST:PORT (port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:9000")]
    pub listen: String,

    /// Model name served by /v1/models and used as the `model_name` label of the metrics.
    /// Requests may name any model; responses echo the requested name.
    #[arg(long, default_value = "llama-3.1-70b")]
    pub model_name: String,

    /// Capacity of the prefix KV cache in tokens (whole blocks: capacity / block size).
    #[arg(long, default_value_t = 200_000)]
    pub kv_capacity_tokens: u64,

    /// Tokens per KV-cache block; only full blocks are cached (a block is 4 x this many bytes).
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=1_048_576))]
    pub block_size: u32,

    /// Prefill throughput of the engine's single prefill lane, in uncached prompt tokens per second.
    #[arg(long, default_value_t = 36_000.0, value_parser = parse_positive)]
    pub prefill_tokens_per_s: f64,

    /// Fixed part of every time to first token, in milliseconds (scheduling, first decode step).
    #[arg(long, default_value_t = 60.0, value_parser = parse_non_negative)]
    pub ttft_overhead_ms: f64,

    /// Interval between output tokens, in milliseconds, for a batch of one.
    #[arg(long, default_value_t = 25.0, value_parser = parse_non_negative)]
    pub itl_ms: f64,

    /// Growth of the token interval with the running batch: itl * (1 + factor * running).
    #[arg(long, default_value_t = 0.002, value_parser = parse_non_negative)]
    pub itl_batch_factor: f64,

    /// Requests running at once; the rest wait in FIFO order (vllm:num_requests_waiting).
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_num_seqs: u32,

    /// Longest prompt + completion in tokens; longer requests get HTTP 400 like vLLM's.
    #[arg(long, default_value_t = 131_072, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_model_len: u64,

    /// Multiplies every simulated duration (0.1 runs ten times faster than real time).
    #[arg(long, default_value_t = 1.0, value_parser = parse_positive)]
    pub time_scale: f64,

    /// Seed of every random choice (generated words, request ids, injected failures).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,

    /// Fault injection: fraction of completion requests answered with HTTP 500 (0..=1).
    #[arg(long, default_value_t = 0.0, value_parser = parse_fraction)]
    pub fail_rate: f64,

    /// Fault injection: delay before the first response byte of a completion, in milliseconds
    /// (scaled by --time-scale like every duration).
    #[arg(long, default_value_t = 0.0, value_parser = parse_non_negative)]
    pub stall_ms: f64,

    /// Largest request body accepted, in bytes; larger bodies get HTTP 413.
    #[arg(long, default_value_t = 16 * 1024 * 1024)]
    pub max_body_bytes: usize,

    /// Require `Authorization: Bearer KEY` on every `/v1/*` request, as vLLM's `--api-key` does
    /// (401 `{"error": "Unauthorized"}` otherwise; `/health` and `/metrics` stay open).
    #[arg(long, value_name = "KEY", env = "VLLM_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,

    /// The model's `tokenizer.json` (its chat template read from `chat_template.jinja` or
    /// `tokenizer_config.json` beside it): prompts become the token ids vLLM computes, cache blocks
    /// are --block-size ids, and token counts are in those tokens. Without it a token is 4 bytes of
    /// the canonical prompt.
    #[arg(long, value_name = "PATH")]
    pub tokenizer: Option<std::path::PathBuf>,

    /// Publish the cache's KV events in vLLM's wire format on a ZeroMQ PUB socket bound here
    /// (`BlockStored` for each block stored, `BlockRemoved` for each eviction). Needs --tokenizer:
    /// the events carry token ids.
    #[arg(long, value_name = "tcp://HOST:PORT", requires = "tokenizer")]
    pub kv_events_endpoint: Option<String>,

    /// Serve replays of the last --kv-events-buffer-steps batches on a ZeroMQ ROUTER socket bound
    /// here, as vLLM's ZmqEventPublisher does.
    #[arg(long, value_name = "tcp://HOST:PORT", requires = "kv_events_endpoint")]
    pub kv_events_replay_endpoint: Option<String>,

    /// The topic of every KV-event message (vLLM's `topic`; its recipes use "kv").
    #[arg(long, default_value = "kv")]
    pub kv_events_topic: String,

    /// Batches kept for replay (vLLM's `buffer_steps`).
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub kv_events_buffer_steps: u64,

    /// Logs and traces (used by the binary; `serve` ignores them).
    #[command(flatten)]
    pub telemetry: telemetry::TelemetryArgs,
}

impl Default for Config {
    /// The flag defaults.
    fn default() -> Self {
        <Self as clap::Parser>::parse_from(["engine-sim"])
    }
}

impl Config {
    /// Cache capacity in whole blocks.
    pub fn kv_capacity_blocks(&self) -> usize {
        usize::try_from(self.kv_capacity_tokens / u64::from(self.block_size.max(1)))
            .unwrap_or(usize::MAX)
    }

    /// Bytes of prompt text in one cache block.
    pub fn block_bytes(&self) -> usize {
        self.block_size.max(1) as usize * crate::BYTES_PER_TOKEN
    }

    /// A simulated duration given in milliseconds, after `--time-scale`.
    pub(crate) fn scaled_ms(&self, ms: f64) -> Duration {
        scaled_secs(ms / 1000.0, self.time_scale)
    }
}

/// `secs * scale` as a Duration, saturating instead of panicking on absurd values.
pub(crate) fn scaled_secs(secs: f64, scale: f64) -> Duration {
    let v = secs * scale;
    if v.is_finite() && v > 0.0 {
        Duration::try_from_secs_f64(v).unwrap_or(Duration::MAX)
    } else {
        Duration::ZERO
    }
}

fn parse_f64(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|e| format!("{s:?} is not a number: {e}"))?;
    if !v.is_finite() {
        return Err(format!("{s:?} is not a finite number"));
    }
    Ok(v)
}

fn parse_non_negative(s: &str) -> Result<f64, String> {
    let v = parse_f64(s)?;
    if v < 0.0 {
        return Err(format!("{s:?} must be >= 0"));
    }
    Ok(v)
}

fn parse_positive(s: &str) -> Result<f64, String> {
    let v = parse_f64(s)?;
    if v <= 0.0 {
        return Err(format!("{s:?} must be > 0"));
    }
    Ok(v)
}

fn parse_fraction(s: &str) -> Result<f64, String> {
    let v = parse_f64(s)?;
    if !(0.0..=1.0).contains(&v) {
        return Err(format!("{s:?} must be between 0 and 1"));
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[test]
    fn defaults_match_the_calibration() {
        let c = Config::default();
        assert_eq!(c.listen, "127.0.0.1:9000");
        assert_eq!(c.block_size, 16);
        assert_eq!(c.kv_capacity_blocks(), 200_000 / 16);
        assert_eq!(c.block_bytes(), 64);
        // 8,000-token miss: overhead + prefill ~ 280 ms.
        let miss_ms = c.ttft_overhead_ms + 8000.0 / c.prefill_tokens_per_s * 1000.0;
        assert!((270.0..=290.0).contains(&miss_ms), "{miss_ms}");
    }

    #[test]
    fn flags_are_validated() {
        assert!(Config::try_parse_from(["engine-sim", "--block-size", "0"]).is_err());
        assert!(Config::try_parse_from(["engine-sim", "--time-scale", "-1"]).is_err());
        assert!(Config::try_parse_from(["engine-sim", "--fail-rate", "1.5"]).is_err());
        assert!(Config::try_parse_from(["engine-sim", "--max-num-seqs", "0"]).is_err());
        let e = Config::try_parse_from(["engine-sim", "--kv-events-endpoint", "tcp://*:5557"])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--tokenizer") && e.contains("--kv-events-endpoint"),
            "{e}"
        );
        let c =
            Config::try_parse_from(["engine-sim", "--time-scale", "0.1", "--seed", "7"]).unwrap();
        assert_eq!(c.time_scale, 0.1);
        assert_eq!(c.scaled_ms(250.0), Duration::from_millis(25));
    }
}
