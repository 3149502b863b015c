use clap::Parser;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let config = control_plane::Config::parse();
    let _telemetry = config.telemetry.init("control-plane");
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
