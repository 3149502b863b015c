//! The canonical prompt text of an OpenAI request (shared with the router) and the validation of
//! completion requests.
//!
//! # Canonical prompt text
//!
//! This exact definition is shared with the router, whose prefix keys must describe the bytes
//! the engine caches:
//!
//! - Chat (`/v1/chat/completions`): for each message of `messages`, in order: its `role`, `"\n"`,
//!   its content text, `"\n"`. The content is a string, or an array of parts whose `text` is
//!   concatenated for the parts of `"type": "text"` (other parts, e.g. images, add nothing); a
//!   missing or null content is empty.
//! - Completions (`/v1/completions`): the `prompt` string, or the first element of a `prompt`
//!   array when that element is a string.
//!
//! Anything else (no messages, a role that is not a string, a content that is a number, a prompt
//! of token ids, ...) has no canonical prompt, and the engine answers 400.
//!
//! Tokens: 4 bytes of the canonical prompt make a token, rounded up.

use std::fmt::Write as _;

use serde_json::Value;

/// Which OpenAI API a request is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApiKind {
    /// `POST /v1/chat/completions`
    Chat,
    /// `POST /v1/completions`
    Completions,
}

impl ApiKind {
    /// The kind a body has when the path is not known: chat if it has `messages`.
    pub fn of_body(body: &Value) -> Self {
        if body.get("messages").is_some() {
            ApiKind::Chat
        } else {
            ApiKind::Completions
        }
    }
}

/// A request the engine refuses, as an OpenAI `invalid_request_error` (HTTP 400).
/// The message names the field and the value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct InvalidRequest {
    /// Human-readable reason, naming the field and its value.
    pub message: String,
    /// The offending field, as a path (`messages[2].content`), when there is one.
    pub param: Option<String>,
}

impl InvalidRequest {
    /// An error about `param`.
    pub fn new(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            param: Some(param.into()),
        }
    }

    fn missing(param: &str) -> Self {
        Self::new(param, format!("missing required field \"{param}\""))
    }

    fn wrong_type(param: &str, expected: &str, got: &Value) -> Self {
        Self::new(
            param,
            format!("\"{param}\" must be {expected}, got {}", describe(got)),
        )
    }
}

/// A short description of a JSON value for error messages: its type and (a prefix of) its value.
pub fn describe(v: &Value) -> String {
    const MAX: usize = 48;
    match v {
        Value::Null => "null".to_owned(),
        Value::Bool(b) => format!("boolean {b}"),
        Value::Number(n) => format!("number {n}"),
        Value::String(s) => {
            if s.len() <= MAX {
                format!("string {s:?}")
            } else {
                let mut end = MAX;
                while !s.is_char_boundary(end) {
                    end -= 1;
                }
                format!("string {:?}... ({} bytes)", &s[..end], s.len())
            }
        }
        Value::Array(a) => format!("an array of {} elements", a.len()),
        Value::Object(_) => "an object".to_owned(),
    }
}

/// Calls `piece` with the canonical prompt text of `body`, in order, borrowing from `body`
/// (no copy). Fails, naming the field, when the body has no canonical prompt; `piece` may have
/// been called before the error.
pub fn visit_canonical_prompt<'a>(
    kind: ApiKind,
    body: &'a Value,
    mut piece: impl FnMut(&'a str),
) -> Result<(), InvalidRequest> {
    if !body.is_object() {
        return Err(InvalidRequest {
            message: format!("request body must be a JSON object, got {}", describe(body)),
            param: None,
        });
    }
    match kind {
        ApiKind::Chat => visit_chat(body, &mut piece),
        ApiKind::Completions => visit_completion(body, &mut piece),
    }
}

fn visit_chat<'a>(body: &'a Value, piece: &mut impl FnMut(&'a str)) -> Result<(), InvalidRequest> {
    let messages = match body.get("messages") {
        None | Some(Value::Null) => return Err(InvalidRequest::missing("messages")),
        Some(Value::Array(m)) => m,
        Some(other) => {
            return Err(InvalidRequest::wrong_type(
                "messages",
                "an array of messages",
                other,
            ))
        }
    };
    if messages.is_empty() {
        return Err(InvalidRequest::new(
            "messages",
            "\"messages\" must contain at least one message, got an empty array",
        ));
    }
    let mut path = String::new();
    for (i, message) in messages.iter().enumerate() {
        let Some(message) = message.as_object() else {
            return Err(InvalidRequest::wrong_type(
                field(&mut path, format_args!("messages[{i}]")),
                "an object",
                message,
            ));
        };
        let role = match message.get("role") {
            Some(Value::String(r)) => r,
            None => {
                return Err(InvalidRequest::missing(field(
                    &mut path,
                    format_args!("messages[{i}].role"),
                )))
            }
            Some(other) => {
                return Err(InvalidRequest::wrong_type(
                    field(&mut path, format_args!("messages[{i}].role")),
                    "a string",
                    other,
                ))
            }
        };
        piece(role);
        piece("\n");
        match message.get("content") {
            None | Some(Value::Null) => {}
            Some(Value::String(text)) => piece(text),
            Some(Value::Array(parts)) => {
                for (j, part) in parts.iter().enumerate() {
                    visit_part(part, i, j, &mut path, piece)?;
                }
            }
            Some(other) => {
                return Err(InvalidRequest::wrong_type(
                    field(&mut path, format_args!("messages[{i}].content")),
                    "a string or an array of content parts",
                    other,
                ))
            }
        }
        piece("\n");
    }
    Ok(())
}

