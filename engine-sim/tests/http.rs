//! The engine over real HTTP: `serve` on 127.0.0.1:0, hyper's client, a real SSE parser.

mod common;

use bytes::Bytes;
use common::{chat, fast_config, parse_metrics, TestServer};
use engine_sim::{canonical_prompt, Config};
use eventsource_stream::Eventsource;
use futures_util::StreamExt;
use http::{Method, StatusCode};
use http_body_util::BodyExt;
use serde_json::{json, Value};
use test_support::wait_for;

fn system_prompt() -> String {
    // ~4 KB, not a multiple of the 64-byte block.
    "You are a meticulous assistant for the prefix-router project. ".repeat(67)
}

fn tokens(text: &str) -> u64 {
    (text.len() as u64).div_ceil(4)
}

/// Cached tokens the engine must report for `prompt` once `cached` was fully cached:
/// the full 64-byte blocks of their common prefix, 16 tokens each.
fn expected_cached(prompt: &str, cached: &str) -> u64 {
    let common = prompt
        .bytes()
        .zip(cached.bytes())
        .take_while(|(a, b)| a == b)
        .count() as u64;
    common / 64 * 16
}

#[tokio::test]
async fn non_streaming_chat_has_the_openai_shape_and_counts_cached_tokens() {
    let server = TestServer::start(fast_config()).await;
    let system = system_prompt();
    let body = chat(&system, "What is a KV cache?", 7, false);
    let prompt = canonical_prompt(&body).unwrap();
    assert!(prompt.starts_with("system\nYou are"));

    let (status, first) = server.post_json("/v1/chat/completions", &body).await;
    assert_eq!(status, StatusCode::OK, "{first}");
    assert!(first["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(first["object"], "chat.completion");
    assert!(first["created"].as_u64().unwrap() > 1_600_000_000);
    assert_eq!(first["model"], "client-model", "echoes the requested model");
    let choice = &first["choices"][0];
    assert_eq!(choice["index"], 0);
    assert_eq!(choice["message"]["role"], "assistant");
    assert_eq!(choice["finish_reason"], "length");
    let content = choice["message"]["content"].as_str().unwrap();
    assert_eq!(
        content.split(' ').count(),
        7,
        "one word per token: {content:?}"
    );
    let usage = &first["usage"];
    assert_eq!(usage["prompt_tokens"], tokens(&prompt));
    assert_eq!(usage["completion_tokens"], 7);
    assert_eq!(usage["total_tokens"], tokens(&prompt) + 7);
    assert_eq!(
        usage["prompt_tokens_details"]["cached_tokens"], 0,
        "cold cache"
    );

    let (_, again) = server.post_json("/v1/chat/completions", &body).await;
    let full_blocks = prompt.len() as u64 / 64 * 16;
    assert_eq!(
        again["usage"]["prompt_tokens_details"]["cached_tokens"],
        full_blocks
    );
    assert_eq!(
        again["choices"][0]["message"]["content"], content,
        "same prompt, same words"
    );
    assert_ne!(again["id"], first["id"]);

    // Same system prompt, another question: a partial hit, to the block.
    let other = chat(&system, "And what is prefix-aware routing?", 3, false);
    let other_prompt = canonical_prompt(&other).unwrap();
    let (_, partial) = server.post_json("/v1/chat/completions", &other).await;
    let want = expected_cached(&other_prompt, &prompt);
    assert!(want > 0 && want < tokens(&other_prompt));
    assert_eq!(
        partial["usage"]["prompt_tokens_details"]["cached_tokens"],
        want
    );
    server.stop().await;
}

#[tokio::test]
async fn non_streaming_completions_shape() {
    let server = TestServer::start(fast_config()).await;
    let body = json!({"model": "m", "prompt": ["Once upon a time", "ignored"], "max_tokens": 4});
    let (status, v) = server.post_json("/v1/completions", &body).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert!(v["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(
        v["choices"][0]["text"].as_str().unwrap().split(' ').count(),
        4
    );
    assert_eq!(v["usage"]["prompt_tokens"], tokens("Once upon a time"));
    assert_eq!(v["usage"]["completion_tokens"], 4);
    // No max_tokens: 16 like vLLM's default here.
    let (_, v) = server
        .post_json("/v1/completions", &json!({"prompt": "hi"}))
        .await;
    assert_eq!(v["usage"]["completion_tokens"], 16);
    assert_eq!(
        v["model"], "llama-3.1-70b",
        "no model named: the served one"
    );
    server.stop().await;
}

#[tokio::test]
async fn streaming_chat_parsed_by_an_sse_parser_ends_in_done() {
    let server = TestServer::start(fast_config()).await;
    let system = system_prompt();
    let body = chat(&system, "Stream please.", 5, true);
    let resp = server
        .send(Method::POST, "/v1/chat/completions", &body.to_string())
        .await;
    assert_eq!(resp.status(), StatusCode::OK);
    let ct = resp.headers()["content-type"].to_str().unwrap();
    assert!(ct.starts_with("text/event-stream"), "{ct}");

    let mut events = resp.into_body().into_data_stream().eventsource();
    let mut data = Vec::new();
    while let Some(ev) = events.next().await {
        let ev = ev.expect("well-formed SSE");
        assert_eq!(ev.event, "message", "plain data events");
        data.push(ev.data);
    }
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).expect("each event is JSON"))
        .collect();
    // role chunk, 5 token chunks, usage chunk.
    assert_eq!(chunks.len(), 7);
    let id = &chunks[0]["id"];
    for c in &chunks {
        assert_eq!(&c["id"], id);
        assert_eq!(c["object"], "chat.completion.chunk");
        assert_eq!(c["model"], "client-model");
    }
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let tokens_: Vec<&Value> = chunks[1..6].iter().map(|c| &c["choices"][0]).collect();
    for (i, t) in tokens_.iter().enumerate() {
        let want = if i == 4 { json!("length") } else { Value::Null };
        assert_eq!(t["finish_reason"], want);
    }
    let text: String = tokens_
        .iter()
        .map(|t| t["delta"]["content"].as_str().unwrap())
        .collect();
    let usage_chunk = &chunks[6];
    assert_eq!(usage_chunk["choices"], json!([]));
    let prompt = canonical_prompt(&body).unwrap();
    assert_eq!(usage_chunk["usage"]["prompt_tokens"], tokens(&prompt));
    assert_eq!(usage_chunk["usage"]["completion_tokens"], 5);
    assert_eq!(
        usage_chunk["usage"]["prompt_tokens_details"]["cached_tokens"],
        0
    );

    // The non-streaming answer to the same prompt has the same words, and now hits the cache.
    let (_, whole) = server
        .post_json(
            "/v1/chat/completions",
            &chat(&system, "Stream please.", 5, false),
        )
        .await;
    assert_eq!(whole["choices"][0]["message"]["content"], text);
    assert_eq!(
        whole["usage"]["prompt_tokens_details"]["cached_tokens"],
        prompt.len() as u64 / 64 * 16
    );
    server.stop().await;
}

#[tokio::test]
async fn streaming_completion_framing_is_exactly_data_events() {
    let server = TestServer::start(fast_config()).await;
    let body = json!({"prompt": "x".repeat(300), "max_tokens": 3, "stream": true});
    let (status, _, raw) = server
        .request(Method::POST, "/v1/completions", &body.to_string())
        .await;
    assert_eq!(status, StatusCode::OK);
    let raw = String::from_utf8(raw.to_vec()).unwrap();
    assert!(raw.ends_with("\n\ndata: [DONE]\n\n"), "{raw}");
    let events: Vec<&str> = raw.split_terminator("\n\n").collect();
    assert_eq!(events.len(), 3 + 1 + 1, "3 tokens, usage, [DONE]: {raw}");
    for e in &events[..4] {
        let json = e
            .strip_prefix("data: ")
            .expect("every event is one data line");
        assert!(!json.contains('\n'));
        let v: Value = serde_json::from_str(json).unwrap();
        assert_eq!(v["object"], "text_completion");
    }
    let usage: Value = serde_json::from_str(&events[3]["data: ".len()..]).unwrap();
    assert_eq!(usage["usage"]["prompt_tokens"], 75);
    server.stop().await;
}

#[tokio::test]
async fn metrics_counters_match_the_requests_served() {
    let server = TestServer::start(fast_config()).await;
    let system = system_prompt();
    let mut prompt_tokens = 0;
    let mut cached_tokens = 0;
    for i in 0..6 {
        let body = chat(&system, &format!("question {}", i % 3), 2, false);
        let (status, v) = server.post_json("/v1/chat/completions", &body).await;
        assert_eq!(status, StatusCode::OK);
        prompt_tokens += v["usage"]["prompt_tokens"].as_u64().unwrap();
        cached_tokens += v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
    }
    // One streaming request too; its usage comes in the last chunk.
    let (_, _, raw) = server
        .request(
            Method::POST,
            "/v1/chat/completions",
            &chat(&system, "question 0", 2, true).to_string(),
        )
        .await;
    let raw = String::from_utf8(raw.to_vec()).unwrap();
    let events: Vec<&str> = raw.split_terminator("\n\n").collect();
    let usage_event = events[events.len() - 2];
    let usage: Value = serde_json::from_str(&usage_event["data: ".len()..]).unwrap();
    prompt_tokens += usage["usage"]["prompt_tokens"].as_u64().unwrap();
    cached_tokens += usage["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached_tokens > 0);
    // A refused request is still a request received.
    let (status, _) = server.post_json("/v1/chat/completions", &json!({})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);

    let (status, text) = server.get_text("/metrics").await;
    assert_eq!(status, StatusCode::OK);
    let m = parse_metrics(&text);
    let get = |name: &str| -> f64 {
        *m.get(&format!("{name}{{model_name=\"llama-3.1-70b\"}}"))
            .unwrap_or_else(|| panic!("{name} missing from:\n{text}"))
    };
    assert_eq!(get("vllm:prefix_cache_queries_total"), prompt_tokens as f64);
    assert_eq!(get("vllm:prefix_cache_hits_total"), cached_tokens as f64);
    assert_eq!(get("vllm:prompt_tokens_total"), prompt_tokens as f64);
    assert_eq!(get("vllm:generation_tokens_total"), 14.0);
    assert_eq!(get("vllm:request_success_total"), 7.0);
    assert_eq!(get("engine_sim_requests_total"), 8.0);
    assert_eq!(get("vllm:num_requests_running"), 0.0);
    assert_eq!(get("vllm:num_requests_waiting"), 0.0);
    assert_eq!(
        get("vllm:kv_cache_usage_perc"),
        0.0,
        "nothing pinned when idle"
    );
    assert_eq!(get("vllm:time_to_first_token_seconds_count"), 7.0);
    let inf =
        m["vllm:time_to_first_token_seconds_bucket{model_name=\"llama-3.1-70b\",le=\"+Inf\"}"];
    assert_eq!(inf, 7.0);
    assert!(m.contains_key(
        "vllm:time_to_first_token_seconds_bucket{model_name=\"llama-3.1-70b\",le=\"0.06\"}"
    ));
    assert!(text.contains("# TYPE vllm:time_to_first_token_seconds histogram"));
    assert!(text.contains("# TYPE vllm:prefix_cache_hits_total counter"));

    let stats = server.engine.stats();
    assert_eq!(stats.prefix_cache_queries, prompt_tokens);
    assert_eq!(stats.prefix_cache_hits, cached_tokens);
    assert_eq!(stats.requests_total, 8);
    server.stop().await;
}

#[tokio::test]
async fn bad_input_gets_openai_errors_and_the_server_keeps_serving() {
    let server = TestServer::start(Config {
        max_body_bytes: 4096,
        max_model_len: 2048,
        ..fast_config()
    })
    .await;
    let error_of = |bytes: &Bytes| -> Value {
        let v: Value = serde_json::from_slice(bytes).expect("error body is JSON");
        assert_eq!(v["error"]["code"], Value::Null);
        assert!(v["error"]["message"].is_string());
        v["error"].clone()
    };

    let (status, _, b) = server
        .request(Method::POST, "/v1/chat/completions", "{\"messages\": [")
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let e = error_of(&b);
    assert_eq!(e["type"], "invalid_request_error");
    assert!(
        e["message"].as_str().unwrap().contains("not valid JSON"),
        "{e}"
    );

    let cases = [
        (
            "/v1/chat/completions",
            json!({"model": "m"}),
            "messages",
            "missing required field",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": {"role": "user"}}),
            "messages",
            "an object",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": 42}]}),
            "messages[0].content",
            "number 42",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}),
            "max_tokens",
            "string \"ten\"",
        ),
        (
            "/v1/completions",
            json!({"prompt": [1, 2, 3]}),
            "prompt[0]",
            "number 1",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "stream": 1}),
            "stream",
            "number 1",
        ),
        (
            "/v1/completions",
            json!({"prompt": "y".repeat(4000), "max_tokens": 2000}),
            "prompt",
            "maximum context length is 2048",
        ),
    ];
    for (path, body, param, needle) in cases {
        let (status, _, b) = server.request(Method::POST, path, &body.to_string()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
        let e = error_of(&b);
        assert_eq!(e["type"], "invalid_request_error");
        assert_eq!(e["param"], param, "{e}");
        let msg = e["message"].as_str().unwrap();
        assert!(msg.contains(needle), "{msg:?} should contain {needle:?}");
    }

    let (status, _, b) = server
        .request(Method::POST, "/v1/completions", "[1, 2]")
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(error_of(&b)["message"]
        .as_str()
        .unwrap()
        .contains("JSON object"));

    let (status, _, b) = server
        .request(Method::POST, "/v1/completions", &"x".repeat(5000))
        .await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    assert!(error_of(&b)["message"].as_str().unwrap().contains("4096"));

    let (status, headers, b) = server
        .request(Method::GET, "/v1/chat/completions", "")
        .await;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(headers["allow"], "POST");
    error_of(&b);
    let (status, _, _) = server.request(Method::POST, "/metrics", "").await;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);

    let (status, _, b) = server.request(Method::POST, "/v2/nothing", "{}").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert!(error_of(&b)["message"]
        .as_str()
        .unwrap()
        .contains("/v2/nothing"));

    // Still serving.
    let (status, v) = server
        .post_json(
            "/v1/completions",
            &json!({"prompt": "still here", "max_tokens": 1}),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let (status, _) = server.get_text("/health").await;
    assert_eq!(status, StatusCode::OK);
    server.stop().await;
}

