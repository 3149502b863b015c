//! Logs and traces for every prefix-router binary, set up in one call: [`init`].
//!
//! Map:
//! - [`init`] / [`Guard`]: a `tracing` subscriber with two independently filtered layers:
//!   - logs: `tracing-subscriber`'s fmt layer on stderr, text or JSON ([`LogFormat`]), filtered by
//!     `RUST_LOG` (default `info`). It takes **events only**: spans are for traces.
//!   - traces (only when an OTLP endpoint is given, `--otlp-endpoint` or
//!     `OTEL_EXPORTER_OTLP_ENDPOINT`): a `tracing-opentelemetry` layer over an OTLP gRPC (tonic)
//!     exporter behind a batch span processor, taking spans (and the events inside them) at
//!     `info` and above. The SDK reads `OTEL_SERVICE_NAME` / `OTEL_RESOURCE_ATTRIBUTES`, the
//!     sampler (`OTEL_TRACES_SAMPLER`, `OTEL_TRACES_SAMPLER_ARG`) and the batch settings
//!     (`OTEL_BSP_*`) itself; without a service name it uses the binary's.
//! - [`TelemetryArgs`]: the `--log-format` and `--otlp-endpoint` flags, flattened into each
//!   binary's clap settings.
//! - [`propagation`]: W3C trace context (`traceparent`, `tracestate`) in and out of HTTP headers.
//!
//! Invariants:
//! - With export off no layer wants a span, so `info_span!` on the request path is a disabled
//!   span: one cached-interest check, no allocation, and `Span::is_disabled` is true (the request
//!   path checks it before doing any propagation work).
//! - Export never blocks or fails a request: finished spans go into the batch processor's bounded
//!   queue (dropped when it is full) and are sent from its own thread, with the exporter's
//!   timeout; an unreachable collector costs a failed export every batch interval, nothing more.
//! - The W3C TraceContext propagator is installed globally whether or not export is on.

use std::io::IsTerminal as _;
use std::time::Duration;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry::KeyValue;
use opentelemetry_otlp::WithExportConfig as _;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{SdkTracerProvider, SpanExporter};
use opentelemetry_sdk::Resource;
use tracing::subscriber::Interest;
use tracing::Metadata;
use tracing_subscriber::filter::{EnvFilter, FilterExt as _, LevelFilter};
use tracing_subscriber::layer::{Context, Filter, SubscriberExt as _};
use tracing_subscriber::util::SubscriberInitExt as _;
use tracing_subscriber::{Layer as _, Registry};

pub mod exposition;
pub mod propagation;

/// How long dropping the [`Guard`] waits for the last spans to be exported.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(5);

/// Log line format on stderr.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines (colored on a terminal).
    #[default]
    Text,
    /// One JSON object per line (`timestamp`, `level`, `target`, `message` and the event's fields).
    Json,
}

/// `--log-format` and `--otlp-endpoint`, for a binary's clap settings (`#[command(flatten)]`;
/// global, so a CLI with subcommands takes them anywhere on its command line).
#[derive(Debug, Clone, Default, PartialEq, Eq, clap::Args)]
pub struct TelemetryArgs {
    /// Log format on stderr (filter with RUST_LOG, default info).
    #[arg(long, global = true, value_enum, value_name = "FORMAT", default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,

    /// OTLP gRPC endpoint to export traces to, e.g. http://localhost:4317 (Jaeger, an OpenTelemetry
    /// collector). Unset: no traces. OTEL_SERVICE_NAME and OTEL_TRACES_SAMPLER(_ARG) apply.
    #[arg(
        long,
        global = true,
        value_name = "URL",
        env = "OTEL_EXPORTER_OTLP_ENDPOINT"
    )]
    pub otlp_endpoint: Option<String>,
}

impl TelemetryArgs {
    /// [`init`] with these flags.
    pub fn init(&self, service_name_default: &str) -> Guard {
        init(
            service_name_default,
            self.log_format,
            self.otlp_endpoint.clone(),
        )
    }
}

