//! OpenAI response bodies: whole responses, SSE chunks, errors, and the filler text.
//!
//! Streams follow vLLM's framing: `data: {json}\n\n` per event; for chat the first event carries
//! `delta.role`; the last token's event carries `finish_reason: "length"`; then a usage event with
//! `choices: []` (always sent, as with `stream_options.include_usage`); then `data: [DONE]\n\n`.

use bytes::{BufMut, Bytes, BytesMut};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

use crate::prompt::ApiKind;

/// The words the simulated model says. All plain ASCII: they need no JSON escaping.
const WORDS: &[&str] = &[
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "with", "was", "on", "be",
    "by", "this", "are", "from", "or", "an", "which", "at", "have", "not", "can", "all", "their",
    "more", "model", "cache", "prefix", "token", "router", "request", "server", "latency",
    "system", "result", "data", "value", "time", "first", "each", "other", "such", "these", "when",
    "between", "through", "because", "while", "where", "after", "before", "under", "over", "again",
    "further", "then", "once", "here", "there", "why", "how",
];

/// Deterministic filler text: the same seed yields the same words.
pub struct Filler {
    rng: SmallRng,
    first: bool,
}

impl Filler {
    /// Words seeded by the engine seed and the prompt (same prompt, same answer).
    pub fn new(seed: u64) -> Self {
        Self {
            rng: SmallRng::seed_from_u64(seed),
            first: true,
        }
    }

    /// Appends the next token's text (a word, space-separated from the previous one).
    pub fn push_token(&mut self, out: &mut impl BufMut) {
        if !self.first {
            out.put_u8(b' ');
        }
        self.first = false;
        out.put_slice(WORDS[self.rng.random_range(0..WORDS.len())].as_bytes());
    }

    /// `n` tokens as one string.
    pub fn text(&mut self, n: u64) -> String {
        let mut out = Vec::with_capacity(n.min(1 << 16) as usize * 7);
        for _ in 0..n {
            self.push_token(&mut out);
        }
        // Only ASCII words were written.
        String::from_utf8(out).unwrap_or_default()
    }
}

/// What every response of one request shares.
pub struct ResponseMeta<'a> {
    pub kind: ApiKind,
    pub id: &'a str,
    pub created: u64,
    pub model: &'a str,
}

/// Token counts of a finished request.
#[derive(Debug, Clone, Copy)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub cached_tokens: u64,
}

impl Usage {
    fn to_json(self) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "total_tokens": self.prompt_tokens.saturating_add(self.completion_tokens),
            "completion_tokens": self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        })
    }
}

/// The id prefix of each API (`chatcmpl-...`, `cmpl-...`).
pub fn id_prefix(kind: ApiKind) -> &'static str {
    match kind {
        ApiKind::Chat => "chatcmpl-",
        ApiKind::Completions => "cmpl-",
    }
}

/// A whole (non-streaming) response body.
pub fn full_response(meta: &ResponseMeta<'_>, text: String, usage: Usage) -> Bytes {
    let choice = match meta.kind {
        ApiKind::Chat => json!({
            "index": 0,
            "message": {"role": "assistant", "content": text, "tool_calls": []},
            "logprobs": null,
            "finish_reason": "length",
            "stop_reason": null,
        }),
        ApiKind::Completions => json!({
            "index": 0,
            "text": text,
            "logprobs": null,
            "finish_reason": "length",
            "stop_reason": null,
        }),
    };
    let object = match meta.kind {
        ApiKind::Chat => "chat.completion",
        ApiKind::Completions => "text_completion",
    };
    let body = json!({
        "id": meta.id,
        "object": object,
        "created": meta.created,
        "model": meta.model,
        "choices": [choice],
        "usage": usage.to_json(),
    });
    Bytes::from(body.to_string())
}

/// Encodes the SSE events of one streaming response. The per-token events are templated
/// (built once, then one small buffer per token).
pub struct StreamEncoder {
    kind: ApiKind,
    /// `data: {"id":...,"choices":[{"index":0,` shared by every event of this response.
    head: Bytes,
    head_json: Value,
}

const DONE: &[u8] = b"data: [DONE]\n\n";

impl StreamEncoder {
    pub fn new(meta: &ResponseMeta<'_>) -> Self {
        let object = match meta.kind {
            ApiKind::Chat => "chat.completion.chunk",
            ApiKind::Completions => "text_completion",
        };
        // serde_json escapes the id and model; `choices` is appended by hand per event.
        let head_json = json!({
            "id": meta.id,
            "object": object,
            "created": meta.created,
            "model": meta.model,
        });
        let mut head = BytesMut::from(&b"data: "[..]);
        let text = head_json.to_string();
        // `{"id":..,"model":".."}` -> `{"id":..,"model":"..",`
        head.put_slice(&text.as_bytes()[..text.len() - 1]);
        head.put_slice(b",\"choices\":[{\"index\":0,");
        Self {
            kind: meta.kind,
            head: head.freeze(),
            head_json,
        }
    }

