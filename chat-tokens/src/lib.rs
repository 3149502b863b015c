//! The prompt as the engine tokenizes it: the token ids vLLM computes for an OpenAI request body,
//! from the model's `tokenizer.json` and chat template, so a router can key its prefix index by
//! the same tokens (and block hashes over them) as the engines' own KV events.
//!
//! Map:
//! - [`ChatTokenizer`]: loads `tokenizer.json` (HF `tokenizers`) and the chat template beside it;
//!   [`ChatTokenizer::tokens`] turns a request body into token ids.
//! - `template`: finding the template (`chat_template.jinja`, else `tokenizer_config.json`'s
//!   `chat_template`, a string or a `[{name, template}]` list), compiling it with transformers'
//!   Jinja settings, vLLM's content-format detection.
//! - `conversation`: a chat body's `messages` as vLLM hands them to the template.
//!
//! What vLLM does, and so this crate (vLLM 0.34 `renderers/hf.py`, `chat_utils/chat_message.py`):
//! - `/v1/chat/completions`: the messages are normalised (text parts joined with `"\n"`, or kept
//!   as `{"type": "text"}` parts when the template loops over the content; tool-call arguments
//!   parsed into objects), rendered with `add_generation_prompt` (default true), `tools`, the
//!   special tokens of `tokenizer_config.json` and the body's `chat_template_kwargs`, and the text
//!   is encoded **without** special tokens (the template writes them): `add_special_tokens`
//!   defaults to false.
//! - `/v1/completions`: the `prompt` string is encoded **with** special tokens (e.g. a BOS),
//!   `add_special_tokens` defaulting to true; a prompt of token ids is taken as is.
//!
//! Invariants: loading reads only the files beside `tokenizer.json` and never the network; every
//! error names the file or the body field and what was wrong; nothing panics on a request body.
//! Absences: no multimodal parts (an image part is an error), no truncation, tools rendered from
//! the request's JSON as sent (vLLM renders pydantic's dump, which adds the unset optional fields
//! as nulls: a template that prints whole tool objects differs there).

mod conversation;
mod segments;
mod template;

use std::path::{Path, PathBuf};

use minijinja::Value;

pub use template::ContentFormat;

/// Which OpenAI endpoint a body was sent to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestKind {
    /// `/v1/chat/completions`: `messages` through the chat template.
    Chat,
    /// `/v1/completions`: the `prompt`.
    Completions,
}

/// How much of a rendered chat [`ChatTokenizer::tokens_while`] encoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Partial {
    /// Bytes of the rendered text the ids cover (0 for completions).
    pub text_bytes: usize,
    /// Bytes of the whole rendered text (0 for completions).
    pub rendered_bytes: usize,
    /// Whether the ids are the whole prompt's.
    pub complete: bool,
}

/// Why a piece-wise encoding stopped.
enum Halt {
    Enough,
    Error(Error),
}

/// What went wrong. Each names the file or the field and what was found there.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file could not be read.
    #[error("cannot read {}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A file was read but is not what it should be.
    #[error("{}: {reason}", path.display())]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// A chat request, and the tokenizer has no chat template.
    #[error(
        "no chat template for {}: neither chat_template.jinja nor a chat_template in \
         tokenizer_config.json beside it",
        path.display()
    )]
    NoChatTemplate {
        /// The tokenizer.json.
        path: PathBuf,
    },
    /// The request body is not a request this crate can tokenize.
    #[error("request body: {0}")]
    Body(String),
    /// The chat template failed on this request (`raise_exception`, a bad expression).
    #[error("chat template {}: {reason}", path.display())]
    Render {
        /// Where the template came from.
        path: PathBuf,
        /// The template's error.
        reason: String,
    },
    /// The tokenizer failed on the text.
    #[error("{}: cannot encode the prompt: {reason}", path.display())]
    Encode {
        /// The tokenizer.json.
        path: PathBuf,
        /// The tokenizer's error.
        reason: String,
    },
}

/// A model's tokenizer and chat template: request bodies in, the engine's token ids out.
/// Immutable once loaded; share it behind an `Arc` (it is `Send + Sync`).
#[derive(Debug)]
pub struct ChatTokenizer {
    path: PathBuf,
    tokenizer: tokenizers::Tokenizer,
    templates: Option<template::Templates>,
    special: template::SpecialTokens,
    splitter: Option<segments::Splitter>,
    cache: segments::SegmentCache,
    chunking: segments::Chunking,
}

/// The default bound on remembered piece ids: 1 Mi ids (4 MiB) per generation, two generations
/// (a fleet's tenants' system prompts and documents are easily several hundred thousand ids).
pub const DEFAULT_CACHE_TOKENS: usize = 1024 * 1024;

