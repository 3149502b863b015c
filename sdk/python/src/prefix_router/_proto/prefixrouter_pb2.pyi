from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RoutingStrategy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROUTING_STRATEGY_UNSPECIFIED: _ClassVar[RoutingStrategy]
    ROUTING_STRATEGY_RANDOM: _ClassVar[RoutingStrategy]
    ROUTING_STRATEGY_LEAST_OUTSTANDING_REQUESTS: _ClassVar[RoutingStrategy]
    ROUTING_STRATEGY_PREFIX_AWARE: _ClassVar[RoutingStrategy]

class RequestPriority(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REQUEST_PRIORITY_UNSPECIFIED: _ClassVar[RequestPriority]
    REQUEST_PRIORITY_CRITICAL: _ClassVar[RequestPriority]
    REQUEST_PRIORITY_STANDARD: _ClassVar[RequestPriority]
    REQUEST_PRIORITY_SHEDDABLE: _ClassVar[RequestPriority]
ROUTING_STRATEGY_UNSPECIFIED: RoutingStrategy
ROUTING_STRATEGY_RANDOM: RoutingStrategy
ROUTING_STRATEGY_LEAST_OUTSTANDING_REQUESTS: RoutingStrategy
ROUTING_STRATEGY_PREFIX_AWARE: RoutingStrategy
REQUEST_PRIORITY_UNSPECIFIED: RequestPriority
REQUEST_PRIORITY_CRITICAL: RequestPriority
REQUEST_PRIORITY_STANDARD: RequestPriority
REQUEST_PRIORITY_SHEDDABLE: RequestPriority

class PrefixAwareRoutingConfig(_message.Message):
    __slots__ = ("prefix_length", "concurrency_threshold", "kv_events", "tokenizer")
    PREFIX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    CONCURRENCY_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    prefix_length: int
    concurrency_threshold: int
    kv_events: KvEventsConfig
    tokenizer: str
    def __init__(self, prefix_length: _Optional[int] = ..., concurrency_threshold: _Optional[int] = ..., kv_events: _Optional[_Union[KvEventsConfig, _Mapping]] = ..., tokenizer: _Optional[str] = ...) -> None: ...

class KvEventsConfig(_message.Message):
    __slots__ = ("endpoint", "replay_endpoint", "topic", "block_size")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    REPLAY_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    replay_endpoint: str
    topic: str
    block_size: int
    def __init__(self, endpoint: _Optional[str] = ..., replay_endpoint: _Optional[str] = ..., topic: _Optional[str] = ..., block_size: _Optional[int] = ...) -> None: ...

class RoutingConfig(_message.Message):
    __slots__ = ("routing_strategy", "prefix_aware_routing_config", "default_priority")
    ROUTING_STRATEGY_FIELD_NUMBER: _ClassVar[int]
    PREFIX_AWARE_ROUTING_CONFIG_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_PRIORITY_FIELD_NUMBER: _ClassVar[int]
    routing_strategy: RoutingStrategy
    prefix_aware_routing_config: PrefixAwareRoutingConfig
    default_priority: RequestPriority
    def __init__(self, routing_strategy: _Optional[_Union[RoutingStrategy, str]] = ..., prefix_aware_routing_config: _Optional[_Union[PrefixAwareRoutingConfig, _Mapping]] = ..., default_priority: _Optional[_Union[RequestPriority, str]] = ...) -> None: ...

class ProductionVariant(_message.Message):
    __slots__ = ("variant_name", "model_name", "initial_variant_weight", "routing_config", "instances")
    VARIANT_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    INITIAL_VARIANT_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    ROUTING_CONFIG_FIELD_NUMBER: _ClassVar[int]
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    variant_name: str
    model_name: str
    initial_variant_weight: float
    routing_config: RoutingConfig
    instances: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, variant_name: _Optional[str] = ..., model_name: _Optional[str] = ..., initial_variant_weight: _Optional[float] = ..., routing_config: _Optional[_Union[RoutingConfig, _Mapping]] = ..., instances: _Optional[_Iterable[str]] = ...) -> None: ...

