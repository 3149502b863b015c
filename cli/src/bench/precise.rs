//! PREFIX_AWARE precise in the bench: the engines' tokenizer and their KV events.
//!
//! A precise run (`--strategies PREFIX_AWARE_PRECISE`) starts its engine-sims with `--tokenizer`
//! and KV events on ports derived from each engine's HTTP port ([`EVENTS_PORT_OFFSET`]), and
//! names both in the variant's `prefix_aware_routing_config` (`kv_events`, `tokenizer`), so every
//! router subscribes to every engine and routes on an exact index of what each holds. Whenever
//! an invocation has a precise run, every engine-sim of every run tokenizes with the same
//! tokenizer (the others publish nothing and their routers infer), so precise and approximate
//! differ only in the events.
//!
//! Without `--tokenizer` the bench writes chat-tokens' tiny ByteLevel BPE (600 ids, a ChatML
//! template) into a temporary directory. Its ids are shorter than the workloads' tokens (4 bytes):
//! the engines' KV capacity and prefill rate are scaled by the measured ids per workload token
//! ([`SimTokenizer::ids_per_token`]), so an engine holds the same text and spends the same
//! simulated time on it as without a tokenizer.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;

use super::metrics;
use super::workload::{Workload, BYTES_PER_TOKEN};

/// The tiny tokenizer's files (chat-tokens' test fixture).
const TINY_FILES: [(&str, &str); 3] = [
    (
        "tokenizer.json",
        include_str!("../../../chat-tokens/tests/fixtures/tiny/tokenizer.json"),
    ),
    (
        "chat_template.jinja",
        include_str!("../../../chat-tokens/tests/fixtures/tiny/chat_template.jinja"),
    ),
    (
        "tokenizer_config.json",
        include_str!("../../../chat-tokens/tests/fixtures/tiny/tokenizer_config.json"),
    ),
];

/// An engine's KV events are published on `tcp://127.0.0.1:{port + EVENTS_PORT_OFFSET}` and
/// replayed on the port after it, `port` being its HTTP port; the routers' templates say the same.
pub const EVENTS_PORT_OFFSET: u16 = 1000;

/// The variant's `kv_events.endpoint` template.
pub fn endpoint_template() -> String {
    format!("tcp://{{host}}:{{port+{EVENTS_PORT_OFFSET}}}")
}

/// The variant's `kv_events.replay_endpoint` template.
pub fn replay_endpoint_template() -> String {
    format!("tcp://{{host}}:{{port+{}}}", EVENTS_PORT_OFFSET + 1)
}

/// The topic the engine-sims publish on and the routers subscribe to.
pub const TOPIC: &str = "kv";

/// The tokenizer an invocation's engine-sims (and precise routers) use.
#[derive(Debug, Clone)]
pub struct BenchTokenizer {
    /// `tokenizer.json`; the chat template beside it.
    pub path: PathBuf,
    /// Whether it is chat-tokens' tiny fixture written by the bench.
    pub tiny: bool,
    /// The temporary directory of the tiny fixture, removed when the last clone drops.
    _dir: Option<Arc<tempfile::TempDir>>,
}

impl BenchTokenizer {
    /// `path`, a `tokenizer.json` with its chat template beside it.
    pub fn at(path: &Path) -> anyhow::Result<Self> {
        chat_tokens::ChatTokenizer::load(path)
            .map_err(|e| anyhow::anyhow!("invalid --tokenizer {}: {e}", path.display()))?;
        Ok(BenchTokenizer {
            path: path.to_path_buf(),
            tiny: false,
            _dir: None,
        })
    }

    /// chat-tokens' tiny fixture, written into a temporary directory.
    pub fn tiny() -> anyhow::Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix("prefixctl-tokenizer-")
            .tempdir()
            .context("creating a directory for the bench's tokenizer")?;
        for (name, text) in TINY_FILES {
            let path = dir.path().join(name);
            std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
        }
        Ok(BenchTokenizer {
            path: dir.path().join("tokenizer.json"),
            tiny: true,
            _dir: Some(Arc::new(dir)),
        })
    }

    /// What the report says of it.
    pub fn describe(&self) -> String {
        if self.tiny {
            "chat-tokens' tiny ByteLevel BPE (600 ids, ChatML template), written by the bench"
                .into()
        } else {
            self.path.display().to_string()
        }
    }

    /// The tokenizer as the engine-sims of a run of `workload` use it.
    pub fn for_workload(&self, workload: &Workload) -> anyhow::Result<SimTokenizer> {
        Ok(SimTokenizer {
            path: self.path.clone(),
            ids_per_token: ids_per_token(&self.path, workload)?,
            kv_events: false,
        })
    }
}

/// The engine-sims' tokenizer in one fleet, and whether they publish KV events.
#[derive(Debug, Clone, PartialEq)]
pub struct SimTokenizer {
    pub path: PathBuf,
    /// The tokenizer's ids per workload token (4 bytes) of the workload's text: the engines'
    /// KV capacity and prefill rate are multiplied by it.
    pub ids_per_token: f64,
    /// The engines publish KV events and the variant names them (PREFIX_AWARE precise).
    pub kv_events: bool,
}

