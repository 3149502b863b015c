//! Where the template comes from, list-form templates, completions, and errors that name the file
//! or the field.

mod common;

use std::fs;

use chat_tokens::{ChatTokenizer, ContentFormat, Error, RequestKind};
use serde_json::json;

const CHAT: &str = r#"{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello café"}]}"#;

fn tokens(t: &ChatTokenizer, body: &str, kind: RequestKind) -> Vec<u32> {
    let mut out = vec![99]; // replaced, not appended to
    t.tokens(body.as_bytes(), kind, &mut out)
        .unwrap_or_else(|e| panic!("{e}"));
    out
}

fn id(t: &ChatTokenizer, token: &str) -> u32 {
    let mut ids = Vec::new();
    t.encode(token, false, &mut ids).unwrap();
    assert_eq!(ids.len(), 1, "{token} is one token");
    ids[0]
}

#[test]
fn a_chat_renders_the_fixture_template_without_added_special_tokens() {
    let dir = common::model_dir(true);
    let t = ChatTokenizer::load(dir.path().join("tokenizer.json")).unwrap();
    assert_eq!(
        t.chat_template_path(),
        Some(dir.path().join("chat_template.jinja").as_path())
    );
    assert_eq!(t.content_format(), Some(ContentFormat::String));
    let text = t.render_chat(CHAT.as_bytes()).unwrap();
    assert_eq!(
        text,
        "<s><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello café<|im_end|>\n\
         <|im_start|>assistant\n"
    );
    let ids = tokens(&t, CHAT, RequestKind::Chat);
    let mut expected = Vec::new();
    t.encode(&text, false, &mut expected).unwrap();
    assert_eq!(ids, expected);
    assert_eq!(ids[0], id(&t, "<s>"), "the BOS the template writes, once");
    assert_ne!(ids[1], id(&t, "<s>"));
    // Content parts join with "\n"; add_special_tokens adds the post-processor's BOS.
    let parts = r#"{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
                    "add_special_tokens": true, "add_generation_prompt": false}"#;
    let text = t.render_chat(parts.as_bytes()).unwrap();
    assert_eq!(text, "<s><|im_start|>user\na\nb<|im_end|>\n");
    let ids = tokens(&t, parts, RequestKind::Chat);
    assert_eq!(&ids[..2], &[id(&t, "<s>"), id(&t, "<s>")]);
}

