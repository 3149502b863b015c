//! Prompt keys: the affinity key of a request, hashed straight from the body bytes.
//!
//! The canonical prompt text matches engine-sim's token and cache accounting:
//! - chat: for each message in order, `role`, `"\n"`, content text, `"\n"` (content is a string or
//!   an array of parts whose `text` is taken when `type` is `"text"`);
//! - completions: the `prompt` string (or the first string of an array); other OpenAI bodies with
//!   an `input` instead (`/v1/embeddings`, `/v1/moderations`) the same way;
//! - `/v1/responses`: the `instructions` string, `"\n"`, then the `input` string, or, when `input`
//!   is an array of items, its JSON text as sent (a later turn resends the earlier items first);
//! - `/invocations`, and any body that is not such JSON: the raw bytes.
//!
//! The key region is the start of that text: `prefix_length` characters (bytes for raw bodies), and
//! for chat never past the end of the FIRST user message, so every later turn of a conversation,
//! which resends that message unchanged, has the same key.
//!
//! When a chat's key region ends before its first user message (a system prompt longer than
//! `prefix_length`), every conversation on that system prompt shares the key. For such a key,
//! when it is hot, [`deep_prompt_key`] gives the conversation's own key: the messages before the
//! first user message whole (up to [`DEEP_HEAD_CHARS`]) plus up to `prefix_length` characters of
//! the first user message, so later turns keep it and different conversations differ.
//!
//! The region is cut into 64-byte blocks with a chained hash
//! `h_i = xxh3_64_with_seed(block_i, h_{i-1})`, `h_{-1}` = the seed (xxh3 of `x-prefix-aware-id`,
//! or a constant); the key is the last (possibly partial) block's hash.
//!
//! No full JSON parse: a small tolerant scanner walks the body, feeds decoded text into the block
//! hasher piece by piece, and stops as soon as the key region is complete. Parsing the rest of a
//! 32 KiB body with serde_json would cost more than the whole decision budget (see
//! `benches/decision.rs`). Malformed JSON met on the way falls back to the raw bytes; JSON
//! errors after the key region are not looked for (the model server rejects such bodies anyway).

use std::borrow::Cow;

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

mod blocks;
mod chat;
mod model;
mod responses;
mod scan;
mod text;

use blocks::{string_end, Specials};
use chat::*;
pub use model::find_model;
use responses::*;
use scan::*;
pub use text::BlockHasher;
use text::*;

/// Bytes per hashed block of the key region.
pub const BLOCK_BYTES: usize = 64;

/// Seed of the block chain when the request carries no `x-prefix-aware-id`.
pub const DEFAULT_SEED: u64 = 0x7072_6566_6978_6b79; // "prefixky"

/// How the body of a request is read for its key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BodyKind {
    /// OpenAI `/v1/chat/completions`, `/v1/completions` and the other `/v1/*` bodies: JSON with
    /// `messages`, `prompt` or `input`.
    OpenAi,
    /// OpenAI `/v1/responses`: JSON with `instructions` and `input`, in either order.
    Responses,
    /// `/invocations`: the raw bytes.
    Raw,
}

/// Most characters of the messages before the first user message that a deep key takes in.
pub const DEEP_HEAD_CHARS: usize = 65_536;

/// Which canonical text a key was taken from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeySource {
    Chat,
    Completion,
    Raw,
}

/// The affinity key of one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PromptKey {
    /// Chain hash of the last block of the key region.
    pub hash: u64,
    /// Blocks in the key region (the last one may be partial).
    pub blocks: u32,
    /// Length of the key region: characters (chat, completion) or bytes (raw).
    pub len: u32,
    pub source: KeySource,
    /// Chat only: the region ended inside the messages before the first user message, so the key
    /// names a shared head (a long system prompt), not a conversation. See [`deep_prompt_key`].
    pub head_only: bool,
    /// Deep keys only: the first user message is the last message (a conversation's first turn,
    /// which no instance can have cached beyond the shared head).
    pub first_turn: bool,
}

/// The chain seed for a request: xxh3 of its prefix-aware id, or [`DEFAULT_SEED`].
pub fn seed_for(prefix_aware_id: Option<&[u8]>) -> u64 {
    match prefix_aware_id {
        Some(id) if !id.is_empty() => xxh3_64(id),
        _ => DEFAULT_SEED,
    }
}

