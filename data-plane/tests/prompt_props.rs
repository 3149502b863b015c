//! Randomized inputs for the prompt key and the routing-table validator.
//!
//! A fixed seed in the normal suite (`PROPTEST_CASES` raises the case count on demand, e.g.
//! `PROPTEST_CASES=20000 cargo test -p data-plane --test prompt_props`). Properties:
//! - no input panics: arbitrary bytes, arbitrary JSON, adversarial nesting (bounded work);
//! - a chat or completion body's key is a function of its canonical prompt text only: the same
//!   under any JSON whitespace, object member order and string escaping, and equal to the
//!   reference (canonical text cut at `prefix_length` characters and after the first user
//!   message, hashed in 64-byte chained blocks);
//! - `find_model` finds exactly the top-level string `model`;
//! - a wire routing table from arbitrary bytes or arbitrary fields is built or rejected with an
//!   error, never a panic.

use std::time::{Duration, Instant};

use data_plane::prompt::{
    deep_prompt_key, find_model, prompt_key, BlockHasher, BodyKind, KeySource, DEFAULT_SEED,
};
use data_plane::table::RoutingTable;
use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed};
use prost::Message as _;
use serde_json::{Map, Value};

/// Fixed seed, cases from `PROPTEST_CASES` (default 256), no regression files written: a failure
/// found here becomes a regular test with its input.
fn config() -> Config {
    Config {
        rng_seed: RngSeed::Fixed(0x15),
        failure_persistence: None,
        ..Config::default()
    }
}

/// Choices drawn while writing a JSON document: whitespace, member order, escapes.
struct Noise<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Noise<'_> {
    fn next(&mut self) -> u8 {
        if self.bytes.is_empty() {
            return 0;
        }
        let b = self.bytes[self.at % self.bytes.len()];
        self.at += 1;
        b
    }

    fn ws(&mut self, out: &mut String) {
        out.push_str(match self.next() % 6 {
            0..=2 => "",
            3 => " ",
            4 => "\n  ",
            _ => "\t\r\n ",
        });
    }
}

/// `v` as JSON text with whitespace between every token, object members in an order drawn from
/// `noise`, and characters of strings written as `\uXXXX` (or `\/`) now and then.
fn write_noisy(v: &Value, noise: &mut Noise<'_>, out: &mut String) {
    noise.ws(out);
    match v {
        Value::String(s) => write_string(s, noise, out),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_noisy(item, noise, out);
            }
            noise.ws(out);
            out.push(']');
        }
        Value::Object(members) => {
            let mut order: Vec<(&String, &Value)> = members.iter().collect();
            // A Fisher-Yates shuffle driven by the noise.
            for i in (1..order.len()).rev() {
                let j = usize::from(noise.next()) % (i + 1);
                order.swap(i, j);
            }
            out.push('{');
            for (i, (k, item)) in order.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                noise.ws(out);
                write_string(k, noise, out);
                noise.ws(out);
                out.push(':');
                write_noisy(item, noise, out);
            }
            noise.ws(out);
            out.push('}');
        }
        other => out.push_str(&other.to_string()),
    }
    noise.ws(out);
}