class EndpointConfig(_message.Message):
    __slots__ = ("endpoint_config_name", "production_variants", "revision", "creation_time_unix_ms")
    ENDPOINT_CONFIG_NAME_FIELD_NUMBER: _ClassVar[int]
    PRODUCTION_VARIANTS_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    CREATION_TIME_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    endpoint_config_name: str
    production_variants: _containers.RepeatedCompositeFieldContainer[ProductionVariant]
    revision: int
    creation_time_unix_ms: int
    def __init__(self, endpoint_config_name: _Optional[str] = ..., production_variants: _Optional[_Iterable[_Union[ProductionVariant, _Mapping]]] = ..., revision: _Optional[int] = ..., creation_time_unix_ms: _Optional[int] = ...) -> None: ...

class Endpoint(_message.Message):
    __slots__ = ("endpoint_name", "endpoint_config_name", "creation_time_unix_ms", "last_modified_time_unix_ms", "routing_table_version")
    ENDPOINT_NAME_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_CONFIG_NAME_FIELD_NUMBER: _ClassVar[int]
    CREATION_TIME_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    LAST_MODIFIED_TIME_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    ROUTING_TABLE_VERSION_FIELD_NUMBER: _ClassVar[int]
    endpoint_name: str
    endpoint_config_name: str
    creation_time_unix_ms: int
    last_modified_time_unix_ms: int
    routing_table_version: int
    def __init__(self, endpoint_name: _Optional[str] = ..., endpoint_config_name: _Optional[str] = ..., creation_time_unix_ms: _Optional[int] = ..., last_modified_time_unix_ms: _Optional[int] = ..., routing_table_version: _Optional[int] = ...) -> None: ...

class RegisteredInstance(_message.Message):
    __slots__ = ("instance_id", "endpoint_name", "variant_name", "address", "lease_ttl_seconds", "lease_expires_unix_ms")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_NAME_FIELD_NUMBER: _ClassVar[int]
    VARIANT_NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    endpoint_name: str
    variant_name: str
    address: str
    lease_ttl_seconds: int
    lease_expires_unix_ms: int
    def __init__(self, instance_id: _Optional[str] = ..., endpoint_name: _Optional[str] = ..., variant_name: _Optional[str] = ..., address: _Optional[str] = ..., lease_ttl_seconds: _Optional[int] = ..., lease_expires_unix_ms: _Optional[int] = ...) -> None: ...

class CreateEndpointConfigRequest(_message.Message):
    __slots__ = ("endpoint_config_name", "production_variants")
    ENDPOINT_CONFIG_NAME_FIELD_NUMBER: _ClassVar[int]
    PRODUCTION_VARIANTS_FIELD_NUMBER: _ClassVar[int]
    endpoint_config_name: str
    production_variants: _containers.RepeatedCompositeFieldContainer[ProductionVariant]
    def __init__(self, endpoint_config_name: _Optional[str] = ..., production_variants: _Optional[_Iterable[_Union[ProductionVariant, _Mapping]]] = ...) -> None: ...

class CreateEndpointConfigResponse(_message.Message):
    __slots__ = ("endpoint_config",)
    ENDPOINT_CONFIG_FIELD_NUMBER: _ClassVar[int]
    endpoint_config: EndpointConfig
    def __init__(self, endpoint_config: _Optional[_Union[EndpointConfig, _Mapping]] = ...) -> None: ...

class UpdateEndpointConfigRequest(_message.Message):
    __slots__ = ("endpoint_config_name", "production_variants", "expected_revision")
    ENDPOINT_CONFIG_NAME_FIELD_NUMBER: _ClassVar[int]
    PRODUCTION_VARIANTS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_REVISION_FIELD_NUMBER: _ClassVar[int]
    endpoint_config_name: str
    production_variants: _containers.RepeatedCompositeFieldContainer[ProductionVariant]
    expected_revision: int
    def __init__(self, endpoint_config_name: _Optional[str] = ..., production_variants: _Optional[_Iterable[_Union[ProductionVariant, _Mapping]]] = ..., expected_revision: _Optional[int] = ...) -> None: ...