impl ChatTokenizer {
    /// Loads `tokenizer.json` at `path` and the chat template and special tokens beside it
    /// (`chat_template.jinja`, `tokenizer_config.json`; both optional: without a template only
    /// completions can be tokenized).
    pub fn load(path: impl AsRef<Path>) -> Result<Self, Error> {
        let path = path.as_ref().to_owned();
        let bytes = std::fs::read(&path).map_err(|source| Error::Read {
            path: path.clone(),
            source,
        })?;
        let tokenizer = tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| Error::Invalid {
            path: path.clone(),
            reason: format!("not a tokenizers tokenizer.json: {e}"),
        })?;
        let dir = path.parent().unwrap_or(Path::new("."));
        let dir = if dir.as_os_str().is_empty() {
            Path::new(".")
        } else {
            dir
        };
        let (templates, special) = template::load(dir)?;
        Ok(ChatTokenizer {
            path,
            splitter: segments::Splitter::new(&tokenizer),
            tokenizer,
            templates,
            special,
            cache: segments::SegmentCache::new(DEFAULT_CACHE_TOKENS),
            chunking: segments::Chunking::new(),
        })
    }

    /// Sets how many token ids of rendered-chat pieces (the text between special tokens, e.g. one
    /// message) are remembered, per generation of two; 0 encodes every chat whole. The ids are
    /// the same either way; the memory makes a resent system prompt or conversation history cost
    /// a lookup. Default [`DEFAULT_CACHE_TOKENS`].
    pub fn with_cache_tokens(mut self, capacity_tokens: usize) -> Self {
        self.cache = segments::SegmentCache::new(capacity_tokens);
        self
    }

    /// Whether chats are encoded piece by piece with remembered pieces (the tokenizer has
    /// special tokens to split on, none with `lstrip`/`rstrip`/`single_word`, and the memory is
    /// not 0).
    pub fn remembers_pieces(&self) -> bool {
        self.splitter.is_some() && self.cache.capacity_tokens() > 0
    }

    /// The tokenizer.json this was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Where the chat template came from (`chat_template.jinja` or `tokenizer_config.json`), if
    /// there is one.
    pub fn chat_template_path(&self) -> Option<&Path> {
        self.templates.as_ref().map(|t| t.origin.as_path())
    }

    /// How the default template wants message content (vLLM's detection), if there is one.
    pub fn content_format(&self) -> Option<ContentFormat> {
        let t = self.templates.as_ref()?;
        t.default
            .as_ref()
            .or(t.tool_use.as_ref())
            .map(|c| c.content_format)
    }

    /// Replaces `out`'s contents with the token ids the engine computes for the JSON request
    /// `body` sent to the `kind` endpoint. The body's key order is kept (it matters where a
    /// template prints objects with `tojson`).
    pub fn tokens(&self, body: &[u8], kind: RequestKind, out: &mut Vec<u32>) -> Result<(), Error> {
        let body: Value = serde_json::from_slice(body)
            .map_err(|e| Error::Body(format!("not a JSON object: {e}")))?;
        self.tokens_of(&body, kind, out, &mut |_| true).map(drop)
    }

    /// [`ChatTokenizer::tokens`] that may stop early: after each piece of a rendered chat (the
    /// text between special tokens, and each special token), `more(ids so far)` says whether
    /// the rest is wanted (a router stops where no engine holds the prompt's blocks any longer:
    /// what follows only adds to its length). `out` then holds a prefix of the ids; the
    /// [`Partial`] says how much of the rendered text they cover. Completions and tokenizers
    /// without the piece-wise path encode whole.
    pub fn tokens_while(
        &self,
        body: &[u8],
        kind: RequestKind,
        out: &mut Vec<u32>,
        more: &mut dyn FnMut(&[u32]) -> bool,
    ) -> Result<Partial, Error> {
        let body: Value = serde_json::from_slice(body)
            .map_err(|e| Error::Body(format!("not a JSON object: {e}")))?;
        self.tokens_of(&body, kind, out, more)
    }

    /// [`ChatTokenizer::tokens`] for a body already parsed (serde_json's maps without its
    /// `preserve_order` feature are sorted by key, which only matters for `tojson` of objects).
    pub fn tokens_of_json(
        &self,
        body: &serde_json::Value,
        kind: RequestKind,
        out: &mut Vec<u32>,
    ) -> Result<(), Error> {
        self.tokens_of(&Value::from_serialize(body), kind, out, &mut |_| true)
            .map(drop)
    }

    fn tokens_of(
        &self,
        body: &Value,
        kind: RequestKind,
        out: &mut Vec<u32>,
        more: &mut dyn FnMut(&[u32]) -> bool,
    ) -> Result<Partial, Error> {
        out.clear();
        if body.kind() != minijinja::value::ValueKind::Map {
            return Err(Error::Body(format!(
                "expected a JSON object, found {}",
                body.kind()
            )));
        }
        match kind {
            RequestKind::Chat => {
                let add_special = flag(body, "add_special_tokens")?.unwrap_or(false);
                let text = self.render(body)?;
                let whole = Partial {
                    text_bytes: text.len(),
                    rendered_bytes: text.len(),
                    complete: true,
                };
                match &self.splitter {
                    Some(splitter) if !add_special && self.cache.capacity_tokens() > 0 => {
                        let mut covered = 0;
                        let split = splitter.split(&text, |piece| {
                            match piece {
                                segments::Piece::Token(id, len) => {
                                    out.push(id);
                                    covered += len;
                                }
                                segments::Piece::Text(text) => {
                                    self.encode_piece(text, out).map_err(Halt::Error)?;
                                    covered += text.len();
                                }
                            }
                            if more(out) {
                                Ok(())
                            } else {
                                Err(Halt::Enough)
                            }
                        });
                        match split {
                            Ok(()) => Ok(whole),
                            Err(Halt::Enough) => Ok(Partial {
                                text_bytes: covered,
                                complete: covered == text.len(),
                                ..whole
                            }),
                            Err(Halt::Error(e)) => Err(e),
                        }
                    }
                    _ => self.encode(&text, add_special, out).map(|()| whole),
                }
            }
            RequestKind::Completions => {
                let add_special = flag(body, "add_special_tokens")?.unwrap_or(true);
                self.completion_prompt(body, add_special, out)?;
                Ok(Partial {
                    text_bytes: 0,
                    rendered_bytes: 0,
                    complete: true,
                })
            }
        }
    }

    /// Whether long chat pieces are encoded chunk by chunk (on until a check finds the chunks'
    /// ids differ from the whole piece's with this tokenizer).
    pub fn chunks_long_pieces(&self) -> bool {
        self.chunking.is_on()
    }

    /// A piece's ids, remembered: a long piece chunk by chunk (a document a question follows, a
    /// long message, re-encoded only from the chunk where it changed), while chunking checks out
    /// on this tokenizer (see `segments::chunks`).
    fn encode_piece(&self, text: &str, out: &mut Vec<u32>) -> Result<(), Error> {
        let encode = |t: &str| {
            let mut ids = Vec::new();
            self.encode(t, false, &mut ids).map(|()| ids)
        };
        if text.len() < 2 * segments::CHUNK_BYTES || !self.chunking.is_on() {
            out.extend_from_slice(&self.cache.get_or_encode(text, encode)?);
            return Ok(());
        }
        let from = out.len();
        for chunk in segments::chunks(text) {
            out.extend_from_slice(&self.cache.get_or_encode(chunk, encode)?);
        }
        if self.chunking.check_next() {
            let whole = encode(text)?;
            if out[from..] != whole[..] {
                tracing::warn!(
                    tokenizer = %self.path.display(),
                    "encoding long chat pieces chunk by chunk differs from encoding them whole \
                     with this tokenizer; every piece is encoded whole from now on"
                );
                self.chunking.turn_off();
                out.truncate(from);
                out.extend_from_slice(&whole);
            }
        }
        Ok(())
    }

    /// The text the chat template renders for a chat body (what [`ChatTokenizer::tokens`]
    /// encodes for [`RequestKind::Chat`]).
    pub fn render_chat(&self, body: &[u8]) -> Result<String, Error> {
        let body: Value = serde_json::from_slice(body)
            .map_err(|e| Error::Body(format!("not a JSON object: {e}")))?;
        self.render(&body)
    }

    /// Appends the ids of `text` encoded by the tokenizer, with or without its special tokens
    /// (a BOS, ...), to `out`.
    pub fn encode(
        &self,
        text: &str,
        add_special_tokens: bool,
        out: &mut Vec<u32>,
    ) -> Result<(), Error> {
        let encoding = self
            .tokenizer
            .encode_fast(text, add_special_tokens)
            .map_err(|e| Error::Encode {
                path: self.path.clone(),
                reason: e.to_string(),
            })?;
        out.extend_from_slice(encoding.get_ids());
        Ok(())
    }

    fn render(&self, body: &Value) -> Result<String, Error> {
        let templates = self
            .templates
            .as_ref()
            .ok_or_else(|| Error::NoChatTemplate {
                path: self.path.clone(),
            })?;
        let tools = body.get_attr("tools").unwrap_or(Value::UNDEFINED);
        let has_tools = !(tools.is_undefined() || tools.is_none());
        let compiled = match (&templates.default, &templates.tool_use) {
            (_, Some(tool_use)) if has_tools => tool_use,
            (Some(default), _) => default,
            (None, Some(tool_use)) => tool_use,
            (None, None) => {
                return Err(Error::NoChatTemplate {
                    path: self.path.clone(),
                })
            }
        };
        let messages = conversation::messages(body, compiled)?;
        let asked_generation_prompt = flag(body, "add_generation_prompt")?;
        let continue_final = flag(body, "continue_final_message")?.unwrap_or(false);
        if continue_final && asked_generation_prompt == Some(true) {
            return Err(Error::Body(
                "add_generation_prompt and continue_final_message cannot both be true".into(),
            ));
        }
        let add_generation_prompt = !continue_final && asked_generation_prompt.unwrap_or(true);
        let final_text = if continue_final {
            conversation::final_text(&messages)
        } else {
            None
        };

        // transformers: render(messages=, tools=, documents=, add_generation_prompt=,
        // **special_tokens_map, **kwargs), kwargs being vLLM's chat_template_kwargs.
        let mut context: Vec<(Value, Value)> = Vec::with_capacity(8 + self.special.0.len());
        for (k, v) in &self.special.0 {
            context.push((Value::from(*k), v.clone()));
        }
        let kwargs = body
            .get_attr("chat_template_kwargs")
            .unwrap_or(Value::UNDEFINED);
        if kwargs.kind() == minijinja::value::ValueKind::Map {
            for key in kwargs.try_iter().into_iter().flatten() {
                let value = kwargs.get_item(&key).unwrap_or(Value::UNDEFINED);
                context.push((key, value));
            }
        }
        context.push((Value::from("messages"), Value::from(messages)));
        context.push((
            Value::from("tools"),
            if has_tools { tools } else { Value::from(()) },
        ));
        let documents = body.get_attr("documents").unwrap_or(Value::UNDEFINED);
        context.push((
            Value::from("documents"),
            if documents.is_undefined() {
                Value::from(())
            } else {
                documents
            },
        ));
        context.push((
            Value::from("add_generation_prompt"),
            Value::from(add_generation_prompt),
        ));
        let context: Value = context.into_iter().collect();
        let mut text = compiled.render(context).map_err(|e| Error::Render {
            path: templates.origin.clone(),
            reason: render_error(&e),
        })?;
        if let Some(final_text) = final_text {
            // transformers: cut the rendering after the final message's (stripped) text.
            let needle = final_text.trim();
            let at = text
                .rfind(needle)
                .map(|i| i + needle.len())
                .or_else(|| text.rfind(&final_text).map(|i| i + final_text.len()));
            match at {
                Some(end) => text.truncate(end),
                None => {
                    return Err(Error::Render {
                        path: templates.origin.clone(),
                        reason: "continue_final_message: the rendered chat does not contain the \
                                 final message's content"
                            .into(),
                    })
                }
            }
        }
        Ok(text)
    }

    fn completion_prompt(
        &self,
        body: &Value,
        add_special: bool,
        out: &mut Vec<u32>,
    ) -> Result<(), Error> {
        let prompt = body.get_attr("prompt").unwrap_or(Value::UNDEFINED);
        if let Some(text) = prompt.as_str() {
            return self.encode(text, add_special, out);
        }
        if prompt.kind() != minijinja::value::ValueKind::Seq {
            return Err(Error::Body(format!(
                "prompt: expected a string or a list of token ids, found {}",
                prompt.kind()
            )));
        }
        let items: Vec<Value> = prompt.try_iter().into_iter().flatten().collect();
        match items.as_slice() {
            [one] if one.as_str().is_some() => {
                self.encode(one.as_str().unwrap_or(""), add_special, out)
            }
            [one] if one.kind() == minijinja::value::ValueKind::Seq => token_ids(one, out),
            _ if items
                .iter()
                .all(|v| v.kind() == minijinja::value::ValueKind::Number) =>
            {
                token_ids(&prompt, out)
            }
            _ => Err(Error::Body(format!(
                "prompt: a batch of {} prompts, not one prompt",
                items.len()
            ))),
        }
    }
}

fn token_ids(list: &Value, out: &mut Vec<u32>) -> Result<(), Error> {
    for (i, v) in list.try_iter().into_iter().flatten().enumerate() {
        let id = u32::try_from(v.clone())
            .map_err(|_| Error::Body(format!("prompt[{i}]: {v} is not a token id")))?;
        out.push(id);
    }
    Ok(())
}

/// A boolean field of the body: absent or null is `None`.
fn flag(body: &Value, field: &str) -> Result<Option<bool>, Error> {
    let v = body.get_attr(field).unwrap_or(Value::UNDEFINED);
    match v.kind() {
        minijinja::value::ValueKind::Undefined | minijinja::value::ValueKind::None => Ok(None),
        minijinja::value::ValueKind::Bool => Ok(Some(v.is_true())),
        other => Err(Error::Body(format!(
            "{field}: expected a boolean, found {other}"
        ))),
    }
}

/// The template's error with its cause chain (minijinja puts the `raise_exception` text in it).
fn render_error(e: &minijinja::Error) -> String {
    let mut out = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}
