//! `data-plane`: flags, logging to stderr, bind, serve until SIGINT/SIGTERM, drain.

use std::process::ExitCode;

use clap::Parser;
use data_plane::Config;

#[tokio::main]
async fn main() -> ExitCode {
    let config = Config::parse();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let listener = match tokio::net::TcpListener::bind(&config.listen).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("data-plane: cannot listen on {}: {e}", config.listen);
            return ExitCode::FAILURE;
        }
    };
    match data_plane::serve(listener, config, shutdown_signal()).await {
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
        let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
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
