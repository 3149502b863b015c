//! `POST /v1/embeddings` in vLLM's shape: one vector per input (a string, an array of strings,
//! token ids or arrays of token ids), deterministic from the input's bytes and the engine seed,
//! unit length, `dimensions` long (default [`DEFAULT_DIMENSIONS`]); `encoding_format` `float` or
//! `base64` (little-endian f32, what the official Python client asks for by default).

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use hyper::body::Incoming;
use serde_json::{json, Value};
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::engine::Engine;
use crate::prompt::{describe, InvalidRequest};
use crate::reply::{invalid, json_response, read_json, unix_now, ResponseBody};

/// Vector length when the request names none.
pub const DEFAULT_DIMENSIONS: usize = 256;
/// Longest vector a request may ask for.
pub const MAX_DIMENSIONS: usize = 8192;

/// `POST /v1/embeddings`.
pub(crate) async fn handle(engine: &Engine, req: Request<Incoming>) -> Response<ResponseBody> {
    engine.count_request();
    let body = match read_json(engine, req).await {
        Ok(b) => b,
        Err(resp) => return resp,
    };
    let config = engine.config();
    match respond(&body, &config.model_name, config.seed, unix_now()) {
        Ok(answer) => json_response(StatusCode::OK, Bytes::from(answer.to_string())),
        Err(e) => invalid(&e),
    }
}

/// The embeddings response body for `body`, or the error naming the field and value.
pub fn respond(
    body: &Value,
    model: &str,
    seed: u64,
    created: u64,
) -> Result<Value, InvalidRequest> {
    let inputs = inputs(body.get("input"))?;
    let dimensions = match body.get("dimensions") {
        None | Some(Value::Null) => DEFAULT_DIMENSIONS,
        Some(v) => match v.as_u64() {
            Some(n) if (1..=MAX_DIMENSIONS as u64).contains(&n) => n as usize,
            _ => {
                return Err(InvalidRequest::new(
                    "dimensions",
                    format!(
                        "\"dimensions\" must be an integer in 1..={MAX_DIMENSIONS}, got {}",
                        describe(v)
                    ),
                ))
            }
        },
    };
    let base64 = match body.get("encoding_format") {
        None | Some(Value::Null) => false,
        Some(Value::String(f)) if f == "float" => false,
        Some(Value::String(f)) if f == "base64" => true,
        Some(other) => {
            return Err(InvalidRequest::new(
                "encoding_format",
                format!(
                    "\"encoding_format\" must be \"float\" or \"base64\", got {}",
                    describe(other)
                ),
            ))
        }
    };
    let model = match body.get("model") {
        Some(Value::String(m)) => m.as_str(),
        _ => model,
    };
    let mut prompt_tokens = 0u64;
    let data: Vec<Value> = inputs
        .iter()
        .enumerate()
        .map(|(index, input)| {
            prompt_tokens += input.tokens;
            let v = vector(&input.bytes, dimensions, seed);
            let embedding = if base64 {
                Value::String(base64_f32(&v))
            } else {
                json!(v)
            };
            json!({"index": index, "object": "embedding", "embedding": embedding})
        })
        .collect();
    Ok(json!({
        "id": format!("embd-{:016x}", xxh3_64_with_seed(body.to_string().as_bytes(), seed)),
        "object": "list",
        "created": created,
        "model": model,
        "data": data,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens, "completion_tokens": 0, "prompt_tokens_details": null},
    }))
}

/// One input: the bytes its vector is drawn from, and its token count.
struct Input {
    bytes: Vec<u8>,
    tokens: u64,
}

