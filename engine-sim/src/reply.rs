//! What every handler answers with: the response body (a whole buffer or a stream of SSE
//! events), JSON and OpenAI-shaped error responses, and request bodies read within the limit.

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::header::{HeaderValue, ALLOW, CONTENT_LENGTH, CONTENT_TYPE};
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use serde_json::Value;
use tokio::sync::mpsc;

use crate::engine::Engine;
use crate::openai;
use crate::prompt::InvalidRequest;

/// Response bodies: a whole buffer, or SSE events produced by a request's task.
pub(crate) enum ResponseBody {
    Full(Option<Bytes>),
    Stream(mpsc::Receiver<Bytes>),
}

impl Body for ResponseBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match self.get_mut() {
            ResponseBody::Full(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            ResponseBody::Stream(rx) => rx.poll_recv(cx).map(|b| b.map(|b| Ok(Frame::data(b)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self, ResponseBody::Full(None))
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            ResponseBody::Full(Some(b)) => SizeHint::with_exact(b.len() as u64),
            ResponseBody::Full(None) => SizeHint::with_exact(0),
            ResponseBody::Stream(_) => SizeHint::default(),
        }
    }
}

pub(crate) fn response(
    status: StatusCode,
    content_type: &'static str,
    body: Bytes,
) -> Response<ResponseBody> {
    let mut r = Response::new(ResponseBody::Full(Some(body)));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    r
}

pub(crate) fn json_response(status: StatusCode, body: Bytes) -> Response<ResponseBody> {
    response(status, "application/json", body)
}

pub(crate) fn error(
    status: StatusCode,
    kind: &str,
    message: &str,
    param: Option<&str>,
) -> Response<ResponseBody> {
    json_response(status, openai::error_body(message, kind, param))
}

pub(crate) fn invalid(e: &InvalidRequest) -> Response<ResponseBody> {
    error(
        StatusCode::BAD_REQUEST,
        "invalid_request_error",
        &e.message,
        e.param.as_deref(),
    )
}

pub(crate) fn method_not_allowed(
    method: &Method,
    path: &str,
    allow: &'static str,
) -> Response<ResponseBody> {
    let mut r = error(
        StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request_error",
        &format!("method {method} is not allowed on {path} (allowed: {allow})"),
        None,
    );
    r.headers_mut()
        .insert(ALLOW, HeaderValue::from_static(allow));
    r
}

pub(crate) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Reads the whole body as JSON (413 past `--max-body-bytes`, 400 when it is not JSON).
pub(crate) async fn read_json(
    engine: &Engine,
    req: Request<Incoming>,
) -> Result<Value, Response<ResponseBody>> {
    let raw = read_body(req, engine.config().max_body_bytes).await?;
    serde_json::from_slice(&raw).map_err(|e| {
        invalid(&InvalidRequest {
            message: format!("request body is not valid JSON: {e}"),
            param: None,
        })
    })
}

/// Reads the whole body, refusing more than `limit` bytes with 413.
pub(crate) async fn read_body(
    req: Request<Incoming>,
    limit: usize,
) -> Result<Bytes, Response<ResponseBody>> {
    let too_large = || {
        error(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            &format!("request body is larger than the limit of {limit} bytes"),
            None,
        )
    };
    let declared = req
        .headers()
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(too_large());
    }
    match Limited::new(req.into_body(), limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => Err(too_large()),
        Err(e) => Err(error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            &format!("could not read the request body: {e}"),
            None,
        )),
    }
}
