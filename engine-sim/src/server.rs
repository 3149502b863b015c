//! The HTTP/1 server: routes, completions (streamed or whole), graceful shutdown (bodies, limits
//! and errors in [`crate::reply`]).
//!
//! Tracing: a completion is a `completion` span (parented by the caller's W3C `traceparent`) with
//! children `queue` (waiting for a running slot), `prefill` (until the first token: the shared
//! prefill lane for the uncached tokens, then the first-token overhead; with prompt, cached and
//! uncached token counts) and `decode` (the remaining tokens). With trace export off they are
//! disabled spans and no header is read for them. Numbers are recorded as `i64`:
//! `tracing-opentelemetry` exports other integer types as strings.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderValue, CACHE_CONTROL, CONTENT_TYPE};
use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use hyper_util::server::graceful::GracefulShutdown;
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tracing::field::Empty;
use tracing::{debug, warn, Span};
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::engine::Engine;
use crate::kv_cache::{BlockHasher, PromptBlocks};
use crate::openai::{self, Filler, ResponseMeta, StreamEncoder, Usage};
use crate::prompt::{self, ApiKind, InvalidRequest};
use crate::reply::{
    error, invalid, json_response, method_not_allowed, read_body, response, unix_now, ResponseBody,
};
use crate::Config;

/// How long a graceful shutdown waits for in-flight responses before giving up on them.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(30);

/// Serves the OpenAI-compatible API, `/metrics`, `/health` and `/v1/models` of a new engine
/// on `listener` until `shutdown` completes, then stops accepting and drains in-flight
/// responses (at most 30 s).
pub async fn serve(
    listener: TcpListener,
    config: Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    serve_engine(listener, Engine::try_new(config)?, shutdown).await
}

/// [`serve`] for an engine the caller keeps a handle on (to read [`Engine::stats`]).
pub async fn serve_engine(
    listener: TcpListener,
    engine: Arc<Engine>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let publisher = match &engine.kv_events {
        Some(outbox) => {
            let c = engine.config();
            crate::kv_events::start(
                outbox,
                crate::kv_events::PublisherConfig {
                    endpoint: c.kv_events_endpoint.clone().unwrap_or_default(),
                    replay_endpoint: c.kv_events_replay_endpoint.clone(),
                    topic: c.kv_events_topic.clone(),
                    buffer_steps: usize::try_from(c.kv_events_buffer_steps).unwrap_or(usize::MAX),
                    block_size: c.block_size,
                },
            )
            .await?
        }
        None => None,
    };
    // The sockets close when serving stops.
    struct AbortOnDrop(Option<tokio::task::JoinHandle<()>>);
    impl Drop for AbortOnDrop {
        fn drop(&mut self) {
            if let Some(task) = &self.0 {
                task.abort();
            }
        }
    }
    let _publisher = AbortOnDrop(publisher);
    let graceful = GracefulShutdown::new();
    let mut http = http1::Builder::new();
    // No header read timeout: it would also close idle keep-alive connections after 30 s, and a
    // router's pool would then race the close (a request on a connection the server is closing).
    // Idle connections cost nothing here and graceful shutdown closes them.
    http.header_read_timeout(None);
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        tokio::select! {
            biased;
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _peer)) => {
                    let _ = stream.set_nodelay(true);
                    let engine = Arc::clone(&engine);
                    let service = service_fn(move |req| {
                        let engine = Arc::clone(&engine);
                        async move { Ok::<_, Infallible>(route(&engine, req).await) }
                    });
                    let conn = graceful.watch(http.serve_connection(TokioIo::new(stream), service));
                    tokio::spawn(async move {
                        if let Err(e) = conn.await {
                            debug!(error = %e, "connection closed with an error");
                        }
                    });
                }
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            },
        }
    }
    drop(listener);
    if tokio::time::timeout(DRAIN_TIMEOUT, graceful.shutdown())
        .await
        .is_err()
    {
        warn!("graceful shutdown: gave up on responses still running after {DRAIN_TIMEOUT:?}");
    }
    Ok(())
}

/// vLLM's `--api-key` check: `/v1/*` needs `Authorization: Bearer KEY`.
fn authorized(engine: &Engine, req: &Request<Incoming>) -> bool {
    let Some(key) = &engine.config.api_key else {
        return true;
    };
    if !req.uri().path().starts_with("/v1/") {
        return true;
    }
    req.headers()
        .get(http::header::AUTHORIZATION)
        .and_then(|v| credentials::bearer(v.as_bytes()))
        .is_some_and(|presented| {
            use subtle::ConstantTimeEq as _;
            bool::from(presented.ct_eq(key.as_bytes()))
        })
}

