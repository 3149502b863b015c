//! The `engine-sim` binary itself: --help, a taken port, serving until SIGTERM.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_engine-sim");

#[test]
fn help_lists_the_contract_flags() {
    let out = Command::new(BIN).arg("--help").output().unwrap();
    assert!(out.status.success());
    let help = String::from_utf8(out.stdout).unwrap();
    for flag in [
        "--listen",
        "--kv-capacity-tokens",
        "--block-size",
        "--prefill-tokens-per-s",
        "--ttft-overhead-ms",
        "--itl-ms",
        "--max-num-seqs",
        "--time-scale",
        "--seed",
        "--fail-rate",
        "--stall-ms",
        "--model-name",
    ] {
        assert!(help.contains(flag), "{flag} missing from --help:\n{help}");
    }
}

#[test]
fn a_taken_port_is_one_clear_line_and_a_failure_exit() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let out = Command::new(BIN)
        .args(["--listen", &addr])
        .env("RUST_LOG", "info")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert_eq!(
        stderr,
        format!("engine-sim: cannot listen on {addr}: Address already in use\n")
    );
}

#[test]
fn serves_then_exits_cleanly_on_sigterm() {
    let mut child = Command::new(BIN)
        .args(["--listen", "127.0.0.1:0", "--time-scale", "0.01"])
        .env("RUST_LOG", "info")
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    let addr = loop {
        line.clear();
        assert!(
            stderr.read_line(&mut line).unwrap() > 0,
            "exited before listening"
        );
        if let Some(rest) = line.split("addr=").nth(1) {
            break rest.split_whitespace().next().unwrap().to_owned();
        }
    };
    assert!(
        !line.contains('\u{1b}'),
        "no colour codes when stderr is not a terminal"
    );

    let mut conn = std::net::TcpStream::connect(&addr).unwrap();
    conn.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut resp = String::new();
    conn.read_to_string(&mut resp).unwrap();
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");

    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let deadline = Instant::now() + Duration::from_secs(10);
    let exit = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "no exit 10 s after SIGTERM");
        std::thread::sleep(Duration::from_millis(10));
    };
    assert!(exit.success(), "{exit:?}");
}
