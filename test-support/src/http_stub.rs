//! A raw HTTP/1.1 server for tests that need a model server, a metrics endpoint or any other
//! upstream whose answers they choose: [`HttpStub`] binds `127.0.0.1:0` and answers every request
//! with its handler's [`StubReply`], keeping connections alive until the client or the reply closes
//! them. Servers that break the protocol on purpose answer with [`StubReply::raw`] bytes or a
//! [`StubReply::cut_chunked`] body, then close or hold the connection; [`read_request`] is there
//! for a server that must write on its own.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::Arc;

use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWriteExt as _};
use tokio::sync::oneshot;

/// One request as the stub read it.
#[derive(Debug, Clone)]
pub struct StubRequest {
    pub method: String,
    /// The request target: path and query.
    pub target: String,
    /// Header names in lower case, in the order sent.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl StubRequest {
    /// The first value of header `name` (lower case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Reads one request (its head and a `content-length` body) from `stream`. `buffer` keeps what
/// was read past it for the next call on the same connection. `None` at end of stream or on error.
pub async fn read_request<S: AsyncRead + Unpin>(
    stream: &mut S,
    buffer: &mut Vec<u8>,
) -> Option<StubRequest> {
    let mut chunk = [0u8; 16 << 10];
    loop {
        if let Some(end) = buffer.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buffer[..end]).into_owned();
            let mut lines = head.split("\r\n");
            let mut request_line = lines.next().unwrap_or("").split(' ');
            let method = request_line.next().unwrap_or("").to_string();
            let target = request_line.next().unwrap_or("").to_string();
            let headers: Vec<(String, String)> = lines
                .filter_map(|l| l.split_once(':'))
                .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_string()))
                .collect();
            let length = headers
                .iter()
                .find(|(n, _)| n == "content-length")
                .and_then(|(_, v)| v.parse().ok())
                .unwrap_or(0);
            while buffer.len() < end + 4 + length {
                match stream.read(&mut chunk).await {
                    Ok(0) | Err(_) => return None,
                    Ok(n) => buffer.extend_from_slice(&chunk[..n]),
                }
            }
            let body = buffer[end + 4..end + 4 + length].to_vec();
            buffer.drain(..end + 4 + length);
            return Some(StubRequest {
                method,
                target,
                headers,
                body,
            });
        }
        match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => buffer.extend_from_slice(&chunk[..n]),
        }
    }
}

/// What the stub answers: status, headers and a body sent with its `content-length`, or a body
/// that breaks off, or bytes that are not HTTP at all.
#[derive(Debug, Clone)]
pub struct StubReply {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    framing: Framing,
    after: After,
}

/// How the body goes on the wire.
#[derive(Debug, Clone, Copy)]
enum Framing {
    ContentLength,
    /// `transfer-encoding: chunked`, the body holding the chunks sent, without the last chunk.
    CutChunked,
    /// The body is the whole reply, head included (or no head: garbage).
    Raw,
}

/// What the connection does after the reply.
#[derive(Debug, Clone, Copy)]
enum After {
    KeepAlive,
    Close,
    /// Held open, nothing more read or written, until the client closes it.
    Hold,
}

impl StubReply {
    /// `status` with a body of `content_type`.
    pub fn new(status: u16, content_type: &str, body: impl Into<Vec<u8>>) -> Self {
        StubReply {
            status,
            headers: vec![("content-type".into(), content_type.into())],
            body: body.into(),
            framing: Framing::ContentLength,
            after: After::KeepAlive,
        }
    }

    /// A 200 of `content_type` with a chunked body that sends `chunks` and never ends: follow it
    /// with [`then_close`](Self::then_close) (cut mid-body) or [`then_hold`](Self::then_hold)
    /// (stalled).
    pub fn cut_chunked(content_type: &str, chunks: &[&str]) -> Self {
        let body: String = chunks
            .iter()
            .map(|c| format!("{:x}\r\n{c}\r\n", c.len()))
            .collect();
        StubReply {
            framing: Framing::CutChunked,
            ..Self::new(200, content_type, body)
        }
    }

