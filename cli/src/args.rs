//! The command line (clap derive). Names follow CONTRACT.md's "CLI" section exactly; each
//! subcommand group mirrors a SageMaker CLI verb (`create-endpoint-config` is
//! `endpoint-config create` here).

use std::path::PathBuf;

use clap::{ArgGroup, Args, Parser, Subcommand, ValueEnum};

/// Default control-plane URL (`--control-plane`, env `PREFIX_ROUTER_CONTROL_PLANE`).
pub const DEFAULT_CONTROL_PLANE: &str = "http://127.0.0.1:7070";

#[derive(Debug, Clone, Parser)]
#[command(
    name = "prefixctl",
    version,
    propagate_version = true,
    about = "prefix-router command line: endpoint configs, endpoints, instances, routing tables, and a local fleet",
    after_help = "Exit codes: 0 ok, 1 API or connection error (the server's message, with its gRPC code), \
                  2 usage error or invalid input (nothing was sent).\n\
                  With --output json, stdout carries exactly one JSON document (routing-table watch: one per line); \
                  messages go to stderr."
)]
pub struct Cli {
    /// Control-plane gRPC URL; several, comma-separated (replicas), are tried in order.
    #[arg(long, global = true, value_name = "URL", env = "PREFIX_ROUTER_CONTROL_PLANE", default_value = DEFAULT_CONTROL_PLANE)]
    pub control_plane: String,

    /// Output format: a readable table, or JSON (SageMaker-like PascalCase) for scripts.
    #[arg(long, global = true, value_enum, default_value_t = OutputFormat::Table)]
    pub output: OutputFormat,

    /// Bearer token sent with every call (`authorization: Bearer TOKEN`), for a control plane
    /// started with --auth-token-file (or behind an authenticating proxy).
    #[arg(
        long,
        global = true,
        value_name = "TOKEN",
        env = "PREFIX_ROUTER_TOKEN",
        hide_env_values = true,
        conflicts_with = "bearer_token_file"
    )]
    pub bearer_token: Option<String>,

    /// Like --bearer-token, read from the first line of a file (`prefixctl up` prints its path).
    #[arg(
        long,
        global = true,
        value_name = "PATH",
        env = "PREFIX_ROUTER_TOKEN_FILE"
    )]
    pub bearer_token_file: Option<std::path::PathBuf>,

    /// PEM CA certificate to trust for an https:// control plane (default: the system's roots).
    #[arg(long, global = true, value_name = "PEM")]
    pub ca_cert: Option<std::path::PathBuf>,

    /// PEM client certificate for a control plane that requires mutual TLS (with --tls-key).
    #[arg(long, global = true, value_name = "PEM", requires = "tls_key")]
    pub tls_cert: Option<std::path::PathBuf>,

    /// PEM private key of --tls-cert.
    #[arg(long, global = true, value_name = "PEM", requires = "tls_cert")]
    pub tls_key: Option<std::path::PathBuf>,

    /// Logs on stderr and traces of the API commands and `up` (`bench` and `demo` log nothing).
    #[command(flatten)]
    pub telemetry: telemetry::TelemetryArgs,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OutputFormat {
    Table,
    Json,
}

#[derive(Debug, Clone, Subcommand)]
pub enum Command {
    /// Endpoint configs: named, revisioned lists of production variants.
    #[command(subcommand)]
    EndpointConfig(EndpointConfigCommand),
    /// Endpoints: names that route with an endpoint config.
    #[command(subcommand)]
    Endpoint(EndpointCommand),
    /// Model servers that join a variant under a lease.
    #[command(subcommand)]
    Instance(InstanceCommand),
    /// The versioned routing tables the data planes receive.
    #[command(subcommand)]
    RoutingTable(RoutingTableCommand),
    /// All-in-one local fleet: control plane (embedded), data plane and simulated engines.
    Up(UpArgs),
    /// The fleet benchmark: each strategy on a fresh simulated fleet, compared (see BENCHMARKS.md).
    Bench(Box<crate::bench::BenchArgs>),
    /// A short live demo: RANDOM, then PREFIX_AWARE switched in with UpdateEndpointConfig, side by side.
    Demo(crate::bench::DemoArgs),
    /// A live view of the engines' prefix-cache reports, read from data planes' /metrics: per
    /// instance and placement rule, the share of prompt tokens served from cache, and what the
    /// PREFIX_AWARE prefix index holds of each instance.
    Top(TopArgs),
    /// Prints a shell completion script (e.g. `prefixctl completions bash > /etc/bash_completion.d/prefixctl`).
    Completions(CompletionsArgs),
}

