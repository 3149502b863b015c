//! `prefixctl`: parses the command line and hands it to the library.

use clap::Parser;

fn main() -> std::process::ExitCode {
    cli::main(cli::Cli::parse())
}