    /// The event(s) for token `index` (0-based) of `total`, its text written by `filler`.
    pub fn token(&self, filler: &mut Filler, index: u64, total: u64) -> Bytes {
        let mut out = BytesMut::with_capacity(2 * self.head.len() + 96);
        if index == 0 && self.kind == ApiKind::Chat {
            out.put_slice(&self.head);
            out.put_slice(
                b"\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"logprobs\":null,\"finish_reason\":null}]}\n\n",
            );
        }
        out.put_slice(&self.head);
        match self.kind {
            ApiKind::Chat => out.put_slice(b"\"delta\":{\"content\":\""),
            ApiKind::Completions => out.put_slice(b"\"text\":\""),
        }
        filler.push_token(&mut out);
        out.put_slice(b"\"");
        if self.kind == ApiKind::Chat {
            out.put_slice(b"}");
        }
        if index + 1 == total {
            out.put_slice(
                b",\"logprobs\":null,\"finish_reason\":\"length\",\"stop_reason\":null}]}\n\n",
            );
        } else {
            out.put_slice(b",\"logprobs\":null,\"finish_reason\":null}]}\n\n");
        }
        out.freeze()
    }

    /// The final usage event followed by `data: [DONE]`.
    pub fn usage_and_done(&self, usage: Usage) -> Bytes {
        let mut event = self.head_json.clone();
        event["choices"] = json!([]);
        event["usage"] = usage.to_json();
        let mut out = BytesMut::with_capacity(512);
        out.put_slice(b"data: ");
        out.put_slice(event.to_string().as_bytes());
        out.put_slice(b"\n\n");
        out.put_slice(DONE);
        out.freeze()
    }
}

/// An OpenAI-style error body.
pub fn error_body(message: &str, kind: &str, param: Option<&str>) -> Bytes {
    Bytes::from(
        json!({"error": {"message": message, "type": kind, "param": param, "code": null}})
            .to_string(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn events(b: &[u8]) -> Vec<Value> {
        let s = std::str::from_utf8(b).unwrap();
        assert!(s.ends_with("\n\n"));
        s.split_terminator("\n\n")
            .map(|e| {
                let data = e.strip_prefix("data: ").unwrap();
                serde_json::from_str(data).unwrap()
            })
            .collect()
    }

    #[test]
    fn templated_chunks_are_valid_json_with_escaped_fields() {
        let meta = ResponseMeta {
            kind: ApiKind::Chat,
            id: "chatcmpl-1",
            created: 7,
            model: "we\"ird\nmodel",
        };
        let enc = StreamEncoder::new(&meta);
        let mut filler = Filler::new(1);
        let first = events(&enc.token(&mut filler, 0, 2));
        assert_eq!(first.len(), 2);
        assert_eq!(first[0]["choices"][0]["delta"]["role"], "assistant");
        assert_eq!(first[0]["model"], "we\"ird\nmodel");
        assert_eq!(first[1]["object"], "chat.completion.chunk");
        let last = events(&enc.token(&mut filler, 1, 2));
        assert_eq!(last[0]["choices"][0]["finish_reason"], "length");
        let word = last[0]["choices"][0]["delta"]["content"].as_str().unwrap();
        assert!(word.starts_with(' '));

        let meta = ResponseMeta {
            kind: ApiKind::Completions,
            ..meta
        };
        let enc = StreamEncoder::new(&meta);
        let ev = events(&enc.token(&mut filler, 0, 1));
        assert_eq!(ev.len(), 1);
        assert_eq!(ev[0]["object"], "text_completion");
        assert!(ev[0]["choices"][0]["text"].is_string());
        let tail = enc.usage_and_done(Usage {
            prompt_tokens: 3,
            completion_tokens: 1,
            cached_tokens: 0,
        });
        assert!(tail.ends_with(b"data: [DONE]\n\n"));
    }

    #[test]
    fn filler_is_deterministic() {
        assert_eq!(Filler::new(5).text(50), Filler::new(5).text(50));
        assert_ne!(Filler::new(5).text(50), Filler::new(6).text(50));
        assert_eq!(Filler::new(5).text(3).split(' ').count(), 3);
    }
}
