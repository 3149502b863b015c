//! `ControlPlane` gRPC service: maps requests onto [`Store`] calls and store errors onto gRPC
//! codes. sled is synchronous, so each call runs on the blocking pool.
//!
//! Each method has a span (`prefixrouter.v1.ControlPlane/Method`) with the names it was called
//! with and, for writes, the routing-table version after the call; [`crate::rpc_layer`] makes the
//! caller's trace its parent. Numbers are recorded as `i64`: `tracing-opentelemetry` exports
//! other integer types as strings.

use std::sync::Arc;

use tonic::{Request, Response, Status};
use tracing::field::Empty;

use proto::control_plane_server::ControlPlane;
use proto::*;

use crate::discovery::NodeRegistry;
use crate::store::{Store, StoreError};

pub struct ControlPlaneService {
    store: Arc<Store>,
    nodes: Arc<NodeRegistry>,
    /// With the etcd store: the other replicas' data planes, for rollout status.
    cluster: Option<Arc<crate::etcd::ClusterNodes>>,
}

impl ControlPlaneService {
    pub fn new(store: Arc<Store>, nodes: Arc<NodeRegistry>) -> Self {
        Self {
            store,
            nodes,
            cluster: None,
        }
    }

    /// Reports the data planes of the other replicas too (etcd store).
    pub fn with_cluster(mut self, cluster: Option<Arc<crate::etcd::ClusterNodes>>) -> Self {
        self.cluster = cluster;
        self
    }

    async fn blocking<T, F>(&self, f: F) -> Result<T, Status>
    where
        T: Send + 'static,
        F: FnOnce(&Store) -> Result<T, StoreError> + Send + 'static,
    {
        let store = self.store.clone();
        tokio::task::spawn_blocking(move || f(&store))
            .await
            .map_err(|e| Status::internal(format!("control plane task failed: {e}")))?
            .map_err(|e| {
                let status = to_status(e);
                let span = tracing::Span::current();
                if !span.is_disabled() {
                    span.record("otel.status_code", "error");
                    span.record("rpc.grpc.status_code", status.code() as i64);
                }
                status
            })
    }

    /// The routing-table version now published, for writes whose store call does not return it.
    fn published_version(&self) -> u64 {
        self.store.published().version
    }
}

/// Records `routing_table_version` on the current (method) span.
fn record_version(version: u64) {
    let span = tracing::Span::current();
    if !span.is_disabled() {
        span.record("routing_table_version", version as i64);
    }
}

/// Store errors as gRPC statuses; the message is the error's text, which names field and value.
pub fn to_status(e: StoreError) -> Status {
    let msg = e.to_string();
    match e {
        StoreError::Invalid(_) => Status::invalid_argument(msg),
        StoreError::NotFound { .. } | StoreError::VariantNotFound { .. } => Status::not_found(msg),
        StoreError::AlreadyExists { .. } => Status::already_exists(msg),
        StoreError::FailedPrecondition(_) => Status::failed_precondition(msg),
        StoreError::Unavailable(_) => Status::unavailable(msg),
        StoreError::Aborted(_) | StoreError::Conflict => Status::aborted(msg),
        StoreError::OutOfSpace(_) => {
            tracing::error!(error = %msg, "storage full");
            Status::resource_exhausted(msg)
        }
        StoreError::Storage(_) | StoreError::Corrupt { .. } => {
            tracing::error!(error = %msg, "storage failure");
            Status::internal(msg)
        }
    }
}

