"""grpcio-reflection (which speaks only grpc.reflection.v1alpha) lists and resolves the control
plane's services: a generic client needs no stubs."""

from google.protobuf.descriptor_pool import DescriptorPool
import grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)


def test_python_reflection_client_lists_the_services(control_plane):
    channel = grpc.insecure_channel(control_plane.address)
    database = ProtoReflectionDescriptorDatabase(channel)
    services = database.get_services()
    print("reflection services:", services)
    assert "prefixrouter.v1.ControlPlane" in services
    assert "prefixrouter.v1.RoutingDiscovery" in services
    pool = DescriptorPool(database)
    service = pool.FindServiceByName("prefixrouter.v1.ControlPlane")
    methods = [m.name for m in service.methods]
    print("ControlPlane methods:", methods)
    assert "DescribeEndpointConfig" in methods and "RegisterInstance" in methods
    channel.close()
