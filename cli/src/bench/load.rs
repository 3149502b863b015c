//! Closed-loop load: each client sends one streaming chat request at a time through a router,
//! reads the stream to its end, and sends the next. Time to first token is taken at the client,
//! when the first content chunk arrives. The prompt's `usage` (prompt and cached tokens) is kept
//! beside each sample, for engines whose `/metrics` carry no cache counters.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use http_body_util::{BodyExt, Full};
use tokio::sync::mpsc;

use super::metrics::HttpClient;
use super::workload::Workload;

/// One finished request.
#[derive(Debug, Clone)]
pub struct Sample {
    pub client: usize,
    pub done: Instant,
    pub ttft: Duration,
    pub latency: Duration,
    pub output_tokens: u32,
    /// `x-prefix-router-instance` of the response.
    pub instance: String,
    pub affinity: u64,
    pub error: Option<String>,
}

/// What a response's `usage` said about its prompt, when the engine reported it
/// (`usage.prompt_tokens`, `usage.prompt_tokens_details.cached_tokens`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PromptUsage {
    pub prompt_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
}

/// One finished request and its prompt usage.
#[derive(Debug, Clone)]
pub struct Finished {
    pub sample: Sample,
    pub usage: PromptUsage,
}

/// What one streamed response carried.
struct Streamed {
    ttft: Duration,
    text: String,
    output_tokens: u32,
    instance: String,
    usage: PromptUsage,
}

/// What the clients send: each client's conversation from `workload` over `documents`, every
/// request naming `model`.
pub struct Conversations {
    pub workload: Arc<Workload>,
    pub documents: Arc<Vec<Arc<str>>>,
    pub model: Arc<str>,
}

/// How long after the run's end a request may still take before it counts as failed: a router
/// that never answers must not hold the bench (and the runs after it) forever.
pub const LAST_ANSWER_GRACE: Duration = Duration::from_secs(30);

/// Who sends it: `concurrency` clients spread over `routers`, each sending until `stop_at`; a
/// request unanswered [`LAST_ANSWER_GRACE`] after `stop_at` fails.
pub struct Clients {
    pub routers: Vec<String>,
    pub concurrency: usize,
    pub stop_at: Instant,
}

/// Runs the `clients` with their `conversations`, sending each sample down `out`.
/// Every request names the model in its body and nothing else: no `x-endpoint-name`, which would
/// name an endpoint a peer router (`--router-url`) does not have. The bench's own routers send a
/// model that names no endpoint of theirs (e.g. the engines' own id, which peer routers may
/// require) to their default endpoint, the bench endpoint (see [`super::fleet`]).
/// Returns when every client finished its last request.
pub async fn run_clients(
    conversations: Conversations,
    clients: Clients,
    http: HttpClient,
    out: mpsc::UnboundedSender<Finished>,
) {
    let Conversations {
        workload,
        documents,
        model,
    } = conversations;
    let Clients {
        routers,
        concurrency,
        stop_at,
    } = clients;
    let mut tasks = tokio::task::JoinSet::new();
    for client in 0..concurrency {
        let url: http::Uri = format!("{}/v1/chat/completions", routers[client % routers.len()])
            .parse()
            .expect("router URLs are valid");
        let (w, docs, model, http, out) = (
            workload.clone(),
            documents.clone(),
            model.clone(),
            http.clone(),
            out.clone(),
        );
        tasks.spawn(async move {
            let mut state = w.client(client);
            let mut last_reply: Option<String> = None;
            while Instant::now() < stop_at {
                let req = state.next(&w, &docs, last_reply.take());
                let body = Bytes::from(req.body(&model));
                let started = Instant::now();
                let result = send_by(&http, &url, body, started, stop_at + LAST_ANSWER_GRACE).await;
                let done = Instant::now();
                let finished = match result {
                    Ok(s) => {
                        let sample = Sample {
                            client,
                            done,
                            ttft: s.ttft,
                            latency: done - started,
                            output_tokens: s.output_tokens,
                            instance: s.instance,
                            affinity: req.affinity,
                            error: None,
                        };
                        last_reply = Some(s.text);
                        Finished {
                            sample,
                            usage: s.usage,
                        }
                    }
                    Err(e) => Finished {
                        sample: Sample {
                            client,
                            done,
                            ttft: Duration::ZERO,
                            latency: done - started,
                            output_tokens: 0,
                            instance: String::new(),
                            affinity: req.affinity,
                            error: Some(format!("{e:#}")),
                        },
                        usage: PromptUsage::default(),
                    },
                };
                if out.send(finished).is_err() {
                    return;
                }
            }
        });
    }
    while tasks.join_next().await.is_some() {}
}

/// [`send`], failed at `deadline` if not done by then.
async fn send_by(
    http: &HttpClient,
    url: &http::Uri,
    body: Bytes,
    started: Instant,
    deadline: Instant,
) -> anyhow::Result<Streamed> {
    let deadline = tokio::time::Instant::from_std(deadline);
    match tokio::time::timeout_at(deadline, send(http, url, body, started)).await {
        Ok(result) => result,
        Err(_) => anyhow::bail!(
            "no whole answer {:.1} s after it was sent (the run had ended)",
            started.elapsed().as_secs_f64()
        ),
    }
}