#[tokio::test]
async fn models_and_health() {
    let server = TestServer::start(Config {
        model_name: "tiny-sim".into(),
        ..fast_config()
    })
    .await;
    let (status, body) = server.get_text("/health").await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, ""));
    let (status, body) = server.get_text("/v1/models").await;
    assert_eq!(status, StatusCode::OK);
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], "tiny-sim");
    assert_eq!(v["data"][0]["object"], "model");
    let (_, metrics) = server.get_text("/metrics").await;
    assert!(metrics.contains("vllm:num_requests_running{model_name=\"tiny-sim\"} 0"));
    server.stop().await;
}

#[tokio::test]
async fn fault_flags_fail_and_stall() {
    let server = TestServer::start(Config {
        fail_rate: 1.0,
        stall_ms: 2000.0, // x 0.01 = 20 ms
        ..fast_config()
    })
    .await;
    let start = std::time::Instant::now();
    let (status, v) = server
        .post_json("/v1/completions", &json!({"prompt": "x"}))
        .await;
    assert!(
        start.elapsed() >= std::time::Duration::from_millis(20),
        "stalled first"
    );
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(v["error"]["type"], "server_error");
    assert_eq!(server.engine.stats().failures_injected, 1);
    assert_eq!(
        server.engine.stats().prefix_cache_queries,
        0,
        "never reached the engine"
    );
    server.stop().await;

    // A fraction fails, reproducibly for a seed.
    let mut outcomes = Vec::new();
    for _ in 0..2 {
        let server = TestServer::start(Config {
            fail_rate: 0.5,
            seed: 9,
            ..fast_config()
        })
        .await;
        let mut statuses = Vec::new();
        for _ in 0..40 {
            let (s, _) = server
                .post_json("/v1/completions", &json!({"prompt": "x", "max_tokens": 1}))
                .await;
            statuses.push(s.as_u16());
        }
        server.stop().await;
        outcomes.push(statuses);
    }
    assert_eq!(outcomes[0], outcomes[1]);
    let failed = outcomes[0].iter().filter(|&&s| s == 500).count();
    assert!(
        (8..=32).contains(&failed),
        "{failed} of 40 failed at rate 0.5"
    );
}

