//! The OpenTelemetry SDK reads the standard environment variables itself: `OTEL_SERVICE_NAME`
//! names the service (else the binary's default applies) and `OTEL_TRACES_SAMPLER` /
//! `OTEL_TRACES_SAMPLER_ARG` choose the sampler. Its own test binary: it sets environment variables.

use std::sync::{Arc, Mutex};

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{SpanData, SpanExporter};
use opentelemetry_sdk::Resource;
use tracing_subscriber::layer::SubscriberExt as _;

/// Records exported span names and the resource's service name.
#[derive(Debug, Clone, Default)]
struct Capture {
    spans: Arc<Mutex<Vec<String>>>,
    service: Arc<Mutex<Option<String>>>,
}

impl SpanExporter for Capture {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        self.spans
            .lock()
            .unwrap()
            .extend(batch.into_iter().map(|s| s.name.into_owned()));
        Ok(())
    }

    fn set_resource(&mut self, resource: &Resource) {
        let name = resource
            .get(&opentelemetry::Key::from_static_str("service.name"))
            .map(|v| v.as_str().into_owned());
        *self.service.lock().unwrap() = name;
    }
}

/// Builds the provider `telemetry::init` would build, records three spans through the tracing
/// layer, flushes, and returns (service name, exported span names).
fn run_with_env() -> (Option<String>, Vec<String>) {
    let capture = Capture::default();
    let provider = telemetry::tracer_provider("data-plane", capture.clone());
    let subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
    tracing::subscriber::with_default(subscriber, || {
        for _ in 0..3 {
            tracing::info_span!("route").in_scope(|| {});
        }
    });
    provider.force_flush().unwrap();
    let service = capture.service.lock().unwrap().clone();
    let spans = capture.spans.lock().unwrap().clone();
    provider.shutdown().unwrap();
    (service, spans)
}

#[test]
fn service_name_and_sampler_come_from_the_environment() {
    for var in [
        "OTEL_SERVICE_NAME",
        "OTEL_RESOURCE_ATTRIBUTES",
        "OTEL_TRACES_SAMPLER",
        "OTEL_TRACES_SAMPLER_ARG",
    ] {
        std::env::remove_var(var);
    }
    let (service, spans) = run_with_env();
    assert_eq!(
        service.as_deref(),
        Some("data-plane"),
        "the binary's name when the environment names no service"
    );
    assert_eq!(
        spans,
        ["route", "route", "route"],
        "default sampler: parent-based, always on"
    );

    std::env::set_var("OTEL_SERVICE_NAME", "router-eu-1");
    std::env::set_var("OTEL_TRACES_SAMPLER", "traceidratio");
    std::env::set_var("OTEL_TRACES_SAMPLER_ARG", "0");
    let (service, spans) = run_with_env();
    assert_eq!(service.as_deref(), Some("router-eu-1"));
    assert!(spans.is_empty(), "ratio 0 samples nothing: {spans:?}");

    std::env::set_var("OTEL_TRACES_SAMPLER", "always_on");
    std::env::remove_var("OTEL_TRACES_SAMPLER_ARG");
    let (_, spans) = run_with_env();
    assert_eq!(spans.len(), 3);
}
