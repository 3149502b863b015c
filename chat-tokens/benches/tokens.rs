//! The time to tokenize a ~2,000-token chat as the engine does (render the template, encode),
//! which the router pays per request. Issue 56's budget for a whole routing decision with
//! tokenization is 50 us on one core. Run: `cargo bench -p chat-tokens --bench tokens`.

use std::path::Path;

use chat_tokens::{ChatTokenizer, RequestKind};
use criterion::{criterion_group, criterion_main, Criterion};

fn chat_of_about(tokenizer: &ChatTokenizer, target_tokens: usize) -> Vec<u8> {
    let paragraph = "A router sends each request to the engine that already holds its prompt's \
        prefix in its KV cache, so the prefill computes only the tokens it has not seen. The \
        quick brown fox jumps over the lazy dog; café, naïve, 東京, 3.14159 and 2026-12-07. ";
    let mut messages =
        vec![serde_json::json!({"role": "system", "content": "You are a helpful assistant."})];
    let mut ids = Vec::new();
    let mut turn = 0;
    loop {
        // The messages last, so a bench can append one.
        let body = format!(
            r#"{{"model": "tiny", "messages": {}}}"#,
            serde_json::Value::from(messages.clone())
        );
        tokenizer
            .tokens(body.as_bytes(), RequestKind::Chat, &mut ids)
            .unwrap();
        if ids.len() >= target_tokens {
            eprintln!(
                "bench chat: {} messages, {} bytes, {} tokens",
                messages.len(),
                body.len(),
                ids.len()
            );
            return body.into_bytes();
        }
        let role = if turn % 2 == 0 { "user" } else { "assistant" };
        messages.push(serde_json::json!({"role": role, "content": paragraph.repeat(2)}));
        turn += 1;
    }
}

fn bench(c: &mut Criterion) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny/tokenizer.json");
    let tokenizer = ChatTokenizer::load(&path).unwrap();
    let body = chat_of_about(&tokenizer, 2_000);
    let text = tokenizer.render_chat(&body).unwrap();
    let mut ids = Vec::with_capacity(4096);
    // Every piece remembered: a conversation resent as is.
    c.bench_function("chat_2000_tokens_repeated", |b| {
        b.iter(|| {
            tokenizer
                .tokens(&body, RequestKind::Chat, &mut ids)
                .unwrap()
        })
    });
    // The usual case: the history remembered, a new last user message (~60 tokens) encoded.
    let mut n = 0u64;
    let prefix = &body[..body.len() - 2];
    c.bench_function("chat_2000_tokens_new_last_message", |b| {
        b.iter_batched(
            || {
                n += 1;
                let mut next = prefix.to_vec();
                next.extend_from_slice(
                    format!(",{{\"role\": \"user\", \"content\": \"question {n}: which engine holds \
                             the prefix of this conversation, and how many tokens does it skip?\"}}]}}")
                        .as_bytes(),
                );
                next
            },
            |next| tokenizer.tokens(&next, RequestKind::Chat, &mut ids).unwrap(),
            criterion::BatchSize::SmallInput,
        )
    });
    let whole = ChatTokenizer::load(&path).unwrap().with_cache_tokens(0);
    c.bench_function("chat_2000_tokens_nothing_remembered", |b| {
        b.iter(|| whole.tokens(&body, RequestKind::Chat, &mut ids).unwrap())
    });
    c.bench_function("render_only", |b| {
        b.iter(|| tokenizer.render_chat(&body).unwrap())
    });
    c.bench_function("encode_whole_text", |b| {
        b.iter(|| {
            ids.clear();
            tokenizer.encode(&text, false, &mut ids).unwrap()
        })
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
