//! The API subcommands: each parses its input, makes its calls through the SDK
//! ([`proto::client::Client`]) and prints one result.

use futures_util::StreamExt;
use proto::client::{Client, ClientOptions, TlsOptions};
use proto::PrefixAwareRoutingConfig;

use crate::args::{
    Cli, EndpointCommand, EndpointConfigCommand, InstanceCommand, OutputFormat,
    RoutingTableCommand, UpdateEndpointConfigArgs, WatchArgs,
};
use crate::output::{emit, emit_json_line, Report};
use crate::shapes::{
    EndpointConfigDoc, EndpointConfigList, EndpointDescriptionDoc, EndpointDoc, EndpointList,
    InstanceDoc, RoutingTableDoc,
};
use crate::variants::{load_production_variants, parse_strategy};

/// Connects to `--control-plane` with `--bearer-token` (or `--bearer-token-file`) and the TLS
/// flags.
pub async fn connect(cli: &Cli) -> Result<Client, proto::client::Error> {
    let bearer_token = match (&cli.bearer_token, &cli.bearer_token_file) {
        (Some(t), _) => Some(t.clone()),
        (None, Some(path)) => Some(credentials::read_first(path).map_err(|e| {
            proto::client::Error::InvalidToken(format!("--bearer-token-file: {e}"))
        })?),
        (None, None) => None,
    };
    let identity = cli.tls_cert.as_deref().zip(cli.tls_key.as_deref());
    let options = ClientOptions {
        bearer_token,
        tls: TlsOptions::from_files(cli.ca_cert.as_deref(), identity)?,
        ..ClientOptions::default()
    };
    Client::connect_with(cli.control_plane.as_str(), options).await
}

pub async fn endpoint_config(cli: &Cli, command: &EndpointConfigCommand) -> anyhow::Result<()> {
    // Check local input before connecting: bad input is a usage error whether or not the
    // control plane is up.
    match command {
        EndpointConfigCommand::Create(a) => {
            let variants = load_production_variants(&a.production_variants)?;
            let config = connect(cli)
                .await?
                .create_endpoint_config(&a.endpoint_config_name, variants)
                .await?;
            emit(cli.output, &EndpointConfigDoc::from(&config))
        }
        EndpointConfigCommand::Update(a) => update_endpoint_config(cli, a).await,
        EndpointConfigCommand::Describe(a) => {
            let d = connect(cli)
                .await?
                .describe_endpoint_config(&a.endpoint_config_name, a.revision)
                .await?;
            emit(cli.output, &EndpointConfigDoc::from(&d))
        }
        EndpointConfigCommand::List => {
            let configs = connect(cli).await?.list_endpoint_configs().await?;
            emit(
                cli.output,
                &EndpointConfigList {
                    endpoint_configs: configs.iter().map(EndpointConfigDoc::from).collect(),
                },
            )
        }
        EndpointConfigCommand::Delete(a) => {
            connect(cli)
                .await?
                .delete_endpoint_config(&a.endpoint_config_name)
                .await?;
            done(
                cli.output,
                &format!("deleted endpoint config {:?}", a.endpoint_config_name),
            )
        }
    }
}

async fn update_endpoint_config(cli: &Cli, a: &UpdateEndpointConfigArgs) -> anyhow::Result<()> {
    let updated = match (&a.production_variants, &a.variant_name, &a.routing_strategy) {
        (Some(doc), _, _) => {
            let variants = load_production_variants(doc)?;
            connect(cli)
                .await?
                .update_endpoint_config(&a.endpoint_config_name, variants, a.expected_revision)
                .await?
        }
        (None, Some(variant), Some(strategy)) => {
            let strategy = parse_strategy(strategy, variant)?;
            let prefix =
                (a.prefix_length.is_some() || a.concurrency_threshold.is_some()).then(|| {
                    PrefixAwareRoutingConfig {
                        prefix_length: a.prefix_length.unwrap_or(0),
                        concurrency_threshold: a.concurrency_threshold.unwrap_or(0),
                        ..Default::default()
                    }
                });
            connect(cli)
                .await?
                .set_variant_routing_strategy(&a.endpoint_config_name, variant, strategy, prefix)
                .await?
        }
        // clap's argument groups rule this out.
        _ => anyhow::bail!(crate::InputError(
            "give --production-variants, or --variant-name with --routing-strategy".into()
        )),
    };
    emit(cli.output, &EndpointConfigDoc::from(&updated))
}

