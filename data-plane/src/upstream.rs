//! Keep-alive HTTP/1.1 connections to instances, driven by the request's own task.
//!
//! A general client (hyper-util's legacy `Client`) runs every connection as a task of its own:
//! the request goes to it through a channel and the response comes back through another, two
//! task wake-ups per request, plus its pool's bookkeeping (a hashed key per checkout, a lazy
//! connect future, an extension map per response). The router needs much less: plain HTTP to
//! addresses it already knows, one request at a time per connection. So each instance keeps its
//! idle connections (in its [`InstanceState`](crate::load::InstanceState), so they outlive a
//! table swap), and a request checks one out and polls it itself, first until the response
//! head arrives ([`send`]), then while its response body streams ([`Conn::poll_drive`]); at the
//! end of the body the connection goes back ([`Pool::put`]). A connection whose response body
//! did not end (client gone, timeout, a 5xx that was retried) is dropped, which closes it.
//!
//! An idle connection is not polled, so a close by the server is seen at the next checkout:
//! [`send`] first drives the connection until it can take a request, and a connection that
//! turns out closed before the request was written is replaced by a new one without counting a
//! failure. A reused connection that the server closed while the request was on its way (the
//! keep-alive race) is also retried once on a new connection: nothing was answered yet.

use std::future::Future as _;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Mutex;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::uri::Authority;
use http::{Request, Response};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::client::conn::http1::{self, Connection, SendRequest};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

/// The body of a forwarded request: the request body, read whole (it decides the placement).
pub(crate) type UpstreamBody = Full<Bytes>;

/// Connect timeout towards instances (a black-holed instance fails over within it).
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// Idle connections kept per instance and worker thread; more are closed when they come back.
pub(crate) const MAX_IDLE: usize = 1024;
/// An idle connection older than this is closed rather than reused (servers drop idle
/// keep-alive connections after a while; uvicorn after 5 s, nginx after 75 s).
pub(crate) const IDLE_TIMEOUT_MS: u64 = 60_000;

/// Why an upstream exchange failed (before any response head).
#[derive(Debug, thiserror::Error)]
pub(crate) enum UpstreamError {
    #[error("connect to {authority} failed: {source}")]
    Connect {
        authority: Authority,
        source: std::io::Error,
    },
    #[error("TLS with {authority} failed: {source}")]
    Tls {
        authority: Authority,
        source: std::io::Error,
    },
    #[error("connect to {authority} timed out after {}s", CONNECT_TIMEOUT.as_secs())]
    ConnectTimeout { authority: Authority },
    #[error(transparent)]
    Http(#[from] hyper::Error),
}

/// One keep-alive connection to an instance.
pub(crate) struct Conn {
    authority: Authority,
    /// The worker thread whose runtime polls the socket.
    worker: usize,
    send: SendRequest<UpstreamBody>,
    /// `None` once the connection has ended (the server closed it, or it failed).
    conn: Option<Connection<TokioIo<UpstreamIo>, UpstreamBody>>,
    idle_since_ms: u64,
}

impl Conn {
    /// Polls the connection (reads and writes whatever it can); `true` while it is open.
    pub(crate) fn poll_drive(&mut self, cx: &mut Context<'_>) -> bool {
        if let Some(conn) = &mut self.conn {
            if Pin::new(conn).poll(cx).is_ready() {
                self.conn = None;
            }
        }
        self.conn.is_some()
    }

    /// Drives the connection until it can take a request: `false` if it is closed.
    async fn ready(&mut self) -> bool {
        std::future::poll_fn(|cx| {
            let open = self.poll_drive(cx);
            match self.send.poll_ready(cx) {
                Poll::Ready(Ok(())) => Poll::Ready(open),
                Poll::Ready(Err(_)) => Poll::Ready(false),
                Poll::Pending if open => Poll::Pending,
                Poll::Pending => Poll::Ready(false),
            }
        })
        .await
    }

