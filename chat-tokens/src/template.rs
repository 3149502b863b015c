//! The chat template: found beside `tokenizer.json`, compiled once, rendered the way transformers'
//! `apply_chat_template` renders it.
//!
//! transformers (`utils/chat_template_utils.py`, `_compile_jinja_template`) renders with
//! `ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[AssistantTracker,
//! loopcontrols])`, a `tojson` filter that is Python's `json.dumps` (no HTML escaping, non-ASCII kept),
//! and the globals `raise_exception` and `strftime_now`. The same here with minijinja, plus
//! minijinja-contrib's Python string and dict methods (`.strip()`, `.items()`, ...), and
//! `{% generation %}` blocks (transformers' assistant-mask extension) rendered as plain blocks.

use std::path::{Path, PathBuf};

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Environment, ErrorKind, Value};

use crate::Error;

/// The name the template is registered under (not `.html`: no auto-escaping).
const NAME: &str = "chat_template";

/// How message content reaches the template (vLLM's `ChatTemplateContentFormat`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContentFormat {
    /// The text parts joined with `"\n"` into one string.
    String,
    /// A list of `{"type": "text", "text": ...}` parts (the template loops over the content).
    OpenAi,
}

/// One compiled template.
#[derive(Debug)]
pub(crate) struct Compiled {
    env: Environment<'static>,
    pub(crate) content_format: ContentFormat,
    /// Whether the template names the `developer` role (vLLM converts it to `system` if not).
    pub(crate) knows_developer: bool,
}

impl Compiled {
    pub(crate) fn new(source: String, origin: &Path) -> Result<Self, Error> {
        let content_format = detect_content_format(&source);
        let knows_developer = source.contains("\"developer\"") || source.contains("'developer'");
        let source = generation_blocks_as_plain_blocks(&source);
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(NAME, source)
            .map_err(|e| Error::Invalid {
                path: origin.to_owned(),
                reason: format!("the chat template does not compile: {e:#}"),
            })?;
        Ok(Compiled {
            env,
            content_format,
            knows_developer,
        })
    }

    pub(crate) fn render(&self, context: Value) -> Result<String, minijinja::Error> {
        self.env.get_template(NAME)?.render(context)
    }
}

/// The templates of one model, as transformers finds them.
#[derive(Debug)]
pub(crate) struct Templates {
    /// Where the template came from (for errors).
    pub(crate) origin: PathBuf,
    pub(crate) default: Option<Compiled>,
    /// The `tool_use` template of a list-form `chat_template`, used when the request has tools.
    pub(crate) tool_use: Option<Compiled>,
}

