//! `prefixctl`: the prefix-router command line, first user of the Rust SDK ([`proto::client`]).
//!
//! Map:
//! - [`args`]: the command line (clap derive); names follow CONTRACT.md's "CLI" section.
//! - [`variants`]: `--production-variants` (SageMaker-shaped JSON, inline or `file://`) to proto
//!   and back.
//! - [`commands`]: the API subcommands over the SDK.
//! - [`shapes`]: the `--output json` documents (PascalCase) and their table renderings;
//!   [`output`]: printing (tables, JSON, RFC 3339 times).
//! - [`up`]: the all-in-one local fleet (embedded control plane, data plane, engine-sim engines).
//! - [`top`]: `top`, the live view of the engines' cache reports per instance and placement
//!   rule, read from data planes' `/metrics`.
//! - [`bench`]: `bench` and `demo`: workloads, an in-process fleet per strategy, closed-loop load,
//!   the report (JSON, table, BENCHMARKS.md section, SVG plot).
//!
//! Invariants: with `--output json`, stdout carries exactly one JSON document (`routing-table
//! watch`: one per line, JSON Lines); every message goes to stderr. Exit codes: 0 ok, 1 API or
//! connection error, 2 usage error or invalid input (nothing was sent). An error is one line,
//! `error: ...`, naming the thing and the value; API errors carry the gRPC code and the server's
//! message as is.
//!
//! Adding a subcommand is one [`args::Command`] variant and one arm in [`run`].

pub mod args;
pub mod bench;
pub mod commands;
pub mod output;
pub mod shapes;
pub mod top;
pub mod up;
pub mod variants;

use std::process::ExitCode;

use clap::CommandFactory;

pub use args::{Cli, Command, OutputFormat};

/// Input the CLI rejected before sending anything (exit code 2).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InputError(pub String);

/// Exit code for input errors, as clap uses for usage errors.
pub const EXIT_USAGE: u8 = 2;
/// Exit code for API and connection errors (and everything else that failed).
pub const EXIT_FAILURE: u8 = 1;

/// Runs one parsed command line. An API command runs inside a `prefixctl <command>` span, whose
/// trace context the SDK sends with each call (so the control plane's spans join its trace).
pub async fn run(cli: Cli) -> anyhow::Result<()> {
    if let Some(name) = cli.command.api_name() {
        use tracing::Instrument as _;
        let span = tracing::info_span!("prefixctl", otel.name = name, otel.kind = "client");
        return run_command(cli).instrument(span).await;
    }
    run_command(cli).await
}

async fn run_command(cli: Cli) -> anyhow::Result<()> {
    match &cli.command {
        Command::EndpointConfig(c) => commands::endpoint_config(&cli, c).await,
        Command::Endpoint(c) => commands::endpoint(&cli, c).await,
        Command::Instance(c) => commands::instance(&cli, c).await,
        Command::RoutingTable(c) => commands::routing_table(&cli, c).await,
        Command::Up(a) => up::run(a, cli.output).await,
        Command::Bench(a) => bench::run((**a).clone()).await,
        Command::Demo(a) => bench::demo(a.clone()).await,
        Command::Top(a) => top::run(a, cli.output).await,
        Command::Completions(a) => {
            let mut out = Vec::new();
            clap_complete::generate(a.shell, &mut Cli::command(), "prefixctl", &mut out);
            output::write_stdout(&String::from_utf8_lossy(&out))
        }
    }
}

/// The whole program after argument parsing: runs `cli` on a tokio runtime, prints an error as
/// one `error: ...` line on stderr, and returns the exit code.
pub fn main(cli: Cli) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::from(EXIT_FAILURE);
        }
    };
    let result = runtime.block_on(async {
        // Logs (and traces, with --otlp-endpoint) for the API commands and `up`; `bench`,
        // `demo` and `top` keep stderr for their own messages (`bench` logs its routers too
        // when RUST_LOG asks for it). Dropped at the end: flushes the last spans.
        let _telemetry = match &cli.command {
            Command::Bench(_) if std::env::var_os("RUST_LOG").is_some() => {
                Some(cli.telemetry.init("prefixctl"))
            }
            Command::Bench(_) | Command::Demo(_) | Command::Top(_) | Command::Completions(_) => {
                None
            }
            _ => Some(cli.telemetry.init("prefixctl")),
        };
        run(cli).await
    });
    // Servers started by `up` have stopped; do not wait on stray blocking tasks.
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", one_line(&e));
            ExitCode::from(exit_code(&e))
        }
    }
}

/// An error and its causes as one line, `a: b: c`, leaving out a cause whose text the part
/// before it already carries (errors that print their source too).
pub fn one_line(e: &anyhow::Error) -> String {
    let mut line = String::new();
    let mut last = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if last.contains(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
        last = text;
    }
    line.replace('\n', " ")
}

/// 2 for input the CLI rejected, 1 for everything else.
pub fn exit_code(e: &anyhow::Error) -> u8 {
    if e.chain().any(|c| c.is::<InputError>()) {
        EXIT_USAGE
    } else {
        EXIT_FAILURE
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_print_as_one_line_without_repeats() {
        #[derive(Debug, thiserror::Error)]
        #[error("storage error: {0}")]
        struct Wrapping(#[source] std::io::Error);
        let e = anyhow::Error::new(Wrapping(std::io::Error::other("locked")))
            .context("cannot open data dir /d");
        assert_eq!(
            one_line(&e),
            "cannot open data dir /d: storage error: locked"
        );
        let input = anyhow::Error::new(InputError("bad".into()));
        assert_eq!(exit_code(&input), EXIT_USAGE);
        assert_eq!(exit_code(&anyhow::anyhow!("x")), EXIT_FAILURE);
    }
}