class UpdateEndpointConfigResponse(_message.Message):
    __slots__ = ("endpoint_config", "routing_table_version")
    ENDPOINT_CONFIG_FIELD_NUMBER: _ClassVar[int]
    ROUTING_TABLE_VERSION_FIELD_NUMBER: _ClassVar[int]
    endpoint_config: EndpointConfig
    routing_table_version: int
    def __init__(self, endpoint_config: _Optional[_Union[EndpointConfig, _Mapping]] = ..., routing_table_version: _Optional[int] = ...) -> None: ...

class DescribeEndpointConfigRequest(_message.Message):
    __slots__ = ("endpoint_config_name", "revision")
    ENDPOINT_CONFIG_NAME_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    endpoint_config_name: str
    revision: int
    def __init__(self, endpoint_config_name: _Optional[str] = ..., revision: _Optional[int] = ...) -> None: ...

class DescribeEndpointConfigResponse(_message.Message):
    __slots__ = ("endpoint_config", "latest_revision", "endpoint_names")
    ENDPOINT_CONFIG_FIELD_NUMBER: _ClassVar[int]
    LATEST_REVISION_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_NAMES_FIELD_NUMBER: _ClassVar[int]
    endpoint_config: EndpointConfig
    latest_revision: int
    endpoint_names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, endpoint_config: _Optional[_Union[EndpointConfig, _Mapping]] = ..., latest_revision: _Optional[int] = ..., endpoint_names: _Optional[_Iterable[str]] = ...) -> None: ...

class ListEndpointConfigsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListEndpointConfigsResponse(_message.Message):
    __slots__ = ("endpoint_configs",)
    ENDPOINT_CONFIGS_FIELD_NUMBER: _ClassVar[int]
    endpoint_configs: _containers.RepeatedCompositeFieldContainer[EndpointConfig]
    def __init__(self, endpoint_configs: _Optional[_Iterable[_Union[EndpointConfig, _Mapping]]] = ...) -> None: ...

class DeleteEndpointConfigRequest(_message.Message):
    __slots__ = ("endpoint_config_name",)
    ENDPOINT_CONFIG_NAME_FIELD_NUMBER: _ClassVar[int]
    endpoint_config_name: str
    def __init__(self, endpoint_config_name: _Optional[str] = ...) -> None: ...

class DeleteEndpointConfigResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CreateEndpointRequest(_message.Message):
    __slots__ = ("endpoint_name", "endpoint_config_name")
    ENDPOINT_NAME_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_CONFIG_NAME_FIELD_NUMBER: _ClassVar[int]
    endpoint_name: str
    endpoint_config_name: str
    def __init__(self, endpoint_name: _Optional[str] = ..., endpoint_config_name: _Optional[str] = ...) -> None: ...

class CreateEndpointResponse(_message.Message):
    __slots__ = ("endpoint",)
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    endpoint: Endpoint
    def __init__(self, endpoint: _Optional[_Union[Endpoint, _Mapping]] = ...) -> None: ...

class UpdateEndpointRequest(_message.Message):
    __slots__ = ("endpoint_name", "endpoint_config_name")
    ENDPOINT_NAME_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_CONFIG_NAME_FIELD_NUMBER: _ClassVar[int]
    endpoint_name: str
    endpoint_config_name: str
    def __init__(self, endpoint_name: _Optional[str] = ..., endpoint_config_name: _Optional[str] = ...) -> None: ...

class UpdateEndpointResponse(_message.Message):
    __slots__ = ("endpoint",)
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    endpoint: Endpoint
    def __init__(self, endpoint: _Optional[_Union[Endpoint, _Mapping]] = ...) -> None: ...

class DescribeEndpointRequest(_message.Message):
    __slots__ = ("endpoint_name",)
    ENDPOINT_NAME_FIELD_NUMBER: _ClassVar[int]
    endpoint_name: str
    def __init__(self, endpoint_name: _Optional[str] = ...) -> None: ...

