"""The SDK against a real control plane: every RPC, SageMaker-shaped dicts, a live strategy
switch, the routing-table watch, errors named after their gRPC codes; bearer token and TLS
against in-process gRPC servers."""

import concurrent.futures
import json
import shutil
import subprocess

import grpc
import pytest

import prefix_router
from prefix_router import errors, shapes
from prefix_router._proto import prefixrouter_pb2 as pb
from prefix_router._proto import prefixrouter_pb2_grpc as pb_grpc

# A SageMaker ProductionVariants document as the CLI takes it (InstanceType is SageMaker's and
# ignored; Instances is ours).
VARIANTS = json.dumps([{
    "VariantName": "v1", "ModelName": "llama", "InitialVariantWeight": 1,
    "InstanceType": "ml.g5.2xlarge", "InitialInstanceCount": 1,
    "Instances": ["http://127.0.0.1:9001", "http://127.0.0.1:9002"],
    "RoutingConfig": {"RoutingStrategy": "RANDOM"},
}])


def snake(name):
    return shapes.snake(name)


def test_a_method_per_rpc():
    for service in pb.DESCRIPTOR.services_by_name.values():
        for method in service.methods:
            assert callable(getattr(prefix_router.Client, snake(method.name), None)), method.name


def test_every_call_with_sagemaker_shapes(control_plane):
    c = prefix_router.Client(control_plane.url)
    created = c.create_endpoint_config(endpoint_config_name="chat", production_variants=VARIANTS)
    assert created["EndpointConfigName"] == "chat"
    assert created["Revision"] == 1
    variant = created["ProductionVariants"][0]
    assert variant["VariantName"] == "v1"
    assert variant["RoutingConfig"]["RoutingStrategy"] == "RANDOM"
    assert variant["Instances"] == ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]
    assert isinstance(created["CreationTimeUnixMs"], int)

    endpoint = c.create_endpoint(endpoint_name="chat", endpoint_config_name="chat")
    assert endpoint["EndpointName"] == "chat" and endpoint["RoutingTableVersion"] >= 1
    assert [e["EndpointName"] for e in c.list_endpoints()["Endpoints"]] == ["chat"]
    assert [e["EndpointConfigName"] for e in c.list_endpoint_configs()["EndpointConfigs"]] == ["chat"]

    # The strategy switch of the README, then the describe that shows it.
    updated = c.set_variant_routing_strategy("chat", "v1", "PREFIX_AWARE", prefix_length=1024)
    assert updated["Revision"] == 2 and updated["RoutingTableVersion"] > endpoint["RoutingTableVersion"]
    described = c.describe_endpoint_config(endpoint_config_name="chat")
    routing = described["ProductionVariants"][0]["RoutingConfig"]
    assert routing["RoutingStrategy"] == "PREFIX_AWARE"
    assert routing["PrefixAwareRoutingConfig"]["PrefixLength"] == 1024
    assert described["LatestRevision"] == 2 and described["EndpointNames"] == ["chat"]
    first = c.describe_endpoint_config(endpoint_config_name="chat", revision=1)
    assert first["ProductionVariants"][0]["RoutingConfig"]["RoutingStrategy"] == "RANDOM"

    # A describe answer pastes back in (the object holding ProductionVariants).
    again = c.update_endpoint_config(endpoint_config_name="chat", production_variants=described,
                                     expected_revision=2)
    assert again["Revision"] == 3

    inst = c.register_instance(endpoint_name="chat", variant_name="v1",
                               address="http://127.0.0.1:9003", lease_ttl_seconds=60)
    assert inst["Address"] == "http://127.0.0.1:9003" and inst["LeaseTtlSeconds"] == 60
    renewed = c.renew_instance_lease(instance_id=inst["InstanceId"])
    assert renewed["LeaseExpiresUnixMs"] >= inst["LeaseExpiresUnixMs"]
    desc = c.describe_endpoint(endpoint_name="chat")
    assert desc["EndpointName"] == "chat"
    assert desc["EndpointConfig"]["Revision"] == 3
    assert [i["InstanceId"] for i in desc["RegisteredInstances"]] == [inst["InstanceId"]]
    assert c.deregister_instance(instance_id=inst["InstanceId"]) == {}

    c.create_endpoint_config(endpoint_config_name="other", production_variants=VARIANTS)
    assert c.update_endpoint(endpoint_name="chat", endpoint_config_name="other")["EndpointConfigName"] == "other"
    assert c.delete_endpoint(endpoint_name="chat") == {}
    assert c.delete_endpoint_config(endpoint_config_name="chat") == {}


