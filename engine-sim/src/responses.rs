//! `POST /v1/responses` (OpenAI's Responses API, whole or streamed as its SSE events): the prompt goes through the
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
use tokio::sync::mpsc;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::engine::Engine;
use crate::kv_cache::BlockHasher;
use crate::openai::{Filler, Usage};
use crate::prompt::{describe, InvalidRequest, DEFAULT_MAX_TOKENS};
use crate::reply::{invalid, json_response, read_json, unix_now, ResponseBody};

/// The validated request: its canonical prompt and what the answer echoes.
#[derive(Debug, PartialEq)]
pub struct ResponsesRequest {
    pub prompt: String,
    pub stream: bool,
    pub instructions: Option<String>,
    pub max_output_tokens: u64,
    pub model: Option<String>,
}

/// Validates a Responses body; errors name the field and its value.
pub fn parse(body: &Value) -> Result<ResponsesRequest, InvalidRequest> {
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
    let stream = match body.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(v) => {
            return Err(InvalidRequest::new(
                "stream",
                format!("\"stream\" must be a boolean, got {}", describe(v)),
            ))
        }
    };
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
        stream,
        instructions: instructions.map(str::to_owned),
        max_output_tokens,
        model: model.map(str::to_owned),
    })
}

/// What every body of one response shares.
struct Answer<'a> {
    id: String,
    model: &'a str,
    created_at: u64,
    request: &'a ResponsesRequest,
}

impl Answer<'_> {
    /// The Response object: `completed` with its text and usage, or `in_progress` with neither.
    fn response(&self, done: Option<(&str, Usage)>) -> Value {
        let output = match done {
            Some((text, _)) => json!([self.message("completed", text)]),
            None => json!([]),
        };
        let usage = done.map(|(_, u)| {
            json!({
                "input_tokens": u.prompt_tokens,
                "input_tokens_details": {"cached_tokens": u.cached_tokens},
                "output_tokens": u.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": u.prompt_tokens.saturating_add(u.completion_tokens),
            })
        });
        json!({
            "id": format!("resp_{}", self.id),
            "object": "response",
            "created_at": self.created_at,
            "status": if done.is_some() { "completed" } else { "in_progress" },
            "error": null,
            "incomplete_details": null,
            "instructions": self.request.instructions,
            "max_output_tokens": self.request.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": true,
            "temperature": 1.0,
            "tool_choice": "auto",
            "tools": [],
            "top_p": 1.0,
            "metadata": {},
            "text": {"format": {"type": "text"}},
            "usage": usage,
        })
    }

    fn message(&self, status: &str, text: &str) -> Value {
        json!({
            "type": "message",
            "id": format!("msg_{}", self.id),
            "status": status,
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}],
        })
    }
}

/// The prompt's blocks and the seed of the answer's words.
fn prompt_of(engine: &Engine, request: &ResponsesRequest) -> (crate::PromptBlocks, u64) {
    let config = engine.config();
    let mut hasher = BlockHasher::new(config.block_bytes());
    hasher.update(request.prompt.as_bytes());
    let prompt = hasher.finish();
    let seed = xxh3_64_with_seed(&prompt.prompt_hash.to_le_bytes(), config.seed);
    (prompt, seed)
}

/// Runs one request through the engine and returns the whole Responses body.
pub async fn respond(engine: &Arc<Engine>, request: &ResponsesRequest, n: u64) -> Bytes {
    let (prompt, filler_seed) = prompt_of(engine, request);
    let prompt_tokens = prompt.prompt_tokens();
    let max_tokens = request.max_output_tokens;
    let mut seq = engine.admit(prompt).await;
    seq.first_token().await;
    if max_tokens > 1 {
        seq.next_tokens(max_tokens - 1).await;
    }
    let text = Filler::new(filler_seed).text(max_tokens);
    let usage = Usage {
        prompt_tokens,
        completion_tokens: max_tokens,
        cached_tokens: seq.cached_tokens(),
    };
    seq.finish();
    let answer = answer(engine, request, n);
    Bytes::from(answer.response(Some((&text, usage))).to_string())
}

fn answer<'a>(engine: &'a Engine, request: &'a ResponsesRequest, n: u64) -> Answer<'a> {
    Answer {
        id: format!("{:016x}{:016x}", engine.draw(n, 1), engine.draw(n, 2)),
        model: request
            .model
            .as_deref()
            .unwrap_or(&engine.config().model_name),
        created_at: unix_now(),
        request,
    }
}

