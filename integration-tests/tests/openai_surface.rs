//! The whole OpenAI surface through the data plane: `GET /v1/models` from the routing table,
//! every other `/v1/*` path proxied to the endpoint chosen as for chat (engine-sim answers
//! `/v1/embeddings` and `/v1/responses`), unknown non-`/v1` paths 404; and the official `openai`
//! Python client (`models.list()`, `embeddings.create()`, `responses.create()`) through it.

mod common;

use common::{Fleet, ENDPOINT};
use serde_json::{json, Value};

fn body(a: &common::Answer) -> Value {
    serde_json::from_slice(&a.body).unwrap_or_else(|e| {
        panic!("{e}: {}", String::from_utf8_lossy(&a.body));
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_come_from_the_table_and_other_v1_paths_are_proxied() {
    let fleet = Fleet::start().await;

    // The endpoint, then its variant's model name; answered by the router itself.
    let models = fleet.get("/v1/models").await;
    assert_eq!(models.status, 200);
    assert!(models.headers.get("x-prefix-router-instance").is_none());
    assert_eq!(
        body(&models),
        json!({"object": "list", "data": [
            {"id": ENDPOINT, "object": "model", "created": 0, "owned_by": "prefix-router"},
            {"id": "llama", "object": "model", "created": 0, "owned_by": "prefix-router", "parent": ENDPOINT},
        ]})
    );
    let one = fleet.get(&format!("/v1/models/{ENDPOINT}")).await;
    assert_eq!(
        (one.status, body(&one)["id"].clone()),
        (200, json!(ENDPOINT))
    );
    let none = fleet.get("/v1/models/nope").await;
    assert_eq!(none.status, 404);
    assert!(body(&none)["error"]["message"]
        .as_str()
        .unwrap()
        .contains("nope"));

    // Embeddings and responses reach the engine, keyed PREFIX_AWARE.
    let e = fleet
        .post_json(
            "/v1/embeddings",
            &json!({"model": ENDPOINT, "input": ["hello", "world"], "dimensions": 16}),
        )
        .await;
    assert_eq!(e.status, 200, "{}", String::from_utf8_lossy(&e.body));
    assert!(e.headers.get("x-prefix-router-instance").is_some());
    let decision = e.headers.get("x-prefix-router-decision").unwrap();
    assert!(
        decision.to_str().unwrap().starts_with("prefix_"),
        "{decision:?}"
    );
    let e = body(&e);
    assert_eq!(e["data"].as_array().unwrap().len(), 2);
    assert_eq!(e["data"][0]["embedding"].as_array().unwrap().len(), 16);

    // Instructions longer than a cache block (16 tokens of 4 bytes), so a repeat hits the cache.
    let instructions = "Answer in one short sentence. ".repeat(8);
    let ask = json!({"model": ENDPOINT, "instructions": instructions, "input": "What is a KV cache?", "max_output_tokens": 3});
    let r = fleet.post_json("/v1/responses", &ask).await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let decision = r.headers.get("x-prefix-router-decision").unwrap();
    assert!(
        decision.to_str().unwrap().starts_with("prefix_"),
        "{decision:?}"
    );
    let r = body(&r);
    assert_eq!(r["object"], "response");
    assert_eq!(r["output"][0]["content"][0]["type"], "output_text");
    let again = body(&fleet.post_json("/v1/responses", &ask).await);
    assert!(
        again["usage"]["input_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            > 0
    );
    let mut streamed = ask.clone();
    streamed["stream"] = json!(true);
    let events = fleet.post_json("/v1/responses", &streamed).await;
    assert_eq!(events.status, 200);
    let events = String::from_utf8_lossy(&events.body);
    assert!(events.starts_with("event: response.created\n"), "{events}");
    assert_eq!(
        events
            .matches("event: response.output_text.delta\n")
            .count(),
        3,
        "{events}"
    );
    assert!(events.contains("event: response.completed\n"), "{events}");

    // A /v1 path the engine does not serve is still proxied: the engine's own 404, with the
    // router's headers.
    let t = fleet
        .post_json("/v1/tokenize", &json!({"model": ENDPOINT, "prompt": "hi"}))
        .await;
    assert_eq!(t.status, 404);
    assert!(t.headers.get("x-prefix-router-instance").is_some());
    assert!(String::from_utf8_lossy(&t.body).contains("unknown path"));
    // Outside /v1: the router's 404.
    let n = fleet.get("/tokenize").await;
    assert_eq!(n.status, 404);
    assert!(n.headers.get("x-prefix-router-instance").is_none());
}

const SCRIPT: &str = r#"
import sys
import openai

client = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused", max_retries=0, timeout=20)
models = client.models.list()
print("models.list():", [(m.id, m.owned_by) for m in models.data])
assert [m.id for m in models.data] == ["chat", "llama"], models
assert all(m.object == "model" and m.owned_by == "prefix-router" for m in models.data), models

e = client.embeddings.create(model="chat", input=["hello", "world"])
assert len(e.data) == 2 and e.data[1].index == 1, e
v = e.data[0].embedding
assert len(v) == 256 and abs(sum(x * x for x in v) - 1) < 1e-3, len(v)
assert client.embeddings.create(model="chat", input="hello").data[0].embedding == v
print("embeddings.create(): 2 vectors of", len(v))

brief = "Answer in one short sentence. " * 8
r = client.responses.create(model="chat", instructions=brief,
                            input="What is a KV cache?", max_output_tokens=5)
assert r.object == "response" and r.status == "completed", r
assert len(r.output_text.split(" ")) == 5, r.output_text
again = client.responses.create(model="chat", instructions=brief,
                                input="What is a KV cache?", max_output_tokens=5)
assert again.output_text == r.output_text
assert again.usage.input_tokens_details.cached_tokens > 0, again.usage
print("responses.create():", repr(r.output_text), "cached on repeat:", again.usage.input_tokens_details.cached_tokens)
events = list(client.responses.create(model="chat", instructions=brief, input="What is a KV cache?",
                                      max_output_tokens=5, stream=True))
types = [e.type for e in events]
assert types[0] == "response.created" and types[-1] == "response.completed", types
deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
assert deltas == r.output_text == events[-1].response.output_text, (deltas, r.output_text)
print("responses.create(stream=True):", len(events), "events,", types.count("response.output_text.delta"), "deltas")
print("openai client ok")
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_openai_python_client_through_the_data_plane() {
    let test = "the_official_openai_python_client_through_the_data_plane";
    if test_support::require_tool(test, test_support::python_modules(&["openai"])).is_none() {
        return;
    }
    let fleet = Fleet::start().await;
    let base = fleet.router.clone();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new("python3")
            .args(["-c", SCRIPT, &base])
            .output()
    })
    .await
    .unwrap()
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "python client failed:\nstdout: {stdout}\nstderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{stdout}");
    assert!(stdout.contains("openai client ok"), "{stdout}");
}