class DataPlaneStatus(_message.Message):
    __slots__ = ("node_id", "applied_version", "up_to_date", "connected", "last_seen_unix_ms", "last_nack", "queues")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    APPLIED_VERSION_FIELD_NUMBER: _ClassVar[int]
    UP_TO_DATE_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    LAST_NACK_FIELD_NUMBER: _ClassVar[int]
    QUEUES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    applied_version: int
    up_to_date: bool
    connected: bool
    last_seen_unix_ms: int
    last_nack: str
    queues: _containers.RepeatedCompositeFieldContainer[EndpointQueue]
    def __init__(self, node_id: _Optional[str] = ..., applied_version: _Optional[int] = ..., up_to_date: _Optional[bool] = ..., connected: _Optional[bool] = ..., last_seen_unix_ms: _Optional[int] = ..., last_nack: _Optional[str] = ..., queues: _Optional[_Iterable[_Union[EndpointQueue, _Mapping]]] = ...) -> None: ...

class DescribeEndpointResponse(_message.Message):
    __slots__ = ("endpoint", "endpoint_config", "registered_instances", "current_routing_table_version", "data_planes")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_CONFIG_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_INSTANCES_FIELD_NUMBER: _ClassVar[int]
    CURRENT_ROUTING_TABLE_VERSION_FIELD_NUMBER: _ClassVar[int]
    DATA_PLANES_FIELD_NUMBER: _ClassVar[int]
    endpoint: Endpoint
    endpoint_config: EndpointConfig
    registered_instances: _containers.RepeatedCompositeFieldContainer[RegisteredInstance]
    current_routing_table_version: int
    data_planes: _containers.RepeatedCompositeFieldContainer[DataPlaneStatus]
    def __init__(self, endpoint: _Optional[_Union[Endpoint, _Mapping]] = ..., endpoint_config: _Optional[_Union[EndpointConfig, _Mapping]] = ..., registered_instances: _Optional[_Iterable[_Union[RegisteredInstance, _Mapping]]] = ..., current_routing_table_version: _Optional[int] = ..., data_planes: _Optional[_Iterable[_Union[DataPlaneStatus, _Mapping]]] = ...) -> None: ...

class ListEndpointsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListEndpointsResponse(_message.Message):
    __slots__ = ("endpoints",)
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    endpoints: _containers.RepeatedCompositeFieldContainer[Endpoint]
    def __init__(self, endpoints: _Optional[_Iterable[_Union[Endpoint, _Mapping]]] = ...) -> None: ...

class DeleteEndpointRequest(_message.Message):
    __slots__ = ("endpoint_name",)
    ENDPOINT_NAME_FIELD_NUMBER: _ClassVar[int]
    endpoint_name: str
    def __init__(self, endpoint_name: _Optional[str] = ...) -> None: ...

class DeleteEndpointResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RegisterInstanceRequest(_message.Message):
    __slots__ = ("endpoint_name", "variant_name", "address", "lease_ttl_seconds")
    ENDPOINT_NAME_FIELD_NUMBER: _ClassVar[int]
    VARIANT_NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    endpoint_name: str
    variant_name: str
    address: str
    lease_ttl_seconds: int
    def __init__(self, endpoint_name: _Optional[str] = ..., variant_name: _Optional[str] = ..., address: _Optional[str] = ..., lease_ttl_seconds: _Optional[int] = ...) -> None: ...

class RegisterInstanceResponse(_message.Message):
    __slots__ = ("instance",)
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    instance: RegisteredInstance
    def __init__(self, instance: _Optional[_Union[RegisteredInstance, _Mapping]] = ...) -> None: ...

class RenewInstanceLeaseRequest(_message.Message):
    __slots__ = ("instance_id",)
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    def __init__(self, instance_id: _Optional[str] = ...) -> None: ...

class RenewInstanceLeaseResponse(_message.Message):
    __slots__ = ("instance",)
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    instance: RegisteredInstance
    def __init__(self, instance: _Optional[_Union[RegisteredInstance, _Mapping]] = ...) -> None: ...

class DeregisterInstanceRequest(_message.Message):
    __slots__ = ("instance_id",)
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    def __init__(self, instance_id: _Optional[str] = ...) -> None: ...

class DeregisterInstanceResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Instance(_message.Message):
    __slots__ = ("instance_id", "address")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    address: str
    def __init__(self, instance_id: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class VariantRoutes(_message.Message):
    __slots__ = ("variant_name", "model_name", "weight", "routing_config", "instances")
    VARIANT_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    ROUTING_CONFIG_FIELD_NUMBER: _ClassVar[int]
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    variant_name: str
    model_name: str
    weight: float
    routing_config: RoutingConfig
    instances: _containers.RepeatedCompositeFieldContainer[Instance]
    def __init__(self, variant_name: _Optional[str] = ..., model_name: _Optional[str] = ..., weight: _Optional[float] = ..., routing_config: _Optional[_Union[RoutingConfig, _Mapping]] = ..., instances: _Optional[_Iterable[_Union[Instance, _Mapping]]] = ...) -> None: ...

class EndpointRoutes(_message.Message):
    __slots__ = ("endpoint_name", "endpoint_config_name", "endpoint_config_revision", "variants")
    ENDPOINT_NAME_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_CONFIG_NAME_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_CONFIG_REVISION_FIELD_NUMBER: _ClassVar[int]
    VARIANTS_FIELD_NUMBER: _ClassVar[int]
    endpoint_name: str
    endpoint_config_name: str
    endpoint_config_revision: int
    variants: _containers.RepeatedCompositeFieldContainer[VariantRoutes]
    def __init__(self, endpoint_name: _Optional[str] = ..., endpoint_config_name: _Optional[str] = ..., endpoint_config_revision: _Optional[int] = ..., variants: _Optional[_Iterable[_Union[VariantRoutes, _Mapping]]] = ...) -> None: ...

class RoutingTable(_message.Message):
    __slots__ = ("version", "endpoints")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    version: int
    endpoints: _containers.RepeatedCompositeFieldContainer[EndpointRoutes]
    def __init__(self, version: _Optional[int] = ..., endpoints: _Optional[_Iterable[_Union[EndpointRoutes, _Mapping]]] = ...) -> None: ...

class WatchRoutingTableRequest(_message.Message):
    __slots__ = ("node_id", "applied_version", "response_nonce", "error_detail", "status")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    APPLIED_VERSION_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_NONCE_FIELD_NUMBER: _ClassVar[int]
    ERROR_DETAIL_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    applied_version: int
    response_nonce: str
    error_detail: str
    status: RouterStatus
    def __init__(self, node_id: _Optional[str] = ..., applied_version: _Optional[int] = ..., response_nonce: _Optional[str] = ..., error_detail: _Optional[str] = ..., status: _Optional[_Union[RouterStatus, _Mapping]] = ...) -> None: ...

class RouterStatus(_message.Message):
    __slots__ = ("queues",)
    QUEUES_FIELD_NUMBER: _ClassVar[int]
    queues: _containers.RepeatedCompositeFieldContainer[EndpointQueue]
    def __init__(self, queues: _Optional[_Iterable[_Union[EndpointQueue, _Mapping]]] = ...) -> None: ...

class EndpointQueue(_message.Message):
    __slots__ = ("endpoint_name", "critical", "standard", "sheddable")
    ENDPOINT_NAME_FIELD_NUMBER: _ClassVar[int]
    CRITICAL_FIELD_NUMBER: _ClassVar[int]
    STANDARD_FIELD_NUMBER: _ClassVar[int]
    SHEDDABLE_FIELD_NUMBER: _ClassVar[int]
    endpoint_name: str
    critical: int
    standard: int
    sheddable: int
    def __init__(self, endpoint_name: _Optional[str] = ..., critical: _Optional[int] = ..., standard: _Optional[int] = ..., sheddable: _Optional[int] = ...) -> None: ...

class WatchRoutingTableResponse(_message.Message):
    __slots__ = ("version", "nonce", "routing_table")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    ROUTING_TABLE_FIELD_NUMBER: _ClassVar[int]
    version: int
    nonce: str
    routing_table: bytes
    def __init__(self, version: _Optional[int] = ..., nonce: _Optional[str] = ..., routing_table: _Optional[bytes] = ...) -> None: ...