fn write_string(s: &str, noise: &mut Noise<'_>, out: &mut String) {
    use std::fmt::Write as _;
    out.push('"');
    for c in s.chars() {
        let escape = noise.next().is_multiple_of(8);
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '/' if escape => out.push_str("\\/"),
            c if (c as u32) < 0x20 || escape => {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{u:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Text with the characters JSON and UTF-8 make interesting: quotes, backslashes, controls,
/// 2-, 3- and 4-byte characters, and plain ASCII.
fn text() -> impl Strategy<Value = String> {
    let ch = prop_oneof![
        4 => proptest::char::range('a', 'z'),
        1 => Just(' '),
        1 => prop::sample::select(vec!['"', '\\', '/', '\n', '\t', '\u{1}', '\u{7f}']),
        1 => prop::sample::select(vec!['é', 'ü', '€', '世', '界', '😀', '\u{10ffff}', '\u{2028}']),
        1 => any::<char>(),
    ];
    prop::collection::vec(ch, 0..300).prop_map(|v| v.into_iter().collect())
}

/// A message's content: a string, an array of parts, or null.
#[derive(Debug, Clone)]
enum Content {
    Text(String),
    Parts(Vec<(bool, String)>), // (type is "text", text)
    Null,
}

#[derive(Debug, Clone)]
struct Message {
    role: &'static str,
    content: Content,
    name: Option<String>,
}

fn message() -> impl Strategy<Value = Message> {
    let content = prop_oneof![
        4 => text().prop_map(Content::Text),
        2 => prop::collection::vec((any::<bool>(), text()), 0..4).prop_map(Content::Parts),
        1 => Just(Content::Null),
    ];
    (
        prop::sample::select(vec!["system", "user", "assistant", "tool", "developer"]),
        content,
        prop::option::of(text()),
    )
        .prop_map(|(role, content, name)| Message {
            role,
            content,
            name,
        })
}

fn chat_value(messages: &[Message], extra: &Map<String, Value>) -> Value {
    let messages: Vec<Value> = messages
        .iter()
        .map(|m| {
            let mut o = Map::new();
            o.insert("role".into(), Value::String(m.role.into()));
            o.insert(
                "content".into(),
                match &m.content {
                    Content::Text(t) => Value::String(t.clone()),
                    Content::Null => Value::Null,
                    Content::Parts(parts) => Value::Array(
                        parts
                            .iter()
                            .map(|(is_text, t)| {
                                let mut p = Map::new();
                                if *is_text {
                                    p.insert("type".into(), "text".into());
                                    p.insert("text".into(), Value::String(t.clone()));
                                } else {
                                    p.insert("type".into(), "image_url".into());
                                    p.insert("image_url".into(), serde_json::json!({"url": t}));
                                }
                                Value::Object(p)
                            })
                            .collect(),
                    ),
                },
            );
            if let Some(n) = &m.name {
                o.insert("name".into(), Value::String(n.clone()));
            }
            Value::Object(o)
        })
        .collect();
    let mut body = extra.clone();
    body.insert("messages".into(), Value::Array(messages));
    Value::Object(body)
}

/// The contract's key region for a chat: `role\ncontent\n` per message, up to `limit`
/// characters and never past the end of the first user message.
fn reference_chat_text(messages: &[Message], limit: usize) -> String {
    let mut text = String::new();
    for m in messages {
        text.push_str(m.role);
        text.push('\n');
        match &m.content {
            Content::Text(t) => text.push_str(t),
            Content::Parts(parts) => {
                for (is_text, t) in parts {
                    if *is_text {
                        text.push_str(t);
                    }
                }
            }
            Content::Null => {}
        }
        text.push('\n');
        if m.role == "user" {
            break;
        }
    }
    text.chars().take(limit).collect()
}

fn hash_of(text: &str) -> (u64, u32) {
    let mut h = BlockHasher::new(DEFAULT_SEED);
    h.feed(text.as_bytes());
    h.finish()
}

/// Top-level members besides the prompt: a model, flags, and nested values to skip.
fn extra_members() -> impl Strategy<Value = Map<String, Value>> {
    (
        prop::option::of(text()),
        prop::option::of(any::<bool>()),
        prop::option::of(json_value()),
    )
        .prop_map(|(model, stream, tools)| {
            let mut m = Map::new();
            if let Some(model) = model {
                m.insert("model".into(), Value::String(model));
            }
            if let Some(s) = stream {
                m.insert("stream".into(), Value::Bool(s));
            }
            if let Some(t) = tools {
                m.insert("tools".into(), t);
            }
            m
        })
}

/// Any JSON value, nested a few levels, with member names that matter to the scanner.
fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(Value::from),
        text().prop_map(Value::String),
    ];
    let name = prop_oneof![
        3 => prop::sample::select(vec![
            "model", "messages", "prompt", "role", "content", "type", "text", "user", "x",
        ])
        .prop_map(String::from),
        1 => text(),
    ];
    leaf.prop_recursive(5, 64, 8, move |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..8).prop_map(Value::Array),
            prop::collection::vec((name.clone(), inner), 0..8)
                .prop_map(|members| Value::Object(members.into_iter().collect())),
        ]
    })
}