impl Command {
    /// `endpoint-config create`, ...: the name of an API command (its trace's root span), `None`
    /// for the others.
    pub fn api_name(&self) -> Option<&'static str> {
        Some(match self {
            Command::EndpointConfig(c) => match c {
                EndpointConfigCommand::Create(_) => "endpoint-config create",
                EndpointConfigCommand::Update(_) => "endpoint-config update",
                EndpointConfigCommand::Describe(_) => "endpoint-config describe",
                EndpointConfigCommand::List => "endpoint-config list",
                EndpointConfigCommand::Delete(_) => "endpoint-config delete",
            },
            Command::Endpoint(c) => match c {
                EndpointCommand::Create(_) => "endpoint create",
                EndpointCommand::Update(_) => "endpoint update",
                EndpointCommand::Describe(_) => "endpoint describe",
                EndpointCommand::List => "endpoint list",
                EndpointCommand::Delete(_) => "endpoint delete",
            },
            Command::Instance(c) => match c {
                InstanceCommand::Register(_) => "instance register",
                InstanceCommand::Deregister(_) => "instance deregister",
                InstanceCommand::Renew(_) => "instance renew",
            },
            Command::RoutingTable(RoutingTableCommand::Watch(_)) => "routing-table watch",
            Command::Up(_)
            | Command::Bench(_)
            | Command::Demo(_)
            | Command::Top(_)
            | Command::Completions(_) => return None,
        })
    }
}

#[derive(Debug, Clone, Subcommand)]
pub enum EndpointConfigCommand {
    /// Creates an endpoint config (revision 1).
    Create(CreateEndpointConfigArgs),
    /// Writes a new revision: all variants (--production-variants), or one variant's strategy
    /// (--variant-name with --routing-strategy).
    Update(UpdateEndpointConfigArgs),
    /// Shows a config's variants (the latest revision, or --revision N).
    Describe(DescribeEndpointConfigArgs),
    /// Lists endpoint configs.
    List,
    /// Deletes an endpoint config that no endpoint uses.
    Delete(EndpointConfigName),
}

#[derive(Debug, Clone, Args)]
pub struct EndpointConfigName {
    /// Name of the endpoint config.
    #[arg(long, value_name = "NAME")]
    pub endpoint_config_name: String,
}

#[derive(Debug, Clone, Args)]
pub struct CreateEndpointConfigArgs {
    /// Name of the endpoint config.
    #[arg(long, value_name = "NAME")]
    pub endpoint_config_name: String,
    /// SageMaker-shaped ProductionVariants JSON, inline or as file://PATH, e.g.
    /// '[{"VariantName":"v1","ModelName":"llama","Instances":["http://127.0.0.1:9001"],
    /// "RoutingConfig":{"RoutingStrategy":"PREFIX_AWARE"}}]'.
    #[arg(long, value_name = "JSON|file://PATH")]
    pub production_variants: String,
}

#[derive(Debug, Clone, Args)]
#[command(group(ArgGroup::new("change").required(true).args(["production_variants", "routing_strategy"])))]
pub struct UpdateEndpointConfigArgs {
    /// Name of the endpoint config.
    #[arg(long, value_name = "NAME")]
    pub endpoint_config_name: String,
    /// The new variants (replace all), as for `create`.
    #[arg(long, value_name = "JSON|file://PATH", conflicts_with_all = ["variant_name", "routing_strategy"])]
    pub production_variants: Option<String>,
    /// With --production-variants: write only if the latest revision is still N.
    #[arg(long, value_name = "N", requires = "production_variants")]
    pub expected_revision: Option<u64>,
    /// Shortcut: the variant whose routing strategy changes.
    #[arg(long, value_name = "VARIANT", requires = "routing_strategy")]
    pub variant_name: Option<String>,
    /// Shortcut: RANDOM, LEAST_OUTSTANDING_REQUESTS or PREFIX_AWARE.
    #[arg(long, value_name = "STRATEGY", requires = "variant_name")]
    pub routing_strategy: Option<String>,
    /// Shortcut: PREFIX_AWARE prefix length (64..=65536); default: keep the variant's.
    #[arg(long, value_name = "N", requires = "routing_strategy")]
    pub prefix_length: Option<u32>,
    /// Shortcut: PREFIX_AWARE concurrency threshold (1..=4096); default: keep the variant's.
    #[arg(long, value_name = "N", requires = "routing_strategy")]
    pub concurrency_threshold: Option<u32>,
}

