//! `ControlPlane` gRPC service: maps requests onto [`Store`] calls and store errors onto gRPC
//! codes. sled is synchronous, so each call runs on the blocking pool.

use std::sync::Arc;

use tonic::{Request, Response, Status};

use proto::control_plane_server::ControlPlane;
use proto::*;

use crate::discovery::NodeRegistry;
use crate::store::{Store, StoreError};

pub struct ControlPlaneService {
    store: Arc<Store>,
    nodes: Arc<NodeRegistry>,
}

impl ControlPlaneService {
    pub fn new(store: Arc<Store>, nodes: Arc<NodeRegistry>) -> Self {
        Self { store, nodes }
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
            .map_err(to_status)
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
        StoreError::Storage(_) | StoreError::Corrupt { .. } => {
            tracing::error!(error = %msg, "storage failure");
            Status::internal(msg)
        }
    }
}

#[tonic::async_trait]
impl ControlPlane for ControlPlaneService {
    async fn create_endpoint_config(
        &self,
        request: Request<CreateEndpointConfigRequest>,
    ) -> Result<Response<CreateEndpointConfigResponse>, Status> {
        let r = request.into_inner();
        let config =
            self.blocking(move |s| s.create_config(&r.endpoint_config_name, &r.production_variants)).await?;
        Ok(Response::new(CreateEndpointConfigResponse { endpoint_config: Some(config) }))
    }

    async fn update_endpoint_config(
        &self,
        request: Request<UpdateEndpointConfigRequest>,
    ) -> Result<Response<UpdateEndpointConfigResponse>, Status> {
        let r = request.into_inner();
        let (config, version) = self
            .blocking(move |s| s.update_config(&r.endpoint_config_name, &r.production_variants, r.expected_revision))
            .await?;
        tracing::info!(
            endpoint_config = %config.endpoint_config_name,
            revision = config.revision,
            routing_table_version = version,
            "endpoint config updated"
        );
        Ok(Response::new(UpdateEndpointConfigResponse { endpoint_config: Some(config), routing_table_version: version }))
    }

    async fn describe_endpoint_config(
        &self,
        request: Request<DescribeEndpointConfigRequest>,
    ) -> Result<Response<DescribeEndpointConfigResponse>, Status> {
        let r = request.into_inner();
        let (config, latest, users) =
            self.blocking(move |s| s.describe_config(&r.endpoint_config_name, r.revision)).await?;
        Ok(Response::new(DescribeEndpointConfigResponse {
            endpoint_config: Some(config),
            latest_revision: latest,
            endpoint_names: users,
        }))
    }

    async fn list_endpoint_configs(
        &self,
        _request: Request<ListEndpointConfigsRequest>,
    ) -> Result<Response<ListEndpointConfigsResponse>, Status> {
        let configs = self.blocking(|s| s.list_configs()).await?;
        Ok(Response::new(ListEndpointConfigsResponse { endpoint_configs: configs }))
    }

    async fn delete_endpoint_config(
        &self,
        request: Request<DeleteEndpointConfigRequest>,
    ) -> Result<Response<DeleteEndpointConfigResponse>, Status> {
        let r = request.into_inner();
        self.blocking(move |s| s.delete_config(&r.endpoint_config_name)).await?;
        Ok(Response::new(DeleteEndpointConfigResponse {}))
    }

    async fn create_endpoint(
        &self,
        request: Request<CreateEndpointRequest>,
    ) -> Result<Response<CreateEndpointResponse>, Status> {
        let r = request.into_inner();
        let endpoint = self.blocking(move |s| s.create_endpoint(&r.endpoint_name, &r.endpoint_config_name)).await?;
        Ok(Response::new(CreateEndpointResponse { endpoint: Some(endpoint) }))
    }

    async fn update_endpoint(
        &self,
        request: Request<UpdateEndpointRequest>,
    ) -> Result<Response<UpdateEndpointResponse>, Status> {
        let r = request.into_inner();
        let endpoint = self.blocking(move |s| s.update_endpoint(&r.endpoint_name, &r.endpoint_config_name)).await?;
        Ok(Response::new(UpdateEndpointResponse { endpoint: Some(endpoint) }))
    }

    async fn describe_endpoint(
        &self,
        request: Request<DescribeEndpointRequest>,
    ) -> Result<Response<DescribeEndpointResponse>, Status> {
        let r = request.into_inner();
        let view = self.blocking(move |s| s.describe_endpoint(&r.endpoint_name)).await?;
        let endpoint_version = view.endpoint.routing_table_version;
        let data_planes = self
            .nodes
            .snapshot()
            .into_iter()
            .map(|(node_id, s)| DataPlaneStatus {
                node_id,
                applied_version: s.applied_version,
                up_to_date: s.applied_version >= endpoint_version,
                connected: s.streams > 0,
                last_seen_unix_ms: s.last_seen_unix_ms,
                last_nack: s.last_nack,
            })
            .collect();
        Ok(Response::new(DescribeEndpointResponse {
            endpoint: Some(view.endpoint),
            endpoint_config: Some(view.config),
            registered_instances: view.registered,
            current_routing_table_version: view.current_version,
            data_planes,
        }))
    }

    async fn list_endpoints(
        &self,
        _request: Request<ListEndpointsRequest>,
    ) -> Result<Response<ListEndpointsResponse>, Status> {
        let endpoints = self.blocking(|s| s.list_endpoints()).await?;
        Ok(Response::new(ListEndpointsResponse { endpoints }))
    }

    async fn delete_endpoint(
        &self,
        request: Request<DeleteEndpointRequest>,
    ) -> Result<Response<DeleteEndpointResponse>, Status> {
        let r = request.into_inner();
        self.blocking(move |s| s.delete_endpoint(&r.endpoint_name)).await?;
        Ok(Response::new(DeleteEndpointResponse {}))
    }

    async fn register_instance(
        &self,
        request: Request<RegisterInstanceRequest>,
    ) -> Result<Response<RegisterInstanceResponse>, Status> {
        let r = request.into_inner();
        let instance = self
            .blocking(move |s| s.register_instance(&r.endpoint_name, &r.variant_name, &r.address, r.lease_ttl_seconds))
            .await?;
        Ok(Response::new(RegisterInstanceResponse { instance: Some(instance) }))
    }

    async fn renew_instance_lease(
        &self,
        request: Request<RenewInstanceLeaseRequest>,
    ) -> Result<Response<RenewInstanceLeaseResponse>, Status> {
        let r = request.into_inner();
        let instance = self.blocking(move |s| s.renew_lease(&r.instance_id)).await?;
        Ok(Response::new(RenewInstanceLeaseResponse { instance: Some(instance) }))
    }

    async fn deregister_instance(
        &self,
        request: Request<DeregisterInstanceRequest>,
    ) -> Result<Response<DeregisterInstanceResponse>, Status> {
        let r = request.into_inner();
        self.blocking(move |s| s.deregister_instance(&r.instance_id)).await?;
        Ok(Response::new(DeregisterInstanceResponse {}))
    }
}