def test_a_variant_names_the_priority_of_requests_that_name_none(control_plane):
    c = prefix_router.Client(control_plane.url)
    doc = json.loads(VARIANTS)
    doc[0]["RoutingConfig"]["DefaultPriority"] = "sheddable"
    created = c.create_endpoint_config(endpoint_config_name="batch", production_variants=doc)
    assert created["ProductionVariants"][0]["RoutingConfig"]["DefaultPriority"] == "SHEDDABLE"
    # unset is STANDARD, as the control plane stores it
    plain = c.create_endpoint_config(endpoint_config_name="plain", production_variants=VARIANTS)
    assert plain["ProductionVariants"][0]["RoutingConfig"]["DefaultPriority"] == "STANDARD"
    doc[0]["RoutingConfig"]["DefaultPriority"] = "urgent"
    with pytest.raises(ValueError, match=r"unknown DefaultPriority 'urgent'.*\(expected CRITICAL, STANDARD, SHEDDABLE\)"):
        c.create_endpoint_config(endpoint_config_name="bad", production_variants=doc)


def test_errors_name_the_grpc_code(control_plane):
    c = prefix_router.Client(control_plane.url)
    with pytest.raises(errors.NotFoundError) as e:
        c.describe_endpoint(endpoint_name="nope")
    assert e.value.code == grpc.StatusCode.NOT_FOUND and e.value.code_name == "NOT_FOUND"
    assert str(e.value).startswith("NOT_FOUND: ") and "nope" in str(e.value)

    bad = json.dumps([{"VariantName": "v1", "Instances": ["http://127.0.0.1:9001"],
                       "RoutingConfig": {"RoutingStrategy": "PREFIX_AWARE",
                                         "PrefixAwareRoutingConfig": {"PrefixLength": 5}}}])
    with pytest.raises(errors.InvalidArgumentError) as e:
        c.create_endpoint_config(endpoint_config_name="c", production_variants=bad)
    assert "prefix_length" in str(e.value) and "5" in str(e.value), str(e.value)

    c.create_endpoint_config(endpoint_config_name="c", production_variants=VARIANTS)
    with pytest.raises(errors.AlreadyExistsError):
        c.create_endpoint_config(endpoint_config_name="c", production_variants=VARIANTS)
    with pytest.raises(errors.FailedPreconditionError):
        c.update_endpoint_config(endpoint_config_name="c", production_variants=VARIANTS,
                                 expected_revision=7)
    with pytest.raises(errors.NotFoundError) as e:
        c.set_variant_routing_strategy("c", "v9", "RANDOM")
    assert "(it has: v1)" in str(e.value)
    assert isinstance(e.value, prefix_router.PrefixRouterError)

    # Input this SDK refuses before any call, naming the field and the value.
    with pytest.raises(ValueError, match=r"unknown routing strategy 'PREFIX_AWAR' for variant 'v1'"):
        c.set_variant_routing_strategy("c", "v1", "PREFIX_AWAR")
    with pytest.raises(ValueError, match=r"ProductionVariants\[0\]: missing field VariantName"):
        c.create_endpoint_config(endpoint_config_name="d", production_variants=[{"ModelName": "m"}])
    with pytest.raises(ValueError, match=r"InitialVariantWeight must be a number, got 'x'"):
        c.create_endpoint_config(endpoint_config_name="d",
                                 production_variants=[{"VariantName": "v", "InitialVariantWeight": "x"}])
    with pytest.raises(ValueError, match="cannot read ProductionVariants file"):
        c.create_endpoint_config(endpoint_config_name="d", production_variants="file:///nonexistent.json")

    # A control plane that is not there: UNAVAILABLE.
    down = prefix_router.Client("http://127.0.0.1:1", timeout=2)
    with pytest.raises(errors.UnavailableError):
        down.list_endpoints()


def test_production_variants_from_a_file(control_plane, tmp_path):
    path = tmp_path / "variants.json"
    path.write_text(VARIANTS)
    c = prefix_router.Client(control_plane.url)
    created = c.create_endpoint_config(endpoint_config_name="f", production_variants=f"file://{path}")
    assert created["ProductionVariants"][0]["VariantName"] == "v1"