/// One SSE event of a streamed response: `event: TYPE` and its JSON (`type`, `sequence_number`).
fn event(sequence: &mut u64, kind: &str, mut data: Value) -> Bytes {
    data["type"] = json!(kind);
    data["sequence_number"] = json!(*sequence);
    *sequence += 1;
    Bytes::from(format!("event: {kind}\ndata: {data}\n\n"))
}

/// Streams the answer as the Responses API's SSE events: `response.created`, the message and
/// its part added, one `response.output_text.delta` per token, the text, part and message done,
/// then `response.completed` with the usage.
async fn stream(engine: Arc<Engine>, request: ResponsesRequest, n: u64, tx: mpsc::Sender<Bytes>) {
    let (prompt, filler_seed) = prompt_of(&engine, &request);
    let prompt_tokens = prompt.prompt_tokens();
    let max_tokens = request.max_output_tokens;
    let answer = answer(&engine, &request, n);
    let item_id = format!("msg_{}", answer.id);
    let at = |extra: Value| {
        let mut v = json!({"item_id": item_id, "output_index": 0, "content_index": 0});
        if let (Some(v), Value::Object(extra)) = (v.as_object_mut(), extra) {
            v.extend(extra);
        }
        v
    };
    let mut seq_no = 0;
    let created = json!({"response": answer.response(None)});
    if tx
        .send(event(&mut seq_no, "response.created", created))
        .await
        .is_err()
    {
        return;
    }
    let mut seq = engine.admit(prompt).await;
    let opening = [
        event(
            &mut seq_no,
            "response.output_item.added",
            json!({"output_index": 0, "item": answer.message("in_progress", "")}),
        ),
        event(
            &mut seq_no,
            "response.content_part.added",
            at(json!({"part": {"type": "output_text", "text": "", "annotations": []}})),
        ),
    ];
    for e in opening {
        if tx.send(e).await.is_err() {
            return;
        }
    }
    seq.first_token().await;
    let mut filler = Filler::new(filler_seed);
    let mut text = Vec::new();
    for i in 0..max_tokens {
        if i > 0 {
            seq.next_token().await;
        }
        let before = text.len();
        filler.push_token(&mut text);
        let delta = String::from_utf8_lossy(&text[before..]).into_owned();
        let e = event(
            &mut seq_no,
            "response.output_text.delta",
            at(json!({"delta": delta})),
        );
        if tx.send(e).await.is_err() {
            return;
        }
    }
    let text = String::from_utf8_lossy(&text).into_owned();
    let usage = Usage {
        prompt_tokens,
        completion_tokens: max_tokens,
        cached_tokens: seq.cached_tokens(),
    };
    seq.finish();
    let part = json!({"type": "output_text", "text": text, "annotations": []});
    let closing = [
        event(
            &mut seq_no,
            "response.output_text.done",
            at(json!({"text": text})),
        ),
        event(
            &mut seq_no,
            "response.content_part.done",
            at(json!({"part": part})),
        ),
        event(
            &mut seq_no,
            "response.output_item.done",
            json!({"output_index": 0, "item": answer.message("completed", &text)}),
        ),
        event(
            &mut seq_no,
            "response.completed",
            json!({"response": answer.response(Some((&text, usage)))}),
        ),
    ];
    for e in closing {
        if tx.send(e).await.is_err() {
            return;
        }
    }
}

/// `POST /v1/responses` (`stream: true` answers with SSE events).
pub(crate) async fn handle(engine: &Arc<Engine>, req: Request<Incoming>) -> Response<ResponseBody> {
    let n = engine.count_request();
    let body = match read_json(engine, req).await {
        Ok(b) => b,
        Err(resp) => return resp,
    };
    let request = match parse(&body) {
        Ok(request) => request,
        Err(e) => return invalid(&e),
    };
    if !request.stream {
        return json_response(StatusCode::OK, respond(engine, &request, n).await);
    }
    let (tx, rx) = mpsc::channel::<Bytes>(8);
    let engine = Arc::clone(engine);
    tokio::spawn(async move {
        // A client that goes away aborts the request, releasing its slot and blocks.
        tokio::select! {
            () = stream(Arc::clone(&engine), request, n, tx.clone()) => {}
            () = tx.closed() => {}
        }
    });
    let mut r = Response::new(ResponseBody::Stream(rx));
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    r
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
        let e = parse(&json!({"input": "x", "stream": "yes"})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("stream"));
        let e = parse(&json!({"instructions": "x"})).unwrap_err();
        assert!(e.message.contains("\"input\""), "{}", e.message);
    }
}