/// The key of a request body. Never fails: anything unreadable as the expected JSON is keyed by its
/// raw bytes.
pub fn prompt_key(kind: BodyKind, body: &[u8], prefix_length: usize, seed: u64) -> PromptKey {
    let key = match kind {
        BodyKind::OpenAi => json_key(body, prefix_length, seed, Depth::Shallow),
        BodyKind::Responses => responses_key(body, prefix_length, seed),
        BodyKind::Raw => None,
    };
    key.unwrap_or_else(|| raw_key(body, prefix_length, seed))
}

/// Bytes per block of [`prompt_blocks`].
pub const PREFIX_BLOCK_BYTES: usize = 256;

/// The whole prompt of a request as the chained hashes of its [`PREFIX_BLOCK_BYTES`]-byte
/// blocks: `out[j]` names the prompt's first `(j + 1) * PREFIX_BLOCK_BYTES` bytes, so two
/// prompts share `out[..d]` exactly when they share that prefix (a trailing partial block is
/// not named). The prompt is the body from its top-level `messages` (every message, the earlier
/// turns a conversation resends included), `prompt` or `input` value on, as sent: a client
/// resends the same messages as the same bytes, and hashing them as they are costs a few
/// microseconds for 32 KiB where decoding them costs ten times that. What follows the value
/// (other fields, the closing brace) comes after the point where two turns of a conversation
/// part anyway. Other bodies: their raw bytes. At most `max_bytes` are read. Returns the
/// prompt's length in bytes. `out` is cleared first and only grows: no allocation once it has
/// room.
pub fn prompt_blocks(
    kind: BodyKind,
    body: &[u8],
    seed: u64,
    max_bytes: usize,
    out: &mut Vec<u64>,
) -> usize {
    let span = match kind {
        BodyKind::OpenAi => prompt_value(body),
        BodyKind::Responses | BodyKind::Raw => None,
    };
    let prompt = match span {
        Some(start) => &body[start..],
        None => body,
    };
    let prompt = &prompt[..prompt.len().min(max_bytes)];
    out.clear();
    let mut chain = seed;
    for block in prompt.chunks_exact(PREFIX_BLOCK_BYTES) {
        chain = xxh3_64_with_seed(block, chain);
        out.push(chain);
    }
    prompt.len()
}

/// Where the top-level `messages`, `prompt` or `input` value of a JSON object starts.
fn prompt_value(body: &[u8]) -> Option<usize> {
    let mut s = Scan::new(body);
    if !s.eat(b'{') || s.eat(b'}') {
        return None;
    }
    loop {
        let k = s.key()?;
        s.ws();
        if s.is(k, "messages") || s.is(k, "prompt") || s.is(k, "input") {
            return Some(s.pos);
        }
        s.skip_value()?;
        if !s.next_or_close(b'}')? {
            return None;
        }
    }
}

/// The conversation key of a chat whose [`prompt_key`] is `head_only`: the whole head (up to
/// [`DEEP_HEAD_CHARS`]) and `prefix_length` characters of the first user message. `None` when
/// the body has no such key (not a chat, no user message, or a head longer than the bound).
pub fn deep_prompt_key(body: &[u8], prefix_length: usize, seed: u64) -> Option<PromptKey> {
    let key = json_key(body, prefix_length, seed, Depth::Deep)?;
    (key.source == KeySource::Chat && !key.head_only).then_some(key)
}

/// How far a chat key reaches.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Depth {
    /// `limit` characters from the start, never past the first user message.
    Shallow,
    /// The head whole, then `limit` characters of the first user message.
    Deep,
}

/// The key of the first `prefix_length` bytes.
pub fn raw_key(body: &[u8], prefix_length: usize, seed: u64) -> PromptKey {
    let region = &body[..body.len().min(prefix_length)];
    let mut hasher = BlockHasher::new(seed);
    hasher.feed(region);
    let (hash, blocks) = hasher.finish();
    PromptKey {
        hash,
        blocks,
        len: region.len() as u32,
        source: KeySource::Raw,
        head_only: false,
        first_turn: false,
    }
}

