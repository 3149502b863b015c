use clap::Parser;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let config = control_plane::Config::parse();
    let _telemetry = config.telemetry.init("control-plane");
    // The store first: a locked or unusable data dir fails before anything is announced.
    let (store, options) = match control_plane::prepare(&config).await {
        Ok(prepared) => prepared,
        Err(e) => {
            eprintln!("control-plane: {e:#}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let listener = match tokio::net::TcpListener::bind(config.listen).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("control-plane: cannot listen on {}: {e}", config.listen);
            return std::process::ExitCode::FAILURE;
        }
    };
    if let Ok(addr) = listener.local_addr() {
        eprintln!("control-plane listening on {addr}");
    }
    if let Some(Ok(addr)) = options.metrics_listener.as_ref().map(|l| l.local_addr()) {
        eprintln!("control-plane metrics listening on {addr}");
    }
    let shutdown = control_plane::shutdown_signal();
    match control_plane::serve_with(listener, store, options, shutdown).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("control-plane: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