fn all_keys(body: &[u8]) {
    for limit in [0, 1, 7, 64, 2048] {
        let _ = prompt_key(BodyKind::OpenAi, body, limit, DEFAULT_SEED);
        let _ = prompt_key(BodyKind::Raw, body, limit, 3);
        let _ = deep_prompt_key(body, limit, DEFAULT_SEED);
    }
    let _ = find_model(body);
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn arbitrary_bytes_never_panic(body in prop::collection::vec(any::<u8>(), 0..2048)) {
        all_keys(&body);
        // raw keys are the leading bytes, whatever they are
        let k = prompt_key(BodyKind::Raw, &body, 64, DEFAULT_SEED);
        prop_assert_eq!(k.source, KeySource::Raw);
        prop_assert_eq!(k.len as usize, body.len().min(64));
    }

    #[test]
    fn arbitrary_json_never_panics_and_its_key_ignores_formatting(
        v in json_value(),
        noise in prop::collection::vec(any::<u8>(), 1..64),
        cut in any::<prop::sample::Index>(),
    ) {
        let compact = serde_json::to_vec(&v).unwrap();
        let mut noisy = String::new();
        write_noisy(&v, &mut Noise { bytes: &noise, at: 0 }, &mut noisy);
        all_keys(&compact);
        all_keys(noisy.as_bytes());
        // and every prefix of it (a truncated body)
        all_keys(&compact[..cut.index(compact.len() + 1)]);
        // JSON read as chat or completion is keyed by its text, however it is written. (A body
        // with more than one of `messages`, `prompt` and `input` is no valid request of any API:
        // it is keyed by whichever comes first, so its member order matters. Found at 10,000
        // cases: `{"messages":[],"prompt":""}`.)
        let prompts = ["messages", "prompt", "input"]
            .iter()
            .filter(|k| v.get(**k).is_some())
            .count();
        if prompts > 1 {
            return Ok(());
        }
        let a = prompt_key(BodyKind::OpenAi, &compact, 256, DEFAULT_SEED);
        let b = prompt_key(BodyKind::OpenAi, noisy.as_bytes(), 256, DEFAULT_SEED);
        if a.source != KeySource::Raw && b.source != KeySource::Raw {
            prop_assert_eq!(a, b, "{} vs {}", String::from_utf8_lossy(&compact), noisy);
        }
    }

    #[test]
    fn chat_key_is_the_canonical_text_however_the_json_is_written(
        messages in prop::collection::vec(message(), 1..6),
        extra in extra_members(),
        limit in prop_oneof![Just(64usize), 1usize..400, Just(2048), Just(65536)],
        noise in prop::collection::vec(any::<u8>(), 1..64),
    ) {
        let v = chat_value(&messages, &extra);
        let compact = serde_json::to_vec(&v).unwrap();
        let mut noisy = String::new();
        write_noisy(&v, &mut Noise { bytes: &noise, at: 0 }, &mut noisy);
        let expected_text = reference_chat_text(&messages, limit);
        let (hash, blocks) = hash_of(&expected_text);
        for body in [&compact[..], noisy.as_bytes()] {
            let k = prompt_key(BodyKind::OpenAi, body, limit, DEFAULT_SEED);
            prop_assert_eq!(k.source, KeySource::Chat, "{}", String::from_utf8_lossy(body));
            prop_assert_eq!(
                (k.hash, k.blocks, k.len as usize),
                (hash, blocks, expected_text.chars().count()),
                "expected text {:?} from {}", expected_text, String::from_utf8_lossy(body)
            );
        }
        let deep = |b: &[u8]| deep_prompt_key(b, limit, DEFAULT_SEED);
        prop_assert_eq!(deep(&compact), deep(noisy.as_bytes()));
    }

    #[test]
    fn completion_key_is_the_prompt_text_however_the_json_is_written(
        prompt in text(),
        as_array in any::<bool>(),
        extra in extra_members(),
        limit in 1usize..400,
        noise in prop::collection::vec(any::<u8>(), 1..64),
    ) {
        let mut body = extra;
        let p = Value::String(prompt.clone());
        body.insert("prompt".into(), if as_array { Value::Array(vec![p]) } else { p });
        let v = Value::Object(body);
        let mut noisy = String::new();
        write_noisy(&v, &mut Noise { bytes: &noise, at: 0 }, &mut noisy);
        let expected: String = prompt.chars().take(limit).collect();
        let k = prompt_key(BodyKind::OpenAi, noisy.as_bytes(), limit, DEFAULT_SEED);
        prop_assert_eq!(k.source, KeySource::Completion);
        prop_assert_eq!((k.hash, k.blocks), hash_of(&expected), "{}", noisy);
    }

    #[test]
    fn find_model_finds_exactly_the_top_level_string_model(
        messages in prop::collection::vec(message(), 0..3),
        extra in extra_members(),
        nested_model in any::<bool>(),
        noise in prop::collection::vec(any::<u8>(), 1..64),
    ) {
        let mut v = chat_value(&messages, &extra);
        if nested_model {
            // a "model" member inside a nested object must not be taken for the top-level one
            v["tools"] = serde_json::json!([{"model": "not-this-one"}]);
        }
        let mut noisy = String::new();
        write_noisy(&v, &mut Noise { bytes: &noise, at: 0 }, &mut noisy);
        let expected = v.get("model").and_then(Value::as_str);
        let found = find_model(noisy.as_bytes());
        prop_assert_eq!(found.as_deref(), expected, "{}", noisy);
    }

    #[test]
    fn routing_table_from_arbitrary_bytes_is_rejected_or_built(
        bytes in prop::collection::vec(any::<u8>(), 0..512),
    ) {
        if let Ok(wire) = proto::RoutingTable::decode(bytes.as_slice()) {
            let _ = RoutingTable::build(wire, None);
        }
    }

    #[test]
    fn routing_table_from_arbitrary_fields_is_rejected_with_a_reason_or_built(
        wire in wire_table(),
    ) {
        match RoutingTable::build(wire.clone(), None) {
            Err(e) => prop_assert!(!e.to_string().is_empty()),
            Ok(table) => {
                // what was accepted is what was sent, and its ranges hold
                prop_assert_eq!(table.endpoints().count(), wire.endpoints.len());
                for e in table.endpoints() {
                    prop_assert!(!e.name().is_empty());
                    for v in e.variants() {
                        prop_assert!(v.weight().is_finite() && v.weight() > 0.0);
                    }
                }
                // and it survives a swap onto itself
                let again = RoutingTable::build(wire, Some(&table));
                prop_assert!(again.is_ok());
            }
        }
    }
}