#[test]
fn completions_add_special_tokens_unless_told_not_to_and_take_token_ids_as_they_are() {
    let dir = common::model_dir(false);
    let t = ChatTokenizer::load(dir.path().join("tokenizer.json")).unwrap();
    let with = tokens(
        &t,
        r#"{"prompt": "the quick brown fox"}"#,
        RequestKind::Completions,
    );
    let without = tokens(
        &t,
        r#"{"prompt": "the quick brown fox", "add_special_tokens": false}"#,
        RequestKind::Completions,
    );
    assert_eq!(with[0], id(&t, "<s>"));
    assert_eq!(&with[1..], &without[..]);
    assert_eq!(
        tokens(
            &t,
            r#"{"prompt": ["the quick brown fox"]}"#,
            RequestKind::Completions
        ),
        with
    );
    assert_eq!(
        tokens(&t, r#"{"prompt": [5, 6, 7]}"#, RequestKind::Completions),
        [5, 6, 7]
    );
    assert_eq!(
        tokens(&t, r#"{"prompt": [[5, 6]]}"#, RequestKind::Completions),
        [5, 6]
    );
    // No template: a chat cannot be tokenized, and says why.
    let e = t
        .tokens(CHAT.as_bytes(), RequestKind::Chat, &mut Vec::new())
        .unwrap_err();
    assert!(matches!(e, Error::NoChatTemplate { .. }), "{e}");
    assert!(e.to_string().contains("tokenizer.json"), "{e}");
}

#[test]
fn tokenizer_config_templates_string_and_list_form() {
    let dir = common::model_dir(false);
    let template = fs::read_to_string(common::fixture_dir().join("chat_template.jinja")).unwrap();
    let reference = {
        let d = common::model_dir(true);
        let t = ChatTokenizer::load(d.path().join("tokenizer.json")).unwrap();
        tokens(&t, CHAT, RequestKind::Chat)
    };
    // The same template as tokenizer_config.json's string: the same tokens.
    let config = json!({"bos_token": "<s>", "eos_token": {"content": "<|im_end|>"}, "chat_template": template});
    fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
    let t = ChatTokenizer::load(dir.path().join("tokenizer.json")).unwrap();
    assert_eq!(
        t.chat_template_path(),
        Some(dir.path().join("tokenizer_config.json").as_path())
    );
    assert_eq!(tokens(&t, CHAT, RequestKind::Chat), reference);

    // The list form: "default", and "tool_use" when the request has tools.
    let config = json!({"bos_token": "<s>", "chat_template": [
        {"name": "tool_use", "template": "TOOLS {{ tools | length }}"},
        {"name": "default", "template": "{% for m in messages %}[{{ m.role }}]{% endfor %}"},
        {"name": "rag", "template": "RAG"}
    ]});
    fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
    let t = ChatTokenizer::load(dir.path().join("tokenizer.json")).unwrap();
    assert_eq!(t.render_chat(CHAT.as_bytes()).unwrap(), "[system][user]");
    let with_tools =
        r#"{"messages": [], "tools": [{"type": "function", "function": {"name": "f"}}]}"#;
    assert_eq!(t.render_chat(with_tools.as_bytes()).unwrap(), "TOOLS 1");

    // chat_template.jinja wins over tokenizer_config.json's.
    fs::write(
        dir.path().join("chat_template.jinja"),
        "JINJA {{ bos_token }}",
    )
    .unwrap();
    let t = ChatTokenizer::load(dir.path().join("tokenizer.json")).unwrap();
    assert_eq!(t.render_chat(CHAT.as_bytes()).unwrap(), "JINJA <s>");
}

#[test]
fn templates_get_transformers_functions_and_vllm_messages() {
    let dir = common::model_dir(false);
    let template = r#"{% for m in messages %}{% if m.role == 'bad' %}{{ raise_exception('no ' + m.role) }}{% endif %}
{{ m.role }}:{% if m.content is string %}{{ m.content.upper() }}{% else %}{% for p in m.content %}<{{ p.text }}>{% endfor %}{% endif %}
{% if m.tool_calls %}{{ m.tool_calls[0].function.arguments | tojson }}{{ m.tool_calls[0].function.arguments | tojson(indent=2) }}{% endif %}
{% endfor %}{{ {"f": 1.0, "e": 1e-5, "s": "é\n\""} | tojson(sort_keys=true) }}{{ strftime_now("%Y")|length }}"#;
    fs::write(dir.path().join("chat_template.jinja"), template).unwrap();
    let t = ChatTokenizer::load(dir.path().join("tokenizer.json")).unwrap();
    assert_eq!(t.content_format(), Some(ContentFormat::OpenAi));
    let body = json!({"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": null, "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{\"b\": [1, 2], \"a\": {}}"}}]},
        {"role": "tool", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]},
    ]});
    // Through bytes written by hand so the arguments' key order is the request's.
    let text = t.render_chat(body.to_string().as_bytes()).unwrap();
    assert_eq!(
        text,
        // What Python's jinja2 renders with transformers' environment and tojson.
        "user:<hi>assistant:{\"b\": [1, 2], \"a\": {}}{\n  \"b\": [\n    1,\n    2\n  ],\n  \"a\": {}\n}\
         tool:X\nY{\"e\": 1e-05, \"f\": 1.0, \"s\": \"é\\n\\\"\"}4"
    );
    let e = t
        .render_chat(br#"{"messages": [{"role": "bad", "content": "x"}]}"#)
        .unwrap_err();
    assert!(matches!(e, Error::Render { .. }), "{e}");
    assert!(e.to_string().contains("no bad"), "{e}");
    assert!(e.to_string().contains("chat_template.jinja"), "{e}");
}

