//! The JSON shapes of `--output json` (SageMaker-like PascalCase, times as RFC 3339 UTC) and
//! their table renderings. `ProductionVariants` inside them is exactly the `--production-variants`
//! input shape, so a described config pastes back in (`file://` of a saved describe works too).

use proto::client::{EndpointConfigDescription, EndpointDescription, UpdatedEndpointConfig};
use proto::{DataPlaneStatus, Endpoint, EndpointConfig, RegisteredInstance, RoutingTable};
use serde::{Deserialize, Serialize};

use crate::output::{key_values, rfc3339, Report, Table};
use crate::variants::{strategy_name, ProductionVariantDoc, RoutingConfigDoc};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct EndpointConfigDoc {
    pub endpoint_config_name: String,
    pub revision: u64,
    /// Set by describe.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latest_revision: Option<u64>,
    pub creation_time: String,
    pub production_variants: Vec<ProductionVariantDoc>,
    /// Set by describe: the endpoints routing with this config.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint_names: Option<Vec<String>>,
    /// Set by update: the routing-table version the update produced (0: no endpoint uses it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub routing_table_version: Option<u64>,
}

impl From<&EndpointConfig> for EndpointConfigDoc {
    fn from(c: &EndpointConfig) -> Self {
        Self {
            endpoint_config_name: c.endpoint_config_name.clone(),
            revision: c.revision,
            latest_revision: None,
            creation_time: rfc3339(c.creation_time_unix_ms),
            production_variants: c
                .production_variants
                .iter()
                .map(ProductionVariantDoc::from)
                .collect(),
            endpoint_names: None,
            routing_table_version: None,
        }
    }
}

impl From<&EndpointConfigDescription> for EndpointConfigDoc {
    fn from(d: &EndpointConfigDescription) -> Self {
        Self {
            latest_revision: Some(d.latest_revision),
            endpoint_names: Some(d.endpoint_names.clone()),
            ..Self::from(&d.endpoint_config)
        }
    }
}

impl From<&UpdatedEndpointConfig> for EndpointConfigDoc {
    fn from(u: &UpdatedEndpointConfig) -> Self {
        Self {
            routing_table_version: Some(u.routing_table_version),
            ..Self::from(&u.endpoint_config)
        }
    }
}

impl Report for EndpointConfigDoc {
    fn table(&self) -> String {
        let mut pairs = vec![("EndpointConfigName", self.endpoint_config_name.clone())];
        let revision = match self.latest_revision {
            Some(latest) if latest != self.revision => {
                format!("{} (latest {latest})", self.revision)
            }
            _ => self.revision.to_string(),
        };
        pairs.push(("Revision", revision));
        pairs.push(("CreationTime", self.creation_time.clone()));
        if let Some(names) = &self.endpoint_names {
            pairs.push((
                "Endpoints",
                if names.is_empty() {
                    "-".into()
                } else {
                    names.join(", ")
                },
            ));
        }
        if let Some(v) = self.routing_table_version {
            pairs.push((
                "RoutingTableVersion",
                if v == 0 {
                    "- (no endpoint uses this config)".into()
                } else {
                    v.to_string()
                },
            ));
        }
        format!(
            "{}\n{}",
            key_values(&pairs),
            variants_table(&self.production_variants).render()
        )
    }
}

fn variants_table(variants: &[ProductionVariantDoc]) -> Table {
    let mut t = Table::new(&[
        "VARIANT",
        "MODEL",
        "WEIGHT",
        "STRATEGY",
        "PREFIX_LENGTH",
        "CONCURRENCY_THRESHOLD",
        "DEFAULT_PRIORITY",
        "INSTANCES",
    ]);
    for v in variants {
        let rc = v.routing_config.clone().unwrap_or(RoutingConfigDoc {
            routing_strategy: None,
            prefix_aware_routing_config: None,
            default_priority: None,
        });
        let prefix = rc.prefix_aware_routing_config;
        t.row(vec![
            v.variant_name.clone(),
            dash(&v.model_name),
            v.initial_variant_weight
                .map_or("1".into(), |w| w.to_string()),
            rc.routing_strategy.unwrap_or_else(|| "RANDOM".into()),
            prefix
                .as_ref()
                .and_then(|p| p.prefix_length)
                .map_or("-".into(), |n| n.to_string()),
            prefix
                .as_ref()
                .and_then(|p| p.concurrency_threshold)
                .map_or("-".into(), |n| n.to_string()),
            rc.default_priority.unwrap_or_else(|| "STANDARD".into()),
            if v.instances.is_empty() {
                "-".into()
            } else {
                v.instances.join(", ")
            },
        ]);
    }
    t
}