/// Wire tables with fields drawn near and across their valid ranges.
fn wire_table() -> impl Strategy<Value = proto::RoutingTable> {
    let name = prop_oneof![
        4 => prop::sample::select(vec!["e1", "e2", "v1", "v2", "chat"]).prop_map(String::from),
        1 => Just(String::new()),
        1 => text(),
    ];
    let address = prop_oneof![
        4 => (1u16..65535).prop_map(|p| format!("http://127.0.0.1:{p}")),
        1 => prop::sample::select(vec![
            "", "http://", "https://h:1", "ftp://h:1", "http://h:99999", "127.0.0.1:80",
            "http://[::1]:8/x", "http://a b:1",
        ])
        .prop_map(String::from),
        1 => text(),
    ];
    let instance = (name.clone(), address).prop_map(|(id, address)| proto::Instance {
        instance_id: format!("i-{id}"),
        address,
    });
    let routing = (
        -1i32..5,
        prop_oneof![Just(0u32), 63u32..70, 65530u32..65540, any::<u32>()],
        prop_oneof![Just(0u32), 1u32..5, 4090u32..4100, any::<u32>()],
        any::<bool>(),
    )
        .prop_map(|(strategy, prefix_length, concurrency_threshold, set)| {
            set.then_some(proto::RoutingConfig {
                routing_strategy: strategy,
                prefix_aware_routing_config: Some(proto::PrefixAwareRoutingConfig {
                    prefix_length,
                    concurrency_threshold,
                    ..Default::default()
                }),
                ..Default::default()
            })
        });
    let weight = prop_oneof![
        Just(0.0f32),
        Just(1.0f32),
        Just(f32::NAN),
        Just(f32::INFINITY),
        any::<f32>(),
    ];
    let variant = (
        name.clone(),
        weight,
        routing,
        prop::collection::vec(instance, 0..4),
    )
        .prop_map(
            |(variant_name, weight, routing_config, instances)| proto::VariantRoutes {
                variant_name,
                model_name: "llama".into(),
                weight,
                routing_config,
                instances,
            },
        );
    let endpoint =
        (name, prop::collection::vec(variant, 0..3)).prop_map(|(endpoint_name, variants)| {
            proto::EndpointRoutes {
                endpoint_name,
                endpoint_config_name: "c".into(),
                endpoint_config_revision: 1,
                variants,
            }
        });
    (1u64..u64::MAX, prop::collection::vec(endpoint, 0..3))
        .prop_map(|(version, endpoints)| proto::RoutingTable { version, endpoints })
}