/// The key of an OpenAI body, or `None` to fall back to the raw bytes.
fn json_key(body: &[u8], limit: usize, seed: u64, depth: Depth) -> Option<PromptKey> {
    let mut s = Scan::new(body);
    if !s.eat(b'{') {
        return None;
    }
    if s.eat(b'}') {
        return None;
    }
    loop {
        let k = s.key()?;
        if s.is(k, "messages") {
            return chat_key(&mut s, limit, seed, depth);
        }
        if s.is(k, "prompt") || s.is(k, "input") {
            return completion_key(&mut s, limit, seed);
        }
        s.skip_value()?;
        if !s.next_or_close(b'}')? {
            return None;
        }
    }
}

fn completion_key(s: &mut Scan<'_>, limit: usize, seed: u64) -> Option<PromptKey> {
    let mut key = TextKey::new(limit, seed);
    s.ws();
    match s.peek()? {
        b'"' => stream_string(s, &mut key)?,
        b'[' => {
            s.pos += 1;
            s.ws();
            if s.peek()? != b'"' {
                return None; // token ids or nested arrays: raw bytes
            }
            stream_string(s, &mut key)?;
        }
        _ => return None,
    }
    key.finish(KeySource::Completion)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text_hash(text: &str, seed: u64) -> u64 {
        let mut h = BlockHasher::new(seed);
        h.feed(text.as_bytes());
        h.finish().0
    }

    fn chat(body: &str, limit: usize) -> PromptKey {
        prompt_key(BodyKind::OpenAi, body.as_bytes(), limit, DEFAULT_SEED)
    }

    #[test]
    fn embeddings_input_is_keyed_like_a_prompt() {
        let input = chat(r#"{"model":"e","input":"The handbook, section 4"}"#, 64);
        let prompt = chat(r#"{"model":"e","prompt":"The handbook, section 4"}"#, 64);
        assert_eq!(input.hash, prompt.hash);
        assert_eq!(input.source, KeySource::Completion);
        assert_eq!(
            input.hash,
            text_hash("The handbook, section 4", DEFAULT_SEED)
        );
        let list = chat(r#"{"input":["The handbook, section 4","other"]}"#, 64);
        assert_eq!(list.hash, input.hash);
    }

    #[test]
    fn responses_key_on_instructions_then_input_in_either_order() {
        let responses = |body: &str, limit| {
            prompt_key(BodyKind::Responses, body.as_bytes(), limit, DEFAULT_SEED)
        };
        let expected = text_hash("Be brief.\nWhat is a KV cache?", DEFAULT_SEED);
        let a = responses(
            r#"{"model":"e","instructions":"Be brief.","input":"What is a KV cache?"}"#,
            1000,
        );
        let b = responses(
            r#"{"input":"What is a KV cache?","stream":false,"instructions":"Be brief."}"#,
            1000,
        );
        assert_eq!((a.hash, a.source), (expected, KeySource::Completion));
        assert_eq!(b.hash, expected);
        // The key region is the start: the same instructions and a long shared input start.
        let long = "x".repeat(100);
        let c = responses(
            &format!(r#"{{"instructions":"Be brief.","input":"{long} 1"}}"#),
            64,
        );
        let d = responses(
            &format!(r#"{{"instructions":"Be brief.","input":"{long} 2"}}"#),
            64,
        );
        assert_eq!(c.hash, d.hash);
        assert_ne!(
            responses(
                r#"{"instructions":"Be terse.","input":"What is a KV cache?"}"#,
                1000
            )
            .hash,
            expected
        );
        // Input items: their JSON text, so a later turn that resends them keeps the key.
        let items = r#"[{"role":"user","content":"hi"}]"#;
        let e = responses(&format!(r#"{{"input":{items}}}"#), 1000);
        assert_eq!(e.hash, text_hash(items, DEFAULT_SEED));
        // Neither field: the raw bytes.
        let raw = r#"{"model":"e"}"#;
        assert_eq!(responses(raw, 1000).source, KeySource::Raw);
    }

    /// A chat with a long system prompt and `turns` user turns; `content_first` puts each
    /// message's `content` before its `role`.
    fn conversation(user: &str, turns: usize, content_first: bool) -> String {
        let system = "Answer as the handbook says; cite the section. ".repeat(60);
        let message = |role: &str, content: &str| {
            let content = serde_json::to_string(content).unwrap();
            if content_first {
                format!(r#"{{"content":{content},"role":"{role}"}}"#)
            } else {
                format!(r#"{{"role":"{role}","content":{content}}}"#)
            }
        };
        let mut messages = vec![message("system", &system)];
        for t in 0..turns {
            if t > 0 {
                messages.push(message("assistant", "Done."));
            }
            messages.push(message("user", &format!("{user}, turn {t}")));
        }
        format!(
            r#"{{"model":"m","messages":[{}],"stream":true}}"#,
            messages.join(",")
        )
    }

    #[test]
    fn a_key_cut_inside_a_long_system_prompt_is_head_only_and_deepens_to_the_conversation() {
        for content_first in [false, true] {
            let a1 = conversation("alice asks about refunds", 1, content_first);
            let a3 = conversation("alice asks about refunds", 3, content_first);
            let b1 = conversation("bob asks about shipping", 1, content_first);
            // prefix_length 1024 ends inside the 2,880-character system prompt
            let (ka, kb) = (chat(&a1, 1024), chat(&b1, 1024));
            assert!(ka.head_only && kb.head_only);
            assert_eq!(ka.hash, kb.hash, "users share the head's key");
            let deep = |b: &str| deep_prompt_key(b.as_bytes(), 1024, DEFAULT_SEED).unwrap();
            let (da1, da3, db1) = (deep(&a1), deep(&a3), deep(&b1));
            assert_eq!(da1.hash, da3.hash, "a conversation keeps its deep key");
            assert_ne!(da1.hash, db1.hash, "conversations differ");
            assert!(!da1.head_only);
            assert!(da1.first_turn && !da3.first_turn && db1.first_turn);
            // the deep key is the whole head plus the first user message
            let head = format!(
                "system\n{}\nuser\nalice asks about refunds, turn 0\n",
                "Answer as the handbook says; cite the section. ".repeat(60)
            );
            assert_eq!(da1.hash, text_hash(&head, DEFAULT_SEED), "{content_first}");
            // a limit that reaches the user message: not head-only, and nothing to deepen
            let whole = chat(&a1, 4096);
            assert!(!whole.head_only);
            assert!(deep_prompt_key(a3.as_bytes(), 4096, DEFAULT_SEED).is_some());
        }
    }

    #[test]
    fn a_first_turn_whose_key_ends_inside_content_parts_is_a_first_turn_in_any_member_order() {
        // Found by tests/prompt_props.rs: with `role` before a parts array whose text fills the
        // key, the deep key said "not the first turn" (the rest of the message was not read).
        let text = "a".repeat(43);
        let parts = format!(r#"[{{"type":"text","text":"{text}"}}]"#);
        for body in [
            format!(r#"{{"messages":[{{"role":"user","content":{parts},"name":""}}]}}"#),
            format!(r#"{{"messages":[{{"name":"","content":{parts},"role":"user"}}]}}"#),
        ] {
            let k = deep_prompt_key(body.as_bytes(), 48, DEFAULT_SEED).unwrap();
            assert!(k.first_turn, "{body}");
            let two = body.replace("}]}", r#"},{"role":"assistant","content":"ok"}]}"#);
            let k2 = deep_prompt_key(two.as_bytes(), 48, DEFAULT_SEED).unwrap();
            assert!(!k2.first_turn, "{two}");
            assert_eq!(k.hash, k2.hash);
        }
    }

    #[test]
    fn a_deep_key_takes_prefix_length_characters_of_a_long_first_user_message() {
        let long_user = "a pasted log line\n".repeat(200);
        let one = conversation(&long_user, 1, false);
        let two = conversation(&long_user, 2, false);
        let d1 = deep_prompt_key(one.as_bytes(), 512, DEFAULT_SEED).unwrap();
        let d2 = deep_prompt_key(two.as_bytes(), 512, DEFAULT_SEED).unwrap();
        assert_eq!(d1.hash, d2.hash);
        assert!(
            d1.first_turn,
            "the rest of the cut message is skipped to see what follows"
        );
        assert!(!d2.first_turn);
        // no user message, or not a chat: no deep key
        let system_only = r#"{"messages":[{"role":"system","content":"x"}]}"#;
        assert!(deep_prompt_key(system_only.as_bytes(), 512, DEFAULT_SEED).is_none());
        assert!(deep_prompt_key(br#"{"prompt":"x"}"#, 512, DEFAULT_SEED).is_none());
    }

    #[test]
    fn block_hasher_is_chained_per_64_bytes_whatever_the_feeding() {
        let data: Vec<u8> = (0..1000u32).map(|i| (i * 7 % 251) as u8).collect();
        let mut whole = BlockHasher::new(1);
        whole.feed(&data);
        let mut pieces = BlockHasher::new(1);
        for chunk in data.chunks(13) {
            pieces.feed(chunk);
        }
        assert_eq!(whole.finish(), pieces.finish());
        // by definition
        let mut h = 1u64;
        for block in data.chunks(64) {
            h = xxh3_64_with_seed(block, h);
        }
        assert_eq!(whole.finish(), (h, 16));
        assert_eq!(BlockHasher::new(9).finish(), (9, 0));
    }

    #[test]
    fn chat_key_is_canonical_text_up_to_first_user_message() {
        let body = r#"{"model":"m","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Hi there"},{"role":"assistant","content":"Hello"}]}"#;
        let k = chat(body, 4096);
        assert_eq!(k.source, KeySource::Chat);
        assert_eq!(
            k.hash,
            text_hash("system\nBe brief.\nuser\nHi there\n", DEFAULT_SEED)
        );
        // content before role, array parts, escapes: same canonical text
        let body2 = r#"{"messages":[{"content":[{"text":"Be ","type":"text"},{"type":"image_url","image_url":{"url":"x"}},{"type":"text","text":"brief."}],"role":"system"},{"role":"user","name":"u","content":"Hi\u0020there"}],"model":"m"}"#;
        assert_eq!(chat(body2, 4096).hash, k.hash);
    }

    #[test]
    fn count_chars_counts_scalar_values() {
        for text in [
            "",
            "a",
            "héllo wörld",
            &"é€😀a".repeat(700),
            &"x".repeat(5000),
        ] {
            assert_eq!(count_chars(text.as_bytes()), text.chars().count(), "{text}");
        }
    }

    #[test]
    fn cut_chars_stops_at_the_start_of_the_character_past_the_limit() {
        for text in [
            "",
            "a",
            "héllo wörld",
            &"é€😀a".repeat(40),
            &"x".repeat(100),
        ] {
            let total = text.chars().count();
            for limit in 0..=total + 2 {
                let expected = text
                    .char_indices()
                    .nth(limit)
                    .map_or(text.len(), |(at, _)| at);
                assert_eq!(
                    cut_chars(text.as_bytes(), limit),
                    (expected, limit.min(total)),
                    "{text:?} cut at {limit}"
                );
            }
        }
    }

    #[test]
    fn prefix_length_counts_characters_not_bytes() {
        let body = r#"{"messages":[{"role":"system","content":"héllo wörld"}]}"#;
        let k = chat(body, 10);
        assert_eq!(k.len, 10);
        assert_eq!(k.hash, text_hash("system\nhél", DEFAULT_SEED));
        // cut inside an escaped run
        let body = r#"{"messages":[{"role":"user","content":"a\nb\u00e9cd"}]}"#;
        assert_eq!(chat(body, 9).hash, text_hash("user\na\nbé", DEFAULT_SEED));
    }

    /// The key of `text`'s first `limit` characters, computed the obvious way.
    fn reference_key(text: &str, limit: usize) -> (u64, u32) {
        let cut: String = text.chars().take(limit).collect();
        (text_hash(&cut, DEFAULT_SEED), cut.chars().count() as u32)
    }

    #[test]
    fn long_multibyte_and_escaped_text_is_cut_on_whole_characters() {
        // Prose in 1-, 2-, 3- and 4-byte characters with escapes, long enough that the key ends
        // inside it at every limit below.
        // and long runs without any escape, where the search window, not an escape, ends a piece.
        let content = r#"Grüße, 世界! 😀 tab\there \\ \"q\" \u00e9 end. "#.repeat(30)
            + &"世界😀üa".repeat(300)
            + r#"\n"#;
        let decoded: String = serde_json::from_str(&format!("\"{content}\"")).unwrap();
        let system = "sys";
        for (order, body) in [
            (
                "role first",
                format!(
                    r#"{{"messages":[{{"role":"system","content":"{system}"}},{{"role":"user","content":"{content}"}}]}}"#
                ),
            ),
            (
                "content first",
                format!(
                    r#"{{"messages":[{{"content":"{system}","role":"system"}},{{"content":"{content}","role":"user"}}]}}"#
                ),
            ),
        ] {
            let text = format!("system\n{system}\nuser\n{decoded}\n");
            for limit in [
                1, 5, 11, 12, 13, 63, 64, 65, 100, 257, 1000, 1500, 2047, 2500,
            ] {
                let k = chat(&body, limit);
                assert_eq!(k.source, KeySource::Chat, "{order}, limit {limit}");
                assert_eq!(
                    (k.hash, k.len),
                    reference_key(&text, limit),
                    "{order}, limit {limit}"
                );
            }
        }
        let completion = format!(r#"{{"prompt":"{content}"}}"#);
        for limit in [1, 7, 64, 999, 1500, 2500] {
            let k = prompt_key(BodyKind::OpenAi, completion.as_bytes(), limit, DEFAULT_SEED);
            assert_eq!(k.source, KeySource::Completion);
            assert_eq!(
                (k.hash, k.len),
                reference_key(&decoded, limit),
                "limit {limit}"
            );
        }
    }

    #[test]
    fn conversation_turns_share_the_key() {
        let sys = "You are a helpful assistant. ".repeat(40);
        let turn1 = format!(
            r#"{{"model":"m","messages":[{{"role":"system","content":"{sys}"}},{{"role":"user","content":"Tell me about Rust"}}]}}"#
        );
        let turn2 = format!(
            r#"{{"model":"m","messages":[{{"role":"system","content":"{sys}"}},{{"role":"user","content":"Tell me about Rust"}},{{"role":"assistant","content":"It is a language."}},{{"role":"user","content":"More please"}}]}}"#
        );
        let other_user = format!(
            r#"{{"model":"m","messages":[{{"role":"system","content":"{sys}"}},{{"role":"user","content":"Tell me about Go"}}]}}"#
        );
        assert_eq!(chat(&turn1, 4096), chat(&turn2, 4096));
        assert_ne!(chat(&turn1, 4096).hash, chat(&other_user, 4096).hash);
        // a short prefix_length makes them collide (only the system prompt)
        assert_eq!(chat(&turn1, 512).hash, chat(&other_user, 512).hash);
    }

    #[test]
    fn completions_and_raw_bodies() {
        let k = chat(r#"{"prompt":"Once upon a time","max_tokens":5}"#, 4);
        assert_eq!(
            (k.source, k.hash),
            (KeySource::Completion, text_hash("Once", DEFAULT_SEED))
        );
        let k = chat(r#"{"prompt":["Once upon","x"]}"#, 100);
        assert_eq!(k.hash, text_hash("Once upon", DEFAULT_SEED));
        // token ids: raw bytes
        let body = r#"{"prompt":[1,2,3]}"#;
        assert_eq!(chat(body, 100).source, KeySource::Raw);
        let k = prompt_key(BodyKind::Raw, b"abcdef", 3, 5);
        assert_eq!((k.hash, k.len), (text_hash("abc", 5), 3));
    }

    #[test]
    fn malformed_json_falls_back_to_raw_bytes() {
        for body in [
            "",
            "not json",
            "{",
            "{}",
            "[1,2]",
            r#"{"messages":"x"}"#,
            r#"{"messages":[{"role":"user","content":"unterminated}]}"#,
            r#"{"messages":[{"content":"no role"}]}"#,
            r#"{"messages":[{"role":"user","content":"bad \q escape"}]}"#,
            r#"{"messages":[{"role":"user","content":"lone \ud800 surrogate"}]}"#,
        ] {
            let k = chat(body, 100);
            assert_eq!(k.source, KeySource::Raw, "{body}");
            assert_eq!(k, raw_key(body.as_bytes(), 100, DEFAULT_SEED));
        }
        let invalid_utf8 = b"{\"messages\":[{\"role\":\"user\",\"content\":\"\xff\xfe\"}]}";
        assert_eq!(
            prompt_key(BodyKind::OpenAi, invalid_utf8, 100, 1).source,
            KeySource::Raw
        );
    }

    #[test]
    fn arbitrary_bytes_never_panic() {
        for base in [
            &br#"{"model":"m","messages":[{"role":"system","content":[{"type":"text","text":"a\u00e9\"b"}]},{"role":"user","content":"q"}],"prompt":["x"]}"#[..],
            &br#"{"messages":[{"content":"x\\\"y","role":"user"}],"tools":[{"a":[1,{"b":"\""}]}],"model":"m","n":1}"#[..],
        ] {
            fuzz(base);
        }
    }

    fn fuzz(base: &[u8]) {
        for cut in 0..base.len() {
            let _ = prompt_key(BodyKind::OpenAi, &base[..cut], 7, 1);
            let _ = find_model(&base[..cut]);
            for limit in [0, 1, 3, 64] {
                let _ = prompt_key(BodyKind::OpenAi, &base[..cut], limit, 1);
            }
        }
        let mut x = 0x12345u64;
        for _ in 0..20_000 {
            let mut b = base.to_vec();
            for _ in 0..4 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let i = (x as usize) % b.len();
                b[i] = (x >> 32) as u8;
            }
            let _ = prompt_key(BodyKind::OpenAi, &b, 50, 1);
            let _ = find_model(&b);
            let _ = find_model(&b[(x as usize >> 40) % b.len()..]);
        }
    }

    #[test]
    fn model_field_anywhere_at_top_level() {
        assert_eq!(
            find_model(br#"{"model":"e1","messages":[]}"#).as_deref(),
            Some("e1")
        );
        assert_eq!(
            find_model(br#"{"messages":[{"role":"user","content":"{\"model\":\"no\"}"}],"tools":[{"model":"no"}],"model":"e\u0032"}"#)
                .as_deref(),
            Some("e2")
        );
        assert_eq!(find_model(br#"{"messages":[]}"#), None);
        // after the messages: read from the end, past nested and escaped values
        assert_eq!(
            find_model(br#"{"messages":[{"role":"user","content":"say \"model\": \"x\""}], "model" : "e\"3",
                "tools":[{"type":"function","function":{"name":"f","model":"no"}}],"stop":["\\","\""],"n":1,"stream":true} "#)
                .as_deref(),
            Some("e\"3")
        );
        assert_eq!(
            find_model(br#"{"messages":[{"role":"user","content":"\"model\":\"no\""}],"n":1}"#),
            None
        );
        assert_eq!(
            find_model(br#"{"messages":[{"role":"user","content":"x"}],"model":"e"#),
            None
        );
        assert_eq!(
            find_model(br#"{"messages":[{"role":"user","content":"x"}],"model":7}"#),
            None
        );
        assert_eq!(find_model(br#"{"model":5}"#), None);
    }

    #[test]
    fn prefix_aware_id_changes_the_seed() {
        assert_eq!(seed_for(None), DEFAULT_SEED);
        assert_eq!(seed_for(Some(b"")), DEFAULT_SEED);
        assert_ne!(seed_for(Some(b"a")), seed_for(Some(b"b")));
        let body = br#"{"messages":[{"role":"user","content":"hi"}]}"#;
        let a = prompt_key(BodyKind::OpenAi, body, 100, seed_for(Some(b"a")));
        let b = prompt_key(BodyKind::OpenAi, body, 100, seed_for(Some(b"b")));
        assert_ne!(a.hash, b.hash);
    }

    #[test]
    fn key_stops_at_first_user_message_even_without_reading_the_rest() {
        // The tail after the first user message is garbage: the key is still the chat key.
        let body = r#"{"messages":[{"role":"user","content":"hello"}, garbage"#;
        let k = chat(body, 100);
        assert_eq!(
            (k.source, k.hash),
            (KeySource::Chat, text_hash("user\nhello\n", DEFAULT_SEED))
        );
    }
}
