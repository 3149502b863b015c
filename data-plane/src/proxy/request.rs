//! What the client sent: the path's endpoint name, the routing headers, the body (read whole,
//! within `--max-body-bytes`, the body-read timeout and the request's deadline), and the request
//! an instance receives (end-to-end headers only, the instance's `Host`, the chosen
//! `authorization`).

use std::pin::Pin;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Request, Response};
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use hyper::body::Incoming;
use tokio::time::Sleep;

use super::{Router, X_ENDPOINT_NAME, X_TARGET_VARIANT};
use crate::response::ResponseBody;
use crate::table::RoutingTable;
use crate::upstream::UpstreamBody;

/// The endpoint and variant the client named by header (`x-endpoint-name`,
/// `x-target-variant`); `Err` names a header that is not UTF-8 text.
pub(super) fn routing_headers(headers: &HeaderMap) -> Result<(Option<&str>, Option<&str>), String> {
    let header = |name: &HeaderName| -> Result<Option<&str>, String> {
        match headers.get(name) {
            None => Ok(None),
            Some(v) => v
                .to_str()
                .map(Some)
                .map_err(|_| format!("header {name} is not valid UTF-8 text")),
        }
    };
    Ok((header(&X_ENDPOINT_NAME)?, header(&X_TARGET_VARIANT)?))
}

impl Router {
    /// Reads the request body whole: 413 past `--max-body-bytes` (by `content-length` at once),
    /// 408 when it does not arrive within the body-read timeout, 504 past the request's deadline,
    /// 400 when the client's stream fails.
    pub(super) async fn read_body(
        &self,
        table: &RoutingTable,
        headers: &HeaderMap,
        body: Incoming,
        deadline: Pin<&mut Sleep>,
    ) -> Result<Bytes, Response<ResponseBody>> {
        let declared = headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
        if declared.is_some_and(|len| len > self.max_body_bytes as u64) {
            return Err(self.too_large(table));
        }
        let read = tokio::select! {
            biased;
            read = Limited::new(body, self.max_body_bytes).collect() => Ok(read),
            () = deadline => Err(504),
            () = tokio::time::sleep(self.body_read_timeout) => Err(408),
        };
        match read {
            Err(status) => Err(self.unrouted(
                Some(table),
                status,
                "timed out reading the request body",
                "timeout_error",
            )),
            Ok(Err(e)) if e.downcast_ref::<LengthLimitError>().is_some() => {
                Err(self.too_large(table))
            }
            Ok(Err(e)) => {
                let msg = format!("could not read the request body: {e}");
                Err(self.unrouted(Some(table), 400, &msg, "invalid_request_error"))
            }
            Ok(Ok(collected)) => Ok(collected.to_bytes()),
        }
    }

    fn too_large(&self, table: &RoutingTable) -> Response<ResponseBody> {
        let msg = format!(
            "request body is larger than the limit of {} bytes",
            self.max_body_bytes
        );
        self.unrouted(Some(table), 413, &msg, "request_too_large")
    }
}

pub(crate) fn invocation_endpoint(path: &str) -> Option<Result<String, String>> {
    let raw = path
        .strip_prefix("/endpoints/")?
        .strip_suffix("/invocations")?;
    if raw.is_empty() || raw.contains('/') {
        return None;
    }
    let bytes = raw.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok());
            match hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
                Some(b) => out.push(b),
                None => {
                    return Some(Err(format!(
                        "bad percent-encoding in endpoint name {raw:?}"
                    )))
                }
            }
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    Some(String::from_utf8(out).map_err(|_| format!("endpoint name {raw:?} is not valid UTF-8")))
}

pub(super) const HOP_BY_HOP: [HeaderName; 8] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHENTICATE,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

pub(super) fn strip_hop_by_hop(headers: &mut HeaderMap) {
    for name in &HOP_BY_HOP {
        headers.remove(name);
    }
}

/// The request to an instance: the client's method and end-to-end headers, `target` (origin
/// form), the instance's `Host`, the `authorization` chosen by [`crate::access::Access`] (the client's own is
/// never copied), and the body.
pub(super) fn upstream_request(
    parts: &http::request::Parts,
    target: &http::Uri,
    host: &HeaderValue,
    authorization: Option<&HeaderValue>,
    body: &Bytes,
) -> Request<UpstreamBody> {
    let mut req = Request::new(Full::new(body.clone()));
    *req.method_mut() = parts.method.clone();
    *req.uri_mut() = target.clone();
    let headers = req.headers_mut();
    headers.reserve(parts.headers.len() + 1);
    headers.insert(header::HOST, host.clone());
    for (name, value) in &parts.headers {
        if HOP_BY_HOP.contains(name)
            || name == header::HOST
            || name == header::CONTENT_LENGTH
            || name == header::EXPECT
            || name == header::PROXY_AUTHORIZATION
            || name == header::AUTHORIZATION
        {
            continue;
        }
        headers.append(name.clone(), value.clone());
    }
    if let Some(a) = authorization {
        headers.insert(header::AUTHORIZATION, a.clone());
    }
    req
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn invocation_paths() {
        assert_eq!(
            invocation_endpoint("/endpoints/e1/invocations"),
            Some(Ok("e1".into()))
        );
        assert_eq!(
            invocation_endpoint("/endpoints/my%20ep/invocations"),
            Some(Ok("my ep".into()))
        );
        assert!(matches!(
            invocation_endpoint("/endpoints/%ff/invocations"),
            Some(Err(_))
        ));
        assert!(matches!(
            invocation_endpoint("/endpoints/%zz/invocations"),
            Some(Err(_))
        ));
        assert_eq!(invocation_endpoint("/endpoints//invocations"), None);
        assert_eq!(invocation_endpoint("/endpoints/a/b/invocations"), None);
        assert_eq!(invocation_endpoint("/other"), None);
    }
}
