//! Router settings: the binary's flags, and what in-process users (tests, `prefixctl up`, bench)
//! fill in (`Config { control_plane: ..., ..Config::default() }`).

use std::path::PathBuf;
use std::time::Duration;

/// prefix-router data plane: a stateless HTTP router for LLM inference fleets.
#[derive(Debug, Clone, clap::Parser)]
#[command(name = "data-plane", version, about)]
pub struct Config {
    /// Address to serve HTTP on (used by the binary; `serve` takes a bound listener).
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub listen: String,

    /// Control-plane gRPC URL to watch routing tables from; several, comma-separated, are tried in
    /// order, moving to the next when a stream breaks (control-plane replicas on one etcd).
    #[arg(long, default_value = "http://127.0.0.1:7070")]
    pub control_plane: String,

    /// This router's node id, reported to the control plane (default: hostname-pid).
    #[arg(long)]
    pub node_id: Option<String>,

    /// Endpoint for OpenAI requests with no x-endpoint-name header and no model naming an endpoint.
    #[arg(long)]
    pub default_endpoint: Option<String>,

    /// File holding the last good routing table (encoded proto): loaded at start, rewritten
    /// atomically after each applied table, so a restarted router serves without the control plane.
    #[arg(long)]
    pub table_cache: Option<PathBuf>,

    /// Largest request body read (bigger: 413).
    #[arg(long, default_value_t = 8 * 1024 * 1024)]
    pub max_body_bytes: usize,

    /// Per-request timeout in milliseconds, from the request's arrival to the end of the response
    /// body (504 if no response head came in time).
    #[arg(long, default_value_t = 300_000)]
    pub request_timeout_ms: u64,

    /// On shutdown, how long in-flight requests may take to finish before connections are closed.
    #[arg(long, default_value_t = 30_000)]
    pub shutdown_grace_ms: u64,

    /// Threads that serve connections, each with its own single-threaded runtime that keeps a
    /// connection (and its upstream connections) for its whole life; 0: one per CPU.
    #[arg(long, default_value_t = 0)]
    pub workers: usize,

    /// File whose first line is this router's token for the control plane (one of its
    /// --auth-token-file tokens, any role); re-read at each reconnect.
    #[arg(long, value_name = "PATH")]
    pub auth_token_file: Option<PathBuf>,

    /// PEM CA certificate to trust for an https:// control plane (default: the system's roots).
    #[arg(long, value_name = "PEM")]
    pub ca_cert: Option<PathBuf>,

    /// PEM client certificate for a control plane that requires mutual TLS.
    #[arg(long, value_name = "PEM", requires = "control_plane_tls_key")]
    pub control_plane_tls_cert: Option<PathBuf>,

    /// PEM private key of --control-plane-tls-cert.
    #[arg(long, value_name = "PEM", requires = "control_plane_tls_cert")]
    pub control_plane_tls_key: Option<PathBuf>,

    /// Client API keys, one per line, each optionally followed by `tenant=NAME priority=P` (flow
    /// control: the key's tenant, and the highest priority its holder may ask for): requests (all
    /// but /healthz, /readyz, /metrics) must carry `Authorization: Bearer KEY` (401 otherwise).
    /// Re-read when the file changes.
    #[arg(long, value_name = "PATH")]
    pub api_key_file: Option<PathBuf>,

    /// Pass the client's `Authorization` header on to instances (by default it is removed).
    #[arg(long)]
    pub forward_authorization: bool,

    /// File whose first line is the key sent to instances as `Authorization: Bearer KEY`
    /// (vLLM's --api-key); replaces any client header.
    #[arg(long, value_name = "PATH")]
    pub upstream_api_key_file: Option<PathBuf>,