fn visit_part<'a>(
    part: &'a Value,
    i: usize,
    j: usize,
    path: &mut String,
    piece: &mut impl FnMut(&'a str),
) -> Result<(), InvalidRequest> {
    let Some(part) = part.as_object() else {
        return Err(InvalidRequest::wrong_type(
            field(path, format_args!("messages[{i}].content[{j}]")),
            "an object",
            part,
        ));
    };
    match part.get("type") {
        Some(Value::String(t)) if t == "text" => match part.get("text") {
            Some(Value::String(text)) => {
                piece(text);
                Ok(())
            }
            None => Err(InvalidRequest::missing(field(
                path,
                format_args!("messages[{i}].content[{j}].text"),
            ))),
            Some(other) => Err(InvalidRequest::wrong_type(
                field(path, format_args!("messages[{i}].content[{j}].text")),
                "a string",
                other,
            )),
        },
        Some(Value::String(_)) => Ok(()),
        None => Err(InvalidRequest::missing(field(
            path,
            format_args!("messages[{i}].content[{j}].type"),
        ))),
        Some(other) => Err(InvalidRequest::wrong_type(
            field(path, format_args!("messages[{i}].content[{j}].type")),
            "a string",
            other,
        )),
    }
}

fn visit_completion<'a>(
    body: &'a Value,
    piece: &mut impl FnMut(&'a str),
) -> Result<(), InvalidRequest> {
    match body.get("prompt") {
        None | Some(Value::Null) => Err(InvalidRequest::missing("prompt")),
        Some(Value::String(p)) => {
            piece(p);
            Ok(())
        }
        Some(Value::Array(a)) => match a.first() {
            Some(Value::String(p)) => {
                piece(p);
                Ok(())
            }
            None => Err(InvalidRequest::new(
                "prompt",
                "\"prompt\" must not be an empty array",
            )),
            Some(other) => Err(InvalidRequest::wrong_type(
                "prompt[0]",
                "a string (token id prompts are not supported)",
                other,
            )),
        },
        Some(other) => Err(InvalidRequest::wrong_type(
            "prompt",
            "a string or an array of strings",
            other,
        )),
    }
}

fn field<'p>(buf: &'p mut String, args: std::fmt::Arguments<'_>) -> &'p str {
    buf.clear();
    let _ = buf.write_fmt(args);
    buf
}

/// The canonical prompt text of `body` for the given API, or `None` when the engine would
/// refuse the request (see the module documentation for the definition).
pub fn canonical_prompt_for(kind: ApiKind, body: &Value) -> Option<String> {
    let mut out = String::new();
    visit_canonical_prompt(kind, body, |p| out.push_str(p)).ok()?;
    Some(out)
}

/// The canonical prompt text of `body`, the API guessed from the body (chat if it has
/// `messages`, else completions). Prefer [`visit_canonical_prompt`] on hot paths: it does not
/// copy the text.
pub fn canonical_prompt(body: &Value) -> Option<String> {
    canonical_prompt_for(ApiKind::of_body(body), body)
}

/// The validated parameters of a completion request, besides its prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestParams<'a> {
    /// `stream: true`
    pub stream: bool,
    /// Output tokens to generate: `max_completion_tokens`, else `max_tokens`, else 16.
    pub max_tokens: u64,
    /// The `model` the client named, if any.
    pub model: Option<&'a str>,
}

/// Output length when the request names none.
pub const DEFAULT_MAX_TOKENS: u64 = 16;