/// Special tokens from `tokenizer_config.json`, passed to the template as transformers passes its
/// `special_tokens_map`.
#[derive(Debug, Default)]
pub(crate) struct SpecialTokens(pub(crate) Vec<(&'static str, Value)>);

const SPECIAL_TOKEN_KEYS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// `chat_template.jinja` beside the tokenizer, else `tokenizer_config.json`'s `chat_template`;
/// the special tokens from `tokenizer_config.json`. Neither file is required.
pub(crate) fn load(dir: &Path) -> Result<(Option<Templates>, SpecialTokens), Error> {
    let config_path = dir.join("tokenizer_config.json");
    let config: Option<serde_json::Value> = match std::fs::read(&config_path) {
        Ok(bytes) => Some(serde_json::from_slice(&bytes).map_err(|e| Error::Invalid {
            path: config_path.clone(),
            reason: format!("not JSON: {e}"),
        })?),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(source) => {
            return Err(Error::Read {
                path: config_path,
                source,
            })
        }
    };
    let special = special_tokens(config.as_ref(), &config_path)?;

    let jinja_path = dir.join("chat_template.jinja");
    match std::fs::read_to_string(&jinja_path) {
        Ok(source) => {
            let default = Some(Compiled::new(source, &jinja_path)?);
            return Ok((
                Some(Templates {
                    origin: jinja_path,
                    default,
                    tool_use: None,
                }),
                special,
            ));
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(source) => {
            return Err(Error::Read {
                path: jinja_path,
                source,
            })
        }
    }

    let Some(field) = config.as_ref().and_then(|c| c.get("chat_template")) else {
        return Ok((None, special));
    };
    let bad = |reason: String| Error::Invalid {
        path: config_path.clone(),
        reason,
    };
    let (default, tool_use) = match field {
        serde_json::Value::Null => return Ok((None, special)),
        serde_json::Value::String(s) => (Some(s.clone()), None),
        serde_json::Value::Array(list) => {
            let (mut default, mut tool_use) = (None, None);
            for (i, entry) in list.iter().enumerate() {
                let (Some(name), Some(template)) = (
                    entry.get("name").and_then(|v| v.as_str()),
                    entry.get("template").and_then(|v| v.as_str()),
                ) else {
                    return Err(bad(format!(
                        "chat_template[{i}] is not a {{\"name\": ..., \"template\": ...}} object of strings"
                    )));
                };
                match name {
                    "default" => default = Some(template.to_owned()),
                    "tool_use" => tool_use = Some(template.to_owned()),
                    _ => {}
                }
            }
            if default.is_none() && tool_use.is_none() {
                return Err(bad(
                    "chat_template lists no template named \"default\" (nor \"tool_use\")".into(),
                ));
            }
            (default, tool_use)
        }
        other => {
            return Err(bad(format!(
                "chat_template is a {}, expected a string or a list of {{name, template}}",
                json_kind(other)
            )))
        }
    };
    let compile = |s: Option<String>| s.map(|s| Compiled::new(s, &config_path)).transpose();
    Ok((
        Some(Templates {
            default: compile(default)?,
            tool_use: compile(tool_use)?,
            origin: config_path.clone(),
        }),
        special,
    ))
}

fn special_tokens(config: Option<&serde_json::Value>, path: &Path) -> Result<SpecialTokens, Error> {
    let mut out = SpecialTokens::default();
    let Some(config) = config else {
        return Ok(out);
    };
    let text = |key: &str, v: &serde_json::Value| -> Result<Option<String>, Error> {
        match v {
            serde_json::Value::Null => Ok(None),
            serde_json::Value::String(s) => Ok(Some(s.clone())),
            serde_json::Value::Object(o) => match o.get("content") {
                Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
                _ => Err(Error::Invalid {
                    path: path.to_owned(),
                    reason: format!("{key} is an object without a string \"content\""),
                }),
            },
            other => Err(Error::Invalid {
                path: path.to_owned(),
                reason: format!(
                    "{key} is a {}, expected a string or {{\"content\": ...}}",
                    json_kind(other)
                ),
            }),
        }
    };
    for key in SPECIAL_TOKEN_KEYS {
        if let Some(v) = config.get(key) {
            if let Some(s) = text(key, v)? {
                out.0.push((key, Value::from(s)));
            }
        }
    }
    if let Some(serde_json::Value::Array(list)) = config.get("additional_special_tokens") {
        let mut tokens = Vec::with_capacity(list.len());
        for v in list {
            if let Some(s) = text("additional_special_tokens", v)? {
                tokens.push(Value::from(s));
            }
        }
        out.0
            .push(("additional_special_tokens", Value::from(tokens)));
    }
    Ok(out)
}

pub(crate) fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "boolean",
        serde_json::Value::Number(_) => "number",
        serde_json::Value::String(_) => "string",
        serde_json::Value::Array(_) => "list",
        serde_json::Value::Object(_) => "object",
    }
}

/// `{% generation %}` ... `{% endgeneration %}` (transformers' `AssistantTracker`, which only marks
/// the assistant's tokens) as `{% if true %}` ... `{% endif %}`, whitespace control kept.
fn generation_blocks_as_plain_blocks(source: &str) -> String {
    if !source.contains("generation") {
        return source.to_owned();
    }
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        out.push_str(&rest[..start]);
        let tag = &rest[start..];
        let Some(end) = tag.find("%}") else {
            out.push_str(tag);
            return out;
        };
        let inner = &tag[2..end];
        let (open, body, close) = split_whitespace_control(inner);
        let replacement = match body.trim() {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match replacement {
            Some(r) => {
                out.push_str("{%");
                out.push_str(open);
                out.push(' ');
                out.push_str(r);
                out.push(' ');
                out.push_str(close);
                out.push_str("%}");
            }
            None => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

fn split_whitespace_control(inner: &str) -> (&str, &str, &str) {
    let open = if inner.starts_with(['-', '+']) {
        &inner[..1]
    } else {
        ""
    };
    let inner = &inner[open.len()..];
    let close = if inner.ends_with(['-', '+']) {
        &inner[inner.len() - 1..]
    } else {
        ""
    };
    (open, &inner[..inner.len() - close.len()], close)
}

/// vLLM's content-format detection (`_detect_content_format`), approximated on the source: the
/// template iterates over a message's content (`{% for part in message['content'] %}`, through
/// the variables it assigns from `messages`) or over a variable named `content`, so it wants the
/// OpenAI list of parts; otherwise a string.
pub(crate) fn detect_content_format(source: &str) -> ContentFormat {
    let statements = statements(source);
    // Names bound to `messages` or a slice of it (`{% set loop_messages = messages[1:] %}`).
    let mut message_lists = vec!["messages".to_owned()];
    let mut changed = true;
    while changed {
        changed = false;
        for s in &statements {
            if let Some(("set", rest)) = s.split_once(' ') {
                if let Some((name, value)) = rest.split_once('=') {
                    let (name, value) = (name.trim(), value.trim());
                    if is_access_of(value, &message_lists).is_some()
                        && !message_lists.iter().any(|m| m == name)
                        && is_identifier(name)
                    {
                        message_lists.push(name.to_owned());
                        changed = true;
                    }
                }
            }
        }
    }
    // Loop variables over those lists: the messages.
    let loops: Vec<(&str, &str)> = statements
        .iter()
        .filter_map(|s| {
            let rest = s.strip_prefix("for ")?;
            let (target, iter) = rest.split_once(" in ")?;
            Some((target.trim(), iter.trim()))
        })
        .collect();
    let messages: Vec<String> = loops
        .iter()
        .filter(|(_, iter)| is_access_of(iter, &message_lists) == Some(""))
        .map(|(target, _)| (*target).to_owned())
        .collect();
    let over_content = loops.iter().any(|(_, iter)| {
        let iter = iter.split(['|', ' ']).next().unwrap_or("");
        iter == "content"
            || messages.iter().any(|m| {
                let Some(rest) = iter.strip_prefix(m.as_str()) else {
                    return false;
                };
                let rest = rest
                    .split('[')
                    .filter(|p| !p.contains(':'))
                    .collect::<Vec<_>>()
                    .join("[");
                matches!(rest.as_str(), "['content']" | "[\"content\"]" | ".content")
            })
    });
    if over_content {
        ContentFormat::OpenAi
    } else {
        ContentFormat::String
    }
}

/// For `expr` = one of `names`, optionally sliced or filtered: `Some(the rest)`, where the rest is
/// empty for the list itself (a slice, a filter) and non-empty for an element access.
fn is_access_of<'a>(expr: &'a str, names: &[String]) -> Option<&'a str> {
    let expr = expr.split('|').next().unwrap_or("").trim();
    for name in names {
        if let Some(rest) = expr.strip_prefix(name.as_str()) {
            if rest.is_empty() || (rest.starts_with('[') && rest.contains(':')) {
                return Some("");
            }
        }
    }
    None
}

fn is_identifier(s: &str) -> bool {
    !s.is_empty() && s.chars().all(|c| c.is_alphanumeric() || c == '_')
}

/// The statements of the template (`{% ... %}` contents without whitespace control), with runs
/// of whitespace collapsed to one space.
fn statements(source: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        let tag = &rest[start + 2..];
        let Some(end) = tag.find("%}") else { break };
        let (_, body, _) = split_whitespace_control(&tag[..end]);
        out.push(body.split_whitespace().collect::<Vec<_>>().join(" "));
        rest = &tag[end + 2..];
    }
    out
}

fn raise_exception(message: String) -> Result<String, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
}

