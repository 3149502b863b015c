//! `data-plane`: flags, logs (and traces) via `telemetry`, bind, serve until SIGINT/SIGTERM, drain.

use std::process::ExitCode;

// mimalloc rather than the system allocator: the request path's allocations (hyper's buffers and
// header maps, the request body) cost about a tenth of the router's CPU with glibc malloc
// (`perf` on the router_overhead benchmark); with mimalloc the added latency p50 fell from about
// 66 to 59 µs.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use clap::Parser;
use data_plane::Config;

// This runtime only watches the control plane and waits for a signal: connections are served by
// `serve`'s worker threads.
#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let config = Config::parse();
    let _telemetry = config.telemetry.init("data-plane");
    if let Err(e) = data_plane::check_files(&config) {
        eprintln!("data-plane: {e:#}");
        return ExitCode::FAILURE;
    }
    let listener = match tokio::net::TcpListener::bind(&config.listen).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("data-plane: cannot listen on {}: {e}", config.listen);
            return ExitCode::FAILURE;
        }
    };
    let ext_proc = match &config.ext_proc_listen {
        None => None,
        Some(addr) => match tokio::net::TcpListener::bind(addr).await {
            Ok(l) => {
                if let Ok(bound) = l.local_addr() {
                    eprintln!("data-plane ext-proc listening on {bound}");
                }
                Some(l)
            }
            Err(e) => {
                eprintln!("data-plane: cannot listen on {addr} (--ext-proc-listen): {e}");
                return ExitCode::FAILURE;
            }
        },
    };
    // after the picker's line: a harness that waits for this one finds both
    if let Ok(addr) = listener.local_addr() {
        eprintln!("data-plane listening on {addr}");
    }
    match data_plane::serve_with_picker(listener, ext_proc, config, shutdown_signal()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("data-plane: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Completes on SIGINT or SIGTERM.
async fn shutdown_signal() {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => {
                    let _ = interrupt.await;
                    return;
                }
            };
        tokio::select! {
            _ = interrupt => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = interrupt.await;
    }
    tracing::info!("shutdown signal received; draining");
}