#[derive(Debug, Clone, Args)]
pub struct DescribeEndpointConfigArgs {
    /// Name of the endpoint config.
    #[arg(long, value_name = "NAME")]
    pub endpoint_config_name: String,
    /// A past revision (default: the latest).
    #[arg(long, value_name = "N")]
    pub revision: Option<u64>,
}

#[derive(Debug, Clone, Subcommand)]
pub enum EndpointCommand {
    /// Creates an endpoint routing with an endpoint config.
    Create(EndpointArgs),
    /// Points an endpoint at another config (or its config's latest revision).
    Update(EndpointArgs),
    /// Shows an endpoint, its variants, and per data plane the routing-table version it applied.
    Describe(EndpointName),
    /// Lists endpoints.
    List,
    /// Deletes an endpoint.
    Delete(EndpointName),
}

#[derive(Debug, Clone, Args)]
pub struct EndpointArgs {
    /// Name of the endpoint.
    #[arg(long, value_name = "NAME")]
    pub endpoint_name: String,
    /// Name of the endpoint config.
    #[arg(long, value_name = "NAME")]
    pub endpoint_config_name: String,
}

#[derive(Debug, Clone, Args)]
pub struct EndpointName {
    /// Name of the endpoint.
    #[arg(long, value_name = "NAME")]
    pub endpoint_name: String,
}

#[derive(Debug, Clone, Subcommand)]
pub enum InstanceCommand {
    /// Adds a model server to an endpoint's variant under a lease.
    Register(RegisterInstanceArgs),
    /// Removes a registered instance.
    Deregister(InstanceId),
    /// Renews a registered instance's lease for another lease length.
    Renew(InstanceId),
}

#[derive(Debug, Clone, Args)]
pub struct RegisterInstanceArgs {
    /// Name of the endpoint.
    #[arg(long, value_name = "NAME")]
    pub endpoint_name: String,
    /// The production variant the instance joins.
    #[arg(long, value_name = "VARIANT")]
    pub variant_name: String,
    /// The model server's base URL.
    #[arg(long, value_name = "http://HOST:PORT")]
    pub address: String,
    /// Lease length in seconds (1..=3600); 0 = the control plane's default (30).
    #[arg(long, value_name = "SECONDS", default_value_t = 0)]
    pub lease_ttl_seconds: u32,
}

#[derive(Debug, Clone, Args)]
pub struct InstanceId {
    /// The id RegisterInstance returned.
    #[arg(long, value_name = "UUID")]
    pub instance_id: String,
}

#[derive(Debug, Clone, Subcommand)]
pub enum RoutingTableCommand {
    /// Prints each routing-table version as it streams (until Ctrl-C). With --output json: one
    /// JSON object per line per version (JSON Lines), the one exception to one document.
    Watch(WatchArgs),
}

#[derive(Debug, Clone, Args)]
pub struct WatchArgs {
    /// Node id to watch as (it shows up in `endpoint describe` like a data plane).
    /// Default: prefixctl-watch-PID.
    #[arg(long, value_name = "ID")]
    pub node_id: Option<String>,
    /// Stop after this many versions.
    #[arg(long, value_name = "N")]
    pub count: Option<u64>,
}

#[derive(Debug, Clone, Args)]
pub struct UpArgs {
    /// Data-plane HTTP address (port 0: any free port).
    #[arg(long, value_name = "HOST:PORT", default_value = "127.0.0.1:8080")]
    pub listen: String,
    /// Control-plane gRPC address (port 0: any free port).
    #[arg(long, value_name = "HOST:PORT", default_value = "127.0.0.1:7070")]
    pub control_plane_listen: String,
    /// Where the embedded control plane keeps its state (in DIR/control-plane).
    #[arg(long, value_name = "DIR", default_value = "./.prefix-router")]
    pub data_dir: PathBuf,
    /// Number of simulated engines (engine-sim).
    #[arg(long, value_name = "N", default_value_t = 7, value_parser = clap::value_parser!(u16).range(1..=256))]
    pub engines: u16,
    /// Engines listen on consecutive ports from this one (0: any free ports).
    #[arg(long, value_name = "PORT", default_value_t = 9001)]
    pub engine_base_port: u16,
    /// Routing strategy of variant v1: RANDOM, LEAST_OUTSTANDING_REQUESTS or PREFIX_AWARE.
    #[arg(long, value_name = "STRATEGY", default_value = "RANDOM")]
    pub routing_strategy: String,
    /// Multiplies the engines' simulated durations (0.1 runs ten times faster than real time).
    #[arg(long, value_name = "F", default_value_t = 1.0)]
    pub time_scale: f64,
}

