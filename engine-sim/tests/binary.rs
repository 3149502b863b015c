//! The `engine-sim` binary itself: --help, a taken port, serving until SIGTERM.

use std::io::{Read, Write};
use std::process::Command;
use std::time::Duration;

use test_support::{wait_for_blocking, ChildServer};

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
    let mut server = ChildServer::start_with_env(
        "engine-sim",
        &["--time-scale", "0.01"],
        &[("RUST_LOG", "info")],
    )
    .unwrap();
    let logs = server.logs();
    assert!(
        logs.contains("addr="),
        "the info line names the address: {logs}"
    );
    assert!(
        !logs.contains('\u{1b}'),
        "no colour codes when stderr is not a terminal: {logs}"
    );

    let mut conn = std::net::TcpStream::connect(server.addr).unwrap();
    conn.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut resp = String::new();
    conn.read_to_string(&mut resp).unwrap();
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");

    let status = Command::new("kill")
        .args(["-TERM", &server.child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let exit = wait_for_blocking("the exit after SIGTERM", Duration::from_secs(10), || {
        server.child.try_wait().unwrap()
    });
    assert!(exit.success(), "{exit:?}");
}
