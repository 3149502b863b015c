//! A fault-injecting TCP proxy: listens on `127.0.0.1:0`, forwards every connection to a target,
//! and can be switched at run time (for new and open connections alike) to delay, black-hole,
//! reset, close mid-stream or throttle the traffic, and back to pass-through. Placed between a
//! data plane and an engine or the control plane, it injects network faults without touching
//! the servers.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// What the proxy does to the bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Forward as they come.
    Pass,
    /// Hold each chunk this long before forwarding it (both directions).
    Delay(Duration),
    /// Accept, keep the connection open, forward nothing either way (bytes wait, unread, until
    /// the fault is lifted: a path that black-holes packets, not a closed port).
    BlackHole,
    /// Reset every connection (RST), open ones at once and new ones on accept.
    Reset,
    /// Close a connection once this many bytes came back from the target on it (counted from
    /// its start; a connection already past it closes at its next chunk).
    CloseAfter(u64),
    /// At most this many bytes per second per direction and connection.
    Bandwidth(u64),
}

/// A running proxy; it stops, and its connections close, when dropped.
pub struct FaultProxy {
    pub addr: SocketAddr,
    fault: watch::Sender<Fault>,
    /// Bumped to reset every open connection once.
    cut: watch::Sender<u64>,
    target: Arc<Mutex<SocketAddr>>,
    accepted: Arc<AtomicU64>,
    /// Bytes forwarded from targets to clients.
    down: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl FaultProxy {
    /// A pass-through proxy to `target`.
    pub async fn start(target: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind loopback");
        let addr = listener.local_addr().expect("local addr");
        let (fault, rx) = watch::channel(Fault::Pass);
        let (cut, cut_rx) = watch::channel(0u64);
        let accepted = Arc::new(AtomicU64::new(0));
        let count = Arc::clone(&accepted);
        let down = Arc::new(AtomicU64::new(0));
        let down_count = Arc::clone(&down);
        let target = Arc::new(Mutex::new(target));
        let to = Arc::clone(&target);
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                count.fetch_add(1, Relaxed);
                let _ = client.set_nodelay(true);
                let target = *to.lock().unwrap_or_else(|e| e.into_inner());
                let conn = Conn {
                    fault: rx.clone(),
                    cut: cut_rx.clone(),
                    down: Arc::clone(&down_count),
                };
                tokio::spawn(serve(client, target, conn));
            }
        });
        FaultProxy {
            addr,
            fault,
            cut,
            target,
            accepted,
            down,
            task,
        }
    }

    /// New connections go to `target` from now on (open ones stay where they are): a server
    /// restarted on another port, or swapped for a misbehaving one, behind the same address.
    pub fn retarget(&self, target: SocketAddr) {
        *self.target.lock().unwrap_or_else(|e| e.into_inner()) = target;
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Switches every connection, open and new, to `fault`.
    pub fn set(&self, fault: Fault) {
        self.fault.send_replace(fault);
    }

    /// Resets every connection open now (new ones are not affected): with [`Self::retarget`],
    /// moves keep-alive clients to the new target at once.
    pub fn reset_open_connections(&self) {
        self.cut.send_modify(|n| *n += 1);
    }

    pub fn fault(&self) -> Fault {
        *self.fault.borrow()
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> u64 {
        self.accepted.load(Relaxed)
    }

    /// Bytes forwarded from the target to clients so far.
    pub fn bytes_down(&self) -> u64 {
        self.down.load(Relaxed)
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Closes with RST instead of FIN.
fn reset(stream: TcpStream) {
    #[allow(deprecated)] // set_linger: the blocking close it warns of is what RST needs here
    let _ = stream.set_linger(Some(Duration::ZERO));
    drop(stream);
}

/// Sleeps as the fault asks after `n` bytes were read.
async fn pace(fault: Fault, n: usize) {
    match fault {
        Fault::Delay(d) => tokio::time::sleep(d).await,
        Fault::Bandwidth(bps) => {
            tokio::time::sleep(Duration::from_secs_f64(n as f64 / bps.max(1) as f64)).await
        }
        _ => {}
    }
}

/// What a connection's task watches and counts.
struct Conn {
    fault: watch::Receiver<Fault>,
    cut: watch::Receiver<u64>,
    down: Arc<AtomicU64>,
}

async fn serve(client: TcpStream, target: SocketAddr, mut conn: Conn) {
    conn.cut.mark_unchanged();
    let fault = &mut conn.fault;
    // A black-holed path still completes the handshake (the kernel accepted it); nothing flows
    // until it heals.
    loop {
        let now = *fault.borrow_and_update();
        match now {
            Fault::BlackHole => {}
            Fault::Reset => return reset(client),
            _ => break,
        }
        if fault.changed().await.is_err() {
            return;
        }
    }
    let Ok(upstream) = TcpStream::connect(target).await else {
        return reset(client);
    };
    let _ = upstream.set_nodelay(true);
    pump(client, upstream, conn).await;
}

async fn pump(mut client: TcpStream, mut upstream: TcpStream, conn: Conn) {
    let Conn {
        mut fault,
        mut cut,
        down: forwarded,
    } = conn;
    let mut up = vec![0u8; 16 << 10];
    let mut down = vec![0u8; 16 << 10];
    let (mut up_open, mut down_open) = (true, true);
    let mut down_bytes = 0u64;
    while up_open || down_open {
        let now = *fault.borrow_and_update();
        match now {
            Fault::Reset => {
                reset(client);
                reset(upstream);
                return;
            }
            Fault::BlackHole => {
                if fault.changed().await.is_err() {
                    return;
                }
                continue;
            }
            Fault::CloseAfter(limit) if down_bytes >= limit => return,
            _ => {}
        }
        // A throttled chunk is at most a tenth of a second's worth.
        let chunk = match now {
            Fault::Bandwidth(bps) => (bps as usize / 10).clamp(1, up.len()),
            _ => up.len(),
        };
        tokio::select! {
            r = client.read(&mut up[..chunk]), if up_open => match r {
                Ok(0) | Err(_) => {
                    up_open = false;
                    let _ = upstream.shutdown().await;
                }
                Ok(n) => {
                    pace(now, n).await;
                    if upstream.write_all(&up[..n]).await.is_err() {
                        return;
                    }
                }
            },
            r = upstream.read(&mut down[..chunk]), if down_open => match r {
                Ok(0) | Err(_) => {
                    down_open = false;
                    let _ = client.shutdown().await;
                }
                Ok(n) => {
                    let n = match now {
                        Fault::CloseAfter(limit) => n.min((limit - down_bytes) as usize),
                        _ => n,
                    };
                    pace(now, n).await;
                    if client.write_all(&down[..n]).await.is_err() {
                        return;
                    }
                    down_bytes += n as u64;
                    forwarded.fetch_add(n as u64, Relaxed);
                }
            },
            changed = fault.changed() => if changed.is_err() {
                return; // the proxy is gone
            },
            _ = cut.changed() => {
                reset(client);
                reset(upstream);
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;
    use tokio::time::timeout;

    /// Echoes what it reads; on a line `send N\n` writes N bytes instead.
    async fn echo() -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                tokio::spawn(async move {
                    let mut buf = [0u8; 4096];
                    while let Ok(n) = s.read(&mut buf).await {
                        if n == 0 {
                            break;
                        }
                        let text = String::from_utf8_lossy(&buf[..n]).into_owned();
                        let reply = match text.strip_prefix("send ") {
                            Some(k) => vec![b'x'; k.trim().parse().unwrap()],
                            None => buf[..n].to_vec(),
                        };
                        if s.write_all(&reply).await.is_err() {
                            break;
                        }
                    }
                });
            }
        });
        addr
    }

    async fn read_n(s: &mut TcpStream, n: usize) -> std::io::Result<Vec<u8>> {
        let mut out = vec![0u8; n];
        s.read_exact(&mut out).await?;
        Ok(out)
    }

    const LIMIT: Duration = Duration::from_secs(10);

    #[tokio::test]
    async fn passes_through_then_delays_then_passes_again() {
        let proxy = FaultProxy::start(echo().await).await;
        let mut s = TcpStream::connect(proxy.addr).await.unwrap();
        s.write_all(b"hello").await.unwrap();
        assert_eq!(
            timeout(LIMIT, read_n(&mut s, 5)).await.unwrap().unwrap(),
            b"hello"
        );
        proxy.set(Fault::Delay(Duration::from_millis(300)));
        let started = Instant::now();
        s.write_all(b"again").await.unwrap();
        assert_eq!(
            timeout(LIMIT, read_n(&mut s, 5)).await.unwrap().unwrap(),
            b"again"
        );
        // held once each way
        assert!(
            started.elapsed() >= Duration::from_millis(600),
            "{:?}",
            started.elapsed()
        );
        proxy.set(Fault::Pass);
        s.write_all(b"third").await.unwrap();
        assert_eq!(
            timeout(LIMIT, read_n(&mut s, 5)).await.unwrap().unwrap(),
            b"third"
        );
        assert_eq!(proxy.accepted(), 1);
        assert_eq!(proxy.bytes_down(), 15);
    }

    #[tokio::test]
    async fn black_hole_keeps_connections_open_and_silent_until_healed() {
        let proxy = FaultProxy::start(echo().await).await;
        let mut open = TcpStream::connect(proxy.addr).await.unwrap();
        open.write_all(b"ping").await.unwrap();
        assert_eq!(
            timeout(LIMIT, read_n(&mut open, 4)).await.unwrap().unwrap(),
            b"ping"
        );
        proxy.set(Fault::BlackHole);
        // an open connection and a new one: connected, but nothing comes back
        let mut new = timeout(LIMIT, TcpStream::connect(proxy.addr))
            .await
            .unwrap()
            .unwrap();
        open.write_all(b"lost?").await.unwrap();
        new.write_all(b"new").await.unwrap();
        let mut buf = [0u8; 8];
        assert!(timeout(Duration::from_millis(300), open.read(&mut buf))
            .await
            .is_err());
        assert!(timeout(Duration::from_millis(300), new.read(&mut buf))
            .await
            .is_err());
        // healed: what waited goes through, on both
        proxy.set(Fault::Pass);
        assert_eq!(
            timeout(LIMIT, read_n(&mut open, 5)).await.unwrap().unwrap(),
            b"lost?"
        );
        assert_eq!(
            timeout(LIMIT, read_n(&mut new, 3)).await.unwrap().unwrap(),
            b"new"
        );
    }

    #[tokio::test]
    async fn reset_resets_open_and_new_connections() {
        let proxy = FaultProxy::start(echo().await).await;
        let mut open = TcpStream::connect(proxy.addr).await.unwrap();
        open.write_all(b"ping").await.unwrap();
        read_n(&mut open, 4).await.unwrap();
        proxy.set(Fault::Reset);
        let mut buf = [0u8; 8];
        let r = timeout(LIMIT, open.read(&mut buf)).await.unwrap();
        assert!(
            matches!(&r, Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset),
            "{r:?}"
        );
        let mut new = TcpStream::connect(proxy.addr).await.unwrap();
        let r = timeout(LIMIT, new.read(&mut buf)).await.unwrap();
        assert!(
            matches!(&r, Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset),
            "{r:?}"
        );
        // back to pass-through: new connections work again
        proxy.set(Fault::Pass);
        let mut again = TcpStream::connect(proxy.addr).await.unwrap();
        again.write_all(b"ok").await.unwrap();
        assert_eq!(
            timeout(LIMIT, read_n(&mut again, 2))
                .await
                .unwrap()
                .unwrap(),
            b"ok"
        );
    }

    #[tokio::test]
    async fn close_after_n_bytes_cuts_the_stream_there() {
        let proxy = FaultProxy::start(echo().await).await;
        proxy.set(Fault::CloseAfter(1000));
        let mut s = TcpStream::connect(proxy.addr).await.unwrap();
        s.write_all(b"send 5000\n").await.unwrap();
        let mut got = Vec::new();
        timeout(LIMIT, s.read_to_end(&mut got))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(got.len(), 1000);
    }

    #[tokio::test]
    async fn retarget_sends_new_connections_to_the_new_target() {
        let proxy = FaultProxy::start(echo().await).await;
        let mut first = TcpStream::connect(proxy.addr).await.unwrap();
        first.write_all(b"send 3\n").await.unwrap();
        assert_eq!(read_n(&mut first, 3).await.unwrap(), b"xxx");
        // a server that answers "other" to anything
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        proxy.retarget(l.local_addr().unwrap());
        tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            s.write_all(b"other").await.unwrap();
        });
        let mut second = TcpStream::connect(proxy.addr).await.unwrap();
        assert_eq!(
            timeout(LIMIT, read_n(&mut second, 5))
                .await
                .unwrap()
                .unwrap(),
            b"other"
        );
        // the open connection still reaches the first target, until it is cut
        first.write_all(b"send 2\n").await.unwrap();
        assert_eq!(read_n(&mut first, 2).await.unwrap(), b"xx");
        proxy.reset_open_connections();
        let mut buf = [0u8; 4];
        let r = timeout(LIMIT, first.read(&mut buf)).await.unwrap();
        assert!(matches!(r, Err(_) | Ok(0)), "{r:?}");
    }

    #[tokio::test]
    async fn bandwidth_cap_slows_a_transfer() {
        let proxy = FaultProxy::start(echo().await).await;
        proxy.set(Fault::Bandwidth(100_000));
        let mut s = TcpStream::connect(proxy.addr).await.unwrap();
        let started = Instant::now();
        s.write_all(b"send 50000\n").await.unwrap();
        let got = timeout(LIMIT, read_n(&mut s, 50_000))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(got.len(), 50_000);
        // 50 KB at 100 KB/s: at least 0.4 s (a lower bound only: the machine may be slower)
        assert!(
            started.elapsed() >= Duration::from_millis(400),
            "{:?}",
            started.elapsed()
        );
    }
}