#[derive(Debug, Clone, Args)]
#[command(
    after_help = "Per endpoint and variant: per instance, requests/s, requests in flight, prompt \
                        tokens/s and HIT, the share of prompt tokens the engine reported served from its \
                        cache (NOW: over the last interval; TOTAL: since the routers started); per placement \
                        rule (decision), prompt tokens and HIT; and for PREFIX_AWARE, the blocks (of 256 \
                        prompt characters) each router's prefix index lists on the instance against the \
                        capacity it learnt from the engine's reports (the mean over the routers), and whether \
                        that index is exact (fed by the engine's KV events) or inferred. Counters \
                        are summed over the routers. A router that does not answer is \
                        named in one line; --once fails only when none answers."
)]
pub struct TopArgs {
    /// Data-plane base URLs (their GET /metrics is read), comma-separated; the view sums them.
    #[arg(
        long,
        value_name = "URL[,URL...]",
        required = true,
        value_delimiter = ','
    )]
    pub router_url: Vec<String>,
    /// Seconds between refreshes (0.1 to 3600).
    #[arg(long, value_name = "SECS", default_value_t = 2.0)]
    pub interval: f64,
    /// Print one snapshot of the cumulative counters and exit (with --output json: one JSON
    /// document). Without it, refreshes until Ctrl-C (the screen is cleared between refreshes on
    /// a terminal; with --output json, one JSON object per line).
    #[arg(long)]
    pub once: bool,
}

#[derive(Debug, Clone, Args)]
pub struct CompletionsArgs {
    /// bash, zsh, fish, elvish or powershell.
    #[arg(value_enum)]
    pub shell: clap_complete::Shell,
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn command_line_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn update_takes_variants_or_the_strategy_shortcut() {
        let parse = |args: &[&str]| {
            Cli::try_parse_from(
                [
                    "prefixctl",
                    "endpoint-config",
                    "update",
                    "--endpoint-config-name",
                    "c",
                ]
                .iter()
                .chain(args),
            )
        };
        assert!(parse(&["--production-variants", "[]"]).is_ok());
        assert!(parse(&["--variant-name", "v1", "--routing-strategy", "RANDOM"]).is_ok());
        assert!(parse(&[]).is_err(), "one of the two forms is required");
        assert!(
            parse(&["--variant-name", "v1"]).is_err(),
            "variant without strategy"
        );
        assert!(
            parse(&["--routing-strategy", "RANDOM"]).is_err(),
            "strategy without variant"
        );
        assert!(parse(&[
            "--production-variants",
            "[]",
            "--variant-name",
            "v1",
            "--routing-strategy",
            "RANDOM"
        ])
        .is_err());
    }

    #[test]
    fn top_takes_several_router_urls() {
        let cli = Cli::try_parse_from([
            "prefixctl",
            "top",
            "--router-url",
            "http://a:1,http://b:2",
            "--router-url",
            "http://c:3",
            "--once",
            "--output",
            "json",
        ])
        .unwrap();
        let Command::Top(top) = cli.command else {
            panic!("not top: {:?}", cli.command)
        };
        assert_eq!(top.router_url, ["http://a:1", "http://b:2", "http://c:3"]);
        assert_eq!(top.interval, 2.0);
        assert!(top.once);
        assert_eq!(cli.output, OutputFormat::Json);
        assert!(
            Cli::try_parse_from(["prefixctl", "top"]).is_err(),
            "--router-url is required"
        );
    }

    #[test]
    fn global_flags_go_anywhere() {
        let cli = Cli::try_parse_from([
            "prefixctl",
            "endpoint",
            "list",
            "--output",
            "json",
            "--control-plane",
            "http://cp:1",
        ])
        .unwrap();
        assert_eq!(cli.output, OutputFormat::Json);
        assert_eq!(cli.control_plane, "http://cp:1");
    }
}