/// `[` x depth + `]` x depth, placed where the scanner has to skip it, or read into it.
fn nested(depth: usize, open: u8, close: u8) -> Vec<u8> {
    let mut v = vec![open; depth];
    if open == b'{' {
        // {"a":{"a":...{}...}}
        v = b"{\"a\":".repeat(depth);
        v.extend_from_slice(b"{}");
    }
    v.extend(std::iter::repeat_n(close, depth));
    v
}

#[test]
fn adversarial_nesting_is_bounded_work_without_recursion() {
    const DEPTH: usize = 100_000;
    let arrays = nested(DEPTH, b'[', b']');
    let objects = nested(DEPTH, b'{', b'}');
    let mut bodies: Vec<Vec<u8>> = Vec::new();
    for deep in [&arrays, &objects] {
        let deep = String::from_utf8_lossy(deep);
        bodies.push(deep.as_bytes().to_vec());
        for body in [
            format!(r#"{{"tools":{deep},"messages":[{{"role":"user","content":"hi"}}]}}"#),
            format!(r#"{{"messages":{deep}}}"#),
            format!(r#"{{"messages":[{{"role":"user","content":{deep}}}]}}"#),
            format!(r#"{{"messages":[{{"content":{deep},"role":"user"}}],"model":"m"}}"#),
            format!(
                r#"{{"messages":[{{"role":"user","content":[{{"type":"text","text":{deep}}}]}}]}}"#
            ),
            format!(r#"{{"prompt":{deep}}}"#),
            format!(r#"{{"x":{deep},"model":"m"}}"#),
            format!(r#"{{"x":{deep}"#), // unterminated
        ] {
            bodies.push(body.into_bytes());
        }
    }
    // On a thread with a small stack: any recursion per nesting level would overflow it.
    let worker = std::thread::Builder::new()
        .stack_size(256 << 10)
        .spawn(move || {
            let started = Instant::now();
            for body in &bodies {
                all_keys(body);
            }
            started.elapsed()
        })
        .unwrap();
    let took = worker.join().expect("no stack overflow, no panic");
    // 18 bodies of ~100-500 KB, each scanned a few times: linear work is milliseconds even in a
    // debug build; quadratic work would take minutes. The bound is generous for a busy machine.
    assert!(took < Duration::from_secs(20), "took {took:?}");
    // and the key of the chat after the skipped nesting is still found
    let body = format!(
        r#"{{"tools":{},"messages":[{{"role":"user","content":"hi"}}]}}"#,
        String::from_utf8_lossy(&arrays)
    );
    let k = prompt_key(BodyKind::OpenAi, body.as_bytes(), 2048, DEFAULT_SEED);
    assert_eq!(k.source, KeySource::Chat);
    assert_eq!(k.hash, hash_of("user\nhi\n").0);
    assert_eq!(
        find_model(
            format!(
                r#"{{"x":{},"model":"m"}}"#,
                String::from_utf8_lossy(&arrays)
            )
            .as_bytes()
        )
        .as_deref(),
        Some("m")
    );
}
