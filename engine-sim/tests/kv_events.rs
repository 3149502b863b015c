//! engine-sim with `--tokenizer` and `--kv-events-endpoint`: its cache's changes reach a
//! `kv_events::Subscriber` (the workspace's decoder of vLLM's format) as BlockStored events whose
//! token ids are chat-tokens' tokens of the prompt, evictions as BlockRemoved, and the replay
//! socket serves the buffer.

mod common;

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use chat_tokens::{ChatTokenizer, RequestKind};
use common::TestServer;
use engine_sim::{Config, Engine, PromptBlocks};
use http::StatusCode;
use kv_events::{Event, Sink, Subscriber, SubscriberConfig};
use serde_json::json;
use test_support::{unused_port, wait_for};
use zeromq::{Socket, SocketRecv, SocketSend};

const WAIT: Duration = Duration::from_secs(10);

fn tokenizer_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../chat-tokens/tests/fixtures/tiny/tokenizer.json")
}

#[derive(Default)]
struct Recorder(Mutex<Vec<Event>>);

impl Sink for Recorder {
    fn apply(&self, _instance: &str, event: &Event) {
        self.0.lock().unwrap().push(event.clone());
    }
    fn reset(&self, _instance: &str) {}
}

impl Recorder {
    /// The tokens of every stored block, by hash.
    fn stored_blocks(&self) -> std::collections::HashMap<u64, Vec<u32>> {
        let mut out = std::collections::HashMap::new();
        for e in self.0.lock().unwrap().iter() {
            if let Event::Stored {
                hashes,
                token_ids,
                block_size,
                medium,
                ..
            } = e
            {
                assert_eq!(medium.as_deref(), Some("GPU"));
                for (h, ids) in hashes.iter().zip(token_ids.chunks(*block_size as usize)) {
                    out.insert(*h, ids.to_vec());
                }
            }
        }
        out
    }

    fn removed(&self) -> Vec<u64> {
        let events = self.0.lock().unwrap();
        events
            .iter()
            .filter_map(|e| match e {
                Event::Removed { hashes, .. } => Some(hashes.clone()),
                _ => None,
            })
            .flatten()
            .collect()
    }
}