fn dash(s: &str) -> String {
    if s.is_empty() {
        "-".into()
    } else {
        s.to_string()
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct EndpointConfigList {
    pub endpoint_configs: Vec<EndpointConfigDoc>,
}

impl Report for EndpointConfigList {
    fn table(&self) -> String {
        let mut t = Table::new(&[
            "ENDPOINT_CONFIG",
            "REVISION",
            "VARIANTS",
            "STRATEGIES",
            "CREATED",
        ]);
        for c in &self.endpoint_configs {
            let strategies: Vec<String> = c
                .production_variants
                .iter()
                .map(|v| {
                    let s = v
                        .routing_config
                        .as_ref()
                        .and_then(|r| r.routing_strategy.clone())
                        .unwrap_or_else(|| "RANDOM".into());
                    format!("{}={s}", v.variant_name)
                })
                .collect();
            t.row(vec![
                c.endpoint_config_name.clone(),
                c.revision.to_string(),
                c.production_variants.len().to_string(),
                strategies.join(", "),
                c.creation_time.clone(),
            ]);
        }
        t.render()
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct EndpointDoc {
    pub endpoint_name: String,
    pub endpoint_config_name: String,
    pub creation_time: String,
    pub last_modified_time: String,
    /// Routing-table version at which this endpoint's routes last changed.
    pub routing_table_version: u64,
}

impl From<&Endpoint> for EndpointDoc {
    fn from(e: &Endpoint) -> Self {
        Self {
            endpoint_name: e.endpoint_name.clone(),
            endpoint_config_name: e.endpoint_config_name.clone(),
            creation_time: rfc3339(e.creation_time_unix_ms),
            last_modified_time: rfc3339(e.last_modified_time_unix_ms),
            routing_table_version: e.routing_table_version,
        }
    }
}

impl Report for EndpointDoc {
    fn table(&self) -> String {
        key_values(&[
            ("EndpointName", self.endpoint_name.clone()),
            ("EndpointConfigName", self.endpoint_config_name.clone()),
            ("CreationTime", self.creation_time.clone()),
            ("LastModifiedTime", self.last_modified_time.clone()),
            (
                "RoutingTableVersion",
                self.routing_table_version.to_string(),
            ),
        ])
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct EndpointList {
    pub endpoints: Vec<EndpointDoc>,
}

impl Report for EndpointList {
    fn table(&self) -> String {
        let mut t = Table::new(&[
            "ENDPOINT",
            "ENDPOINT_CONFIG",
            "ROUTING_TABLE_VERSION",
            "CREATED",
            "LAST_MODIFIED",
        ]);
        for e in &self.endpoints {
            t.row(vec![
                e.endpoint_name.clone(),
                e.endpoint_config_name.clone(),
                e.routing_table_version.to_string(),
                e.creation_time.clone(),
                e.last_modified_time.clone(),
            ]);
        }
        t.render()
    }
}

/// `endpoint describe`: the endpoint, the config revision it routes with, registered instances
/// and the rollout status per data-plane node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct EndpointDescriptionDoc {
    pub endpoint_name: String,
    /// `InService` when every connected data plane has applied the endpoint's latest routes,
    /// `Updating` while one has not.
    pub endpoint_status: String,
    pub endpoint_config_name: String,
    pub endpoint_config_revision: u64,
    pub creation_time: String,
    pub last_modified_time: String,
    /// Routing-table version at which this endpoint's routes last changed.
    pub routing_table_version: u64,
    /// The control plane's current routing-table version (all endpoints).
    pub current_routing_table_version: u64,
    pub production_variants: Vec<ProductionVariantDoc>,
    pub registered_instances: Vec<InstanceDoc>,
    pub data_planes: Vec<DataPlaneDoc>,
}

impl From<&EndpointDescription> for EndpointDescriptionDoc {
    fn from(d: &EndpointDescription) -> Self {
        let e = EndpointDoc::from(&d.endpoint);
        Self {
            endpoint_name: e.endpoint_name,
            endpoint_status: if d.rolled_out() {
                "InService"
            } else {
                "Updating"
            }
            .into(),
            endpoint_config_name: e.endpoint_config_name,
            endpoint_config_revision: d.endpoint_config.revision,
            creation_time: e.creation_time,
            last_modified_time: e.last_modified_time,
            routing_table_version: e.routing_table_version,
            current_routing_table_version: d.current_routing_table_version,
            production_variants: d
                .endpoint_config
                .production_variants
                .iter()
                .map(ProductionVariantDoc::from)
                .collect(),
            registered_instances: d
                .registered_instances
                .iter()
                .map(InstanceDoc::from)
                .collect(),
            data_planes: d.data_planes.iter().map(DataPlaneDoc::from).collect(),
        }
    }
}

impl Report for EndpointDescriptionDoc {
    fn table(&self) -> String {
        let mut out = key_values(&[
            ("EndpointName", self.endpoint_name.clone()),
            ("EndpointStatus", self.endpoint_status.clone()),
            (
                "EndpointConfig",
                format!(
                    "{} (revision {})",
                    self.endpoint_config_name, self.endpoint_config_revision
                ),
            ),
            ("CreationTime", self.creation_time.clone()),
            ("LastModifiedTime", self.last_modified_time.clone()),
            (
                "RoutingTableVersion",
                format!(
                    "{} (control plane at {})",
                    self.routing_table_version, self.current_routing_table_version
                ),
            ),
        ]);
        out.push('\n');
        out.push_str(&variants_table(&self.production_variants).render());
        if !self.registered_instances.is_empty() {
            out.push_str("\nRegistered instances:\n");
            out.push_str(
                &instances_table(&self.registered_instances)
                    .indent(2)
                    .render(),
            );
        }
        out.push_str("\nData planes:\n");
        if self.data_planes.is_empty() {
            out.push_str("  (none has connected)\n");
        } else {
            let mut t = Table::new(&[
                "NODE",
                "APPLIED_VERSION",
                "UP_TO_DATE",
                "CONNECTED",
                "LAST_SEEN",
                "QUEUED",
                "LAST_NACK",
            ])
            .indent(2);
            for d in &self.data_planes {
                t.row(vec![
                    d.node_id.clone(),
                    d.applied_version.to_string(),
                    yes_no(d.up_to_date),
                    yes_no(d.connected),
                    dash(&d.last_seen_time),
                    if d.connected {
                        d.queued.to_string()
                    } else {
                        "-".into()
                    },
                    d.last_nack.clone().unwrap_or_else(|| "-".into()),
                ]);
            }
            out.push_str(&t.render());
        }
        out
    }
}

fn yes_no(b: bool) -> String {
    if b { "yes" } else { "no" }.into()
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct DataPlaneDoc {
    pub node_id: String,
    /// Last routing-table version the node ACKed.
    pub applied_version: u64,
    pub up_to_date: bool,
    pub connected: bool,
    pub last_seen_time: String,
    /// Requests waiting in the node for this endpoint, as it last reported.
    #[serde(default)]
    pub queued: QueuedDoc,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_nack: Option<String>,
}

/// Requests waiting in one router for one endpoint, by priority.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct QueuedDoc {
    pub critical: u32,
    pub standard: u32,
    pub sheddable: u32,
}

impl QueuedDoc {
    pub fn total(&self) -> u64 {
        u64::from(self.critical) + u64::from(self.standard) + u64::from(self.sheddable)
    }
}

/// `0`, or the total and its classes that have any: `7 (critical 2, standard 5)`.
impl std::fmt::Display for QueuedDoc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.total())?;
        let classes = [
            ("critical", self.critical),
            ("standard", self.standard),
            ("sheddable", self.sheddable),
        ];
        let mut sep = " (";
        for (name, n) in classes.iter().filter(|(_, n)| *n > 0) {
            write!(f, "{sep}{name} {n}")?;
            sep = ", ";
        }
        if sep == ", " {
            f.write_str(")")?;
        }
        Ok(())
    }
}

impl From<&DataPlaneStatus> for DataPlaneDoc {
    fn from(d: &DataPlaneStatus) -> Self {
        Self {
            node_id: d.node_id.clone(),
            applied_version: d.applied_version,
            up_to_date: d.up_to_date,
            connected: d.connected,
            last_seen_time: rfc3339(d.last_seen_unix_ms),
            queued: d
                .queues
                .iter()
                .fold(QueuedDoc::default(), |q, e| QueuedDoc {
                    critical: q.critical.saturating_add(e.critical),
                    standard: q.standard.saturating_add(e.standard),
                    sheddable: q.sheddable.saturating_add(e.sheddable),
                }),
            last_nack: (!d.last_nack.is_empty()).then(|| d.last_nack.clone()),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct InstanceDoc {
    pub instance_id: String,
    pub endpoint_name: String,
    pub variant_name: String,
    pub address: String,
    pub lease_ttl_seconds: u32,
    pub lease_expires_time: String,
}

impl From<&RegisteredInstance> for InstanceDoc {
    fn from(i: &RegisteredInstance) -> Self {
        Self {
            instance_id: i.instance_id.clone(),
            endpoint_name: i.endpoint_name.clone(),
            variant_name: i.variant_name.clone(),
            address: i.address.clone(),
            lease_ttl_seconds: i.lease_ttl_seconds,
            lease_expires_time: rfc3339(i.lease_expires_unix_ms),
        }
    }
}

fn instances_table(instances: &[InstanceDoc]) -> Table {
    let mut t = Table::new(&[
        "INSTANCE_ID",
        "ENDPOINT",
        "VARIANT",
        "ADDRESS",
        "LEASE_TTL_S",
        "LEASE_EXPIRES",
    ]);
    for i in instances {
        t.row(vec![
            i.instance_id.clone(),
            i.endpoint_name.clone(),
            i.variant_name.clone(),
            i.address.clone(),
            i.lease_ttl_seconds.to_string(),
            i.lease_expires_time.clone(),
        ]);
    }
    t
}

impl Report for InstanceDoc {
    fn table(&self) -> String {
        instances_table(std::slice::from_ref(self)).render()
    }
}

/// One routing-table version, as `routing-table watch` prints it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct RoutingTableDoc {
    pub version: u64,
    pub endpoints: Vec<EndpointRoutesDoc>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct EndpointRoutesDoc {
    pub endpoint_name: String,
    pub endpoint_config_name: String,
    pub endpoint_config_revision: u64,
    pub variants: Vec<VariantRoutesDoc>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct VariantRoutesDoc {
    pub variant_name: String,
    pub model_name: String,
    pub weight: f32,
    pub routing_config: RoutingConfigDoc,
    pub instance_count: usize,
    pub instances: Vec<RoutedInstanceDoc>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct RoutedInstanceDoc {
    pub instance_id: String,
    pub address: String,
}

impl From<&RoutingTable> for RoutingTableDoc {
    fn from(t: &RoutingTable) -> Self {
        Self {
            version: t.version,
            endpoints: t
                .endpoints
                .iter()
                .map(|e| EndpointRoutesDoc {
                    endpoint_name: e.endpoint_name.clone(),
                    endpoint_config_name: e.endpoint_config_name.clone(),
                    endpoint_config_revision: e.endpoint_config_revision,
                    variants: e
                        .variants
                        .iter()
                        .map(|v| VariantRoutesDoc {
                            variant_name: v.variant_name.clone(),
                            model_name: v.model_name.clone(),
                            weight: v.weight,
                            routing_config: RoutingConfigDoc::from(
                                &v.routing_config.clone().unwrap_or_default(),
                            ),
                            instance_count: v.instances.len(),
                            instances: v
                                .instances
                                .iter()
                                .map(|i| RoutedInstanceDoc {
                                    instance_id: i.instance_id.clone(),
                                    address: i.address.clone(),
                                })
                                .collect(),
                        })
                        .collect(),
                })
                .collect(),
        }
    }
}

impl Report for RoutingTableDoc {
    fn table(&self) -> String {
        let n = self.endpoints.len();
        let mut out = format!(
            "routing table version {}: {n} endpoint{}\n",
            self.version,
            if n == 1 { "" } else { "s" }
        );
        let mut t = Table::new(&[
            "ENDPOINT",
            "CONFIG_REVISION",
            "VARIANT",
            "STRATEGY",
            "WEIGHT",
            "INSTANCES",
        ])
        .indent(2);
        for e in &self.endpoints {
            for v in &e.variants {
                t.row(vec![
                    e.endpoint_name.clone(),
                    format!("{}@{}", e.endpoint_config_name, e.endpoint_config_revision),
                    v.variant_name.clone(),
                    v.routing_config
                        .routing_strategy
                        .clone()
                        .unwrap_or_else(|| strategy_name(0)),
                    v.weight.to_string(),
                    v.instance_count.to_string(),
                ]);
            }
        }
        if !t.is_empty() {
            out.push_str(&t.render());
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_routers_queue_reads_as_its_total_and_busy_classes() {
        let q = |critical, standard, sheddable| QueuedDoc {
            critical,
            standard,
            sheddable,
        };
        assert_eq!(q(0, 0, 0).to_string(), "0");
        assert_eq!(q(2, 5, 0).to_string(), "7 (critical 2, standard 5)");
        assert_eq!(q(0, 0, 3).to_string(), "3 (sheddable 3)");
        let status = DataPlaneStatus {
            node_id: "dp-0".into(),
            connected: true,
            queues: vec![
                proto::EndpointQueue {
                    endpoint_name: "chat".into(),
                    critical: 1,
                    standard: 0,
                    sheddable: 4,
                },
                proto::EndpointQueue {
                    endpoint_name: "chat".into(),
                    critical: 0,
                    standard: 2,
                    sheddable: 0,
                },
            ],
            ..Default::default()
        };
        assert_eq!(DataPlaneDoc::from(&status).queued, q(1, 2, 4));
    }
}
