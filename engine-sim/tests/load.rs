//! A measurement, not a check: one `engine-sim` process holding 2,000 concurrent streaming
//! requests with the default timing (real time), then idle. Prints what it saw.
//!
//! Run: `cargo test -p engine-sim --test load -- --ignored --nocapture` (Linux: reads /proc).

use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use test_support::{wait_for, ChildServer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const STREAMS: usize = 2000;

/// CPU seconds (user + system) the process has used, from /proc/PID/stat.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let after_comm = &stat[stat.rfind(')').unwrap() + 2..];
    let fields: Vec<&str> = after_comm.split(' ').collect();
    // utime and stime are fields 14 and 15 of the whole line, 12 and 13 after "pid (comm) ".
    let ticks: f64 = fields[11].parse::<f64>().unwrap() + fields[12].parse::<f64>().unwrap();
    ticks / 100.0 // USER_HZ
}

fn rss_mib(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    kb / 1024.0
}

async fn metric(addr: &str, name: &str) -> f64 {
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    conn.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut text = String::new();
    conn.read_to_string(&mut text).await.unwrap();
    text.lines()
        .find(|l| l.starts_with(name) && l.as_bytes().get(name.len()) == Some(&b'{'))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(-1.0)
}

async fn cpu_percent_over(pid: u32, window: Duration) -> f64 {
    let c0 = cpu_seconds(pid);
    let t0 = Instant::now();
    tokio::time::sleep(window).await;
    (cpu_seconds(pid) - c0) / t0.elapsed().as_secs_f64() * 100.0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement of ~30 s; run with --ignored --nocapture"]
async fn holds_2000_concurrent_streams() {
    let mut server = ChildServer::start_with_env(
        "engine-sim",
        &["--max-num-seqs", "4096"],
        &[("RUST_LOG", "info")],
    )
    .unwrap();
    let pid = server.child.id();
    let addr = server.addr.to_string();

    let idle_before = cpu_percent_over(pid, Duration::from_secs(2)).await;
    let done = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let system = "You are a helpful assistant for the prefix-router benchmark. ".repeat(30);
    let mut tasks = Vec::new();
    for i in 0..STREAMS {
        let addr = addr.clone();
        let done = Arc::clone(&done);
        let body = serde_json::json!({
            "model": "m",
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": format!("user {i}")}],
            "max_tokens": 80,
            "stream": true,
        })
        .to_string();
        tasks.push(tokio::spawn(async move {
            let mut conn = tokio::net::TcpStream::connect(&addr).await.unwrap();
            let req = format!(
                "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            conn.write_all(req.as_bytes()).await.unwrap();
            let mut buf = vec![0u8; 16 * 1024];
            let mut tail = Vec::new();
            loop {
                let n = conn.read(&mut buf).await.unwrap();
                if n == 0 {
                    break;
                }
                tail.extend_from_slice(&buf[..n]);
                if tail.len() > 64 {
                    tail.drain(..tail.len() - 64);
                }
            }
            let s = String::from_utf8_lossy(&tail);
            assert!(s.contains("data: [DONE]"), "stream {i} did not end in [DONE]");
            done.fetch_add(1, Ordering::Relaxed);
        }));
    }
    // Wait until the engine runs them all at once.
    wait_for(
        "the engine to run every stream at once",
        Duration::from_secs(30),
        || async { metric(&addr, "vllm:num_requests_running").await >= STREAMS as f64 },
    )
    .await;
    let ramp = started.elapsed();
    let busy = cpu_percent_over(pid, Duration::from_secs(3)).await;
    let still_running = metric(&addr, "vllm:num_requests_running").await;
    let rss_loaded = rss_mib(pid);
    for t in tasks {
        t.await.unwrap();
    }
    let total = started.elapsed();
    assert_eq!(done.load(Ordering::Relaxed), STREAMS);
    let idle_after = cpu_percent_over(pid, Duration::from_secs(3)).await;
    println!(
        "engine-sim held {STREAMS} concurrent streams (80 tokens each, default timing): \
         all running {ramp:.2?} after the first connect, still {still_running} running 3 s \
         later; engine CPU while streaming {busy:.0}% of one core; RSS {rss_loaded:.0} MiB; \
         all {STREAMS} ended in [DONE] after {total:.2?}; idle CPU {idle_before:.1}% before, \
         {idle_after:.1}% after"
    );
    let _ = Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status();
    let _ = server.child.wait();
}