#[tokio::test]
async fn a_client_that_goes_away_frees_its_slot_and_blocks() {
    let server = TestServer::start(fast_config()).await;
    // 100,000 tokens at 0.25 ms: ~25 s if nobody stops it.
    let body = json!({"prompt": "z".repeat(6400), "max_tokens": 100_000, "stream": true});
    let resp = server
        .send(Method::POST, "/v1/completions", &body.to_string())
        .await;
    let mut stream = resp.into_body().into_data_stream();
    let first = stream.next().await.unwrap().unwrap();
    assert!(first.starts_with(b"data: "));
    let engine = std::sync::Arc::clone(&server.engine);
    assert_eq!(engine.stats().running, 1);
    assert!(
        engine.stats().kv_cache_usage > 0.0,
        "its 100 blocks are pinned"
    );
    drop(stream);
    wait_for(
        "the aborted request to be released",
        std::time::Duration::from_secs(10),
        || async {
            let s = engine.stats();
            s.running == 0 && s.kv_cache_usage == 0.0
        },
    )
    .await;
    assert_eq!(engine.stats().cached_blocks, 100, "its blocks stay cached");
    server.stop().await;
}

#[tokio::test]
async fn shutdown_drains_a_running_stream_then_stops_accepting() {
    let mut server = TestServer::start(fast_config()).await;
    let body = json!({"prompt": "drain me", "max_tokens": 200, "stream": true});
    let resp = server
        .send(Method::POST, "/v1/completions", &body.to_string())
        .await;
    let mut stream = resp.into_body().into_data_stream();
    let _first = stream.next().await.unwrap().unwrap();
    server.trigger_shutdown();
    let mut rest = Vec::new();
    while let Some(chunk) = stream.next().await {
        rest.extend_from_slice(&chunk.expect("stream not cut by shutdown"));
    }
    assert!(rest.ends_with(b"data: [DONE]\n\n"));
    server.join().await;
    let refused = tokio::net::TcpStream::connect(server.addr).await;
    assert!(refused.is_err(), "listener closed after shutdown");
}

