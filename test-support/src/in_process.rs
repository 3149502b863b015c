//! A server started in this process on `127.0.0.1:0`: [`InProcessServer`] binds the port, spawns
//! the serve future the test hands it (a data plane, an engine-sim, a control plane: whatever
//! takes a listener and a shutdown future) and keeps its task and its shutdown signal. This crate
//! stays free of the servers' crates, so each test names its own serve call in a closure.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// A listener on a loopback port of its own (`127.0.0.1:0`), for a server's second port (a
/// picker, metrics) or for [`InProcessServer::start_on`].
pub async fn bind_loopback() -> TcpListener {
    TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind loopback")
}

/// The shutdown future a serve call gets: it resolves once the test asks the server to stop
/// ([`InProcessServer::stop`], [`InProcessServer::begin_shutdown`] or a drop), and never after
/// [`InProcessServer::detach`].
pub struct Shutdown(Option<oneshot::Receiver<()>>);

impl Future for Shutdown {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let Some(rx) = self.0.as_mut() else {
            return Poll::Pending;
        };
        match Pin::new(rx).poll(cx) {
            Poll::Ready(Ok(())) => Poll::Ready(()),
            // Detached: the sender went without a word; serve until the runtime ends.
            Poll::Ready(Err(_)) => {
                self.0 = None;
                Poll::Pending
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

/// A server's serve task on a loopback port; asked to stop gracefully when dropped.
pub struct InProcessServer {
    pub addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<anyhow::Result<()>>>,
}

impl InProcessServer {
    /// Binds `127.0.0.1:0` and spawns `serve(listener, shutdown)`:
    /// `InProcessServer::start(|l, stop| data_plane::serve(l, config, stop)).await`.
    pub async fn start<S, F>(serve: S) -> Self
    where
        S: FnOnce(TcpListener, Shutdown) -> F,
        F: Future<Output = anyhow::Result<()>> + Send + 'static,
    {
        Self::start_on(bind_loopback().await, serve)
    }

    /// [`Self::start`] on a listener the caller bound (a port it must know beforehand, or the
    /// port of a server that stopped).
    pub fn start_on<S, F>(listener: TcpListener, serve: S) -> Self
    where
        S: FnOnce(TcpListener, Shutdown) -> F,
        F: Future<Output = anyhow::Result<()>> + Send + 'static,
    {
        let addr = listener.local_addr().expect("bound address");
        let (stop, stopped) = oneshot::channel();
        let task = tokio::spawn(serve(listener, Shutdown(Some(stopped))));
        Self {
            addr,
            stop: Some(stop),
            task: Some(task),
        }
    }

    /// `http://ADDR`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Asks the server to stop and hands back its serve task, to await when the test chooses.
    pub fn begin_shutdown(&mut self) -> JoinHandle<anyhow::Result<()>> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        self.task.take().expect("already shut down")
    }

    /// Graceful stop; the serve call's result (a panic of its task is an error too).
    pub async fn stop(mut self) -> anyhow::Result<()> {
        self.begin_shutdown().await?
    }

    /// [`Self::stop`], panicking unless the serve call returns within `limit`.
    pub async fn stop_within(mut self, limit: Duration) -> anyhow::Result<()> {
        let task = self.begin_shutdown();
        tokio::time::timeout(limit, task)
            .await
            .unwrap_or_else(|_| panic!("the server did not stop within {limit:?}"))?
    }

    /// Lets the server run until the runtime ends (nothing stops it); its address.
    pub fn detach(mut self) -> SocketAddr {
        self.stop.take();
        self.task.take();
        self.addr
    }
}

impl Drop for InProcessServer {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A serve call that accepts until told to stop, then says how many it accepted.
    async fn counting(listener: TcpListener, shutdown: Shutdown) -> anyhow::Result<()> {
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                _ = &mut shutdown => return Ok(()),
                accepted = listener.accept() => { accepted?; }
            }
        }
    }

    #[tokio::test]
    async fn serves_on_a_loopback_port_until_stopped() {
        let server = InProcessServer::start(counting).await;
        assert!(server.addr.ip().is_loopback() && server.addr.port() != 0);
        assert_eq!(server.url(), format!("http://{}", server.addr));
        tokio::net::TcpStream::connect(server.addr).await.unwrap();
        server.stop_within(Duration::from_secs(5)).await.unwrap();
    }

    #[tokio::test]
    async fn a_drop_stops_the_server_and_a_detached_one_keeps_serving() {
        let mut dropped = InProcessServer::start(counting).await;
        let task = dropped.task.take().unwrap();
        drop(dropped);
        tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .expect("a dropped server stops")
            .unwrap()
            .unwrap();

        let addr = InProcessServer::start(counting).await.detach();
        tokio::net::TcpStream::connect(addr).await.unwrap();
        tokio::net::TcpStream::connect(addr).await.unwrap();
    }

    #[tokio::test]
    async fn stop_returns_what_serve_returned() {
        let server = InProcessServer::start(|_, _| async { anyhow::bail!("no table") }).await;
        let e = server.stop().await.unwrap_err();
        assert_eq!(e.to_string(), "no table");
    }
}