#[tonic::async_trait]
impl ControlPlane for ControlPlaneService {
    #[tracing::instrument(
        name = "prefixrouter.v1.ControlPlane/CreateEndpointConfig",
        skip_all,
        fields(otel.kind = "server", rpc.system = "grpc", rpc.service = "prefixrouter.v1.ControlPlane", rpc.grpc.status_code = Empty, otel.status_code = Empty, endpoint_config = %request.get_ref().endpoint_config_name, variants = request.get_ref().production_variants.len() as i64, revision = Empty)
    )]
    async fn create_endpoint_config(
        &self,
        request: Request<CreateEndpointConfigRequest>,
    ) -> Result<Response<CreateEndpointConfigResponse>, Status> {
        let r = request.into_inner();
        let config = self
            .blocking(move |s| s.create_config(&r.endpoint_config_name, &r.production_variants))
            .await?;
        tracing::Span::current().record("revision", config.revision as i64);
        Ok(Response::new(CreateEndpointConfigResponse {
            endpoint_config: Some(config),
        }))
    }

    #[tracing::instrument(
        name = "prefixrouter.v1.ControlPlane/UpdateEndpointConfig",
        skip_all,
        fields(otel.kind = "server", rpc.system = "grpc", rpc.service = "prefixrouter.v1.ControlPlane", rpc.grpc.status_code = Empty, otel.status_code = Empty, endpoint_config = %request.get_ref().endpoint_config_name, variants = request.get_ref().production_variants.len() as i64, revision = Empty, routing_table_version = Empty)
    )]
    async fn update_endpoint_config(
        &self,
        request: Request<UpdateEndpointConfigRequest>,
    ) -> Result<Response<UpdateEndpointConfigResponse>, Status> {
        let r = request.into_inner();
        let (config, version) = self
            .blocking(move |s| {
                s.update_config(
                    &r.endpoint_config_name,
                    &r.production_variants,
                    r.expected_revision,
                )
            })
            .await?;
        tracing::Span::current().record("revision", config.revision as i64);
        record_version(version);
        tracing::info!(
            endpoint_config = %config.endpoint_config_name,
            revision = config.revision,
            routing_table_version = version,
            "endpoint config updated"
        );
        Ok(Response::new(UpdateEndpointConfigResponse {
            endpoint_config: Some(config),
            routing_table_version: version,
        }))
    }

    #[tracing::instrument(
        name = "prefixrouter.v1.ControlPlane/DescribeEndpointConfig",
        skip_all,
        fields(otel.kind = "server", rpc.system = "grpc", rpc.service = "prefixrouter.v1.ControlPlane", rpc.grpc.status_code = Empty, otel.status_code = Empty, endpoint_config = %request.get_ref().endpoint_config_name)
    )]
    async fn describe_endpoint_config(
        &self,
        request: Request<DescribeEndpointConfigRequest>,
    ) -> Result<Response<DescribeEndpointConfigResponse>, Status> {
        let r = request.into_inner();
        let (config, latest, users) = self
            .blocking(move |s| s.describe_config(&r.endpoint_config_name, r.revision))
            .await?;
        Ok(Response::new(DescribeEndpointConfigResponse {
            endpoint_config: Some(config),
            latest_revision: latest,
            endpoint_names: users,
        }))
    }

    #[tracing::instrument(
        name = "prefixrouter.v1.ControlPlane/ListEndpointConfigs",
        skip_all,
        fields(otel.kind = "server", rpc.system = "grpc", rpc.service = "prefixrouter.v1.ControlPlane", rpc.grpc.status_code = Empty, otel.status_code = Empty)
    )]
    async fn list_endpoint_configs(
        &self,
        _request: Request<ListEndpointConfigsRequest>,
    ) -> Result<Response<ListEndpointConfigsResponse>, Status> {
        let configs = self.blocking(|s| s.list_configs()).await?;
        Ok(Response::new(ListEndpointConfigsResponse {
            endpoint_configs: configs,
        }))
    }

    #[tracing::instrument(
        name = "prefixrouter.v1.ControlPlane/DeleteEndpointConfig",
        skip_all,
        fields(otel.kind = "server", rpc.system = "grpc", rpc.service = "prefixrouter.v1.ControlPlane", rpc.grpc.status_code = Empty, otel.status_code = Empty, endpoint_config = %request.get_ref().endpoint_config_name)
    )]
    async fn delete_endpoint_config(
        &self,
        request: Request<DeleteEndpointConfigRequest>,
    ) -> Result<Response<DeleteEndpointConfigResponse>, Status> {
        let r = request.into_inner();
        self.blocking(move |s| s.delete_config(&r.endpoint_config_name))
            .await?;
        Ok(Response::new(DeleteEndpointConfigResponse {}))
    }

    #[tracing::instrument(
        name = "prefixrouter.v1.ControlPlane/CreateEndpoint",
        skip_all,
        fields(otel.kind = "server", rpc.system = "grpc", rpc.service = "prefixrouter.v1.ControlPlane", rpc.grpc.status_code = Empty, otel.status_code = Empty, endpoint = %request.get_ref().endpoint_name, endpoint_config = %request.get_ref().endpoint_config_name, routing_table_version = Empty)
    )]
    async fn create_endpoint(
        &self,
        request: Request<CreateEndpointRequest>,
    ) -> Result<Response<CreateEndpointResponse>, Status> {
        let r = request.into_inner();
        let endpoint = self
            .blocking(move |s| s.create_endpoint(&r.endpoint_name, &r.endpoint_config_name))
            .await?;
        record_version(endpoint.routing_table_version);
        Ok(Response::new(CreateEndpointResponse {
            endpoint: Some(endpoint),
        }))
    }

    #[tracing::instrument(
        name = "prefixrouter.v1.ControlPlane/UpdateEndpoint",
        skip_all,
        fields(otel.kind = "server", rpc.system = "grpc", rpc.service = "prefixrouter.v1.ControlPlane", rpc.grpc.status_code = Empty, otel.status_code = Empty, endpoint = %request.get_ref().endpoint_name, endpoint_config = %request.get_ref().endpoint_config_name, routing_table_version = Empty)
    )]
    async fn update_endpoint(
        &self,
        request: Request<UpdateEndpointRequest>,
    ) -> Result<Response<UpdateEndpointResponse>, Status> {
        let r = request.into_inner();
        let endpoint = self
            .blocking(move |s| s.update_endpoint(&r.endpoint_name, &r.endpoint_config_name))
            .await?;
        record_version(endpoint.routing_table_version);
        Ok(Response::new(UpdateEndpointResponse {
            endpoint: Some(endpoint),
        }))
    }

    #[tracing::instrument(
        name = "prefixrouter.v1.ControlPlane/DescribeEndpoint",
        skip_all,
        fields(otel.kind = "server", rpc.system = "grpc", rpc.service = "prefixrouter.v1.ControlPlane", rpc.grpc.status_code = Empty, otel.status_code = Empty, endpoint = %request.get_ref().endpoint_name, routing_table_version = Empty)
    )]
    async fn describe_endpoint(
        &self,
        request: Request<DescribeEndpointRequest>,
    ) -> Result<Response<DescribeEndpointResponse>, Status> {
        let r = request.into_inner();
        let view = self
            .blocking(move |s| s.describe_endpoint(&r.endpoint_name))
            .await?;
        record_version(view.current_version);
        let endpoint_version = view.endpoint.routing_table_version;
        let local = self.nodes.statuses();
        let others = self.cluster.iter().flat_map(|c| c.others());
        let mut data_planes = merge_data_planes(local.into_iter().chain(others), endpoint_version);
        let name = view.endpoint.endpoint_name.as_str();
        for d in &mut data_planes {
            d.queues.retain(|q| q.endpoint_name == name);
        }
        Ok(Response::new(DescribeEndpointResponse {
            endpoint: Some(view.endpoint),
            endpoint_config: Some(view.config),
            registered_instances: view.registered,
            current_routing_table_version: view.current_version,
            data_planes,
        }))
    }

    #[tracing::instrument(
        name = "prefixrouter.v1.ControlPlane/ListEndpoints",
        skip_all,
        fields(otel.kind = "server", rpc.system = "grpc", rpc.service = "prefixrouter.v1.ControlPlane", rpc.grpc.status_code = Empty, otel.status_code = Empty)
    )]
    async fn list_endpoints(
        &self,
        _request: Request<ListEndpointsRequest>,
    ) -> Result<Response<ListEndpointsResponse>, Status> {
        let endpoints = self.blocking(|s| s.list_endpoints()).await?;
        Ok(Response::new(ListEndpointsResponse { endpoints }))
    }

    #[tracing::instrument(
        name = "prefixrouter.v1.ControlPlane/DeleteEndpoint",
        skip_all,
        fields(otel.kind = "server", rpc.system = "grpc", rpc.service = "prefixrouter.v1.ControlPlane", rpc.grpc.status_code = Empty, otel.status_code = Empty, endpoint = %request.get_ref().endpoint_name, routing_table_version = Empty)
    )]
    async fn delete_endpoint(
        &self,
        request: Request<DeleteEndpointRequest>,
    ) -> Result<Response<DeleteEndpointResponse>, Status> {
        let r = request.into_inner();
        self.blocking(move |s| s.delete_endpoint(&r.endpoint_name))
            .await?;
        record_version(self.published_version());
        Ok(Response::new(DeleteEndpointResponse {}))
    }

    #[tracing::instrument(
        name = "prefixrouter.v1.ControlPlane/RegisterInstance",
        skip_all,
        fields(otel.kind = "server", rpc.system = "grpc", rpc.service = "prefixrouter.v1.ControlPlane", rpc.grpc.status_code = Empty, otel.status_code = Empty, endpoint = %request.get_ref().endpoint_name, variant = %request.get_ref().variant_name, address = %request.get_ref().address, instance_id = Empty, routing_table_version = Empty)
    )]
    async fn register_instance(
        &self,
        request: Request<RegisterInstanceRequest>,
    ) -> Result<Response<RegisterInstanceResponse>, Status> {
        let r = request.into_inner();
        let instance = self
            .blocking(move |s| {
                s.register_instance(
                    &r.endpoint_name,
                    &r.variant_name,
                    &r.address,
                    r.lease_ttl_seconds,
                )
            })
            .await?;
        tracing::Span::current().record("instance_id", instance.instance_id.as_str());
        record_version(self.published_version());
        Ok(Response::new(RegisterInstanceResponse {
            instance: Some(instance),
        }))
    }

    #[tracing::instrument(
        name = "prefixrouter.v1.ControlPlane/RenewInstanceLease",
        skip_all,
        fields(otel.kind = "server", rpc.system = "grpc", rpc.service = "prefixrouter.v1.ControlPlane", rpc.grpc.status_code = Empty, otel.status_code = Empty, instance_id = %request.get_ref().instance_id)
    )]
    async fn renew_instance_lease(
        &self,
        request: Request<RenewInstanceLeaseRequest>,
    ) -> Result<Response<RenewInstanceLeaseResponse>, Status> {
        let r = request.into_inner();
        let instance = self
            .blocking(move |s| s.renew_lease(&r.instance_id))
            .await?;
        Ok(Response::new(RenewInstanceLeaseResponse {
            instance: Some(instance),
        }))
    }

    #[tracing::instrument(
        name = "prefixrouter.v1.ControlPlane/DeregisterInstance",
        skip_all,
        fields(otel.kind = "server", rpc.system = "grpc", rpc.service = "prefixrouter.v1.ControlPlane", rpc.grpc.status_code = Empty, otel.status_code = Empty, instance_id = %request.get_ref().instance_id, routing_table_version = Empty)
    )]
    async fn deregister_instance(
        &self,
        request: Request<DeregisterInstanceRequest>,
    ) -> Result<Response<DeregisterInstanceResponse>, Status> {
        let r = request.into_inner();
        self.blocking(move |s| s.deregister_instance(&r.instance_id))
            .await?;
        record_version(self.published_version());
        Ok(Response::new(DeregisterInstanceResponse {}))
    }
}

/// One status per data plane from every replica's reports (a router that moved between replicas
/// appears on both): the most recently seen report, connected if any replica has its stream.
fn merge_data_planes(
    all: impl Iterator<Item = DataPlaneStatus>,
    endpoint_version: u64,
) -> Vec<DataPlaneStatus> {
    let mut by_node: std::collections::BTreeMap<String, DataPlaneStatus> = Default::default();
    for s in all {
        match by_node.get_mut(&s.node_id) {
            Some(seen) => {
                let connected = seen.connected || s.connected;
                if s.last_seen_unix_ms > seen.last_seen_unix_ms {
                    *seen = s;
                }
                seen.connected = connected;
            }
            None => {
                by_node.insert(s.node_id.clone(), s);
            }
        }
    }
    by_node
        .into_values()
        .map(|mut s| {
            s.up_to_date = s.applied_version >= endpoint_version;
            s
        })
        .collect()
}