async fn send(
    http: &HttpClient,
    url: &http::Uri,
    body: Bytes,
    started: Instant,
) -> anyhow::Result<Streamed> {
    let req = http::Request::post(url.clone())
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Full::new(body))?;
    let resp = http.request(req).await?;
    let status = resp.status();
    let instance = resp
        .headers()
        .get("x-prefix-router-instance")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    let mut body = resp.into_body();
    if !status.is_success() {
        let bytes = body
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        anyhow::bail!(
            "HTTP {status}: {}",
            String::from_utf8_lossy(&bytes[..bytes.len().min(300)])
        );
    }
    let mut sse = SseText::default();
    let mut ttft = None;
    while let Some(frame) = body.frame().await {
        let frame = frame?;
        if let Some(data) = frame.data_ref() {
            sse.feed(data);
            if ttft.is_none() && !sse.text.is_empty() {
                ttft = Some(started.elapsed());
            }
        }
    }
    anyhow::ensure!(sse.done, "stream ended without data: [DONE]");
    let ttft = ttft.ok_or_else(|| anyhow::anyhow!("stream carried no content"))?;
    Ok(Streamed {
        ttft,
        output_tokens: sse.completion_tokens.unwrap_or(sse.chunks),
        text: sse.text,
        instance,
        usage: sse.usage,
    })
}

/// Reassembles an OpenAI chat stream: the content text, the usage, and whether `[DONE]` came.
#[derive(Default)]
pub(super) struct SseText {
    buf: BytesMut,
    pub(super) text: String,
    chunks: u32,
    completion_tokens: Option<u32>,
    usage: PromptUsage,
    done: bool,
}

impl SseText {
    pub(super) fn feed(&mut self, data: &[u8]) {
        self.buf.extend_from_slice(data);
        while let Some(end) = find(&self.buf, b"\n\n") {
            let event = self.buf.split_to(end + 2);
            for line in event[..].split(|&b| b == b'\n') {
                let Some(payload) = line.strip_prefix(b"data:") else {
                    continue;
                };
                let payload = payload.strip_prefix(b" ").unwrap_or(payload);
                if payload == b"[DONE]" {
                    self.done = true;
                    continue;
                }
                let Ok(v) = serde_json::from_slice::<serde_json::Value>(payload) else {
                    continue;
                };
                if let Some(c) = v
                    .pointer("/choices/0/delta/content")
                    .and_then(|c| c.as_str())
                {
                    if !c.is_empty() {
                        self.chunks += 1;
                        self.text.push_str(c);
                    }
                }
                if let Some(n) = v
                    .pointer("/usage/completion_tokens")
                    .and_then(|n| n.as_u64())
                {
                    self.completion_tokens = Some(n as u32);
                }
                if let Some(n) = v.pointer("/usage/prompt_tokens").and_then(|n| n.as_u64()) {
                    self.usage.prompt_tokens = Some(n);
                }
                if let Some(n) = v
                    .pointer("/usage/prompt_tokens_details/cached_tokens")
                    .and_then(|n| n.as_u64())
                {
                    self.usage.cached_tokens = Some(n);
                }
            }
        }
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_router_that_never_answers_fails_the_request_at_the_deadline() {
        // accepts, reads, never answers
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url: http::Uri = format!(
            "http://{}/v1/chat/completions",
            listener.local_addr().unwrap()
        )
        .parse()
        .unwrap();
        let held = tokio::spawn(async move {
            let mut open = Vec::new();
            while let Ok((socket, _)) = listener.accept().await {
                open.push(socket);
            }
        });
        let started = Instant::now();
        let result = send_by(
            &super::super::metrics::http_client(),
            &url,
            Bytes::from_static(b"{}"),
            started,
            started + Duration::from_millis(300),
        )
        .await;
        let error = format!("{:#}", result.err().expect("no answer is an error"));
        assert!(error.contains("no whole answer"), "{error}");
        held.abort();
    }

    #[test]
    fn reassembles_split_sse_events() {
        let stream = "data: {\"choices\":[{\"delta\":{\"role\":\"assistant\"}}]}\n\n\
            data: {\"choices\":[{\"delta\":{\"content\":\"Hel\"}}]}\n\n\
            data: {\"choices\":[{\"delta\":{\"content\":\"lo\"}}]}\n\n\
            data: {\"choices\":[],\"usage\":{\"completion_tokens\":2,\"prompt_tokens\":90,\
            \"prompt_tokens_details\":{\"cached_tokens\":64}}}\n\ndata: [DONE]\n\n";
        let mut sse = SseText::default();
        for piece in stream.as_bytes().chunks(7) {
            sse.feed(piece);
        }
        assert_eq!(sse.text, "Hello");
        assert_eq!(sse.completion_tokens, Some(2));
        assert_eq!(
            sse.usage,
            PromptUsage {
                prompt_tokens: Some(90),
                cached_tokens: Some(64)
            }
        );
        assert!(sse.done);
    }
}