    /// `bytes` as they are, head included: a reply that breaks the protocol on purpose.
    pub fn raw(bytes: impl Into<Vec<u8>>) -> Self {
        StubReply {
            framing: Framing::Raw,
            ..Self::new(200, "", bytes)
        }
    }

    /// 200 with a JSON body.
    pub fn json(body: impl Into<Vec<u8>>) -> Self {
        Self::new(200, "application/json", body)
    }

    /// Adds a header.
    pub fn header(mut self, name: &str, value: &str) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }

    /// Closes the connection after this reply, without a `connection: close` header unless one
    /// was added (as a server whose keep-alive timeout ran out does).
    pub fn then_close(mut self) -> Self {
        self.after = After::Close;
        self
    }

    /// Holds the connection open after this reply, reading no further request, until the client
    /// closes it (a server that stalls).
    pub fn then_hold(mut self) -> Self {
        self.after = After::Hold;
        self
    }

    fn to_bytes(&self) -> Vec<u8> {
        let framing = match self.framing {
            Framing::Raw => return self.body.clone(),
            Framing::ContentLength => format!("content-length: {}", self.body.len()),
            Framing::CutChunked => "transfer-encoding: chunked".to_string(),
        };
        let mut out = format!("HTTP/1.1 {} {}\r\n", self.status, reason(self.status));
        for (name, value) in &self.headers {
            out.push_str(&format!("{name}: {value}\r\n"));
        }
        out.push_str(&format!("{framing}\r\n\r\n"));
        let mut out = out.into_bytes();
        out.extend_from_slice(&self.body);
        out
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        429 => "Too Many Requests",
        500 => "Internal Server Error",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        _ => "Status",
    }
}

/// A raw HTTP/1.1 server on `127.0.0.1:0`, served from a thread of its own (so tests with or
/// without a tokio runtime can use it) until it is dropped.
pub struct HttpStub {
    pub addr: SocketAddr,
    /// `http://ADDR`.
    pub url: String,
    accepted: Arc<AtomicU64>,
    closed: Arc<AtomicU64>,
    _stop: oneshot::Sender<()>,
}

impl HttpStub {
    /// Starts a stub answering every request with `handler`'s reply.
    pub fn start(handler: impl Fn(&StubRequest) -> StubReply + Send + Sync + 'static) -> Self {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind loopback");
        listener
            .set_nonblocking(true)
            .expect("a non-blocking listener");
        let addr = listener.local_addr().expect("a bound address");
        let (accepted, closed) = (Arc::<AtomicU64>::default(), Arc::<AtomicU64>::default());
        let (stop, stopped) = oneshot::channel::<()>();
        let counts = (accepted.clone(), closed.clone());
        let handler = Arc::new(handler);
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime for the stub");
            runtime.block_on(async move {
                let listener =
                    tokio::net::TcpListener::from_std(listener).expect("a tokio listener");
                let accept = async {
                    while let Ok((stream, _)) = listener.accept().await {
                        counts.0.fetch_add(1, SeqCst);
                        let (handler, closed) = (handler.clone(), counts.1.clone());
                        tokio::spawn(async move {
                            serve_connection(stream, &*handler).await;
                            closed.fetch_add(1, SeqCst);
                        });
                    }
                };
                tokio::select! {
                    () = accept => {}
                    _ = stopped => {}
                }
            });
        });
        HttpStub {
            addr,
            url: format!("http://{addr}"),
            accepted,
            closed,
            _stop: stop,
        }
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> u64 {
        self.accepted.load(SeqCst)
    }

    /// Connections over: closed by the stub after a [`StubReply::then_close`] reply, or by the
    /// client.
    pub fn closed(&self) -> u64 {
        self.closed.load(SeqCst)
    }
}

