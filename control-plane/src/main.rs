use clap::Parser;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let config = control_plane::Config::parse();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
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
    match control_plane::serve(listener, config, control_plane::shutdown_signal()).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("control-plane: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
