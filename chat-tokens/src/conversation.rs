//! A chat body's `messages` as vLLM hands them to the template (`parse_chat_messages`,
//! `_postprocess_messages`, the developer-role conversion of `safe_apply_chat_template`).
//!
//! Per message, in vLLM's key order: `role`; `content` (null or missing: no parts; a string: one
//! text part; the text parts joined with `"\n"` for a string-format template, or kept as
//! `{"type": "text", "text": ...}` for an OpenAI-format one); then by role: an assistant's
//! `tool_calls` (arguments parsed from their JSON string into an object, `{}` when empty or not
//! an object; an empty list dropped) and `reasoning` / `reasoning_content`; a tool message's
//! `tool_call_id` (its text parts always joined); `name`; a developer message's `tools`.

use minijinja::value::ValueKind;
use minijinja::Value;

use crate::template::{Compiled, ContentFormat};
use crate::Error;

pub(crate) fn messages(body: &Value, template: &Compiled) -> Result<Vec<Value>, Error> {
    let list = body.get_attr("messages").unwrap_or(Value::UNDEFINED);
    if list.kind() != ValueKind::Seq {
        return Err(Error::Body(format!(
            "messages: expected a list, found {}",
            list.kind()
        )));
    }
    let mut out = Vec::with_capacity(list.len().unwrap_or(0));
    let mut any_developer = false;
    for (i, message) in list.try_iter().into_iter().flatten().enumerate() {
        let m = Message::parse(i, &message, template.content_format)?;
        any_developer |= m.role == "developer";
        out.push(m);
    }
    if any_developer && !template.knows_developer {
        convert_developer_to_system(&mut out);
    }
    Ok(out.into_iter().map(Message::into_value).collect())
}

/// The text of the last message, for `continue_final_message`.
pub(crate) fn final_text(messages: &[Value]) -> Option<String> {
    let content = messages.last()?.get_attr("content").ok()?;
    if let Some(s) = content.as_str() {
        return Some(s.to_owned());
    }
    // OpenAI format: transformers takes the last part's text.
    let last = content.try_iter().ok()?.last()?;
    last.get_attr("text").ok()?.as_str().map(str::to_owned)
}

struct Message {
    role: String,
    content: Content,
    /// The rest, in vLLM's order.
    extra: Vec<(&'static str, Value)>,
}

enum Content {
    Text(String),
    Parts(Vec<String>),
}

impl Message {
    fn parse(i: usize, message: &Value, format: ContentFormat) -> Result<Self, Error> {
        let field = |name: &str| message.get_attr(name).unwrap_or(Value::UNDEFINED);
        if message.kind() != ValueKind::Map {
            return Err(Error::Body(format!(
                "messages[{i}]: expected an object, found {}",
                message.kind()
            )));
        }
        let role = field("role");
        let Some(role) = role.as_str().map(str::to_owned) else {
            return Err(Error::Body(format!(
                "messages[{i}].role: expected a string, found {}",
                role.kind()
            )));
        };
        let texts = texts(i, &field("content"))?;
        let content = if format == ContentFormat::OpenAi && role != "tool" {
            Content::Parts(texts)
        } else {
            Content::Text(texts.join("\n"))
        };
        let mut extra = Vec::new();
        match role.as_str() {
            "assistant" => {
                let calls = field("tool_calls");
                if !(calls.is_undefined() || calls.is_none()) {
                    if let Some(calls) = tool_calls(i, &calls)? {
                        extra.push(("tool_calls", calls));
                    }
                }
                let reasoning = field("reasoning");
                if !(reasoning.is_undefined() || reasoning.is_none()) {
                    extra.push(("reasoning", reasoning.clone()));
                    extra.push(("reasoning_content", reasoning));
                }
            }
            "tool" => {
                let id = field("tool_call_id");
                if !id.is_undefined() {
                    extra.push(("tool_call_id", id));
                }
            }
            _ => {}
        }
        for key in ["name", "task"] {
            let v = field(key);
            if v.as_str().is_some() {
                extra.push((if key == "name" { "name" } else { "task" }, v));
            }
        }
        if role == "developer" {
            let tools = field("tools");
            extra.push((
                "tools",
                if tools.is_undefined() {
                    Value::from(())
                } else {
                    tools
                },
            ));
        }
        Ok(Message {
            role,
            content,
            extra,
        })
    }

    fn into_value(self) -> Value {
        let content = match self.content {
            Content::Text(s) => Value::from(s),
            Content::Parts(parts) => Value::from(
                parts
                    .into_iter()
                    .map(|text| {
                        [("type", Value::from("text")), ("text", Value::from(text))]
                            .into_iter()
                            .collect::<Value>()
                    })
                    .collect::<Vec<_>>(),
            ),
        };
        [("role", Value::from(self.role)), ("content", content)]
            .into_iter()
            .chain(self.extra)
            .collect()
    }