    /// Sends `req` and drives the connection until the response head (or an error) arrives.
    async fn exchange(
        &mut self,
        req: Request<UpstreamBody>,
    ) -> Result<Response<Incoming>, hyper::client::conn::TrySendError<Request<UpstreamBody>>> {
        let mut response = std::pin::pin!(self.send.try_send_request(req));
        std::future::poll_fn(|cx| {
            // The connection first: it writes the request and reads the head, then answers.
            self.poll_drive(cx);
            response.as_mut().poll(cx)
        })
        .await
    }
}

/// The idle connections to one instance: one slot per worker thread (a connection is polled by
/// the runtime of the worker that opened it, so only that worker takes it), so a request locks
/// only its own worker's slot and no lock is shared between workers; most recently used last.
/// Boxed: a connection moves from here to a response body and back without copying its state.
pub(crate) struct Pool {
    slots: Box<[Slot]>,
    /// Idle connections kept per slot.
    max_idle: usize,
}

/// One worker's idle connections, on a cache line of its own (workers' slots side by side
/// would share lines, and every lock would move the line between cores).
#[repr(align(128))]
#[derive(Default)]
struct Slot(#[allow(clippy::vec_box)] Mutex<Vec<Box<Conn>>>);

#[allow(clippy::vec_box)]
impl Slot {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Box<Conn>>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Default for Pool {
    fn default() -> Self {
        Pool {
            slots: (0..WORKERS.load(Relaxed))
                .map(|_| Slot::default())
                .collect(),
            max_idle: MAX_IDLE,
        }
    }
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let idle: usize = self.slots.iter().map(|s| s.lock().len()).sum();
        f.debug_struct("Pool").field("idle", &idle).finish()
    }
}

impl Pool {
    /// Worker `worker`'s slot (pools made before a router with more workers started share).
    fn slot(&self, worker: usize) -> &Slot {
        &self.slots[worker % self.slots.len()]
    }

    /// The most recently used idle connection of this worker thread to `authority` that is still
    /// open and fresh (closed and stale ones met on the way are dropped).
    fn take(&self, authority: &Authority, now_ms: u64) -> Option<Box<Conn>> {
        let worker = worker();
        let mut dropped = Vec::new();
        let found = {
            let mut idle = self.slot(worker).lock();
            let mut found = None;
            let mut i = idle.len();
            while i > 0 {
                i -= 1;
                let c = &idle[i];
                if c.send.is_closed() || now_ms.saturating_sub(c.idle_since_ms) >= IDLE_TIMEOUT_MS {
                    dropped.push(idle.remove(i));
                } else if c.worker == worker && c.authority == *authority {
                    found = Some(idle.remove(i));
                    break;
                }
            }
            found
        };
        // Closed outside the lock.
        drop(dropped);
        found
    }

    /// Gives back a connection whose exchange is over (its response body ended).
    pub(crate) fn put(&self, mut conn: Box<Conn>, now_ms: u64) {
        if conn.conn.is_none() || conn.send.is_closed() {
            return;
        }
        conn.idle_since_ms = now_ms;
        let stale = {
            let mut idle = self.slot(conn.worker).lock();
            // The oldest connection has waited longest: close it if it timed out, or to make room.
            let stale = match idle.first() {
                Some(c)
                    if idle.len() >= self.max_idle
                        || now_ms.saturating_sub(c.idle_since_ms) >= IDLE_TIMEOUT_MS =>
                {
                    Some(idle.remove(0))
                }
                _ => None,
            };
            idle.push(conn);
            stale
        };
        // Closed outside the lock.
        drop(stale);
    }

    /// Idle connections now.
    #[cfg(test)]
    pub(crate) fn idle(&self) -> usize {
        self.slots.iter().map(|s| s.lock().len()).sum()
    }
}

/// The byte stream under a connection: plain TCP, or TLS over it for `https://` instances.
pub(crate) enum UpstreamIo {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::client::TlsStream<TcpStream>>),
}

impl tokio::io::AsyncRead for UpstreamIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            UpstreamIo::Plain(s) => Pin::new(s).poll_read(cx, buf),
            UpstreamIo::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl tokio::io::AsyncWrite for UpstreamIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            UpstreamIo::Plain(s) => Pin::new(s).poll_write(cx, buf),
            UpstreamIo::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    // Vectored, so hyper writes a request's head and its body in one `writev` rather than
    // copying the body into its own buffer first (its "flatten" strategy, for streams that say
    // they cannot write vectored: a 32 KiB copy per request).
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            UpstreamIo::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            UpstreamIo::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            UpstreamIo::Plain(s) => s.is_write_vectored(),
            UpstreamIo::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            UpstreamIo::Plain(s) => Pin::new(s).poll_flush(cx),
            UpstreamIo::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            UpstreamIo::Plain(s) => Pin::new(s).poll_shutdown(cx),
            UpstreamIo::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

/// TLS towards `https://` instances: the CAs of `--upstream-ca-cert`, else the system's roots.
pub(crate) fn tls_connector(
    ca: Option<&std::path::Path>,
) -> anyhow::Result<tokio_rustls::TlsConnector> {
    use anyhow::Context as _;
    use tokio_rustls::rustls;
    use tokio_rustls::rustls::pki_types::pem::PemObject as _;
    use tokio_rustls::rustls::pki_types::CertificateDer;
    let mut roots = rustls::RootCertStore::empty();
    match ca {
        Some(path) => {
            let certs = CertificateDer::pem_file_iter(path)
                .and_then(|it| it.collect::<Result<Vec<_>, _>>())
                .with_context(|| {
                    format!(
                        "--upstream-ca-cert {}: cannot read PEM certificates",
                        path.display()
                    )
                })?;
            let (added, _) = roots.add_parsable_certificates(certs);
            if added == 0 {
                anyhow::bail!(
                    "--upstream-ca-cert {}: no usable CA certificate",
                    path.display()
                );
            }
        }
        None => {
            let found = rustls_native_certs::load_native_certs();
            roots.add_parsable_certificates(found.certs);
        }
    }
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .context("TLS protocol versions")?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(tokio_rustls::TlsConnector::from(std::sync::Arc::new(
        config,
    )))
}

/// A new connection (boxed: it moves between the pool and response bodies, and is large), over
/// TLS when `tls` is given (an `https://` instance).
async fn connect(
    authority: &Authority,
    tls: Option<&tokio_rustls::TlsConnector>,
) -> Result<Box<Conn>, UpstreamError> {
    let port = authority
        .port_u16()
        .unwrap_or(if tls.is_some() { 443 } else { 80 });
    let connecting = TcpStream::connect((authority.host(), port));
    let stream = match tokio::time::timeout(CONNECT_TIMEOUT, connecting).await {
        Ok(Ok(s)) => s,
        Ok(Err(source)) => {
            return Err(UpstreamError::Connect {
                authority: authority.clone(),
                source,
            })
        }
        Err(_) => {
            return Err(UpstreamError::ConnectTimeout {
                authority: authority.clone(),
            })
        }
    };
    let _ = stream.set_nodelay(true);
    let io = match tls {
        None => UpstreamIo::Plain(stream),
        Some(connector) => {
            let tls_error = |source: std::io::Error| UpstreamError::Tls {
                authority: authority.clone(),
                source,
            };
            let host = authority
                .host()
                .trim_start_matches('[')
                .trim_end_matches(']');
            let name = tokio_rustls::rustls::pki_types::ServerName::try_from(host.to_string())
                .map_err(|e| tls_error(std::io::Error::new(std::io::ErrorKind::InvalidInput, e)))?;
            let handshake = connector.connect(name, stream);
            match tokio::time::timeout(CONNECT_TIMEOUT, handshake).await {
                Ok(Ok(s)) => UpstreamIo::Tls(Box::new(s)),
                Ok(Err(e)) => return Err(tls_error(e)),
                Err(_) => {
                    return Err(UpstreamError::ConnectTimeout {
                        authority: authority.clone(),
                    })
                }
            }
        }
    };
    let (send, conn) = http1::Builder::new().handshake(TokioIo::new(io)).await?;
    Ok(Box::new(Conn {
        authority: authority.clone(),
        worker: worker(),
        send,
        conn: Some(conn),
        idle_since_ms: 0,
    }))
}

/// Sends a request (built by `make`, which may be called twice) to `authority` on an idle
/// connection from `pool` or a new one; returns the response head and the connection, which
/// the caller drives while it reads the response body and gives back when the body has ended.
pub(crate) async fn send(
    pool: &Pool,
    authority: &Authority,
    tls: Option<&tokio_rustls::TlsConnector>,
    now_ms: u64,
    make: impl Fn() -> Request<UpstreamBody>,
) -> Result<(Response<Incoming>, Box<Conn>), UpstreamError> {
    let mut req = make();
    // A reused connection that fails before answering gets one more try, on a new connection.
    let mut reused_failed = false;
    loop {
        let pooled = if reused_failed {
            None
        } else {
            pool.take(authority, now_ms)
        };
        let (mut conn, reused) = match pooled {
            Some(c) => (c, true),
            None => (connect(authority, tls).await?, false),
        };
        // (A new connection closed at once is sent on anyway, to get hyper's error for it.)
        if !conn.ready().await && reused {
            continue;
        }
        match conn.exchange(req).await {
            Ok(response) => return Ok((response, conn)),
            Err(mut e) => match e.take_message() {
                // Never written: the connection was closed before it could take the request.
                Some(r) if reused => req = r,
                None if reused && !reused_failed => {
                    reused_failed = true;
                    req = make();
                }
                _ => return Err(e.into_error().into()),
            },
        }
    }
}

thread_local! {
    /// The worker thread this is (see `serve`): idle connections are reused on the thread that
    /// opened them, whose runtime polls their sockets.
    static WORKER: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Worker threads of the routers in this process (the most any has started): each instance's
/// pool has a slot per worker.
static WORKERS: AtomicUsize = AtomicUsize::new(1);

/// Says that a router with `n` worker threads starts (before its instances' pools are made).
pub(crate) fn set_workers(n: usize) {
    WORKERS.fetch_max(n.max(1), Relaxed);
}

/// Marks this thread as worker `n`.
pub(crate) fn set_worker(n: usize) {
    WORKER.with(|w| w.set(n));
}

fn worker() -> usize {
    WORKER.with(|w| w.get())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A listener that accepts and holds connections (never answers).
    async fn listener() -> (Authority, tokio::task::JoinHandle<()>) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let authority: Authority = l.local_addr().unwrap().to_string().parse().unwrap();
        let task = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((s, _)) = l.accept().await {
                held.push(s);
            }
        });
        (authority, task)
    }

    #[tokio::test]
    async fn idle_connections_are_reused_per_authority_until_they_time_out() {
        let (a, _ta) = listener().await;
        let (b, _tb) = listener().await;
        let pool = Pool::default();
        let t = 1_000;
        pool.put(connect(&a, None).await.unwrap(), t);
        pool.put(connect(&b, None).await.unwrap(), t);
        assert_eq!(pool.idle(), 2);
        // the connection to `a`, not the more recent one to `b`
        let c = pool.take(&a, t + 1).unwrap();
        assert_eq!(c.authority, a);
        assert!(pool.take(&a, t + 1).is_none());
        pool.put(c, t + 1);
        // past the idle timeout: closed, not reused
        assert!(pool.take(&a, t + 1 + IDLE_TIMEOUT_MS).is_none());
        assert_eq!(
            pool.idle(),
            0,
            "timed-out connections met on the way are dropped"
        );
    }

    #[tokio::test]
    async fn the_pool_keeps_at_most_max_idle_connections() {
        let (a, _ta) = listener().await;
        let pool = Pool {
            max_idle: 4,
            ..Pool::default()
        };
        for _ in 0..7 {
            pool.put(connect(&a, None).await.unwrap(), 1);
        }
        assert_eq!(pool.idle(), 4);
    }

    #[tokio::test]
    async fn each_worker_keeps_its_connections_in_a_slot_of_its_own() {
        let (a, _ta) = listener().await;
        set_workers(2);
        let pool = Pool::default();
        set_worker(1);
        let conn = connect(&a, None).await.unwrap();
        pool.put(conn, 1);
        assert_eq!(
            (pool.slot(0).lock().len(), pool.slot(1).lock().len()),
            (0, 1)
        );
        set_worker(0);
        assert!(
            pool.take(&a, 2).is_none(),
            "another worker's connection is polled by its runtime, not this one's"
        );
        set_worker(1);
        assert!(pool.take(&a, 2).is_some());
        set_worker(0);
    }

    #[tokio::test]
    async fn plain_upstream_streams_write_vectored() {
        use tokio::io::AsyncWrite as _;
        let (a, _ta) = listener().await;
        let stream = TcpStream::connect(a.as_str()).await.unwrap();
        // else hyper copies every request body into its own buffer before writing it
        assert!(UpstreamIo::Plain(stream).is_write_vectored());
    }

    #[tokio::test]
    async fn connect_errors_name_the_instance() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let authority: Authority = l.local_addr().unwrap().to_string().parse().unwrap();
        drop(l);
        let e = connect(&authority, None).await.err().unwrap();
        assert!(
            e.to_string()
                .starts_with(&format!("connect to {authority} failed")),
            "{e}"
        );
    }
}