pub async fn endpoint(cli: &Cli, command: &EndpointCommand) -> anyhow::Result<()> {
    let client = connect(cli).await?;
    match command {
        EndpointCommand::Create(a) => {
            let e = client
                .create_endpoint(&a.endpoint_name, &a.endpoint_config_name)
                .await?;
            emit(cli.output, &EndpointDoc::from(&e))
        }
        EndpointCommand::Update(a) => {
            let e = client
                .update_endpoint(&a.endpoint_name, &a.endpoint_config_name)
                .await?;
            emit(cli.output, &EndpointDoc::from(&e))
        }
        EndpointCommand::Describe(a) => {
            let d = client.describe_endpoint(&a.endpoint_name).await?;
            emit(cli.output, &EndpointDescriptionDoc::from(&d))
        }
        EndpointCommand::List => {
            let endpoints = client.list_endpoints().await?;
            emit(
                cli.output,
                &EndpointList {
                    endpoints: endpoints.iter().map(EndpointDoc::from).collect(),
                },
            )
        }
        EndpointCommand::Delete(a) => {
            client.delete_endpoint(&a.endpoint_name).await?;
            done(
                cli.output,
                &format!("deleted endpoint {:?}", a.endpoint_name),
            )
        }
    }
}

pub async fn instance(cli: &Cli, command: &InstanceCommand) -> anyhow::Result<()> {
    let client = connect(cli).await?;
    match command {
        InstanceCommand::Register(a) => {
            let i = client
                .register_instance(
                    &a.endpoint_name,
                    &a.variant_name,
                    &a.address,
                    a.lease_ttl_seconds,
                )
                .await?;
            emit(cli.output, &InstanceDoc::from(&i))
        }
        InstanceCommand::Deregister(a) => {
            client.deregister_instance(&a.instance_id).await?;
            done(
                cli.output,
                &format!("deregistered instance {:?}", a.instance_id),
            )
        }
        InstanceCommand::Renew(a) => {
            let i = client.renew_instance_lease(&a.instance_id).await?;
            emit(cli.output, &InstanceDoc::from(&i))
        }
    }
}

pub async fn routing_table(cli: &Cli, command: &RoutingTableCommand) -> anyhow::Result<()> {
    match command {
        RoutingTableCommand::Watch(a) => watch(cli, a).await,
    }
}

/// Prints each version as it arrives, until Ctrl-C, `--count` versions, or the server closes.
async fn watch(cli: &Cli, a: &WatchArgs) -> anyhow::Result<()> {
    let node_id = a
        .node_id
        .clone()
        .unwrap_or_else(|| format!("prefixctl-watch-{}", std::process::id()));
    let client = connect(cli).await?;
    let mut tables = client.watch_routing_table(&node_id).await?;
    eprintln!(
        "watching routing tables at {} as node {node_id:?} (Ctrl-C stops)",
        client.url()
    );
    let mut seen = 0u64;
    let interrupted = control_plane::shutdown_signal();
    tokio::pin!(interrupted);
    while a.count.is_none_or(|n| seen < n) {
        let table = tokio::select! {
            _ = &mut interrupted => break,
            next = tables.next() => match next {
                Some(t) => t?,
                None => {
                    eprintln!("the control plane closed the watch");
                    return Ok(());
                }
            },
        };
        let doc = RoutingTableDoc::from(&table);
        match cli.output {
            OutputFormat::Json => emit_json_line(&doc)?,
            OutputFormat::Table => crate::output::write_stdout(&doc.table())?,
        }
        seen += 1;
    }
    // Let the last ACK through, so rollout status shows what this watcher received.
    tables.close().await;
    Ok(())
}

/// A call that returns nothing: `{}` for scripts, a line on stderr for people.
fn done(format: OutputFormat, message: &str) -> anyhow::Result<()> {
    match format {
        OutputFormat::Json => crate::output::write_stdout("{}\n"),
        OutputFormat::Table => {
            eprintln!("{message}");
            Ok(())
        }
    }
}