/// Validates the non-prompt fields the engine reads.
pub fn parse_params(body: &Value) -> Result<RequestParams<'_>, InvalidRequest> {
    let stream = match body.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(other) => return Err(InvalidRequest::wrong_type("stream", "a boolean", other)),
    };
    let mut max_tokens = None;
    for name in ["max_completion_tokens", "max_tokens"] {
        match body.get(name) {
            None | Some(Value::Null) => {}
            Some(v) => match v.as_u64() {
                Some(n) if n >= 1 => {
                    max_tokens = Some(n);
                    break;
                }
                _ => return Err(InvalidRequest::wrong_type(name, "an integer >= 1", v)),
            },
        }
    }
    let model = match body.get("model") {
        None | Some(Value::Null) => None,
        Some(Value::String(m)) => Some(m.as_str()),
        Some(other) => return Err(InvalidRequest::wrong_type("model", "a string", other)),
    };
    Ok(RequestParams {
        stream,
        max_tokens: max_tokens.unwrap_or(DEFAULT_MAX_TOKENS),
        model,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn chat_canonical_text() {
        let body = json!({"model": "m", "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": [
                {"type": "text", "text": "Hello "},
                {"type": "image_url", "image_url": {"url": "http://x"}},
                {"type": "text", "text": "world"}
            ]},
            {"role": "assistant", "content": null, "tool_calls": []}
        ]});
        assert_eq!(
            canonical_prompt(&body).unwrap(),
            "system\nYou are terse.\nuser\nHello world\nassistant\n\n"
        );
    }

    #[test]
    fn completion_canonical_text() {
        assert_eq!(canonical_prompt(&json!({"prompt": "abc"})).unwrap(), "abc");
        assert_eq!(
            canonical_prompt(&json!({"prompt": ["x", "y"]})).unwrap(),
            "x"
        );
        assert_eq!(canonical_prompt(&json!({"prompt": [1, 2]})), None);
        assert_eq!(canonical_prompt(&json!({"prompt": []})), None);
        assert_eq!(canonical_prompt(&json!({})), None);
        assert_eq!(canonical_prompt(&json!("prompt")), None);
    }

    #[test]
    fn errors_name_the_field_and_value() {
        let err = |kind, body: Value| visit_canonical_prompt(kind, &body, |_| {}).unwrap_err();
        let e = err(ApiKind::Chat, json!({"messages": "hi"}));
        assert_eq!(e.param.as_deref(), Some("messages"));
        assert_eq!(
            e.message,
            "\"messages\" must be an array of messages, got string \"hi\""
        );
        let e = err(
            ApiKind::Chat,
            json!({"messages": [{"role": "user", "content": 42}]}),
        );
        assert_eq!(e.param.as_deref(), Some("messages[0].content"));
        assert!(e.message.contains("number 42"), "{}", e.message);
        let e = err(ApiKind::Chat, json!({"messages": [{"content": "x"}]}));
        assert_eq!(e.param.as_deref(), Some("messages[0].role"));
        let e = err(
            ApiKind::Chat,
            json!({"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]}),
        );
        assert_eq!(e.param.as_deref(), Some("messages[0].content[0].text"));
        let e = err(ApiKind::Chat, json!({"messages": []}));
        assert_eq!(e.param.as_deref(), Some("messages"));
        let e = err(ApiKind::Completions, json!({"messages": []}));
        assert_eq!(e.message, "missing required field \"prompt\"");
        let e = err(ApiKind::Completions, json!({"prompt": {"a": 1}}));
        assert!(e.message.contains("an object"), "{}", e.message);
        let d = describe(&json!("é".repeat(100)));
        assert!(d.ends_with("(200 bytes)"), "{d}");
    }

    #[test]
    fn params() {
        let body = json!({"stream": true, "max_tokens": 5, "model": "x"});
        let p = parse_params(&body).unwrap();
        assert_eq!((p.stream, p.max_tokens, p.model), (true, 5, Some("x")));
        let body = json!({"max_tokens": 5, "max_completion_tokens": 7});
        assert_eq!(parse_params(&body).unwrap().max_tokens, 7);
        let body = json!({"stream": null});
        let p = parse_params(&body).unwrap();
        assert_eq!(
            (p.stream, p.max_tokens, p.model),
            (false, DEFAULT_MAX_TOKENS, None)
        );
        let e = parse_params(&json!({"max_tokens": -3})).unwrap_err();
        assert_eq!(
            e.message,
            "\"max_tokens\" must be an integer >= 1, got number -3"
        );
        assert!(parse_params(&json!({"max_tokens": 0})).is_err());
        assert!(parse_params(&json!({"max_tokens": 1.5})).is_err());
        assert_eq!(
            parse_params(&json!({"stream": "yes"}))
                .unwrap_err()
                .param
                .as_deref(),
            Some("stream")
        );
        assert!(parse_params(&json!({"model": 3})).is_err());
    }
}
