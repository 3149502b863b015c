//! The `engine-sim` binary: flags, logs (and traces) via `telemetry`, listening socket, signals.
//! All else is the library.

use std::process::ExitCode;

use clap::Parser;
use engine_sim::Config;

fn main() -> ExitCode {
    let config = Config::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("engine-sim: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(run(config))
}

async fn run(config: Config) -> ExitCode {
    // Inside the runtime: the trace exporter's connection lives on it. Dropped (flushing the
    // last spans) before the runtime is.
    let _telemetry = config.telemetry.init("engine-sim");
    let listener = match tokio::net::TcpListener::bind(&config.listen).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!(
                "engine-sim: cannot listen on {}: {}",
                config.listen,
                without_os_code(&e)
            );
            return ExitCode::FAILURE;
        }
    };
    match listener.local_addr() {
        Ok(addr) => {
            tracing::info!(%addr, model = %config.model_name, "engine-sim listening");
            // The same line as the other servers', for scripts and tests that start it on port 0.
            eprintln!("engine-sim listening on {addr}");
        }
        Err(e) => tracing::info!(error = %e, "engine-sim listening (address unknown)"),
    }
    match engine_sim::serve(listener, config, shutdown_signal()).await {
        Ok(()) => {
            tracing::info!("engine-sim stopped");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("engine-sim: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// "Address already in use (os error 98)" -> "Address already in use".
fn without_os_code(e: &std::io::Error) -> String {
    let s = e.to_string();
    match s.rfind(" (os error ") {
        Some(i) if s.ends_with(')') => s[..i].to_owned(),
        _ => s,
    }
}

/// Completes on SIGINT or SIGTERM.
async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
    tracing::info!("shutdown signal received, draining");
}