async fn route(engine: &Arc<Engine>, req: Request<Incoming>) -> Response<ResponseBody> {
    if !authorized(engine, &req) {
        return json_response(
            StatusCode::UNAUTHORIZED,
            Bytes::from_static(br#"{"error":"Unauthorized"}"#),
        );
    }
    let method = req.method();
    let get = method == Method::GET || method == Method::HEAD;
    match req.uri().path() {
        "/v1/chat/completions" if method == Method::POST => {
            completion(engine, ApiKind::Chat, req).await
        }
        "/v1/completions" if method == Method::POST => {
            completion(engine, ApiKind::Completions, req).await
        }
        "/v1/embeddings" if method == Method::POST => crate::embeddings::handle(engine, req).await,
        "/v1/responses" if method == Method::POST => crate::responses::handle(engine, req).await,
        "/health" if get => response(StatusCode::OK, "text/plain", Bytes::new()),
        "/metrics" if get => response(
            StatusCode::OK,
            "text/plain; version=0.0.4; charset=utf-8",
            Bytes::from(crate::metrics::render(engine)),
        ),
        "/v1/models" if get => models(engine),
        path @ ("/v1/chat/completions" | "/v1/completions" | "/v1/embeddings" | "/v1/responses") => {
            method_not_allowed(method, path, "POST")
        }
        path @ ("/health" | "/metrics" | "/v1/models") => {
            method_not_allowed(method, path, "GET, HEAD")
        }
        path => error(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            &format!("unknown path {path:?} (this server has /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/responses, /v1/models, /metrics, /health)"),
            None,
        ),
    }
}

fn models(engine: &Engine) -> Response<ResponseBody> {
    let c = engine.config();
    let body = json!({
        "object": "list",
        "data": [{
            "id": c.model_name,
            "object": "model",
            "created": unix_now(),
            "owned_by": "engine-sim",
            "root": c.model_name,
            "parent": null,
            "max_model_len": c.max_model_len,
        }],
    });
    json_response(StatusCode::OK, Bytes::from(body.to_string()))
}

/// [`completion_traced`] inside its `completion` span.
async fn completion(
    engine: &Arc<Engine>,
    kind: ApiKind,
    req: Request<Incoming>,
) -> Response<ResponseBody> {
    let span = tracing::info_span!(
        "completion",
        otel.kind = "server",
        api = match kind {
            ApiKind::Chat => "chat",
            ApiKind::Completions => "completions",
        },
        stream = Empty,
        prompt_tokens = Empty,
        cached_tokens = Empty,
        completion_tokens = Empty,
        status = Empty,
        otel.status_code = Empty,
    );
    if span.is_disabled() {
        return completion_traced(engine, kind, req, span).await;
    }
    telemetry::propagation::set_parent_from_headers(&span, req.headers());
    let response = completion_traced(engine, kind, req, span.clone()).await;
    span.record("status", i64::from(response.status().as_u16()));
    if !response.status().is_success() {
        span.record("otel.status_code", "error");
    }
    response
}

/// The `queue` span: created when the request starts waiting for a running slot.
fn queue_span(parent: &Span) -> Span {
    tracing::info_span!(parent: parent, "queue")
}

/// The `prefill` span of an admitted request, with its token counts (also recorded on the
/// request's span).
fn prefill_span(parent: &Span, seq: &crate::engine::Sequence) -> Span {
    if parent.is_disabled() {
        return Span::none();
    }
    parent.record("prompt_tokens", seq.prompt_tokens() as i64);
    parent.record("cached_tokens", seq.cached_tokens() as i64);
    tracing::info_span!(
        parent: parent,
        "prefill",
        prompt_tokens = seq.prompt_tokens() as i64,
        cached_tokens = seq.cached_tokens() as i64,
        uncached_tokens = seq.prompt_tokens().saturating_sub(seq.cached_tokens()) as i64,
    )
}

async fn completion_traced(
    engine: &Arc<Engine>,
    kind: ApiKind,
    req: Request<Incoming>,
    span: Span,
) -> Response<ResponseBody> {
    let n = engine.count_request();
    let config = engine.config();
    let raw = match read_body(req, config.max_body_bytes).await {
        Ok(b) => b,
        Err(resp) => return resp,
    };
    if config.stall_ms > 0.0 {
        tokio::time::sleep(config.scaled_ms(config.stall_ms)).await;
    }
    if engine.should_fail(n) {
        engine
            .counters
            .failures_injected
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        return error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            &format!(
                "engine-sim: injected failure (--fail-rate {})",
                config.fail_rate
            ),
            None,
        );
    }
    let body: Value = match serde_json::from_slice(&raw) {
        Ok(v) => v,
        Err(e) => {
            return invalid(&InvalidRequest {
                message: format!("request body is not valid JSON: {e}"),
                param: None,
            })
        }
    };
    let params = match prompt::parse_params(&body) {
        Ok(p) => p,
        Err(e) => return invalid(&e),
    };
    let mut hasher = BlockHasher::new(config.block_bytes());
    if let Err(e) = prompt::visit_canonical_prompt(kind, &body, |p| hasher.update(p.as_bytes())) {
        return invalid(&e);
    }
    // With a tokenizer the prompt is the engine's token ids (the body validated above all the
    // same); the output is not cached then (its ids are not known).
    let token_ids: Option<Arc<[u32]>> = match &engine.tokenizer {
        Some(tokenizer) => {
            let mut ids = Vec::new();
            let tokens_kind = match kind {
                ApiKind::Chat => chat_tokens::RequestKind::Chat,
                ApiKind::Completions => chat_tokens::RequestKind::Completions,
            };
            if let Err(e) = tokenizer.tokens(&raw, tokens_kind, &mut ids) {
                return invalid(&InvalidRequest {
                    message: e.to_string(),
                    param: None,
                });
            }
            Some(ids.into())
        }
        None => None,
    };
    // Chat answers are cached after the prompt as the next turn will resend them:
    // `assistant\n{text}` (the canonical form of the assistant message, without its closing
    // newline, which belongs to the next prompt).
    let output_hasher = (kind == ApiKind::Chat && token_ids.is_none()).then(|| {
        let mut h = hasher.clone();
        h.update(b"assistant\n");
        h
    });
    let prompt = match &token_ids {
        Some(ids) => PromptBlocks::from_token_ids(ids, config.block_size as usize),
        None => hasher.finish(),
    };
    let prompt_tokens = prompt.prompt_tokens();
    let max_tokens = params.max_tokens;
    if prompt_tokens.saturating_add(max_tokens) > config.max_model_len {
        let param = match kind {
            ApiKind::Chat => "messages",
            ApiKind::Completions => "prompt",
        };
        return invalid(&InvalidRequest::new(
            param,
            format!(
                "This model's maximum context length is {} tokens. However, you requested {} \
                 tokens ({prompt_tokens} in the {param}, {max_tokens} in the completion). \
                 Please reduce the length of the {param} or completion.",
                config.max_model_len,
                prompt_tokens.saturating_add(max_tokens),
            ),
        ));
    }

    let id = format!(
        "{}{:016x}{:016x}",
        openai::id_prefix(kind),
        engine.draw(n, 1),
        engine.draw(n, 2)
    );
    let meta = ResponseMeta {
        kind,
        id: &id,
        created: unix_now(),
        model: params.model.unwrap_or(&config.model_name),
    };
    let filler_seed = xxh3_64_with_seed(&prompt.prompt_hash.to_le_bytes(), config.seed);

    if !span.is_disabled() {
        span.record("stream", params.stream);
        span.record("completion_tokens", max_tokens as i64);
    }
    if params.stream {
        let encoder = StreamEncoder::new(&meta);
        let (tx, rx) = mpsc::channel::<Bytes>(8);
        let engine = Arc::clone(engine);
        tokio::spawn(async move {
            let produce = async {
                let queue = queue_span(&span);
                let mut seq = engine.admit_tokens(prompt, token_ids).await;
                drop(queue);
                let mut filler = Filler::new(filler_seed);
                let prefill = prefill_span(&span, &seq);
                seq.first_token().await;
                drop(prefill);
                let _decode =
                    tracing::info_span!(parent: &span, "decode", tokens = max_tokens as i64);
                if tx
                    .send(encoder.token(&mut filler, 0, max_tokens))
                    .await
                    .is_err()
                {
                    return;
                }
                for i in 1..max_tokens {
                    seq.next_token().await;
                    if tx
                        .send(encoder.token(&mut filler, i, max_tokens))
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
                if let Some(mut h) = output_hasher {
                    h.update(Filler::new(filler_seed).text(max_tokens).as_bytes());
                    seq.cache_output(h.finish());
                }
                let usage = Usage {
                    prompt_tokens,
                    completion_tokens: max_tokens,
                    cached_tokens: seq.cached_tokens(),
                };
                // Free the slot before the client sees the end, so gauges read after a
                // complete response are settled.
                seq.finish();
                let _ = tx.send(encoder.usage_and_done(usage)).await;
            };
            // A client that goes away aborts the request, releasing its slot and blocks.
            tokio::select! {
                () = produce => {}
                () = tx.closed() => {}
            }
        });
        let mut r = Response::new(ResponseBody::Stream(rx));
        let h = r.headers_mut();
        h.insert(
            CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream; charset=utf-8"),
        );
        h.insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        return r;
    }

    // Non-streaming: if the client goes away hyper drops this future, and `seq` with it.
    let queue = queue_span(&span);
    let mut seq = engine.admit_tokens(prompt, token_ids).await;
    drop(queue);
    let prefill = prefill_span(&span, &seq);
    seq.first_token().await;
    drop(prefill);
    let decode = tracing::info_span!(parent: &span, "decode", tokens = max_tokens as i64);
    if max_tokens > 1 {
        seq.next_tokens(max_tokens - 1).await;
    }
    drop(decode);
    let text = Filler::new(filler_seed).text(max_tokens);
    if let Some(mut h) = output_hasher {
        h.update(text.as_bytes());
        seq.cache_output(h.finish());
    }
    let usage = Usage {
        prompt_tokens,
        completion_tokens: max_tokens,
        cached_tokens: seq.cached_tokens(),
    };
    seq.finish();
    json_response(StatusCode::OK, openai::full_response(&meta, text, usage))
}
