//! An in-process OTLP collector (a tonic `TraceService`) that hands every exported span to the
//! test, for the tracing tests and the check that no secret is ever exported.

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::Span;
use tokio::sync::mpsc;

/// Collects every exported span (with its resource's service name) into a channel.
pub struct Collector {
    spans: mpsc::UnboundedSender<(String, Span)>,
}

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        for resource_spans in request.into_inner().resource_spans {
            let service = resource_spans
                .resource
                .iter()
                .flat_map(|r| &r.attributes)
                .find(|kv| kv.key == "service.name")
                .and_then(|kv| kv.value.as_ref()?.value.as_ref())
                .map(|v| match v {
                    Value::StringValue(s) => s.clone(),
                    other => format!("{other:?}"),
                })
                .unwrap_or_default();
            for scope in resource_spans.scope_spans {
                for span in scope.spans {
                    let _ = self.spans.send((service.clone(), span));
                }
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

/// Starts the collector on a loopback port; returns its URL and the span receiver.
pub async fn start_collector() -> (String, mpsc::UnboundedReceiver<(String, Span)>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(Collector { spans: tx }))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    (url, rx)
}