fn long_text(seed: &str, words: usize) -> String {
    (0..words)
        .map(|i| format!("{seed}{} the router cache", i % 7))
        .collect::<Vec<_>>()
        .join(" ")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cache_publishes_vllm_kv_events_of_the_engine_tokens() {
    let endpoint = format!("tcp://127.0.0.1:{}", unused_port());
    let replay = format!("tcp://127.0.0.1:{}", unused_port());
    let config = Config {
        tokenizer: Some(tokenizer_path()),
        kv_events_endpoint: Some(endpoint.clone()),
        kv_events_replay_endpoint: Some(replay.clone()),
        kv_capacity_tokens: 16 * 40,
        ..common::fast_config()
    };
    let server = TestServer::start(config).await;
    let sink = Arc::new(Recorder::default());
    let mut sub_config = SubscriberConfig::new(&endpoint);
    sub_config.replay_endpoint = Some(replay.clone());
    sub_config.topic = "kv".into();
    sub_config.warm_start = true;
    let subscriber = Subscriber::spawn("engine", sub_config, sink.clone()).unwrap();

    // A SUB socket misses what is published before its subscription arrives: send warm-up chats
    // (each with full blocks) until events come through.
    let mut n = 0;
    wait_for(&"the first KV events at the subscriber", WAIT, || {
        n += 1;
        let body = common::chat("warm-up", &long_text(&format!("w{n}"), 12), 1, false);
        let (server, sink) = (&server, &sink);
        async move {
            let (status, _) = server.post_json("/v1/chat/completions", &body).await;
            assert_eq!(status, StatusCode::OK);
            !sink.0.lock().unwrap().is_empty()
        }
    })
    .await;

    let tokenizer = ChatTokenizer::load(tokenizer_path()).unwrap();
    let body = common::chat(&long_text("system", 30), "and the question", 1, false);
    let mut ids = Vec::new();
    tokenizer
        .tokens(body.to_string().as_bytes(), RequestKind::Chat, &mut ids)
        .unwrap();
    let blocks = PromptBlocks::from_token_ids(&ids, 16);
    assert!(blocks.hashes.len() >= 10, "{} tokens", ids.len());
    let (status, reply) = server.post_json("/v1/chat/completions", &body).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(reply["usage"]["prompt_tokens"], json!(ids.len()));
    wait_for(
        &"BlockStored for every full block of the prompt",
        WAIT,
        || async {
            let stored = sink.stored_blocks();
            blocks.hashes.iter().all(|h| stored.contains_key(h))
        },
    )
    .await;
    let stored = sink.stored_blocks();
    for (i, h) in blocks.hashes.iter().enumerate() {
        assert_eq!(stored[h], ids[i * 16..(i + 1) * 16], "block {i}");
    }
    // The first block has no parent; the repeat hits every full block.
    assert!(sink.0.lock().unwrap().iter().any(|e| matches!(e,
        Event::Stored { hashes, parent: None, .. } if hashes[0] == blocks.hashes[0])));
    let (_, again) = server.post_json("/v1/chat/completions", &body).await;
    assert_eq!(
        again["usage"]["prompt_tokens_details"]["cached_tokens"],
        json!(blocks.hashes.len() * 16)
    );

    // Two other long prompts fill the 40-block cache: the first prompt's blocks are evicted.
    for seed in ["other", "third"] {
        let other = common::chat(&long_text(seed, 30), "x", 1, false);
        let (status, _) = server.post_json("/v1/chat/completions", &other).await;
        assert_eq!(status, StatusCode::OK);
    }
    wait_for(
        &"BlockRemoved for the first prompt's blocks",
        WAIT,
        || async {
            let removed = sink.removed();
            blocks.hashes.iter().any(|h| removed.contains(h))
        },
    )
    .await;

    // The replay socket serves the buffer from seq 0 in vLLM's newest layout, then the end marker.
    let mut dealer = zeromq::DealerSocket::new();
    dealer.connect(&replay).await.unwrap();
    let request = vec![Bytes::new(), Bytes::copy_from_slice(&0u64.to_be_bytes())];
    dealer
        .send(zeromq::ZmqMessage::try_from(request).unwrap())
        .await
        .unwrap();
    let mut seqs = Vec::new();
    loop {
        let frames = tokio::time::timeout(WAIT, dealer.recv())
            .await
            .expect("a replay reply")
            .unwrap()
            .into_vec();
        let [empty, topic, seq, payload] = frames.as_slice() else {
            panic!("replay frames {frames:?}");
        };
        assert!(empty.is_empty());
        let seq = u64::from_be_bytes(seq.as_ref().try_into().unwrap());
        if seq == u64::MAX {
            assert!(topic.is_empty() && payload.is_empty());
            break;
        }
        assert_eq!(topic.as_ref(), b"kv");
        kv_events::decode_batch(payload, &Default::default()).expect("a vLLM batch");
        seqs.push(seq);
    }
    assert_eq!(seqs, (0..seqs.len() as u64).collect::<Vec<_>>());
    assert!(seqs.len() >= 4, "{seqs:?}");

    let (_, metrics) = server.get_text("/metrics").await;
    let metrics = common::parse_metrics(&metrics);
    let published = metrics
        .iter()
        .find(|(k, _)| k.starts_with("engine_sim_kv_events_published_total"))
        .map(|(_, v)| *v);
    assert_eq!(published, Some(seqs.len() as f64));
    subscriber.stop().await;
    server.stop().await;
}

#[test]
fn events_without_a_tokenizer_are_refused_naming_both_flags() {
    let config = Config {
        kv_events_endpoint: Some("tcp://127.0.0.1:1".into()),
        ..Config::default()
    };
    let Err(e) = Engine::try_new(config) else {
        panic!("the engine started")
    };
    let e = format!("{e:#}");
    assert!(
        e.contains("--kv-events-endpoint") && e.contains("--tokenizer"),
        "{e}"
    );
    let config = Config {
        tokenizer: Some("/nonexistent/tokenizer.json".into()),
        ..Config::default()
    };
    let Err(e) = Engine::try_new(config) else {
        panic!("the engine started")
    };
    let e = format!("{e:#}");
    assert!(e.contains("/nonexistent/tokenizer.json"), "{e}");
}
