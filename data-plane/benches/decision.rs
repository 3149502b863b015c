//! Routing-decision cost: body parse + prompt-key hash + endpoint/variant/instance choice, for a
//! 32 KiB chat body (target: p50 < 10 us with 7 instances, < 25 us with 1,000; the prefix index warm), and the cost of building (swapping in) a table of
//! 1,000 instances (target: < 1 ms).
//!
//! `cargo bench -p data-plane --bench decision` (`-- decision_precise` for the KV-events path:
//! tokenization included, target p50 < 50 us for a 2,000-token chat).

use std::hint::black_box;

#[path = "fixtures/content_first.rs"]
mod content_first;
use content_first::chat_body_32k_content_first;

use criterion::{criterion_group, criterion_main, BatchSize, BenchmarkId, Criterion};
use data_plane::load::InFlight;
use data_plane::placement::{Placement, RouteRequest};
use data_plane::prompt::BodyKind;
use data_plane::table::RoutingTable;
use proto::{
    EndpointRoutes, PrefixAwareRoutingConfig, RoutingConfig, RoutingStrategy, VariantRoutes,
};

fn wire_table(instances: usize, strategy: RoutingStrategy) -> proto::RoutingTable {
    proto::RoutingTable {
        version: 1,
        endpoints: vec![EndpointRoutes {
            endpoint_name: "e".into(),
            endpoint_config_name: "c".into(),
            endpoint_config_revision: 1,
            variants: vec![VariantRoutes {
                variant_name: "v1".into(),
                model_name: "m".into(),
                weight: 1.0,
                routing_config: Some(RoutingConfig {
                    routing_strategy: strategy as i32,
                    prefix_aware_routing_config: Some(PrefixAwareRoutingConfig {
                        prefix_length: 2048,
                        concurrency_threshold: 64,
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
                instances: (0..instances)
                    .map(|i| {
                        let a = format!(
                            "http://10.{}.{}.{}:8000",
                            i / 65536,
                            (i / 256) % 256,
                            i % 256
                        );
                        proto::Instance {
                            instance_id: a.clone(),
                            address: a,
                        }
                    })
                    .collect(),
            }],
        }],
    }
}

/// A 32 KiB multi-turn chat as the OpenAI Python client sends it (`messages` first, `role` before
/// `content`, `model` after the messages): an 8 KiB system prompt, turns with escaped newlines and
/// quotes.
fn chat_body_32k() -> Vec<u8> {
    let q = |s: &str| serde_json::to_string(s).unwrap();
    let system = "You are a meticulous assistant.\nFollow the \"house style\" guide. ".repeat(130);
    let mut messages = vec![format!(
        r#"{{"role": "system", "content": {}}}"#,
        q(&system)
    )];
    let mut turn = 0;
    loop {
        let user = format!("Question {turn}: explain item {turn} of the list in detail.\nThanks!");
        messages.push(format!(r#"{{"role": "user", "content": {}}}"#, q(&user)));
        let body = format!(
            r#"{{"messages": [{}], "model": "e", "stream": true}}"#,
            messages.join(", ")
        );
        if body.len() >= 32 * 1024 {
            return body.into_bytes();
        }
        let answer = "Here is a detailed answer.\n- point one\n- point two\n".repeat(8);
        messages.push(format!(
            r#"{{"role": "assistant", "content": {}}}"#,
            q(&answer)
        ));
        turn += 1;
    }
}

fn decision(c: &mut Criterion) {
    let body = chat_body_32k();
    assert!(body.len() >= 32 * 1024);
    let mut group = c.benchmark_group("decision_32KiB_chat");
    for (n, strategy, name) in [
        (7, RoutingStrategy::PrefixAware, "prefix_aware"),
        (1000, RoutingStrategy::PrefixAware, "prefix_aware"),
        (
            7,
            RoutingStrategy::LeastOutstandingRequests,
            "least_outstanding",
        ),
        (
            1000,
            RoutingStrategy::LeastOutstandingRequests,
            "least_outstanding",
        ),
        (7, RoutingStrategy::Random, "random"),
    ] {
        let table = RoutingTable::try_from(wire_table(n, strategy)).unwrap();
        let placement = Placement::new(None);
        // endpoint from the `model` field at the end of the body (worst case: the whole body is scanned)
        let by_model = RouteRequest {
            kind: BodyKind::OpenAi,
            body: &body,
            endpoint: None,
            target_variant: None,
            prefix_aware_id: None,
        };
        let by_header = RouteRequest {
            endpoint: Some("e"),
            ..by_model
        };
        // The endpoint named by header as well, where the key is what costs.
        let requests: &[(&str, &RouteRequest)] = if strategy == RoutingStrategy::PrefixAware {
            &[("model_field", &by_model), ("endpoint_header", &by_header)]
        } else {
            &[("model_field", &by_model)]
        };
        for &(how, req) in requests {
            group.bench_with_input(
                BenchmarkId::new(format!("{name}/{how}"), n),
                req,
                |b, req| {
                    b.iter(|| {
                        let route = placement.route(&table, black_box(req)).unwrap();
                        let guard = InFlight::start(
                            route.variant.instances()[route.instance].state(),
                            route.variant.load(),
                        );
                        black_box((route.instance, route.decision));
                        drop(guard);
                    })
                },
            );
        }
    }
    group.finish();

    // Reference point: what a full serde_json parse of the same body costs (why the key is taken
    // by a scanner that stops early).
    #[derive(serde::Deserialize)]
    #[allow(dead_code)]
    struct Message<'a> {
        #[serde(borrow)]
        role: std::borrow::Cow<'a, str>,
        #[serde(borrow)]
        content: std::borrow::Cow<'a, str>,
    }
    #[derive(serde::Deserialize)]
    #[allow(dead_code)]
    struct ChatBody<'a> {
        #[serde(borrow)]
        messages: Vec<Message<'a>>,
        #[serde(borrow)]
        model: Option<std::borrow::Cow<'a, str>>,
    }
    c.bench_function("parts/prompt_key_2048_chars", |b| {
        b.iter(|| {
            black_box(data_plane::prompt::prompt_key(
                BodyKind::OpenAi,
                black_box(&body),
                2048,
                1,
            ))
        })
    });
    let content_first = chat_body_32k_content_first();
    c.bench_function("parts/prompt_key_4096_chars_content_first", |b| {
        b.iter(|| {
            black_box(data_plane::prompt::prompt_key(
                BodyKind::OpenAi,
                black_box(&content_first),
                4096,
                1,
            ))
        })
    });
    let mut blocks = Vec::new();
    c.bench_function("parts/prompt_blocks_32KiB", |b| {
        b.iter(|| {
            black_box(data_plane::prompt::prompt_blocks(
                BodyKind::OpenAi,
                black_box(&body),
                1,
                data_plane::placement::MAX_PROMPT_BYTES,
                &mut blocks,
            ))
        })
    });
    c.bench_function("parts/find_model_32KiB", |b| {
        b.iter(|| black_box(data_plane::prompt::find_model(black_box(&body)).is_some()))
    });
    c.bench_function("reference/serde_json_borrowed_parse_32KiB", |b| {
        b.iter(|| {
            let parsed: ChatBody<'_> = serde_json::from_slice(black_box(&body)).unwrap();
            black_box(parsed.messages.len());
        })
    });
}

fn table_build(c: &mut Criterion) {
    let mut group = c.benchmark_group("table_build");
    for n in [7usize, 1000] {
        let wire = wire_table(n, RoutingStrategy::PrefixAware);
        let previous = RoutingTable::try_from(wire.clone()).unwrap();
        group.bench_with_input(BenchmarkId::new("fresh", n), &wire, |b, wire| {
            b.iter_batched(
                || wire.clone(),
                |w| RoutingTable::build(w, None).unwrap(),
                BatchSize::SmallInput,
            )
        });
        group.bench_with_input(
            BenchmarkId::new("swap_reusing_state", n),
            &wire,
            |b, wire| {
                b.iter_batched(
                    || wire.clone(),
                    |w| RoutingTable::build(w, Some(&previous)).unwrap(),
                    BatchSize::SmallInput,
                )
            },
        );
    }
    group.finish();
}

/// A chat of about 2,000 tokens of chat-tokens' tiny tokenizer (a system prompt and turns), its
/// last user message `last`.
fn chat_2k_tokens(last: &str) -> Vec<u8> {
    let mut messages = vec![serde_json::json!({"role": "system",
        "content": "You are a meticulous assistant. Follow the house style guide. ".repeat(40)})];
    for turn in 0..8 {
        messages.push(serde_json::json!({"role": "user",
            "content": format!("Question {turn}: explain item {turn} of the list in detail.")}));
        messages.push(serde_json::json!({"role": "assistant",
            "content": "Here is a detailed answer. First point, then the second point. ".repeat(6)}));
    }
    messages.push(serde_json::json!({"role": "user", "content": last}));
    serde_json::to_vec(&serde_json::json!({"model": "e", "messages": messages})).unwrap()
}

/// PREFIX_AWARE on the engines' KV events (issue 56): the decision with the prompt tokenized as
/// the engines do (chat template + tokenizer.json) and matched on the exact index, one instance
/// holding the chat's history (target: p50 < 50 us for a 2,000-token chat on one core).
fn precise(c: &mut Criterion) {
    let mut wire = wire_table(7, RoutingStrategy::PrefixAware);
    let pa = wire.endpoints[0].variants[0]
        .routing_config
        .as_mut()
        .unwrap()
        .prefix_aware_routing_config
        .as_mut()
        .unwrap();
    pa.kv_events = Some(proto::KvEventsConfig {
        endpoint: "tcp://{host}:5557".into(),
        block_size: 16,
        ..Default::default()
    });
    pa.tokenizer = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../chat-tokens/tests/fixtures/tiny/tokenizer.json"
    )
    .into();
    let table = RoutingTable::try_from(wire).unwrap();
    let variant = &table.endpoints().next().unwrap().variants()[0];
    let kv = variant.kv_events().unwrap();
    let history = chat_2k_tokens("And the last item?");
    let mut tokens = Vec::new();
    kv.tokenizer
        .tokens(&history, chat_tokens::RequestKind::Chat, &mut tokens)
        .unwrap();
    let blocks = tokens.len() / 16;
    tokens.truncate(blocks * 16);
    // every instance publishes; instance 3 holds the history
    for (i, &id) in variant.id_hashes().iter().enumerate() {
        let event = if i == 3 {
            kv_events::Event::Stored {
                hashes: (1..=blocks as u64).collect(),
                parent: None,
                token_ids: tokens.clone(),
                block_size: 16,
                lora_name: None,
                medium: None,
                group_idx: None,
            }
        } else {
            kv_events::Event::Cleared
        };
        variant.load().kv().apply(id, &event);
    }
    let placement = Placement::new(None);
    let route = |body: &[u8]| {
        let req = RouteRequest {
            kind: BodyKind::OpenAi,
            body,
            endpoint: Some("e"),
            target_variant: None,
            prefix_aware_id: None,
        };
        let route = placement.route(&table, &req).unwrap();
        assert_eq!(route.instance, 3, "the instance holding the history");
        black_box(route.decision);
    };
    let mut group = c.benchmark_group("decision_precise_2k_token_chat");
    group.bench_function("same_chat_again", |b| b.iter(|| route(black_box(&history))));
    let mut n = 0u64;
    group.bench_function("new_last_message", |b| {
        b.iter_batched(
            || {
                n += 1;
                chat_2k_tokens(&format!("And item {n}, please?"))
            },
            |body| route(&body),
            BatchSize::SmallInput,
        )
    });
    // a 32 KiB document with a new question after it, in one user message (the document's
    // chunks are remembered; only the last is encoded again)
    let document = "The quarterly report covers revenue, costs and the outlook. ".repeat(550);
    let mut q = 0u64;
    group.bench_function("document_32KiB_new_question", |b| {
        b.iter_batched(
            || {
                q += 1;
                serde_json::to_vec(&serde_json::json!({"model": "e", "messages": [
                    {"role": "user", "content": format!("{document}\nQuestion {q}: why?")}]}))
                .unwrap()
            },
            |body| {
                let req = RouteRequest {
                    kind: BodyKind::OpenAi,
                    body: &body,
                    endpoint: Some("e"),
                    target_variant: None,
                    prefix_aware_id: None,
                };
                black_box(placement.route(&table, &req).unwrap().instance);
            },
            BatchSize::SmallInput,
        )
    });
    group.finish();
}

criterion_group!(benches, decision, precise, table_build);
criterion_main!(benches);