/// Keeps the trace pipeline alive; dropping it exports the spans still queued (waiting at most
/// 5 s) and shuts the exporter down. Hold it for the life of `main`, inside the tokio runtime.
#[must_use = "dropping the guard shuts trace export down"]
#[derive(Debug, Default)]
pub struct Guard {
    provider: Option<SdkTracerProvider>,
}

impl Guard {
    /// True when spans are exported.
    pub fn exporting(&self) -> bool {
        self.provider.is_some()
    }

    /// Exports every finished span now. Blocks the calling thread until the export is done or has
    /// failed, so call it from a blocking context (`spawn_blocking`), not from a runtime thread.
    pub fn force_flush(&self) {
        if let Some(p) = &self.provider {
            if let Err(e) = p.force_flush() {
                tracing::warn!(error = %e, "flushing traces failed");
            }
        }
    }
}

impl From<SdkTracerProvider> for Guard {
    /// A guard for a provider built with [`tracer_provider`] and installed by the caller.
    fn from(provider: SdkTracerProvider) -> Self {
        Guard {
            provider: Some(provider),
        }
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        if let Some(p) = self.provider.take() {
            // Export errors were already reported by the exporter; nothing useful to add at exit.
            let _ = p.shutdown_with_timeout(SHUTDOWN_TIMEOUT);
        }
    }
}

/// Installs the global subscriber (logs, and traces when `otlp_endpoint` is set) and the W3C
/// TraceContext propagator. `service_name_default` names the service in traces unless
/// `OTEL_SERVICE_NAME` (or `service.name` in `OTEL_RESOURCE_ATTRIBUTES`) does.
///
/// Call once, early in `main`, from inside a tokio runtime when exporting (the gRPC exporter's
/// connection lives on it). A second call (or a subscriber someone else installed) leaves the
/// first in place. A bad endpoint is reported on stderr and the program goes on without traces.
pub fn init(
    service_name_default: &str,
    log_format: LogFormat,
    otlp_endpoint: Option<String>,
) -> Guard {
    install_propagator();

    let mut export_error = None;
    let provider = match otlp_endpoint
        .as_deref()
        .map(str::trim)
        .filter(|e| !e.is_empty())
    {
        None => None,
        Some(endpoint) => match otlp_exporter(endpoint) {
            Ok(exporter) => Some(tracer_provider(service_name_default, exporter)),
            Err(e) => {
                export_error = Some(format!("traces are not exported: {e}"));
                None
            }
        },
    };

    let logs = log_layer(log_format);
    let traces = provider.as_ref().map(trace_layer);
    let installed = Registry::default()
        .with(logs)
        .with(traces)
        .try_init()
        .is_ok();

    if let Some(e) = export_error {
        if installed {
            tracing::error!("{e}");
        } else {
            eprintln!("{e}");
        }
    }
    match provider {
        Some(p) if installed => {
            opentelemetry::global::set_tracer_provider(p.clone());
            tracing::debug!(
                endpoint = otlp_endpoint.as_deref().unwrap_or_default(),
                "exporting traces over OTLP/gRPC"
            );
            Guard { provider: Some(p) }
        }
        Some(p) => {
            // Someone else's subscriber is in place: our layer is not in it, so export nothing.
            let _ = p.shutdown_with_timeout(Duration::ZERO);
            Guard::default()
        }
        None => Guard::default(),
    }
}

/// Installs the W3C TraceContext propagator globally (what [`init`] does first).
pub fn install_propagator() {
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
}

/// The trace layer [`init`] installs over `provider`: spans (and the events inside them) at `info`
/// and above. The exporter's own gRPC client logs nothing at that level, so exporting never feeds
/// itself. Public so that a benchmark can stack a filter on it and switch export on and off within
/// one run.
///
/// A span carries its own fields and the `target`; not `tracing-opentelemetry`'s default extras
/// (code file, module and line; thread id and name; busy and idle time). Those were seven more
/// attributes on every span, one of them an allocated string, encoded by the router and decoded by
/// the collector, for nothing an operator reads in a request's trace.
pub fn trace_layer<S>(provider: &SdkTracerProvider) -> impl tracing_subscriber::Layer<S>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    tracing_opentelemetry::layer()
        .with_tracer(provider.tracer("prefix-router"))
        .with_location(false)
        .with_threads(false)
        .with_tracked_inactivity(false)
        .with_filter(LevelFilter::INFO)
}