/// Ids per workload token (4 bytes) of the workload's shared text (a document, else a system
/// prompt), as `path`'s tokenizer encodes it.
pub fn ids_per_token(path: &Path, workload: &Workload) -> anyhow::Result<f64> {
    let tokenizer = chat_tokens::ChatTokenizer::load(path)
        .map_err(|e| anyhow::anyhow!("loading the bench's tokenizer {}: {e}", path.display()))?;
    let text = if workload.has_documents() {
        workload.document(0)
    } else {
        workload.system_prompt(0)
    };
    let mut ids = Vec::new();
    tokenizer
        .encode(&text, false, &mut ids)
        .map_err(|e| anyhow::anyhow!("encoding the workload's text: {e}"))?;
    let tokens = text.len() as f64 / BYTES_PER_TOKEN as f64;
    anyhow::ensure!(
        tokens > 0.0 && !ids.is_empty(),
        "the workload has no text to measure the tokenizer {} on",
        path.display()
    );
    Ok(ids.len() as f64 / tokens)
}

/// Whether both event ports of an engine on HTTP port `port` can be bound on loopback now.
pub fn event_ports_free(port: u16) -> bool {
    let Some(last) = port.checked_add(EVENTS_PORT_OFFSET + 1) else {
        return false;
    };
    [last - 1, last]
        .iter()
        .all(|&p| std::net::TcpListener::bind(("127.0.0.1", p)).is_ok())
}

/// The engine-sim flags that publish the events of an engine on HTTP port `port`.
pub fn engine_flags(port: u16) -> [String; 6] {
    let events = port + EVENTS_PORT_OFFSET;
    [
        "--kv-events-endpoint".into(),
        format!("tcp://127.0.0.1:{events}"),
        "--kv-events-replay-endpoint".into(),
        format!("tcp://127.0.0.1:{}", events + 1),
        "--kv-events-topic".into(),
        TOPIC.into(),
    ]
}

/// What one router's exact index took in: KV events applied and blocks indexed, over every
/// instance (from its `/metrics`).
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct RouterIndex {
    pub kv_events: f64,
    pub index_blocks: f64,
}

impl RouterIndex {
    pub fn from_metrics(text: &str) -> Self {
        RouterIndex {
            kv_events: metrics::sum(text, "prefix_router_kv_events_total"),
            index_blocks: metrics::sum(text, "prefix_router_kv_index_blocks"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::workload::WorkloadKind;

    #[test]
    fn the_tiny_tokenizer_loads_and_its_ratio_is_measured_on_the_workload() {
        let t = BenchTokenizer::tiny().unwrap();
        assert!(t.path.ends_with("tokenizer.json") && t.tiny);
        BenchTokenizer::at(&t.path).unwrap();
        for kind in [WorkloadKind::Tenants, WorkloadKind::LongContext] {
            let sim = t.for_workload(&Workload::new(kind, 1)).unwrap();
            // pseudo-words of random letters: a few ids per 4 bytes, as a byte-level BPE of
            // 339 merges makes them
            assert!(
                sim.ids_per_token > 1.5 && sim.ids_per_token < 4.5,
                "{kind:?}: {}",
                sim.ids_per_token
            );
            assert!(!sim.kv_events);
        }
        let dir = t.path.parent().unwrap().to_path_buf();
        drop(t);
        assert!(!dir.exists(), "the tiny fixture's directory is removed");
        let e = BenchTokenizer::at(Path::new("/nonexistent/tokenizer.json")).unwrap_err();
        assert!(
            e.to_string().contains("invalid --tokenizer /nonexistent"),
            "{e}"
        );
    }

    #[test]
    fn the_routers_templates_name_the_engines_ports() {
        assert_eq!(endpoint_template(), "tcp://{host}:{port+1000}");
        assert_eq!(replay_endpoint_template(), "tcp://{host}:{port+1001}");
        let flags = engine_flags(40000);
        assert_eq!(flags[1], "tcp://127.0.0.1:41000");
        assert_eq!(flags[3], "tcp://127.0.0.1:41001");
        assert!(!event_ports_free(u16::MAX - EVENTS_PORT_OFFSET));
    }

    #[test]
    fn a_routers_index_sums_its_instances() {
        let text = "# TYPE prefix_router_kv_events_total counter\n\
            prefix_router_kv_events_total{instance=\"a\",type=\"BlockStored\"} 5\n\
            prefix_router_kv_events_total{instance=\"b\",type=\"BlockRemoved\"} 2\n\
            prefix_router_kv_index_blocks{instance=\"a\"} 7\n";
        assert_eq!(
            RouterIndex::from_metrics(text),
            RouterIndex {
                kv_events: 7.0,
                index_blocks: 7.0
            }
        );
    }
}