#[test]
fn bad_files_and_bodies_say_what_and_where() {
    let dir = common::model_dir(true);
    let path = dir.path().join("tokenizer.json");
    let missing = ChatTokenizer::load(dir.path().join("nope.json")).unwrap_err();
    assert!(matches!(missing, Error::Read { .. }), "{missing}");
    assert!(missing.to_string().contains("nope.json"), "{missing}");

    let check = |file: &str, contents: &str, wants: &str| {
        let d = common::model_dir(true);
        fs::write(d.path().join(file), contents).unwrap();
        let e = ChatTokenizer::load(d.path().join("tokenizer.json")).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains(file) && msg.contains(wants), "{file}: {msg}");
    };
    check(
        "tokenizer.json",
        "{\"model\": 3}",
        "not a tokenizers tokenizer.json",
    );
    check("tokenizer_config.json", "{not json", "not JSON");
    check(
        "tokenizer_config.json",
        r#"{"bos_token": 3}"#,
        "bos_token is a number",
    );
    check("chat_template.jinja", "{% for %}", "does not compile");
    {
        let d = common::model_dir(false);
        fs::write(
            d.path().join("tokenizer_config.json"),
            r#"{"chat_template": 5}"#,
        )
        .unwrap();
        let e = ChatTokenizer::load(d.path().join("tokenizer.json"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("tokenizer_config.json") && e.contains("chat_template is a number"),
            "{e}"
        );
        fs::write(
            d.path().join("tokenizer_config.json"),
            r#"{"chat_template": [{"name": "x", "template": "y"}]}"#,
        )
        .unwrap();
        let e = ChatTokenizer::load(d.path().join("tokenizer.json"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("no template named \"default\""), "{e}");
        fs::write(
            d.path().join("tokenizer_config.json"),
            r#"{"chat_template": [{"name": "default"}]}"#,
        )
        .unwrap();
        let e = ChatTokenizer::load(d.path().join("tokenizer.json"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("chat_template[0]"), "{e}");
    }

    let t = ChatTokenizer::load(&path).unwrap();
    let body_error = |body: &str, kind: RequestKind, wants: &str| {
        let e = t
            .tokens(body.as_bytes(), kind, &mut Vec::new())
            .unwrap_err();
        assert!(
            matches!(e, Error::Body(_)) && e.to_string().contains(wants),
            "{body}: {e}"
        );
    };
    body_error("[1, 2]", RequestKind::Chat, "expected a JSON object");
    body_error("{", RequestKind::Chat, "not a JSON object");
    body_error(
        r#"{"messages": "hi"}"#,
        RequestKind::Chat,
        "messages: expected a list",
    );
    body_error(
        r#"{"messages": [{"content": "x"}]}"#,
        RequestKind::Chat,
        "messages[0].role",
    );
    body_error(
        r#"{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}"#,
        RequestKind::Chat,
        "messages[0].content[0]: parts of type \"image_url\"",
    );
    body_error(
        r#"{"prompt": ["a", "b"]}"#,
        RequestKind::Completions,
        "a batch of 2 prompts",
    );
    body_error(r#"{"prompt": [-1]}"#, RequestKind::Completions, "prompt[0]");
    body_error(
        r#"{"prompt": "x", "add_special_tokens": 1}"#,
        RequestKind::Completions,
        "add_special_tokens",
    );
}

#[test]
fn long_messages_encoded_chunk_by_chunk_equal_the_whole_encoding() {
    let dir = common::model_dir(true);
    let t = ChatTokenizer::load(dir.path().join("tokenizer.json")).unwrap();
    let whole = ChatTokenizer::load(dir.path().join("tokenizer.json"))
        .unwrap()
        .with_cache_tokens(0);
    // documents of 2-12 KiB with a question after them: more than the checks chunking starts
    // with, so a boundary this tokenizer splits differently would have turned it off
    let words = [
        "the",
        "report's",
        "3.5%",
        "growth,",
        "Café",
        "naïve",
        "x",
        "(note)",
        "\"quoted\"",
        "don't",
        "2024",
        "—",
        "emoji🙂",
        "a.b",
        "tab\there",
        "new\nline",
        "  double",
    ];
    let mut x = 7u64;
    for n in 0..60 {
        let mut doc = String::new();
        while doc.len() < 2048 + (n % 6) * 2048 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            doc.push_str(words[(x >> 33) as usize % words.len()]);
            doc.push(if x.is_multiple_of(13) { '.' } else { ' ' });
        }
        let body = json!({"messages": [
            {"role": "system", "content": "Answer from the document."},
            {"role": "user", "content": format!("{doc}\nQuestion {n}: what grew?")},
        ]})
        .to_string();
        assert_eq!(
            tokens(&t, &body, RequestKind::Chat),
            tokens(&whole, &body, RequestKind::Chat),
            "document {n}"
        );
    }
    assert!(
        t.chunks_long_pieces(),
        "chunking checked out on this tokenizer"
    );
}

#[test]
fn an_empty_text_part_adds_nothing_as_in_vllm() {
    let dir = common::model_dir(true);
    let t = ChatTokenizer::load(dir.path().join("tokenizer.json")).unwrap();
    let with_empty = json!({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Hello"}, {"type": "text", "text": ""}, {"type": "text", "text": "there"}]}]})
    .to_string();
    let without = json!({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}]})
    .to_string();
    assert_eq!(
        tokens(&t, &with_empty, RequestKind::Chat),
        tokens(&t, &without, RequestKind::Chat)
    );
}

#[test]
fn tokens_while_stops_after_the_piece_it_is_told_to_and_gives_a_prefix() {
    let dir = common::model_dir(true);
    let t = ChatTokenizer::load(dir.path().join("tokenizer.json")).unwrap();
    let body = json!({"messages": [
        {"role": "system", "content": "You are brief."},
        {"role": "user", "content": "First question, please."},
        {"role": "assistant", "content": "First answer."},
        {"role": "user", "content": "Second question."}]})
    .to_string();
    let all = tokens(&t, &body, RequestKind::Chat);
    let mut out = Vec::new();
    let whole = t
        .tokens_while(body.as_bytes(), RequestKind::Chat, &mut out, &mut |_| true)
        .unwrap();
    assert_eq!(out, all);
    assert!(whole.complete && whole.text_bytes == whole.rendered_bytes);
    // stop once 10 ids are in: a prefix, and the text it covers
    let mut calls = 0;
    let part = t
        .tokens_while(body.as_bytes(), RequestKind::Chat, &mut out, &mut |ids| {
            calls += 1;
            ids.len() < 10
        })
        .unwrap();
    assert!(
        !part.complete && part.text_bytes < part.rendered_bytes,
        "{part:?}"
    );
    assert!(
        out.len() >= 10 && out.len() < all.len(),
        "{} of {}",
        out.len(),
        all.len()
    );
    assert_eq!(out[..], all[..out.len()]);
    assert!(calls > 1);
}