/// The fmt layer: events only (see [`EventsOnly`]), filtered by `RUST_LOG` (default `info`).
fn log_layer<S>(format: LogFormat) -> Box<dyn tracing_subscriber::Layer<S> + Send + Sync>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new("info"))
        .and(EventsOnly);
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    match format {
        LogFormat::Text => fmt
            .with_ansi(std::io::stderr().is_terminal())
            .with_filter(filter)
            .boxed(),
        LogFormat::Json => fmt
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .with_span_list(false)
            .with_filter(filter)
            .boxed(),
    }
}

/// The OTLP gRPC exporter for `endpoint`. Needs a tokio runtime: its connection is made lazily, on
/// the runtime current at this call.
pub fn otlp_exporter(endpoint: &str) -> Result<opentelemetry_otlp::SpanExporter, String> {
    if tokio::runtime::Handle::try_current().is_err() {
        return Err("telemetry::init was called outside a tokio runtime".into());
    }
    opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .with_endpoint(endpoint)
        .build()
        .map_err(|e| format!("OTLP endpoint {endpoint:?}: {e}"))
}

/// The tracer provider [`init`] uses, over any exporter (tests pass their own): a batch span
/// processor (its own thread; `OTEL_BSP_*` apply), the sampler from `OTEL_TRACES_SAMPLER` /
/// `OTEL_TRACES_SAMPLER_ARG` (default: parent-based, always on), and the resource from the
/// environment with `service.name` defaulting to `service_name_default`.
pub fn tracer_provider<E: SpanExporter + 'static>(
    service_name_default: &str,
    exporter: E,
) -> SdkTracerProvider {
    SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource(service_name_default))
        .build()
}

/// The SDK's resource (its detectors read `OTEL_SERVICE_NAME` and `OTEL_RESOURCE_ATTRIBUTES`),
/// with `service.name` set to `default` when the environment names none.
fn resource(default: &str) -> Resource {
    let detected = Resource::builder().build();
    let named = detected
        .get(&opentelemetry::Key::from_static_str("service.name"))
        .is_some_and(|v| !v.as_str().starts_with("unknown_service"));
    if named {
        detected
    } else {
        Resource::builder()
            .with_attribute(KeyValue::new("service.name", default.to_string()))
            .build()
    }
}

/// Lets events through and no span: logs stay lines, spans are for traces. Decided per callsite
/// (cached by `tracing`), so a span no other layer wants is disabled outright.
#[derive(Debug, Clone, Copy)]
pub struct EventsOnly;

impl<S> Filter<S> for EventsOnly {
    fn enabled(&self, meta: &Metadata<'_>, _cx: &Context<'_, S>) -> bool {
        meta.is_event()
    }

    fn callsite_enabled(&self, meta: &'static Metadata<'static>) -> Interest {
        if meta.is_event() {
            Interest::always()
        } else {
            Interest::never()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_spans_are_disabled_without_export() {
        // The subscriber `init` builds when no endpoint is given.
        let subscriber = Registry::default().with(log_layer(LogFormat::Json));
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!("route", endpoint = tracing::field::Empty);
            assert!(
                span.is_disabled(),
                "a request span must cost nothing when traces are off"
            );
            assert!(
                tracing::event_enabled!(tracing::Level::INFO),
                "info events are still logged"
            );
        });
    }

    #[test]
    fn flags_parse() {
        use clap::Parser;
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            t: TelemetryArgs,
        }
        let c = Cli::parse_from([
            "x",
            "--log-format",
            "json",
            "--otlp-endpoint",
            "http://collector:4317",
        ]);
        assert_eq!(c.t.log_format, LogFormat::Json);
        assert_eq!(c.t.otlp_endpoint.as_deref(), Some("http://collector:4317"));
        assert!(Cli::try_parse_from(["x", "--log-format", "xml"]).is_err());
    }
}