def test_watch_yields_each_version_and_acks_it(control_plane):
    c = prefix_router.Client(control_plane.url)
    c.create_endpoint_config(endpoint_config_name="chat", production_variants=VARIANTS)
    c.create_endpoint(endpoint_name="chat", endpoint_config_name="chat")
    watch = c.watch_routing_table(node_id="python-watcher")
    first = next(watch)
    assert [e["EndpointName"] for e in first["Endpoints"]] == ["chat"]
    assert first["Endpoints"][0]["Variants"][0]["RoutingConfig"]["RoutingStrategy"] == "RANDOM"
    changed = c.set_variant_routing_strategy("chat", "v1", "PREFIX_AWARE")
    second = next(watch)
    assert second["Version"] == changed["RoutingTableVersion"]
    assert second["Endpoints"][0]["Variants"][0]["RoutingConfig"]["RoutingStrategy"] == "PREFIX_AWARE"
    # The ACK of the second table reaches the rollout status.
    import time
    deadline = time.monotonic() + 10
    while True:
        planes = c.describe_endpoint(endpoint_name="chat")["DataPlanes"]
        mine = [p for p in planes if p["NodeId"] == "python-watcher"]
        if mine and mine[0]["AppliedVersion"] == second["Version"]:
            assert mine[0]["UpToDate"] and mine[0]["Connected"]
            break
        assert time.monotonic() < deadline, planes
        time.sleep(0.02)
    watch.close()


class _Recorder(pb_grpc.ControlPlaneServicer):
    """ListEndpoints that records the metadata it was called with."""

    def __init__(self):
        self.metadata = []

    def ListEndpoints(self, request, context):
        self.metadata.append(dict(context.invocation_metadata()))
        return pb.ListEndpointsResponse()


def _serve(port_binder):
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=2))
    recorder = _Recorder()
    pb_grpc.add_ControlPlaneServicer_to_server(recorder, server)
    port = port_binder(server)
    server.start()
    return server, recorder, port


def test_bearer_token_travels_as_authorization_metadata():
    server, recorder, port = _serve(lambda s: s.add_insecure_port("127.0.0.1:0"))
    try:
        c = prefix_router.Client(f"http://127.0.0.1:{port}", token="s3cret")
        assert c.list_endpoints() == {"Endpoints": []}
        assert recorder.metadata[-1]["authorization"] == "Bearer s3cret"
        prefix_router.Client(f"http://127.0.0.1:{port}").list_endpoints()
        assert "authorization" not in recorder.metadata[-1]
    finally:
        server.stop(None)
    with pytest.raises(ValueError, match="token"):
        prefix_router.Client("http://127.0.0.1:1", token="has space")


def test_tls_with_a_ca_cert(tmp_path):
    from conftest import require
    require("openssl is not installed", shutil.which("openssl") is not None)
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
         "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True, capture_output=True)
    credentials = grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())])
    server, recorder, port = _serve(lambda s: s.add_secure_port("127.0.0.1:0", credentials))
    try:
        c = prefix_router.Client(f"https://127.0.0.1:{port}", ca_cert=str(cert), token="t")
        assert c.list_endpoints() == {"Endpoints": []}
        assert recorder.metadata[-1]["authorization"] == "Bearer t"
        # Without the CA the server's certificate is not trusted.
        untrusted = prefix_router.Client(f"https://127.0.0.1:{port}", timeout=3)
        with pytest.raises(errors.UnavailableError):
            untrusted.list_endpoints()
    finally:
        server.stop(None)
    with pytest.raises(ValueError, match="plain http://"):
        prefix_router.Client("http://127.0.0.1:1", ca_cert=str(cert))
    with pytest.raises(ValueError, match="cannot read ca_cert"):
        prefix_router.Client("https://127.0.0.1:1", ca_cert=str(tmp_path / "missing.pem"))


def test_tokens_and_roles_against_a_secured_control_plane(tmp_path):
    from conftest import ControlPlane
    tokens = tmp_path / "tokens"
    tokens.write_text("admin-token admin\nreader-token reader\n")
    cp = ControlPlane(tmp_path, ["--auth-token-file", str(tokens)])
    try:
        with pytest.raises(errors.UnauthenticatedError) as e:
            prefix_router.Client(cp.url).list_endpoints()
        assert str(e.value).startswith("UNAUTHENTICATED: ")
        with pytest.raises(errors.UnauthenticatedError):
            prefix_router.Client(cp.url, token="wrong").list_endpoints()
        admin = prefix_router.Client(cp.url, token="admin-token")
        admin.create_endpoint_config(endpoint_config_name="chat", production_variants=VARIANTS)
        admin.create_endpoint(endpoint_name="chat", endpoint_config_name="chat")
        reader = prefix_router.Client(cp.url, token="reader-token")
        assert [e["EndpointName"] for e in reader.list_endpoints()["Endpoints"]] == ["chat"]
        watch = reader.watch_routing_table(node_id="reader-watch")
        assert next(watch)["Endpoints"][0]["EndpointName"] == "chat"
        watch.close()
        with pytest.raises(errors.PermissionDeniedError) as e:
            reader.set_variant_routing_strategy("chat", "v1", "PREFIX_AWARE")
        assert str(e.value).startswith("PERMISSION_DENIED: ")
    finally:
        cp.stop()
