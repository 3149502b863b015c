//! The Rust tokens equal Python's (`tokenizers` + `jinja2`, rendered as transformers and vLLM do:
//! tests/fixtures/oracle.py) for random chats and completions on the fixture tokenizer.

mod common;

use std::io::Write as _;
use std::process::{Command, Stdio};

use chat_tokens::{ChatTokenizer, RequestKind};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

const WORDS: &[&str] = &[
    "the",
    "quick",
    "brown",
    "fox",
    "router",
    "prefix",
    "cache",
    "tokens",
    "café",
    "東京",
    "Москва",
    "🙂",
    "3.14159",
    "2026-12-07",
    "  spaced  ",
    "\n",
    "\n\n",
    "\t",
    "don't",
    "it's",
    "<|im_end|>",
    "<|im_start|>",
    "<s>",
    "{\"json\": true}",
    "naïve",
    "!?",
    "  ",
    "hello,",
    "world.",
];

fn text(rng: &mut SmallRng) -> String {
    let n = rng.random_range(0..40);
    let mut s = String::new();
    for i in 0..n {
        if i > 0 && rng.random_bool(0.7) {
            s.push(' ');
        }
        s.push_str(WORDS[rng.random_range(0..WORDS.len())]);
    }
    s
}

fn content(rng: &mut SmallRng) -> Value {
    match rng.random_range(0..4) {
        0 => json!([{"type": "text", "text": text(rng)}, {"type": "text", "text": text(rng)}]),
        1 => json!([{"type": "text", "text": text(rng)}]),
        _ => json!(text(rng)),
    }
}

fn random_chat(rng: &mut SmallRng) -> Value {
    let mut messages = Vec::new();
    if rng.random_bool(0.5) {
        messages.push(json!({"role": "system", "content": content(rng)}));
    }
    for turn in 0..rng.random_range(1..6) {
        messages.push(json!({"role": "user", "content": content(rng)}));
        if turn > 0 || rng.random_bool(0.5) {
            let mut m = json!({"role": "assistant", "content": content(rng)});
            if rng.random_bool(0.3) {
                m["tool_calls"] = json!([{
                    "id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"days\": 3, \"metric\": true}"}
                }]);
                messages.push(m);
                messages
                    .push(json!({"role": "tool", "tool_call_id": "call_1", "content": text(rng)}));
            } else {
                messages.push(m);
            }
        }
    }
    let mut body = json!({"model": "tiny", "messages": messages});
    if rng.random_bool(0.3) {
        body["tools"] = json!([{"type": "function", "function": {
            "name": "get_weather", "description": "Weather in a city, °C",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
    }
    if rng.random_bool(0.2) {
        body["add_generation_prompt"] = json!(false);
    }
    body
}

#[test]
fn random_chats_and_completions_match_python() {
    let test = "chat_tokens::oracle::random_chats_and_completions_match_python";
    if test_support::require_tool(
        test,
        test_support::python_modules(&["tokenizers", "jinja2"]),
    )
    .is_none()
    {
        return;
    }
    let dir = common::fixture_dir();
    let tokenizer = ChatTokenizer::load(dir.join("tokenizer.json")).unwrap();
    assert!(tokenizer.remembers_pieces());
    // Chats encoded whole, and piece by piece with a memory small enough to turn over.
    let whole = ChatTokenizer::load(dir.join("tokenizer.json"))
        .unwrap()
        .with_cache_tokens(0);
    let small = ChatTokenizer::load(dir.join("tokenizer.json"))
        .unwrap()
        .with_cache_tokens(300);
    let mut rng = SmallRng::seed_from_u64(56);
    let mut bodies = Vec::new();
    for i in 0..60 {
        if i % 4 == 3 {
            let mut body = json!({"model": "tiny", "prompt": text(&mut rng)});
            if i % 8 == 7 {
                body["add_special_tokens"] = json!(false);
            }
            bodies.push(json!({"kind": "completions", "body": body}));
        } else {
            bodies.push(json!({"kind": "chat", "body": random_chat(&mut rng)}));
        }
    }
    let job = json!({
        "tokenizer": dir.join("tokenizer.json"),
        "template": std::fs::read_to_string(dir.join("chat_template.jinja")).unwrap(),
        "special": {"bos_token": "<s>", "eos_token": "<|im_end|>"},
        "bodies": bodies,
    });
    let mut child = Command::new("python3")
        .arg(dir.join("../oracle.py"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3 runs");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(job.to_string().as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "oracle.py failed");
    let expected: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap();
    let mut ids = Vec::new();
    let mut longest = 0;
    for (item, expected) in bodies.iter().zip(&expected) {
        let kind = match item["kind"].as_str() {
            Some("chat") => RequestKind::Chat,
            _ => RequestKind::Completions,
        };
        let body = item["body"].to_string();
        tokenizer
            .tokens(body.as_bytes(), kind, &mut ids)
            .unwrap_or_else(|e| panic!("{e}\nbody: {body}"));
        let expected: Vec<u32> = serde_json::from_value(expected.clone())
            .unwrap_or_else(|_| panic!("the oracle failed: {expected}\nbody: {body}"));
        if ids != expected {
            let rendered = match kind {
                RequestKind::Chat => tokenizer.render_chat(body.as_bytes()).unwrap(),
                RequestKind::Completions => String::new(),
            };
            panic!("tokens differ for {body}\nrust rendered: {rendered:?}\nrust:   {ids:?}\npython: {expected:?}");
        }
        for (name, other) in [
            ("whole", &whole),
            ("small memory", &small),
            ("again", &tokenizer),
        ] {
            let mut again = Vec::new();
            other.tokens(body.as_bytes(), kind, &mut again).unwrap();
            assert_eq!(again, expected, "{name}: {body}");
        }
        longest = longest.max(ids.len());
    }
    assert!(
        longest > 100,
        "the chats are long enough to mean something: {longest}"
    );
}