async fn serve_connection(
    mut stream: tokio::net::TcpStream,
    handler: &impl Fn(&StubRequest) -> StubReply,
) {
    let mut buffer = Vec::new();
    while let Some(request) = read_request(&mut stream, &mut buffer).await {
        let reply = handler(&request);
        if stream.write_all(&reply.to_bytes()).await.is_err() {
            return;
        }
        match reply.after {
            After::KeepAlive => {}
            After::Close => return, // dropping the stream closes it
            After::Hold => {
                let _ = stream.read(&mut [0u8; 1]).await;
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read as _, Write as _};

    #[test]
    fn answers_each_request_on_a_kept_alive_connection() {
        let stub = HttpStub::start(|r| {
            StubReply::json(format!(
                r#"{{"target":"{}","len":{}}}"#,
                r.target,
                r.body.len()
            ))
        });
        let mut s = std::net::TcpStream::connect(stub.addr).unwrap();
        s.write_all(b"POST /a HTTP/1.1\r\ncontent-length: 3\r\n\r\nabcGET /b HTTP/1.1\r\n\r\n")
            .unwrap();
        let mut got = String::new();
        while got.matches("HTTP/1.1 200 OK").count() < 2 || !got.ends_with('}') {
            let mut buf = [0u8; 1024];
            let n = s.read(&mut buf).unwrap();
            assert!(n > 0, "{got}");
            got.push_str(&String::from_utf8_lossy(&buf[..n]));
        }
        assert!(got.contains(r#"{"target":"/a","len":3}"#), "{got}");
        assert!(got.ends_with(r#"{"target":"/b","len":0}"#), "{got}");
        assert_eq!(stub.accepted(), 1);
    }

    #[test]
    fn a_cut_chunked_body_stops_after_its_chunks_and_a_raw_reply_is_sent_as_is() {
        let stub = HttpStub::start(|r| match r.target.as_str() {
            "/cut" => StubReply::cut_chunked("text/event-stream", &["data: 1\n\n"]).then_close(),
            _ => StubReply::raw("SPDY/9 wat\r\n").then_close(),
        });
        let get = |target: &str| {
            let mut s = std::net::TcpStream::connect(stub.addr).unwrap();
            write!(s, "GET {target} HTTP/1.1\r\n\r\n").unwrap();
            let mut got = String::new();
            s.read_to_string(&mut got).unwrap();
            got
        };
        assert_eq!(
            get("/cut"),
            "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n9\r\ndata: 1\n\n\r\n"
        );
        assert_eq!(get("/raw"), "SPDY/9 wat\r\n");
    }

    #[test]
    fn then_hold_keeps_the_connection_until_the_client_closes_it() {
        let stub = HttpStub::start(|_| StubReply::cut_chunked("text/plain", &[]).then_hold());
        let mut s = std::net::TcpStream::connect(stub.addr).unwrap();
        s.write_all(b"GET / HTTP/1.1\r\n\r\nGET / HTTP/1.1\r\n\r\n")
            .unwrap();
        let head =
            "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ntransfer-encoding: chunked\r\n\r\n";
        let mut got = vec![0u8; head.len()];
        s.read_exact(&mut got).unwrap();
        assert_eq!(String::from_utf8_lossy(&got), head);
        s.set_read_timeout(Some(std::time::Duration::from_millis(100)))
            .unwrap();
        let more = s.read(&mut [0u8; 1]);
        assert!(
            matches!(&more, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
            "held open, the second request unanswered: {more:?}"
        );
        assert_eq!(stub.closed(), 0);
        drop(s);
        crate::wait_for_blocking(
            "the stub to see the client close",
            std::time::Duration::from_secs(5),
            || stub.closed() == 1,
        );
    }

    #[test]
    fn then_close_closes_the_connection_after_the_reply() {
        let stub = HttpStub::start(|_| StubReply::new(404, "text/plain", "no").then_close());
        let mut s = std::net::TcpStream::connect(stub.addr).unwrap();
        s.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
        let mut got = String::new();
        s.read_to_string(&mut got).unwrap();
        assert_eq!(
            got,
            "HTTP/1.1 404 Not Found\r\ncontent-type: text/plain\r\ncontent-length: 2\r\n\r\nno"
        );
        crate::wait_for_blocking(
            "the stub to count the close",
            std::time::Duration::from_secs(5),
            || stub.closed() == 1,
        );
    }
}
