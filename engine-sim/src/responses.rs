//! `POST /v1/responses` (OpenAI's Responses API, non-streaming): the prompt goes through the
//! same admission, prefix cache and timing model as a completion, and the answer comes back in
//! the Responses shape (`output[0]` an assistant message with one `output_text` part; `usage`
//! with `input_tokens_details.cached_tokens`).
//!
//! The canonical prompt is the router's key text for this API: `instructions`, `"\n"`, then
//! `input` (its text when a string; its JSON text when an array of input items).

use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use hyper::body::Incoming;
use serde_json::{json, Value};
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::engine::Engine;
use crate::kv_cache::BlockHasher;
use crate::openai::Filler;
use crate::prompt::{describe, InvalidRequest, DEFAULT_MAX_TOKENS};
use crate::server::{invalid, json_response, read_json, unix_now, ResponseBody};

/// The validated request: its canonical prompt and what the answer echoes.
#[derive(Debug, PartialEq)]
pub struct ResponsesRequest<'a> {
    pub prompt: String,
    pub instructions: Option<&'a str>,
    pub max_output_tokens: u64,
    pub model: Option<&'a str>,
}

/// Validates a Responses body; errors name the field and its value.
pub fn parse(body: &Value) -> Result<ResponsesRequest<'_>, InvalidRequest> {
    if !body.is_object() {
        return Err(InvalidRequest {
            message: format!("request body must be a JSON object, got {}", describe(body)),
            param: None,
        });
    }
    let string = |name: &str| match body.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.as_str())),
        Some(other) => Err(InvalidRequest::new(
            name,
            format!("\"{name}\" must be a string, got {}", describe(other)),
        )),
    };
    let instructions = string("instructions")?;
    let model = string("model")?;
    match body.get("stream") {
        None | Some(Value::Null) | Some(Value::Bool(false)) => {}
        Some(v) => {
            return Err(InvalidRequest::new(
                "stream",
                format!(
                    "\"stream\" {} is not supported by engine-sim's /v1/responses (only false)",
                    describe(v)
                ),
            ))
        }
    }
    let max_output_tokens = match body.get("max_output_tokens") {
        None | Some(Value::Null) => DEFAULT_MAX_TOKENS,
        Some(v) => match v.as_u64() {
            Some(n) if n >= 1 => n,
            _ => {
                return Err(InvalidRequest::new(
                    "max_output_tokens",
                    format!(
                        "\"max_output_tokens\" must be an integer >= 1, got {}",
                        describe(v)
                    ),
                ))
            }
        },
    };
    let mut prompt = String::new();
    if let Some(text) = instructions {
        prompt.push_str(text);
        prompt.push('\n');
    }
    match body.get("input") {
        None | Some(Value::Null) => {
            return Err(InvalidRequest::new(
                "input",
                "missing required field \"input\"",
            ))
        }
        Some(Value::String(text)) => prompt.push_str(text),
        Some(items @ Value::Array(_)) => prompt.push_str(&items.to_string()),
        Some(other) => {
            return Err(InvalidRequest::new(
                "input",
                format!(
                    "\"input\" must be a string or an array of input items, got {}",
                    describe(other)
                ),
            ))
        }
    }
    Ok(ResponsesRequest {
        prompt,
        instructions,
        max_output_tokens,
        model,
    })
}

/// Runs one request through the engine and returns the Responses body.
pub async fn respond(engine: &Arc<Engine>, request: &ResponsesRequest<'_>, n: u64) -> Bytes {
    let config = engine.config();
    let mut hasher = BlockHasher::new(config.block_bytes());
    hasher.update(request.prompt.as_bytes());
    let prompt = hasher.finish();
    let prompt_tokens = prompt.prompt_tokens();
    let filler_seed = xxh3_64_with_seed(&prompt.prompt_hash.to_le_bytes(), config.seed);
    let max_tokens = request.max_output_tokens;
    let mut seq = engine.admit(prompt).await;
    seq.first_token().await;
    if max_tokens > 1 {
        seq.next_tokens(max_tokens - 1).await;
    }
    let text = Filler::new(filler_seed).text(max_tokens);
    let cached_tokens = seq.cached_tokens();
    seq.finish();
    let id = format!("{:016x}{:016x}", engine.draw(n, 1), engine.draw(n, 2));
    let body = json!({
        "id": format!("resp_{id}"),
        "object": "response",
        "created_at": unix_now(),
        "status": "completed",
        "error": null,
        "incomplete_details": null,
        "instructions": request.instructions,
        "max_output_tokens": max_tokens,
        "model": request.model.unwrap_or(&config.model_name),
        "output": [{
            "type": "message",
            "id": format!("msg_{id}"),
            "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}],
        }],
        "parallel_tool_calls": true,
        "temperature": 1.0,
        "tool_choice": "auto",
        "tools": [],
        "top_p": 1.0,
        "metadata": {},
        "text": {"format": {"type": "text"}},
        "usage": {
            "input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": max_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens.saturating_add(max_tokens),
        },
    });
    Bytes::from(body.to_string())
}

/// `POST /v1/responses`.
pub(crate) async fn handle(engine: &Arc<Engine>, req: Request<Incoming>) -> Response<ResponseBody> {
    let n = engine.count_request();
    let body = match read_json(engine, req).await {
        Ok(b) => b,
        Err(resp) => return resp,
    };
    match parse(&body) {
        Ok(request) => json_response(StatusCode::OK, respond(engine, &request, n).await),
        Err(e) => invalid(&e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_is_instructions_then_input() {
        let body =
            json!({"model": "m", "input": "What is a KV cache?", "instructions": "Be brief."});
        let r = parse(&body).unwrap();
        assert_eq!(r.prompt, "Be brief.\nWhat is a KV cache?");
        assert_eq!(r.max_output_tokens, DEFAULT_MAX_TOKENS);
        let items = json!({"input": [{"role": "user", "content": "hi"}], "max_output_tokens": 3});
        let r = parse(&items).unwrap();
        assert_eq!(r.prompt, r#"[{"content":"hi","role":"user"}]"#);
        assert_eq!(r.max_output_tokens, 3);
    }

    #[test]
    fn bad_fields_are_named() {
        let e = parse(&json!({"input": 5})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("input"));
        assert!(e.message.contains("number 5"), "{}", e.message);
        let e = parse(&json!({"input": "x", "max_output_tokens": 0})).unwrap_err();
        assert!(e.message.contains("max_output_tokens"), "{}", e.message);
        let e = parse(&json!({"input": "x", "stream": true})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("stream"));
        let e = parse(&json!({"instructions": "x"})).unwrap_err();
        assert!(e.message.contains("\"input\""), "{}", e.message);
    }
}