/// vLLM keeps the KV of generated tokens: the next turn of a chat, which resends the answer,
/// finds the first turn's prompt *and* the answer cached.
#[tokio::test]
async fn the_next_turn_of_a_chat_hits_the_previous_answer() {
    let server = TestServer::start(fast_config()).await;
    let system = system_prompt();
    let turn1 = chat(&system, "What is a KV cache?", 40, false);
    let (_, r1) = server.post_json("/v1/chat/completions", &turn1).await;
    let answer = r1["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();

    let mut turn2 = turn1.clone();
    let messages = turn2["messages"].as_array_mut().unwrap();
    messages.push(json!({"role": "assistant", "content": answer}));
    messages.push(json!({"role": "user", "content": "And why does it matter for routing?"}));
    let prompt2 = canonical_prompt(&turn2).unwrap();
    let (_, r2) = server.post_json("/v1/chat/completions", &turn2).await;
    let cached = r2["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    // Everything up to the end of the answer, to the block.
    let answered = canonical_prompt(&turn1).unwrap() + "assistant\n" + &answer;
    assert!(prompt2.starts_with(&answered));
    assert_eq!(cached, answered.len() as u64 / 64 * 16);
    let prompt1_blocks = canonical_prompt(&turn1).unwrap().len() as u64 / 64 * 16;
    assert!(
        cached > prompt1_blocks,
        "the answer's blocks count too: {cached} vs {prompt1_blocks}"
    );
    server.stop().await;
}

#[tokio::test]
async fn api_key_guards_the_v1_routes_like_vllm() {
    use http_body_util::Full;
    let config = Config {
        api_key: Some("sk-engine-1".into()),
        ..fast_config()
    };
    let server = TestServer::start(config).await;
    let body = chat("system", "hi", 2, false).to_string();
    let call = |auth: Option<&'static str>| {
        let mut req = http::Request::builder()
            .method(Method::POST)
            .uri(server.url("/v1/chat/completions"))
            .header("content-type", "application/json");
        if let Some(a) = auth {
            req = req.header("authorization", a);
        }
        let req = req.body(Full::new(Bytes::from(body.clone()))).unwrap();
        server.client.request(req)
    };
    for wrong in [None, Some("Bearer sk-engine-2"), Some("sk-engine-1")] {
        let resp = call(wrong).await.unwrap();
        assert_eq!(resp.status(), StatusCode::UNAUTHORIZED, "{wrong:?}");
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(&bytes[..], br#"{"error":"Unauthorized"}"#);
    }
    let resp = call(Some("Bearer sk-engine-1")).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    // health and metrics stay open, as in vLLM
    assert_eq!(server.get_text("/health").await.0, StatusCode::OK);
    assert_eq!(server.get_text("/metrics").await.0, StatusCode::OK);
    server.stop().await;
}