/// transformers' `strftime_now(format)`: the current time (UTC here) formatted with the common
/// `strftime` directives (`%d %m %y %Y %b %B %a %A %H %M %S %j %%`).
fn strftime_now(format: String) -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    strftime(&format, now)
}

pub(crate) fn strftime(format: &str, unix_secs: u64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
    ];
    let days = unix_secs / 86_400;
    let secs = unix_secs % 86_400;
    // Howard Hinnant's civil_from_days.
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy_march = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy_march + 2) / 153;
    let day = doy_march - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let before: [i64; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = before[(month - 1) as usize] + day + i64::from(leap && month > 2);
    let month_name = MONTHS[(month - 1) as usize];
    let day_name = DAYS[(days % 7) as usize];
    let mut out = String::with_capacity(format.len() + 16);
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('y') => out.push_str(&format!("{:02}", year % 100)),
            Some('Y') => out.push_str(&year.to_string()),
            Some('b') => out.push_str(&month_name[..3]),
            Some('B') => out.push_str(month_name),
            Some('a') => out.push_str(&day_name[..3]),
            Some('A') => out.push_str(day_name),
            Some('H') => out.push_str(&format!("{:02}", secs / 3600)),
            Some('M') => out.push_str(&format!("{:02}", secs / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", secs % 60)),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// transformers' `tojson`: Python's `json.dumps(x, ensure_ascii=False, indent=indent,
/// separators=separators, sort_keys=sort_keys)`.
fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, minijinja::Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match v.kind() {
            ValueKind::Number => Some(" ".repeat(usize::try_from(v).unwrap_or(0))),
            ValueKind::String => Some(v.as_str().unwrap_or("").to_owned()),
            _ => {
                return Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: indent must be a number or a string",
                ))
            }
        },
    };
    let separators: Option<Value> = kwargs.get("separators")?;
    let (item, key) = match separators.filter(|v| !v.is_none()) {
        Some(v) => {
            let parts: Vec<String> = v
                .try_iter()?
                .map(|p| p.as_str().unwrap_or("").to_owned())
                .collect();
            match parts.as_slice() {
                [item, key] => (item.clone(), key.clone()),
                _ => {
                    return Err(minijinja::Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be (item_separator, key_separator)",
                    ))
                }
            }
        }
        None if indent.is_some() => (",".to_owned(), ": ".to_owned()),
        None => (", ".to_owned(), ": ".to_owned()),
    };
    let sort_keys: bool = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    let ensure_ascii: bool = kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false);
    kwargs.assert_all_used()?;
    let style = JsonStyle {
        indent,
        item,
        key,
        sort_keys,
        ensure_ascii,
    };
    let mut out = String::new();
    style.write(value, 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

struct JsonStyle {
    indent: Option<String>,
    item: String,
    key: String,
    sort_keys: bool,
    ensure_ascii: bool,
}

impl JsonStyle {
    fn newline(&self, depth: usize, out: &mut String) {
        if let Some(indent) = &self.indent {
            out.push('\n');
            for _ in 0..depth {
                out.push_str(indent);
            }
        }
    }

    fn write(&self, value: &Value, depth: usize, out: &mut String) -> Result<(), minijinja::Error> {
        match value.kind() {
            ValueKind::Undefined | ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
            ValueKind::Number if value.is_integer() => match i128::try_from(value.clone()) {
                Ok(i) => out.push_str(&i.to_string()),
                Err(_) => out.push_str(&value.to_string()),
            },
            ValueKind::Number => out.push_str(&python_float(
                f64::try_from(value.clone()).unwrap_or(f64::NAN),
            )),
            ValueKind::String | ValueKind::Bytes => {
                write_string(value.as_str().unwrap_or(""), self.ensure_ascii, out)
            }
            ValueKind::Seq | ValueKind::Iterable | ValueKind::Plain | ValueKind::Invalid => {
                let items: Vec<Value> = value.try_iter()?.collect();
                if items.is_empty() {
                    out.push_str("[]");
                    return Ok(());
                }
                out.push('[');
                for (i, v) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item);
                    }
                    self.newline(depth + 1, out);
                    self.write(v, depth + 1, out)?;
                }
                self.newline(depth, out);
                out.push(']');
            }
            ValueKind::Map => {
                let mut keys: Vec<Value> = value.try_iter()?.collect();
                if keys.is_empty() {
                    out.push_str("{}");
                    return Ok(());
                }
                if self.sort_keys {
                    keys.sort_by_key(|k| k.to_string());
                }
                out.push('{');
                for (i, k) in keys.iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item);
                    }
                    self.newline(depth + 1, out);
                    match k.as_str() {
                        Some(s) => write_string(s, self.ensure_ascii, out),
                        None => write_string(&k.to_string(), self.ensure_ascii, out),
                    }
                    out.push_str(&self.key);
                    self.write(&value.get_item(k)?, depth + 1, out)?;
                }
                self.newline(depth, out);
                out.push('}');
            }
            _ => write_string(&value.to_string(), self.ensure_ascii, out),
        }
        Ok(())
    }
}

