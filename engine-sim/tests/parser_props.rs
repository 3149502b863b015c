//! Randomized request bodies against engine-sim's parser (fixed seed; `PROPTEST_CASES` for
//! more): arbitrary bytes and arbitrary JSON get a 200 or an OpenAI-style 400 naming the field,
//! never a panic, a hang or a dropped connection; the validation functions agree.

mod common;

use common::{fast_config, TestServer};
use engine_sim::prompt::{parse_params, visit_canonical_prompt};
use engine_sim::ApiKind;
use http::Method;
use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed, TestRunner};
use serde_json::{json, Value};

fn config() -> Config {
    Config {
        rng_seed: RngSeed::Fixed(0x15),
        failure_persistence: None,
        ..Config::default()
    }
}

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        (0u64..40).prop_map(Value::from),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(Value::from),
        any::<String>().prop_map(Value::String),
        prop::sample::select(vec!["user", "system", "text", "image_url"]).prop_map(Value::from),
    ];
    let name = prop::sample::select(vec![
        "messages",
        "prompt",
        "role",
        "content",
        "type",
        "text",
        "stream",
        "max_tokens",
        "max_completion_tokens",
        "model",
        "x",
    ])
    .prop_map(String::from);
    leaf.prop_recursive(4, 48, 6, move |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::vec((name.clone(), inner), 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// A body the way a client might send it: near-valid chat or completion bodies with fields of
/// any type, arbitrary JSON, or arbitrary bytes.
fn body() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        2 => (json_value(), json_value(), json_value()).prop_map(|(content, stream, max_tokens)| {
            json!({"messages": [{"role": "user", "content": content}], "stream": stream,
                   "max_tokens": max_tokens}).to_string().into_bytes()
        }),
        2 => (json_value(), json_value()).prop_map(|(prompt, model)| {
            json!({"prompt": prompt, "model": model, "max_tokens": 2}).to_string().into_bytes()
        }),
        2 => json_value().prop_map(|v| v.to_string().into_bytes()),
        1 => prop::collection::vec(any::<u8>(), 0..256),
    ]
}

proptest! {
    #![proptest_config(config())]

    /// Errors name the field: its name appears in the message and in `param`.
    #[test]
    fn validation_errors_name_the_field(v in json_value(), chat in any::<bool>()) {
        let kind = if chat { ApiKind::Chat } else { ApiKind::Completions };
        let mut text = String::new();
        for e in [parse_params(&v).err(), visit_canonical_prompt(kind, &v, |p| text.push_str(p)).err()]
            .into_iter()
            .flatten()
        {
            prop_assert!(!e.message.is_empty());
            if let Some(param) = &e.param {
                let top = param.split(['[', '.']).next().unwrap();
                prop_assert!(e.message.contains(top), "{:?} does not name {}", e.message, top);
            }
        }
    }
}

#[test]
fn arbitrary_bodies_get_200_or_a_400_naming_the_problem() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let server = rt.block_on(TestServer::start(fast_config()));
    let mut runner = TestRunner::new(config());
    runner
        .run(&(body(), any::<bool>()), |(body, chat)| {
            let path = if chat {
                "/v1/chat/completions"
            } else {
                "/v1/completions"
            };
            let text = String::from_utf8_lossy(&body).into_owned();
            // `request` bounds the head and the body to 10 s each and fails on a dropped
            // connection or a body that does not end.
            let (status, _, reply) = rt.block_on(server.request(Method::POST, path, &text));
            match status.as_u16() {
                200 => {}
                400 => {
                    let v: Value = serde_json::from_slice(&reply).expect("a JSON error body");
                    let msg = v["error"]["message"].as_str().unwrap_or_default();
                    prop_assert!(!msg.is_empty(), "{}", String::from_utf8_lossy(&reply));
                    prop_assert_eq!(v["error"]["type"].as_str(), Some("invalid_request_error"));
                }
                other => prop_assert!(false, "status {} for {:?}", other, text),
            }
            Ok(())
        })
        .unwrap();
    // and deep nesting is refused, not recursed into
    let deep = format!(
        "{{\"messages\":{}{}}}",
        "[".repeat(100_000),
        "]".repeat(100_000)
    );
    let (status, _, _) = rt.block_on(server.request(Method::POST, "/v1/chat/completions", &deep));
    assert_eq!(status.as_u16(), 400);
    rt.block_on(server.stop());
}