    /// Most requests in flight through this router; past it: 503 with Retry-After.
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..=10_000_000))]
    pub max_in_flight: u64,

    /// Flow control (see the README's "When the fleet is full"): with `on`, a request that finds
    /// every instance of its variant at its in-flight limit waits in the router, most urgent
    /// first and fair between tenants, instead of being sent on; `off` sends it anyway.
    #[arg(long, value_enum, default_value = "on")]
    pub flow_control: crate::flow::Switch,

    /// Flow control: requests this router keeps in flight on one instance of a RANDOM or
    /// LEAST_OUTSTANDING_REQUESTS variant (PREFIX_AWARE variants use their concurrency_threshold).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub instance_max_in_flight: u64,

    /// Flow control: the longest a request waits for an instance, in milliseconds (then 429 with
    /// Retry-After); a client may ask for less with `x-prefix-router-queue-timeout-ms`.
    #[arg(long, default_value_t = 5_000, value_parser = clap::value_parser!(u64).range(0..=3_600_000))]
    pub queue_timeout_ms: u64,

    /// Flow control: the most requests waiting in this router; past it sheddable requests are
    /// refused first, then any (503 with Retry-After).
    #[arg(long, default_value_t = 1_024, value_parser = clap::value_parser!(u64).range(0..=10_000_000))]
    pub max_queued: u64,

    /// Most header fields in a request (more: 431).
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u64).range(8..=10_000))]
    pub max_headers: u64,

    /// Largest request head (request line and headers) in bytes (larger: 431).
    #[arg(long, default_value_t = 64 * 1024, value_parser = clap::value_parser!(u64).range(8192..=(16 << 20)))]
    pub max_header_bytes: u64,

    /// Time a client has to send its request head, in milliseconds (slow clients are cut off).
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub header_read_timeout_ms: u64,

    /// Time a client has to send its whole request body, in milliseconds (408 past it).
    #[arg(long, default_value_t = 30_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub body_read_timeout_ms: u64,

    /// PEM certificate chain: serve HTTPS on --listen (with --tls-key).
    #[arg(long, value_name = "PEM", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,

    /// PEM private key of --tls-cert.
    #[arg(long, value_name = "PEM", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,

    /// PEM CA certificates to trust for `https://` instances (default: the system's roots).
    #[arg(long, value_name = "PEM")]
    pub upstream_ca_cert: Option<PathBuf>,

    /// Also serve Envoy's external-processing gRPC API here: the router as a Gateway API
    /// Inference Extension endpoint picker, from the same table and placement (see ext_proc).
    #[arg(long, value_name = "ADDR")]
    pub ext_proc_listen: Option<String>,

    /// Logs and traces (used by the binary; `serve` ignores them).
    #[command(flatten)]
    pub telemetry: telemetry::TelemetryArgs,
}

impl Default for Config {
    fn default() -> Self {
        <Config as clap::Parser>::parse_from(["data-plane"])
    }
}

impl Config {
    /// `--workers`, with 0 resolved to the number of CPUs this process may use.
    pub fn resolved_workers(&self) -> usize {
        match self.workers {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        }
    }

    pub fn request_timeout(&self) -> Duration {
        Duration::from_millis(self.request_timeout_ms)
    }

    /// `--node-id`, else `hostname-pid`, else a random id.
    pub fn resolved_node_id(&self) -> String {
        if let Some(id) = self.node_id.as_ref().filter(|s| !s.is_empty()) {
            return id.clone();
        }
        let host = std::env::var("HOSTNAME")
            .ok()
            .or_else(|| std::fs::read_to_string("/proc/sys/kernel/hostname").ok())
            .map(|h| h.trim().to_string())
            .filter(|h| !h.is_empty());
        match host {
            Some(h) => format!("{h}-{}", std::process::id()),
            None => format!("data-plane-{:016x}", rand::random::<u64>()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[test]
    fn defaults_and_flags() {
        let c = Config::default();
        assert_eq!(c.listen, "127.0.0.1:8080");
        assert_eq!(c.control_plane, "http://127.0.0.1:7070");
        assert_eq!(c.max_body_bytes, 8 << 20);
        assert_eq!(c.request_timeout_ms, 300_000);
        assert!(!c.resolved_node_id().is_empty());
        // one worker thread per CPU unless told
        assert_eq!(
            c.resolved_workers(),
            std::thread::available_parallelism().unwrap().get()
        );
        let c = Config::parse_from(["data-plane", "--node-id", "n1", "--workers", "3"]);
        assert_eq!(c.resolved_node_id(), "n1");
        assert_eq!(c.resolved_workers(), 3);
        // the flags of the placement rules the cost model replaced are gone, not ignored
        assert!(Config::try_parse_from(["data-plane", "--hash-balance-factor", "250"]).is_err());
    }
}