/// Python's `repr(float)`: shortest round-trip digits, scientific below 1e-4 and from 1e16.
fn python_float(v: f64) -> String {
    if v.is_nan() {
        return "NaN".into();
    }
    if v.is_infinite() {
        return if v > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    let abs = v.abs();
    if abs != 0.0 && !(1e-4..1e16).contains(&abs) {
        let s = format!("{v:e}");
        let (mantissa, exp) = s.split_once('e').unwrap_or((&s, "0"));
        let (sign, digits) = match exp.strip_prefix('-') {
            Some(d) => ('-', d),
            None => ('+', exp),
        };
        return format!("{mantissa}e{sign}{digits:0>2}");
    }
    if v.fract() == 0.0 {
        format!("{v:.1}")
    } else {
        format!("{v}")
    }
}

fn write_string(s: &str, ensure_ascii: bool, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && (c as u32) > 0x7e) => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_format_follows_the_loops() {
        let string = "{% for message in messages %}{{ message['content'] }}{% endfor %}";
        assert_eq!(detect_content_format(string), ContentFormat::String);
        let openai = "{%- for message in messages -%}{%- for part in message['content'] -%}\
                      {{ part['text'] }}{%- endfor -%}{%- endfor -%}";
        assert_eq!(detect_content_format(openai), ContentFormat::OpenAi);
        let aliased = "{% set loop_messages = messages[1:] %}{% for m in loop_messages %}\
                       {% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}";
        assert_eq!(detect_content_format(aliased), ContentFormat::OpenAi);
        let content_var = "{% for m in messages %}{% set content = m['content'] %}\
                           {% if content is string %}{{ content }}{% else %}\
                           {% for c in content %}{{ c.text }}{% endfor %}{% endif %}{% endfor %}";
        assert_eq!(detect_content_format(content_var), ContentFormat::OpenAi);
    }

    #[test]
    fn generation_blocks_keep_their_whitespace_control() {
        assert_eq!(
            generation_blocks_as_plain_blocks("a{%- generation -%}b{% endgeneration %}c"),
            "a{%- if true -%}b{% endif %}c"
        );
    }

    #[test]
    fn strftime_matches_python() {
        // 2026-12-07 19:49:21 UTC, a Monday: python3 -c 'import time; ...'
        let t = 1_796_672_961;
        assert_eq!(strftime("%d %b %Y", t), "07 Dec 2026");
        assert_eq!(
            strftime("%A %B %j %H:%M:%S %y %%", t),
            "Monday December 341 19:49:21 26 %"
        );
    }

    #[test]
    fn python_floats() {
        assert_eq!(python_float(1.0), "1.0");
        assert_eq!(python_float(0.5), "0.5");
        assert_eq!(python_float(1e16), "1e+16");
        assert_eq!(python_float(1.5e-5), "1.5e-05");
        assert_eq!(python_float(-2.25), "-2.25");
    }
}
