"""`Client`: one method per RPC of `prefixrouter.v1` (snake_case, named after the RPC), taking
keyword arguments and returning SageMaker-shaped dicts (see `prefix_router.shapes`)."""

import queue
import threading
import time
import uuid

import grpc

from . import shapes
from ._proto import prefixrouter_pb2 as pb
from ._proto import prefixrouter_pb2_grpc as pb_grpc
from .errors import FailedPreconditionError, NotFoundError, PrefixRouterError, from_rpc_error

#: How many times `set_variant_routing_strategy` writes before it gives up on concurrent writers.
STRATEGY_UPDATE_ATTEMPTS = 5

# A response whose first field is one of these holds the answer's object: its fields are merged
# into the top level of the returned dict, as boto3's SageMaker client returns `EndpointConfigName`, `ProductionVariants`, ... flat.
_FLATTENED = ("endpoint_config", "endpoint", "instance")


class Client:
    """A client of the control plane's gRPC API.

    `target`: `http://HOST:PORT` (plain), `https://HOST:PORT` (TLS) or `HOST:PORT` (plain unless
    `ca_cert` is given). `token`: a bearer token sent as `authorization: Bearer TOKEN` with
    every call. `ca_cert`: a PEM file path (or its bytes) to trust for TLS. `timeout`: seconds
    per unary call. `options`: extra gRPC channel options.

    Errors raise `prefix_router.errors.PrefixRouterError` subclasses named after the gRPC code
    (`NotFoundError`, `InvalidArgumentError`, `UnauthenticatedError`, ...).
    """

    def __init__(self, target: str, token: str = None, ca_cert=None, timeout: float = 30.0,
                 options=None):
        address, tls = _address(target, ca_cert)
        if token is not None and (not token or any(ord(c) < 0x21 or ord(c) > 0x7E for c in token)):
            raise ValueError("token must be non-empty printable ASCII without spaces")
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._timeout = timeout
        if tls:
            root = ca_cert
            if isinstance(root, str):
                try:
                    with open(root, "rb") as f:
                        root = f.read()
                except OSError as e:
                    raise ValueError(f"cannot read ca_cert {ca_cert!r}: {e}") from None
            credentials = grpc.ssl_channel_credentials(root_certificates=root)
            self._channel = grpc.secure_channel(address, credentials, options=options)
        else:
            self._channel = grpc.insecure_channel(address, options=options)
        self._control_plane = pb_grpc.ControlPlaneStub(self._channel)
        self._discovery = pb_grpc.RoutingDiscoveryStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- one method per ControlPlane RPC ----

    def create_endpoint_config(self, endpoint_config_name: str, production_variants) -> dict:
        return self._call("CreateEndpointConfig", pb.CreateEndpointConfigRequest(
            endpoint_config_name=endpoint_config_name,
            production_variants=shapes.production_variants(production_variants)))

    def update_endpoint_config(self, endpoint_config_name: str, production_variants,
                               expected_revision: int = None) -> dict:
        return self._call("UpdateEndpointConfig", pb.UpdateEndpointConfigRequest(
            endpoint_config_name=endpoint_config_name,
            production_variants=shapes.production_variants(production_variants),
            expected_revision=expected_revision))

    def describe_endpoint_config(self, endpoint_config_name: str, revision: int = None) -> dict:
        return self._call("DescribeEndpointConfig", pb.DescribeEndpointConfigRequest(
            endpoint_config_name=endpoint_config_name, revision=revision))

    def list_endpoint_configs(self) -> dict:
        return self._call("ListEndpointConfigs", pb.ListEndpointConfigsRequest())

    def delete_endpoint_config(self, endpoint_config_name: str) -> dict:
        return self._call("DeleteEndpointConfig", pb.DeleteEndpointConfigRequest(
            endpoint_config_name=endpoint_config_name))

    def create_endpoint(self, endpoint_name: str, endpoint_config_name: str) -> dict:
        return self._call("CreateEndpoint", pb.CreateEndpointRequest(
            endpoint_name=endpoint_name, endpoint_config_name=endpoint_config_name))

    def update_endpoint(self, endpoint_name: str, endpoint_config_name: str) -> dict:
        return self._call("UpdateEndpoint", pb.UpdateEndpointRequest(
            endpoint_name=endpoint_name, endpoint_config_name=endpoint_config_name))

    def describe_endpoint(self, endpoint_name: str) -> dict:
        return self._call("DescribeEndpoint", pb.DescribeEndpointRequest(endpoint_name=endpoint_name))

    def list_endpoints(self) -> dict:
        return self._call("ListEndpoints", pb.ListEndpointsRequest())

    def delete_endpoint(self, endpoint_name: str) -> dict:
        return self._call("DeleteEndpoint", pb.DeleteEndpointRequest(endpoint_name=endpoint_name))

    def register_instance(self, endpoint_name: str, variant_name: str, address: str,
                          lease_ttl_seconds: int = 0) -> dict:
        return self._call("RegisterInstance", pb.RegisterInstanceRequest(
            endpoint_name=endpoint_name, variant_name=variant_name, address=address,
            lease_ttl_seconds=lease_ttl_seconds))

    def renew_instance_lease(self, instance_id: str) -> dict:
        return self._call("RenewInstanceLease", pb.RenewInstanceLeaseRequest(instance_id=instance_id))

    def deregister_instance(self, instance_id: str) -> dict:
        return self._call("DeregisterInstance", pb.DeregisterInstanceRequest(instance_id=instance_id))

    # ---- RoutingDiscovery ----

    def watch_routing_table(self, node_id: str = None, applied_version: int = 0):
        """Yields each routing table the control plane streams (a dict: `Version`, `Endpoints`),
        ACKing each one as it is yielded and NACKing one that does not decode. One stream: it
        ends when the server closes it; closing the generator (or leaving a `for` loop) ends
        it from this side. `node_id` names this watcher in DescribeEndpoint's `DataPlanes`."""
        node_id = node_id or f"prefix-router-python-{uuid.uuid4()}"
        outgoing = queue.Queue()
        done = object()
        outgoing.put(pb.WatchRoutingTableRequest(node_id=node_id, applied_version=applied_version))

        def requests():
            while True:
                item = outgoing.get()
                if item is done:
                    return
                yield item

        call = self._discovery.WatchRoutingTable(requests(), metadata=self._metadata)
        try:
            for response in call:
                table = pb.RoutingTable()
                try:
                    table.ParseFromString(response.routing_table)
                except Exception as e:  # a table this SDK cannot read: NACK it, keep watching
                    outgoing.put(pb.WatchRoutingTableRequest(
                        node_id=node_id, applied_version=applied_version,
                        response_nonce=response.nonce, error_detail=f"cannot decode: {e}"))
                    continue
                applied_version = response.version
                outgoing.put(pb.WatchRoutingTableRequest(
                    node_id=node_id, applied_version=applied_version, response_nonce=response.nonce))
                yield shapes.to_dict(table)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                raise from_rpc_error(e) from None
        finally:
            outgoing.put(done)
            call.cancel()

    # ---- conveniences ----

    def set_variant_routing_strategy(self, endpoint_config_name: str, variant_name: str,
                                     routing_strategy, prefix_length: int = None,
                                     concurrency_threshold: int = None) -> dict:
        """Switches one variant's strategy live: describe, change, update with
        `expected_revision`, retried when another writer got in between."""
        strategy = shapes.parse_strategy(routing_strategy, variant_name)
        for attempt in range(1, STRATEGY_UPDATE_ATTEMPTS + 1):
            current = self._raw("DescribeEndpointConfig", pb.DescribeEndpointConfigRequest(
                endpoint_config_name=endpoint_config_name)).endpoint_config
            variants = list(current.production_variants)
            chosen = [v for v in variants if v.variant_name == variant_name]
            if not chosen:
                names = ", ".join(v.variant_name for v in variants)
                raise NotFoundError(
                    f"no variant {variant_name!r} in endpoint config {endpoint_config_name!r} "
                    f"(it has: {names})")
            routing = chosen[0].routing_config
            routing.routing_strategy = strategy
            if prefix_length is not None:
                routing.prefix_aware_routing_config.prefix_length = prefix_length
            if concurrency_threshold is not None:
                routing.prefix_aware_routing_config.concurrency_threshold = concurrency_threshold
            try:
                return self._call("UpdateEndpointConfig", pb.UpdateEndpointConfigRequest(
                    endpoint_config_name=endpoint_config_name, production_variants=variants,
                    expected_revision=current.revision))
            except FailedPreconditionError:
                if attempt == STRATEGY_UPDATE_ATTEMPTS:
                    raise
                time.sleep(0.02 * attempt)
        raise AssertionError("unreachable")

    # ---- plumbing ----

    def _raw(self, rpc: str, request):
        try:
            return getattr(self._control_plane, rpc)(
                request, timeout=self._timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    def _call(self, rpc: str, request) -> dict:
        response = self._raw(rpc, request)
        out = shapes.to_dict(response)
        fields = response.DESCRIPTOR.fields
        if fields and fields[0].name in _FLATTENED:
            inner = out.pop(shapes.pascal(fields[0].name))
            out = {**(inner or {}), **out}
        return out


def _address(target: str, ca_cert):
    """(`host:port`, tls?) of a target; ValueError for one that cannot work."""
    if not isinstance(target, str) or not target:
        raise ValueError(f"target must be http://HOST:PORT, https://HOST:PORT or HOST:PORT, got {target!r}")
    for scheme, tls in (("http://", False), ("https://", True)):
        if target.startswith(scheme):
            address = target[len(scheme):].rstrip("/")
            if not tls and ca_cert is not None:
                raise ValueError(f"ca_cert is for TLS, but target {target!r} is plain http://")
            break
    else:
        if "://" in target:
            raise ValueError(f"target {target!r}: the scheme must be http:// or https://")
        address, tls = target, ca_cert is not None
    if not address or "/" in address:
        raise ValueError(f"target {target!r} must be SCHEME://HOST:PORT with no path")
    return address, tls


__all__ = ["Client", "PrefixRouterError", "STRATEGY_UPDATE_ATTEMPTS"]