fn inputs(input: Option<&Value>) -> Result<Vec<Input>, InvalidRequest> {
    let text = |s: &str| Input {
        bytes: s.as_bytes().to_vec(),
        tokens: (s.len() as u64).div_ceil(crate::BYTES_PER_TOKEN as u64),
    };
    let ids = |a: &[Value], param: &str| -> Result<Input, InvalidRequest> {
        let mut bytes = Vec::with_capacity(a.len() * 8);
        for (i, v) in a.iter().enumerate() {
            let id = v.as_u64().ok_or_else(|| {
                InvalidRequest::new(
                    format!("{param}[{i}]"),
                    format!("\"{param}[{i}]\" must be a token id, got {}", describe(v)),
                )
            })?;
            bytes.extend_from_slice(&id.to_le_bytes());
        }
        Ok(Input {
            bytes,
            tokens: a.len() as u64,
        })
    };
    let wrong = |v: &Value| {
        InvalidRequest::new(
            "input",
            format!(
                "\"input\" must be a string, an array of strings or token ids, got {}",
                describe(v)
            ),
        )
    };
    let out = match input {
        None | Some(Value::Null) => {
            return Err(InvalidRequest::new(
                "input",
                "missing required field \"input\"",
            ))
        }
        Some(Value::String(s)) => vec![text(s)],
        Some(Value::Array(a)) if a.is_empty() => {
            return Err(InvalidRequest::new(
                "input",
                "\"input\" must not be an empty array",
            ))
        }
        Some(Value::Array(a)) if a[0].is_number() => vec![ids(a, "input")?],
        Some(Value::Array(a)) => a
            .iter()
            .enumerate()
            .map(|(i, v)| match v {
                Value::String(s) => Ok(text(s)),
                Value::Array(t) => ids(t, &format!("input[{i}]")),
                other => Err(InvalidRequest::new(
                    format!("input[{i}]"),
                    format!(
                        "\"input[{i}]\" must be a string or an array of token ids, got {}",
                        describe(other)
                    ),
                )),
            })
            .collect::<Result<_, _>>()?,
        Some(other) => return Err(wrong(other)),
    };
    Ok(out)
}

/// A unit vector drawn from `bytes`: component `j` from xxh3 of the bytes seeded by `seed + j`.
fn vector(bytes: &[u8], dimensions: usize, seed: u64) -> Vec<f32> {
    let mut v: Vec<f32> = (0..dimensions as u64)
        .map(|j| {
            let h = xxh3_64_with_seed(bytes, seed.wrapping_add(j));
            (h as f64 / u64::MAX as f64 * 2.0 - 1.0) as f32
        })
        .collect();
    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt();
    if norm > 0.0 {
        v.iter_mut().for_each(|x| *x /= norm);
    }
    v
}

/// Standard base64 (with padding) of the little-endian bytes of `v`.
fn base64_f32(v: &[f32]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for k in 0..4 {
            if k <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * k) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vectors_are_deterministic_unit_and_differ_by_input() {
        let a = respond(
            &json!({"input": ["hello", "world"], "dimensions": 8}),
            "m",
            1,
            0,
        )
        .unwrap();
        let again = respond(
            &json!({"input": ["hello", "world"], "dimensions": 8}),
            "m",
            1,
            0,
        )
        .unwrap();
        assert_eq!(a, again);
        let v0: Vec<f64> = serde_json::from_value(a["data"][0]["embedding"].clone()).unwrap();
        let v1: Vec<f64> = serde_json::from_value(a["data"][1]["embedding"].clone()).unwrap();
        assert_eq!(v0.len(), 8);
        assert!((v0.iter().map(|x| x * x).sum::<f64>() - 1.0).abs() < 1e-4);
        assert_ne!(v0, v1);
        assert_eq!(a["data"][1]["index"], 1);
        assert_eq!(a["usage"]["prompt_tokens"], 4); // "hello" 2 + "world" 2
        assert_eq!(a["object"], "list");
    }

    #[test]
    fn base64_is_the_float_vector() {
        assert_eq!(base64_f32(&[1.0]), "AACAPw==");
        assert_eq!(base64_f32(&[1.0, 0.0]), "AACAPwAAAAA=");
        let f = respond(&json!({"input": "x", "dimensions": 3}), "m", 7, 0).unwrap();
        let b = respond(
            &json!({"input": "x", "dimensions": 3, "encoding_format": "base64"}),
            "m",
            7,
            0,
        )
        .unwrap();
        let floats: Vec<f32> = serde_json::from_value(f["data"][0]["embedding"].clone()).unwrap();
        assert_eq!(b["data"][0]["embedding"], base64_f32(&floats));
    }

    #[test]
    fn bad_input_names_the_field() {
        let e = respond(&json!({"input": 3}), "m", 0, 0).unwrap_err();
        assert!(
            e.message.contains("\"input\"") && e.message.contains("number 3"),
            "{}",
            e.message
        );
        let e = respond(&json!({"input": ["a", {}]}), "m", 0, 0).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("input[1]"));
        let e = respond(&json!({"input": "a", "dimensions": 0}), "m", 0, 0).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("dimensions"));
        let e = respond(&json!({"input": "a", "encoding_format": "hex"}), "m", 0, 0).unwrap_err();
        assert!(e.message.contains("\"hex\""), "{}", e.message);
    }
}