    fn text(&self) -> String {
        match &self.content {
            Content::Text(s) => s.clone(),
            Content::Parts(p) => p.join("\n"),
        }
    }
}

/// The text parts of a message's content.
fn texts(i: usize, content: &Value) -> Result<Vec<String>, Error> {
    match content.kind() {
        ValueKind::Undefined | ValueKind::None => Ok(Vec::new()),
        ValueKind::String => Ok(vec![content.as_str().unwrap_or("").to_owned()]),
        ValueKind::Seq => {
            let mut out = Vec::new();
            for (j, part) in content.try_iter().into_iter().flatten().enumerate() {
                if let Some(s) = part.as_str() {
                    out.push(s.to_owned());
                    continue;
                }
                let kind = part.get_attr("type").unwrap_or(Value::UNDEFINED);
                match kind.as_str() {
                    Some("text" | "input_text" | "output_text") => {
                        let text = part.get_attr("text").unwrap_or(Value::UNDEFINED);
                        let Some(text) = text.as_str() else {
                            return Err(Error::Body(format!(
                                "messages[{i}].content[{j}].text: expected a string, found {}",
                                text.kind()
                            )));
                        };
                        out.push(text.to_owned());
                    }
                    Some("refusal") => {
                        if let Some(s) = part
                            .get_attr("refusal")
                            .ok()
                            .and_then(|v| v.as_str().map(str::to_owned))
                        {
                            out.push(s);
                        }
                    }
                    Some(other) => {
                        return Err(Error::Body(format!(
                            "messages[{i}].content[{j}]: parts of type {other:?} are not supported \
                             (text only)"
                        )))
                    }
                    None => {
                        return Err(Error::Body(format!(
                            "messages[{i}].content[{j}]: expected a string or an object with a \
                             \"type\", found {}",
                            part.kind()
                        )))
                    }
                }
            }
            // vLLM keeps a part only if it parsed to something (`if parse_res:` in
            // `renderers/chat_utils.py`): an empty text part adds no "\n"
            out.retain(|t| !t.is_empty());
            Ok(out)
        }
        other => Err(Error::Body(format!(
            "messages[{i}].content: expected a string or a list of parts, found {other}"
        ))),
    }
}

/// vLLM's `_postprocess_messages`: arguments as objects. `None` for an empty list (dropped).
fn tool_calls(i: usize, calls: &Value) -> Result<Option<Value>, Error> {
    if calls.kind() != ValueKind::Seq {
        return Ok(Some(calls.clone()));
    }
    let mut out = Vec::new();
    for (j, call) in calls.try_iter().into_iter().flatten().enumerate() {
        if call.kind() != ValueKind::Map {
            return Err(Error::Body(format!(
                "messages[{i}].tool_calls[{j}]: assistant tool_calls entries must be objects"
            )));
        }
        let function = call.get_attr("function").unwrap_or(Value::UNDEFINED);
        if function.kind() != ValueKind::Map {
            return Err(Error::Body(format!(
                "messages[{i}].tool_calls[{j}].function: expected an object, found {}",
                function.kind()
            )));
        }
        let args = function.get_attr("arguments").unwrap_or(Value::UNDEFINED);
        let parsed = if !args.is_true() {
            empty_object()
        } else if args.kind() == ValueKind::Map {
            args
        } else if let Some(s) = args.as_str() {
            match serde_json::from_str::<Value>(s) {
                Ok(v) if v.kind() == ValueKind::Map => v,
                _ => empty_object(),
            }
        } else {
            empty_object()
        };
        let function = replace_key(&function, "arguments", parsed);
        out.push(replace_key(&call, "function", function));
    }
    if out.is_empty() {
        return Ok(None);
    }
    Ok(Some(Value::from(out)))
}

fn empty_object() -> Value {
    std::iter::empty::<(Value, Value)>().collect()
}

/// A copy of the map `map` with `key` set to `value` (in place if present, else appended).
fn replace_key(map: &Value, key: &str, value: Value) -> Value {
    let mut value = Some(value);
    let mut entries: Vec<(Value, Value)> = map
        .try_iter()
        .into_iter()
        .flatten()
        .map(|k| {
            let v = if k.as_str() == Some(key) {
                value.take().unwrap_or_default()
            } else {
                map.get_item(&k).unwrap_or_default()
            };
            (k, v)
        })
        .collect();
    if let Some(v) = value {
        entries.push((Value::from(key), v));
    }
    entries.into_iter().collect()
}

/// vLLM's `_convert_developer_to_system` then `_consolidate_system_messages`: developer messages
/// become system ones (without `tools`); several system messages, or one not first, merge into one
/// first system message whose text is theirs joined with `"\n\n"`.
fn convert_developer_to_system(messages: &mut Vec<Message>) {
    for m in messages.iter_mut() {
        if m.role == "developer" {
            m.role = "system".into();
            m.extra.retain(|(k, _)| *k != "tools");
        }
    }
    let systems = messages.iter().filter(|m| m.role == "system").count();
    let first_is_system = messages.first().is_some_and(|m| m.role == "system");
    if systems == 0 || (systems == 1 && first_is_system) {
        return;
    }
    let texts: Vec<String> = messages
        .iter()
        .filter(|m| m.role == "system")
        .map(Message::text)
        .filter(|t| !t.is_empty())
        .collect();
    messages.retain(|m| m.role != "system");
    messages.insert(
        0,
        Message {
            role: "system".into(),
            content: Content::Text(texts.join("\n\n")),
            extra: Vec::new(),
        },
    );
}
