//! `deploy/kubernetes` (the default install) and `deploy/kubernetes/overlays/single-node` render,
//! every object they render passes the Kubernetes JSON schemas (offline, with the
//! `kubernetes-validate` Python package), and the manifests agree with the binaries: every flag a
//! container or probe passes is in that binary's `--help`, every container port is one a listen
//! flag names, probes, Service target ports and Prometheus annotations point at those ports, every
//! file a flag names is mounted (from a Secret key that exists), every `http://` URL names a
//! Service port. Then both installs run here: every pod a process started from its rendered
//! command line (loopback ports for container ports and Services, folders for volumes, test
//! tokens for the Secret; etcd members from the `etcd` on PATH), ready by its own readiness probe,
//! its metrics where its Prometheus annotations say. Needs the built binaries
//! (`cargo build --workspace --bins`).
//!
//! The kustomizations use `resources`, `namespace` and `$patch: delete` patches only; this test
//! renders them itself (so it needs no kubectl) and, where `kubectl` is installed, checks that
//! `kubectl kustomize` renders exactly the same objects.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;

use integration_tests::deploy::{
    flag_value, flags, help, help_has_env, help_has_flag, port_of, repo_file, BINARIES, SDK_ENV,
};
use manifests::strings;
use serde_yaml_ng::Value;
use test_support::{poll_blocking, python_modules, require_tool, wait_for_blocking, ChildServer};

mod manifests;

/// The installs the README documents, as `kubectl kustomize` takes them.
const INSTALLS: [&str; 2] = [
    "deploy/kubernetes",
    "deploy/kubernetes/overlays/single-node",
];
/// Kubernetes versions the objects must be valid for (kubernetes-validate bundles their schemas).
const KUBERNETES_VERSIONS: [&str; 2] = ["1.30.0", "1.37.0"];
/// Where every container sends its traces (an OpenTelemetry collector in `observability`).
const OTLP_ENDPOINT: &str = "http://otel-collector.observability:4317";
/// Flags whose value starts with `/` without being a file path.
const NOT_PATHS: [&str; 1] = ["--etcd-prefix"];
/// Kinds the renderer knows to be namespaced (anything else it refuses to guess about).
const NAMESPACED: [&str; 11] = [
    "ConfigMap",
    "Deployment",
    "HTTPRoute",
    "HorizontalPodAutoscaler",
    "InferencePool",
    "NetworkPolicy",
    "PodDisruptionBudget",
    "Secret",
    "Service",
    "ServiceAccount",
    "StatefulSet",
];

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The non-empty documents of a multi-document YAML text (split at `---` lines).
fn documents(text: &str) -> Vec<Value> {
    let mut docs = vec![String::new()];
    for line in text.lines() {
        if line == "---" || line.starts_with("--- ") {
            docs.push(String::new());
        } else {
            let doc = docs.last_mut().unwrap();
            doc.push_str(line);
            doc.push('\n');
        }
    }
    docs.iter()
        .map(|d| serde_yaml_ng::from_str::<Value>(d).expect("YAML"))
        .filter(|v| !v.is_null())
        .collect()
}

fn str_at<'a>(v: &'a Value, path: &[&str]) -> Option<&'a str> {
    path.iter().try_fold(v, |v, k| v.get(*k))?.as_str()
}

fn kind(o: &Value) -> &str {
    str_at(o, &["kind"]).expect("a kind")
}

fn name(o: &Value) -> &str {
    str_at(o, &["metadata", "name"]).expect("a name")
}

fn id(o: &Value) -> String {
    format!(
        "{}/{}/{}",
        kind(o),
        str_at(o, &["metadata", "namespace"]).unwrap_or("-"),
        name(o)
    )
}

/// Renders a kustomization the way `kubectl kustomize` does, for the subset the manifests use:
/// `resources` (files and directories holding a kustomization), `namespace`, and `patches` given
/// inline whose patch is `$patch: delete`. Anything else is refused, never ignored.
fn render(dir: &Path) -> Vec<Value> {
    let file = dir.join("kustomization.yaml");
    let k: Value = serde_yaml_ng::from_str(&read(&file)).expect("kustomization.yaml is YAML");
    for key in k.as_mapping().expect("a mapping").keys() {
        let key = key.as_str().unwrap();
        assert!(
            ["apiVersion", "kind", "namespace", "resources", "patches"].contains(&key),
            "{}: `{key}` is not implemented by this test's renderer (keep to resources, \
             namespace and inline `$patch: delete` patches, or teach the renderer)",
            file.display()
        );
    }
    assert_eq!(str_at(&k, &["kind"]), Some("Kustomization"));
    let mut objects = Vec::new();
    for resource in strings(&k["resources"]) {
        let path = dir.join(&resource);
        if path.is_dir() {
            objects.extend(render(&path));
        } else {
            objects.extend(documents(&read(&path)));
        }
    }
    if let Some(patches) = k.get("patches") {
        for entry in patches.as_sequence().expect("a list of patches") {
            let keys: Vec<_> = entry.as_mapping().unwrap().keys().collect();
            assert!(
                keys.len() == 1 && keys[0].as_str() == Some("patch"),
                "{}: only inline `patch:` entries are implemented: {entry:?}",
                file.display()
            );
            let patch: Value = serde_yaml_ng::from_str(entry["patch"].as_str().unwrap()).unwrap();
            assert_eq!(
                str_at(&patch, &["$patch"]),
                Some("delete"),
                "{}: only `$patch: delete` is implemented: {patch:?}",
                file.display()
            );
            let before = objects.len();
            objects.retain(|o| {
                !(o["apiVersion"] == patch["apiVersion"]
                    && o["kind"] == patch["kind"]
                    && o["metadata"]["name"] == patch["metadata"]["name"])
            });
            assert_eq!(
                before - objects.len(),
                1,
                "{}: {patch:?} matches no object",
                file.display()
            );
        }
    }
    if let Some(namespace) = k.get("namespace") {
        for o in &mut objects {
            match kind(o) {
                "Namespace" => {}
                k if NAMESPACED.contains(&k) => {
                    o["metadata"]
                        .as_mapping_mut()
                        .unwrap()
                        .insert("namespace".into(), namespace.clone());
                }
                other => panic!("the renderer does not know whether {other} is namespaced"),
            }
        }
    }
    let ids: BTreeSet<String> = objects.iter().map(id).collect();
    assert_eq!(
        ids.len(),
        objects.len(),
        "{}: duplicate objects",
        dir.display()
    );
    objects
}

fn rendered(install: &str) -> Vec<Value> {
    render(&repo_file(install))
}

fn find<'a>(objects: &'a [Value], kind_: &str, name_: &str) -> Option<&'a Value> {
    objects
        .iter()
        .find(|o| kind(o) == kind_ && name(o) == name_)
}

#[test]
fn both_installs_render_and_kubectl_renders_the_same() {
    for install in INSTALLS {
        let objects = rendered(install);
        for o in &objects {
            if kind(o) != "Namespace" {
                assert_eq!(
                    str_at(o, &["metadata", "namespace"]),
                    Some("prefix-router"),
                    "{install}: {}",
                    id(o)
                );
            }
        }
        match Command::new("kubectl")
            .args(["kustomize", repo_file(install).to_str().unwrap()])
            .output()
        {
            Err(e) => println!(
                "{install}: {} objects; kubectl not runnable ({e}), so not compared with `kubectl kustomize`",
                objects.len()
            ),
            Ok(out) => {
                assert!(
                    out.status.success(),
                    "kubectl kustomize {install}: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
                let theirs = documents(&String::from_utf8(out.stdout).unwrap());
                let keyed = |objects: &[Value]| -> BTreeMap<String, Value> {
                    objects.iter().map(|o| (id(o), o.clone())).collect()
                };
                let (ours, theirs) = (keyed(&objects), keyed(&theirs));
                assert_eq!(
                    ours.keys().collect::<Vec<_>>(),
                    theirs.keys().collect::<Vec<_>>(),
                    "{install}: the objects this test renders vs kubectl kustomize"
                );
                for (key, object) in &ours {
                    assert!(
                        object == &theirs[key],
                        "{install}: {key} differs from kubectl kustomize's:\n{}\n---\n{}",
                        serde_yaml_ng::to_string(object).unwrap(),
                        serde_yaml_ng::to_string(&theirs[key]).unwrap()
                    );
                }
                println!(
                    "{install}: {} objects, the same as `kubectl kustomize` renders",
                    objects.len()
                );
            }
        }
    }
}

/// Runs kubernetes-validate (strict: unknown fields are errors) over `objects`; returns the
/// lines that are not a pass (errors, and warnings such as a kind it has no schema for), and the
/// number of passes.
fn validate(objects: &[Value]) -> (Vec<String>, usize) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("objects.yaml");
    let text: Vec<String> = objects
        .iter()
        .map(|o| serde_yaml_ng::to_string(o).unwrap())
        .collect();
    std::fs::write(&file, text.join("---\n")).unwrap();
    let mut command = Command::new("python3");
    command.args(["-m", "kubernetes_validate", "--strict"]);
    for version in KUBERNETES_VERSIONS {
        command.args(["-k", version]);
    }
    let out = command.arg(&file).output().expect("python3 runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let passed = stdout
        .lines()
        .filter(|l| l.starts_with("INFO ") && l.contains(" passed for resource "))
        .count();
    let mut problems: Vec<String> = stdout
        .lines()
        .filter(|l| !(l.starts_with("INFO ") && l.contains(" passed for resource ")))
        .map(str::to_string)
        .collect();
    if !out.status.success() && problems.is_empty() {
        problems.push(format!(
            "exit {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    (problems, passed)
}

#[test]
fn every_rendered_object_passes_the_kubernetes_schemas() {
    if require_tool(
        "kubernetes schema validation",
        python_modules(&["kubernetes_validate"]),
    )
    .is_none()
    {
        return;
    }
    for install in INSTALLS {
        let objects = rendered(install);
        let (problems, passed) = validate(&objects);
        assert!(
            problems.is_empty(),
            "{install}: kubernetes-validate:\n{}",
            problems.join("\n")
        );
        assert_eq!(
            passed,
            objects.len() * KUBERNETES_VERSIONS.len(),
            "{install}: every object passes for every version"
        );
        println!(
            "{install}: {} objects valid (strict) against Kubernetes {}",
            objects.len(),
            KUBERNETES_VERSIONS.join(" and ")
        );
    }

    // The check sees what it must: a misspelt field and an unknown kind are both problems.
    let mut objects = rendered(INSTALLS[0]);
    let deployment = objects
        .iter_mut()
        .find(|o| kind(o) == "Deployment")
        .unwrap();
    deployment["spec"]
        .as_mapping_mut()
        .unwrap()
        .insert("replica".into(), 3.into());
    let service = objects.iter_mut().find(|o| kind(o) == "Service").unwrap();
    service["apiVersion"] = "v9".into();
    let (problems, _) = validate(&objects);
    assert_eq!(
        problems.len(),
        2 * KUBERNETES_VERSIONS.len(),
        "{problems:#?}"
    );
}

/// The Gateway API install: the default install's objects unchanged, plus an InferencePool and
/// an HTTPRoute (custom resources, which kubernetes-validate has no schema for: their fields are
/// checked here against the published `inference.networking.k8s.io/v1` and
/// `gateway.networking.k8s.io/v1` APIs), the pool's endpoint picker being the data plane's
/// ext-proc port.
#[test]
fn the_gateway_api_install_adds_a_pool_whose_endpoint_picker_is_the_data_plane() {
    let default = rendered(INSTALLS[0]);
    let objects = rendered(GATEWAY_API);
    let (custom, core): (Vec<&Value>, Vec<&Value>) = objects
        .iter()
        .partition(|o| ["InferencePool", "HTTPRoute"].contains(&kind(o)));
    assert_eq!(
        core.len(),
        default.len(),
        "the default install's objects, no more"
    );
    for o in &core {
        assert_eq!(find(&default, kind(o), name(o)), Some(*o), "{}", id(o));
    }
    let pool = find(&objects, "InferencePool", "models").expect("an InferencePool");
    let route = find(&objects, "HTTPRoute", "models").expect("an HTTPRoute");
    assert_eq!(custom.len(), 2);
    assert_eq!(inference_pool_problems(pool), Vec::<String>::new());
    assert_eq!(http_route_problems(route), Vec::<String>::new());

    // The picker: the Service the pool names, on the port the pool names, reaches the data-plane
    // container's --ext-proc-listen.
    let picker = &pool["spec"]["endpointPickerRef"];
    let service = find(&objects, "Service", str_at(picker, &["name"]).unwrap())
        .expect("the endpoint picker's Service");
    let number = picker["port"]["number"].as_u64().unwrap();
    let port = service["spec"]["ports"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|p| p["port"].as_u64() == Some(number))
        .expect("the Service serves the picker's port");
    assert_eq!(str_at(port, &["appProtocol"]), Some("kubernetes.io/h2c"));
    let all = workloads(&objects);
    let selected = selected_by(&all, &service["spec"]["selector"]);
    assert_eq!(
        selected.len(),
        1,
        "one workload behind the picker's Service"
    );
    let container = &containers(selected[0].template)[0];
    let target = resolve_port(&port["targetPort"], &container_ports(container)).unwrap();
    let args = strings(&container["args"]);
    assert_eq!(
        flag_value(&args, "--ext-proc-listen").map(port_of),
        Some(target),
        "the picker's port is where the data plane serves ext_proc"
    );
    // The route sends to the pool.
    let backend = &route["spec"]["rules"][0]["backendRefs"][0];
    assert_eq!(str_at(backend, &["name"]), Some(name(pool)));

    // The checks see what they must: misspelt fields, a missing one and a bad enum.
    let mut bad = pool.clone();
    bad["spec"]["endpointPickerRef"]["failureMode"] = "FailSoft".into();
    bad["spec"]["targetPort"] = bad["spec"]["targetPorts"].clone();
    bad["spec"].as_mapping_mut().unwrap().remove("selector");
    assert_eq!(
        inference_pool_problems(&bad).len(),
        3,
        "{:?}",
        inference_pool_problems(&bad)
    );
    let mut bad = route.clone();
    bad["spec"]["rules"][0]["backendRefs"][0]["kind"] = "Service".into();
    bad["spec"]["parentRef"] = bad["spec"]["parentRefs"].clone();
    assert_eq!(
        http_route_problems(&bad).len(),
        2,
        "{:?}",
        http_route_problems(&bad)
    );
}

/// The Gateway API install (an overlay of the default one).
const GATEWAY_API: &str = "deploy/kubernetes/gateway-api";

/// Keys of `v` outside `allowed`, and `required` ones missing, as messages naming `at`.
fn keys_problems(v: &Value, at: &str, allowed: &[&str], required: &[&str]) -> Vec<String> {
    let Some(map) = v.as_mapping() else {
        return vec![format!("{at}: not a mapping")];
    };
    let mut out = Vec::new();
    for k in map.keys().filter_map(|k| k.as_str()) {
        if !allowed.contains(&k) {
            out.push(format!("{at}.{k}: no such field"));
        }
    }
    for r in required {
        if !map.contains_key(*r) {
            out.push(format!("{at}.{r}: required"));
        }
    }
    out
}

fn port_number_problems(v: &Value, at: &str) -> Vec<String> {
    let mut out = keys_problems(v, at, &["number"], &["number"]);
    if !v["number"]
        .as_u64()
        .is_some_and(|n| (1..=65535).contains(&n))
    {
        out.push(format!("{at}.number: an integer in 1..=65535"));
    }
    out
}

/// An `inference.networking.k8s.io/v1` InferencePool's fields against the published API (v1.0):
/// `spec.selector.matchLabels` (string to string), `spec.targetPorts` (exactly one `{number}`),
/// `spec.endpointPickerRef` (`name`; `group`, `kind`, `port.number`, `failureMode` FailOpen or
/// FailClose).
fn inference_pool_problems(o: &Value) -> Vec<String> {
    let mut out = Vec::new();
    if str_at(o, &["apiVersion"]) != Some("inference.networking.k8s.io/v1") {
        out.push("apiVersion: inference.networking.k8s.io/v1".to_string());
    }
    let spec = &o["spec"];
    out.extend(keys_problems(
        spec,
        "spec",
        &["selector", "targetPorts", "endpointPickerRef"],
        &["selector", "targetPorts", "endpointPickerRef"],
    ));
    if let Some(selector) = spec.get("selector") {
        out.extend(keys_problems(
            selector,
            "spec.selector",
            &["matchLabels"],
            &["matchLabels"],
        ));
        let labels = selector["matchLabels"].as_mapping();
        if !labels.is_some_and(|m| !m.is_empty() && m.values().all(Value::is_string)) {
            out.push("spec.selector.matchLabels: labels (string values)".to_string());
        }
    }
    if let Some(ports) = spec.get("targetPorts") {
        match ports.as_sequence() {
            Some(list) if list.len() == 1 => {
                out.extend(port_number_problems(&list[0], "spec.targetPorts[0]"))
            }
            _ => out.push("spec.targetPorts: exactly one port".to_string()),
        }
    }
    if let Some(picker) = spec.get("endpointPickerRef") {
        let at = "spec.endpointPickerRef";
        out.extend(keys_problems(
            picker,
            at,
            &["group", "kind", "name", "port", "failureMode"],
            &["name"],
        ));
        if let Some(port) = picker.get("port") {
            out.extend(port_number_problems(port, &format!("{at}.port")));
        }
        if let Some(mode) = picker.get("failureMode") {
            if !["FailOpen", "FailClose"].contains(&mode.as_str().unwrap_or_default()) {
                out.push(format!(
                    "{at}.failureMode: FailOpen or FailClose, not {mode:?}"
                ));
            }
        }
        if picker
            .get("kind")
            .is_some_and(|k| k.as_str() != Some("Service"))
        {
            out.push(format!("{at}.kind: Service"));
        }
    }
    out
}

/// A `gateway.networking.k8s.io/v1` HTTPRoute's fields (the subset used): `spec.parentRefs`
/// (`name`, ...), `spec.rules[].matches` and `backendRefs` naming an InferencePool by group and
/// kind.
fn http_route_problems(o: &Value) -> Vec<String> {
    let mut out = Vec::new();
    if str_at(o, &["apiVersion"]) != Some("gateway.networking.k8s.io/v1") {
        out.push("apiVersion: gateway.networking.k8s.io/v1".to_string());
    }
    let spec = &o["spec"];
    out.extend(keys_problems(
        spec,
        "spec",
        &["parentRefs", "hostnames", "rules"],
        &["parentRefs"],
    ));
    for (i, parent) in spec["parentRefs"]
        .as_sequence()
        .into_iter()
        .flatten()
        .enumerate()
    {
        out.extend(keys_problems(
            parent,
            &format!("spec.parentRefs[{i}]"),
            &["group", "kind", "namespace", "name", "sectionName", "port"],
            &["name"],
        ));
    }
    for (i, rule) in spec["rules"]
        .as_sequence()
        .into_iter()
        .flatten()
        .enumerate()
    {
        let at = format!("spec.rules[{i}]");
        out.extend(keys_problems(
            rule,
            &at,
            &["name", "matches", "filters", "backendRefs", "timeouts"],
            &[],
        ));
        for (j, b) in rule["backendRefs"]
            .as_sequence()
            .into_iter()
            .flatten()
            .enumerate()
        {
            let at = format!("{at}.backendRefs[{j}]");
            out.extend(keys_problems(
                b,
                &at,
                &[
                    "group",
                    "kind",
                    "name",
                    "namespace",
                    "port",
                    "weight",
                    "filters",
                ],
                &["name"],
            ));
            if str_at(b, &["group"]) != Some("inference.networking.k8s.io")
                || str_at(b, &["kind"]) != Some("InferencePool")
            {
                out.push(format!(
                    "{at}: an InferencePool (group inference.networking.k8s.io)"
                ));
            }
        }
    }
    out
}

/// A container's command line, split into the binary, its subcommand words and the rest.
struct Invocation {
    binary: String,
    subcommand: Vec<String>,
    argv: Vec<String>,
}

impl Invocation {
    /// `argv` as a container or an exec probe runs it; a leading `env -u VAR ...` is skipped.
    fn parse(argv: Vec<String>) -> Self {
        let mut rest = argv.as_slice();
        if rest.first().map(String::as_str) == Some("env") {
            rest = &rest[1..];
            while rest.first().map(String::as_str) == Some("-u") {
                rest = &rest[2..];
            }
        }
        let binary = rest[0].clone();
        let subcommand = rest[1..]
            .iter()
            .take_while(|w| !w.starts_with('-'))
            .cloned()
            .collect();
        Self {
            binary,
            subcommand,
            argv: rest[1..].to_vec(),
        }
    }
}

/// `--help` texts by binary and subcommand, and what could not be checked.
#[derive(Default)]
struct Helps {
    texts: BTreeMap<(String, Vec<String>), Option<String>>,
    flags_checked: usize,
    not_checked: BTreeSet<String>,
}

impl Helps {
    fn text(&mut self, binary: &str, subcommand: &[String]) -> Option<String> {
        self.texts
            .entry((binary.to_string(), subcommand.to_vec()))
            .or_insert_with(|| {
                if BINARIES.contains(&binary) {
                    let words: Vec<&str> = subcommand.iter().map(String::as_str).collect();
                    Some(help(binary, &words))
                } else {
                    // A third-party binary (etcd): checked when the same program is installed
                    // here (Debian's etcd-server), else listed as not checked.
                    let out = Command::new(binary).arg("--help").output().ok()?;
                    let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
                    text.push_str(&String::from_utf8_lossy(&out.stderr));
                    Some(text)
                }
            })
            .clone()
    }

    /// Every flag of `call` is in its binary's `--help`.
    fn check(&mut self, who: &str, call: &Invocation) {
        let Some(text) = self.text(&call.binary, &call.subcommand) else {
            self.not_checked.insert(format!(
                "{}'s flags ({} is not installed here)",
                call.binary, call.binary
            ));
            return;
        };
        for flag in flags(&call.argv) {
            if help_has_flag(&text, flag) {
                self.flags_checked += 1;
            } else {
                panic!(
                    "{who}: {} {:?} has no flag {flag}:\n{text}",
                    call.binary, call.subcommand
                );
            }
        }
    }
}

/// A Deployment or StatefulSet: name, replicas and pod template.
struct Workload<'a> {
    kind: &'a str,
    name: &'a str,
    replicas: i64,
    object: &'a Value,
    template: &'a Value,
}

fn workloads(objects: &[Value]) -> Vec<Workload<'_>> {
    objects
        .iter()
        .filter(|o| ["Deployment", "StatefulSet"].contains(&kind(o)))
        .map(|o| Workload {
            kind: kind(o),
            name: name(o),
            replicas: o["spec"]["replicas"].as_i64().unwrap_or(1),
            object: o,
            template: &o["spec"]["template"],
        })
        .collect()
}

fn labels(v: &Value) -> BTreeMap<String, String> {
    v.as_mapping()
        .map(|m| {
            m.iter()
                .map(|(k, v)| {
                    (
                        k.as_str().unwrap().to_string(),
                        v.as_str().expect("a string label").to_string(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Whether a label selector (a plain map, or `matchLabels`) selects these pod labels.
fn selects(selector: &Value, pod_labels: &BTreeMap<String, String>) -> bool {
    let wanted = labels(selector.get("matchLabels").unwrap_or(selector));
    !wanted.is_empty() && wanted.iter().all(|(k, v)| pod_labels.get(k) == Some(v))
}

/// The workloads whose pods a label selector selects.
fn selected_by<'a>(all: &'a [Workload<'a>], selector: &Value) -> Vec<&'a Workload<'a>> {
    all.iter()
        .filter(|w| selects(selector, &labels(&w.template["metadata"]["labels"])))
        .collect()
}

fn containers(template: &Value) -> &Vec<Value> {
    template["spec"]["containers"]
        .as_sequence()
        .expect("containers")
}

/// `name -> containerPort` of a container.
fn container_ports(container: &Value) -> BTreeMap<String, u16> {
    container
        .get("ports")
        .and_then(Value::as_sequence)
        .map(|ports| {
            ports
                .iter()
                .map(|p| {
                    let port = p["containerPort"].as_u64().unwrap() as u16;
                    let name = str_at(p, &["name"]).map_or(port.to_string(), str::to_string);
                    (name, port)
                })
                .collect()
        })
        .unwrap_or_default()
}

/// A port given by number or by the name of a container port.
fn resolve_port(port: &Value, ports: &BTreeMap<String, u16>) -> Option<u16> {
    match port {
        Value::Number(n) => n
            .as_u64()
            .map(|n| n as u16)
            .filter(|n| ports.values().any(|p| p == n)),
        Value::String(s) => ports.get(s).copied(),
        _ => None,
    }
}

/// The ports a container's own flags say it listens on.
fn listen_ports(call: &Invocation) -> BTreeSet<u16> {
    let listen_flags: &[&str] = if call.binary == "etcd" {
        &[
            "--listen-client-urls",
            "--listen-peer-urls",
            "--listen-metrics-urls",
        ]
    } else {
        &["--listen", "--metrics-listen", "--ext-proc-listen"]
    };
    listen_flags
        .iter()
        .filter_map(|f| flag_value(&call.argv, f))
        .flat_map(|v| v.split(',').map(port_of))
        .collect()
}

/// The port the pod's Prometheus annotations must name: where the binary serves `/metrics`.
fn metrics_port(call: &Invocation) -> u16 {
    let flag = match call.binary.as_str() {
        "control-plane" => "--metrics-listen",
        "data-plane" | "engine-sim" => "--listen",
        "etcd" => "--listen-metrics-urls",
        other => panic!("where does {other} serve /metrics?"),
    };
    let value = flag_value(&call.argv, flag).unwrap_or_else(|| panic!("{flag} is set"));
    port_of(value.split(',').next().unwrap())
}

/// Every `http://HOST:PORT` in `text`.
fn urls(text: &str) -> Vec<(String, u16)> {
    text.split("http://")
        .skip(1)
        .filter_map(|part| {
            let end = part
                .find(|c: char| !(c.is_ascii_alphanumeric() || "-.:$()_".contains(c)))
                .unwrap_or(part.len());
            let (host, port) = part[..end].rsplit_once(':')?;
            Some((host.to_string(), port.parse().ok()?))
        })
        .collect()
}

/// What the container checks found, to print.
#[derive(Default)]
struct Tally {
    containers: usize,
    ports: usize,
    urls: usize,
    mounted_files: usize,
}

/// Checks one install; returns its tally.
fn check_install(install: &str, objects: &[Value], helps: &mut Helps) -> Tally {
    let dockerfile = read(&repo_file("Dockerfile"));
    let secrets: BTreeMap<&str, BTreeMap<String, String>> = objects
        .iter()
        .filter(|o| kind(o) == "Secret")
        .map(|o| {
            let mut keys = BTreeMap::new();
            for field in ["stringData", "data"] {
                if let Some(m) = o.get(field).and_then(Value::as_mapping) {
                    for (k, v) in m {
                        keys.insert(
                            k.as_str().unwrap().to_string(),
                            v.as_str().unwrap().to_string(),
                        );
                    }
                }
            }
            (name(o), keys)
        })
        .collect();
    let services: BTreeMap<&str, &Value> = objects
        .iter()
        .filter(|o| kind(o) == "Service")
        .map(|o| (name(o), o))
        .collect();
    let service_ports = |svc: &Value| -> BTreeSet<u16> {
        svc["spec"]["ports"]
            .as_sequence()
            .unwrap()
            .iter()
            .map(|p| p["port"].as_u64().unwrap() as u16)
            .collect()
    };
    let all = workloads(objects);
    let mut tally = Tally::default();

    for w in &all {
        let who = format!("{install}: {} {}", w.kind, w.name);
        let pod = &w.template["spec"];
        let pod_labels = labels(&w.template["metadata"]["labels"]);
        assert!(
            selects(&w.object["spec"]["selector"], &pod_labels),
            "{who}: its selector does not select its pods"
        );
        assert_eq!(
            pod["automountServiceAccountToken"].as_bool(),
            Some(false),
            "{who}: pods need no Kubernetes API token"
        );
        // Volumes: a Secret volume names a Secret of the install and keys it has.
        let mut volume_files: BTreeMap<&str, Option<BTreeSet<String>>> = BTreeMap::new();
        let claims: BTreeSet<&str> = w.object["spec"]
            .get("volumeClaimTemplates")
            .and_then(Value::as_sequence)
            .map(|c| c.iter().map(name).collect())
            .unwrap_or_default();
        for claim in &claims {
            volume_files.insert(claim, None);
        }
        for volume in pod
            .get("volumes")
            .and_then(Value::as_sequence)
            .into_iter()
            .flatten()
        {
            let vname = str_at(volume, &["name"]).unwrap();
            let files = volume.get("secret").map(|secret| {
                let sname = str_at(secret, &["secretName"]).unwrap();
                let keys = secrets
                    .get(sname)
                    .unwrap_or_else(|| panic!("{who}: no Secret {sname}"));
                match secret.get("items").and_then(Value::as_sequence) {
                    Some(items) => items
                        .iter()
                        .map(|item| {
                            let key = str_at(item, &["key"]).unwrap();
                            assert!(keys.contains_key(key), "{who}: Secret {sname} has no {key}");
                            str_at(item, &["path"]).unwrap().to_string()
                        })
                        .collect(),
                    None => keys.keys().cloned().collect(),
                }
            });
            volume_files.insert(vname, files);
        }

        let mut metrics_ports = Vec::new();
        for container in containers(w.template) {
            let cname = str_at(container, &["name"]).unwrap();
            let who = format!("{who} container {cname}");
            tally.containers += 1;
            let image = str_at(container, &["image"]).unwrap();
            let mut argv = strings(&container["command"]);
            argv.extend(strings(&container["args"]));
            assert!(!argv.is_empty(), "{who}: no command");
            let call = Invocation::parse(argv);
            let ours = image.starts_with("prefix-router:");
            if ours {
                assert!(
                    BINARIES.contains(&call.binary.as_str()),
                    "{who}: {} is not one of our binaries",
                    call.binary
                );
                assert!(
                    dockerfile.contains(&format!("release/{}", call.binary)),
                    "{who}: the Dockerfile does not ship {}",
                    call.binary
                );
            } else {
                assert!(
                    image.starts_with("quay.io/coreos/etcd:v3.5.") && call.binary == "etcd",
                    "{who}: unexpected image {image} running {}",
                    call.binary
                );
            }
            helps.check(&who, &call);

            // Environment: read by the binary (or the OpenTelemetry SDK), or used in the
            // command line as $(VAR); every $(VAR) is defined.
            let env: BTreeMap<&str, &Value> = container
                .get("env")
                .and_then(Value::as_sequence)
                .into_iter()
                .flatten()
                .map(|e| (str_at(e, &["name"]).unwrap(), e))
                .collect();
            let command_line = call.argv.join(" ");
            for (var, entry) in &env {
                let used = command_line.contains(&format!("$({var})"));
                if ours && !used {
                    let text = helps.text(&call.binary, &[]).unwrap();
                    assert!(
                        SDK_ENV.contains(var) || help_has_env(&text, var),
                        "{who}: {} reads no environment variable {var}",
                        call.binary
                    );
                }
                if let Some(r) = entry.get("valueFrom").and_then(|v| v.get("secretKeyRef")) {
                    let (sname, key) =
                        (str_at(r, &["name"]).unwrap(), str_at(r, &["key"]).unwrap());
                    assert!(
                        secrets.get(sname).is_some_and(|k| k.contains_key(key)),
                        "{who}: ${var} from Secret {sname} key {key}, which does not exist"
                    );
                }
            }
            for part in command_line.split("$(").skip(1) {
                let var = part.split(')').next().unwrap();
                assert!(env.contains_key(var), "{who}: $({var}) is not defined");
            }
            if ours {
                assert_eq!(
                    env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                        .and_then(|e| str_at(e, &["value"])),
                    Some(OTLP_ENDPOINT),
                    "{who}: traces go to the collector"
                );
                assert_eq!(
                    env.get("OTEL_SERVICE_NAME")
                        .and_then(|e| str_at(e, &["value"])),
                    Some(call.binary.as_str()),
                    "{who}: OTEL_SERVICE_NAME"
                );
            }

            // Ports: exactly the ones the listen flags name; probes use them.
            let ports = container_ports(container);
            let listens = listen_ports(&call);
            assert!(!listens.is_empty(), "{who}: no listen flag");
            assert_eq!(
                ports.values().copied().collect::<BTreeSet<_>>(),
                listens,
                "{who}: container ports vs the ports its flags listen on"
            );
            tally.ports += listens.len();
            assert!(
                container.get("readinessProbe").is_some(),
                "{who}: no readiness probe"
            );
            for probe_kind in ["readinessProbe", "livenessProbe", "startupProbe"] {
                let Some(probe) = container.get(probe_kind) else {
                    continue;
                };
                if let Some(exec) = probe.get("exec") {
                    let probe_call = Invocation::parse(strings(&exec["command"]));
                    assert!(
                        BINARIES.contains(&probe_call.binary.as_str()),
                        "{who}: {probe_kind} runs {}",
                        probe_call.binary
                    );
                    helps.check(&format!("{who} {probe_kind}"), &probe_call);
                    let target = flag_value(&probe_call.argv, "--control-plane")
                        .unwrap_or_else(|| panic!("{who}: {probe_kind} names no --control-plane"));
                    assert!(
                        target.starts_with("http://127.0.0.1:")
                            && listens.contains(&port_of(target)),
                        "{who}: {probe_kind} calls {target}, not this container ({listens:?})"
                    );
                    check_paths(&who, &probe_call, container, &volume_files, &mut tally);
                } else {
                    let port = ["httpGet", "tcpSocket", "grpc"]
                        .iter()
                        .find_map(|h| probe.get(*h))
                        .map(|h| &h["port"])
                        .unwrap_or_else(|| panic!("{who}: {probe_kind} has no port"));
                    assert!(
                        resolve_port(port, &ports).is_some(),
                        "{who}: {probe_kind} port {port:?} is not a container port {ports:?}"
                    );
                }
            }

            check_paths(&who, &call, container, &volume_files, &mut tally);

            // URLs in the command line: a Service port of the install, a member of a
            // StatefulSet behind a headless Service, or this container itself.
            for (host, port) in urls(&command_line) {
                if host == "localhost" || host.parse::<std::net::IpAddr>().is_ok() {
                    assert!(listens.contains(&port), "{who}: http://{host}:{port}");
                    continue;
                }
                let labels_: Vec<&str> = host.split('.').collect();
                let service: &str = match labels_.as_slice() {
                    [svc] => svc,
                    [member, svc] => {
                        let (member, svc) = (*member, *svc);
                        let sts = all
                            .iter()
                            .find(|s| {
                                s.kind == "StatefulSet"
                                    && str_at(s.object, &["spec", "serviceName"]) == Some(svc)
                            })
                            .unwrap_or_else(|| panic!("{who}: no StatefulSet behind {svc}"));
                        let headless = services
                            .get(svc)
                            .unwrap_or_else(|| panic!("{who}: no Service {svc}"));
                        assert_eq!(
                            str_at(headless, &["spec", "clusterIP"]),
                            Some("None"),
                            "{who}: {svc} names members, so it is headless"
                        );
                        let ok = member == "$(POD_NAME)" && w.name == sts.name
                            || member
                                .strip_prefix(&format!("{}-", sts.name))
                                .and_then(|i| i.parse::<i64>().ok())
                                .is_some_and(|i| i < sts.replicas);
                        assert!(
                            ok,
                            "{who}: http://{host}:{port} is no member of {}",
                            sts.name
                        );
                        svc
                    }
                    _ => panic!("{who}: http://{host}:{port} is not a Service of the install"),
                };
                let svc = services
                    .get(service)
                    .unwrap_or_else(|| panic!("{who}: http://{host}:{port}: no Service {service}"));
                assert!(
                    service_ports(svc).contains(&port),
                    "{who}: http://{host}:{port}: Service {service} has ports {:?}",
                    service_ports(svc)
                );
                tally.urls += 1;
            }

            // etcd's initial cluster is exactly the StatefulSet's members.
            if let Some(cluster) = flag_value(&call.argv, "--initial-cluster") {
                let members: Vec<&str> = cluster
                    .split(',')
                    .map(|m| {
                        let (member, url) = m.split_once('=').unwrap();
                        assert!(url.starts_with(&format!("http://{member}.")), "{who}: {m}");
                        member
                    })
                    .collect();
                let expected: Vec<String> =
                    (0..w.replicas).map(|i| format!("{}-{i}", w.name)).collect();
                assert_eq!(members, expected, "{who}: --initial-cluster");
            }

            // Hardened and bounded.
            let sc = &container["securityContext"];
            assert_eq!(
                sc["allowPrivilegeEscalation"].as_bool(),
                Some(false),
                "{who}"
            );
            assert_eq!(sc["readOnlyRootFilesystem"].as_bool(), Some(true), "{who}");
            assert!(
                strings(&sc["capabilities"]["drop"]).contains(&"ALL".to_string()),
                "{who}: drops all capabilities"
            );
            assert!(
                sc["runAsNonRoot"].as_bool() == Some(true)
                    || pod["securityContext"]["runAsNonRoot"].as_bool() == Some(true),
                "{who}: runAsNonRoot"
            );
            for bound in ["requests", "limits"] {
                for resource in ["cpu", "memory"] {
                    assert!(
                        container["resources"][bound].get(resource).is_some(),
                        "{who}: resources.{bound}.{resource}"
                    );
                }
            }
            metrics_ports.push(metrics_port(&call));
        }

        // Prometheus finds the pod's metrics port.
        let annotations = labels(&w.template["metadata"]["annotations"]);
        assert_eq!(
            annotations.get("prometheus.io/scrape").map(String::as_str),
            Some("true"),
            "{who}"
        );
        assert_eq!(
            annotations.get("prometheus.io/path").map(String::as_str),
            Some("/metrics"),
            "{who}"
        );
        let annotated: u16 = annotations["prometheus.io/port"].parse().unwrap();
        assert_eq!(
            metrics_ports,
            [annotated],
            "{who}: prometheus.io/port vs where it serves /metrics"
        );
    }

    // Services send to a port every pod they select has.
    for (sname, svc) in &services {
        let selected = selected_by(&all, &svc["spec"]["selector"]);
        assert!(
            !selected.is_empty(),
            "{install}: Service {sname} selects no pods"
        );
        for p in svc["spec"]["ports"].as_sequence().unwrap() {
            let target = p.get("targetPort").unwrap_or(&p["port"]);
            for w in &selected {
                let ports: BTreeMap<String, u16> = containers(w.template)
                    .iter()
                    .flat_map(container_ports)
                    .collect();
                assert!(
                    resolve_port(target, &ports).is_some(),
                    "{install}: Service {sname} targets {target:?}, not a port of {} {ports:?}",
                    w.name
                );
            }
        }
    }
    // Disruption budgets select a workload and let a drain evict at least one pod.
    for pdb in objects.iter().filter(|o| kind(o) == "PodDisruptionBudget") {
        let selected = selected_by(&all, &pdb["spec"]["selector"]);
        assert_eq!(selected.len(), 1, "{install}: PDB {}", name(pdb));
        if let Some(min) = pdb["spec"]["minAvailable"].as_i64() {
            assert!(
                min < selected[0].replicas,
                "{install}: PDB {} minAvailable {min} of {} replicas blocks every drain",
                name(pdb),
                selected[0].replicas
            );
        }
        if let Some(max) = pdb["spec"]["maxUnavailable"].as_i64() {
            assert!(max >= 1, "{install}: PDB {}", name(pdb));
        }
    }
    // Network policies apply to one workload, name its ports, and admit pods of the install.
    for policy in objects.iter().filter(|o| kind(o) == "NetworkPolicy") {
        let who = format!("{install}: NetworkPolicy {}", name(policy));
        let selected = selected_by(&all, &policy["spec"]["podSelector"]);
        assert_eq!(selected.len(), 1, "{who}");
        let ports: BTreeMap<String, u16> = containers(selected[0].template)
            .iter()
            .flat_map(container_ports)
            .collect();
        for rule in policy["spec"]["ingress"].as_sequence().unwrap() {
            for port in rule["ports"].as_sequence().unwrap() {
                assert!(
                    resolve_port(&port["port"], &ports).is_some(),
                    "{who}: port {:?} is not one of {ports:?}",
                    port["port"]
                );
            }
            for peer in rule
                .get("from")
                .and_then(Value::as_sequence)
                .into_iter()
                .flatten()
            {
                assert!(
                    !selected_by(&all, &peer["podSelector"]).is_empty(),
                    "{who}: {peer:?} selects no pods of the install"
                );
            }
        }
    }
    // Autoscalers scale a Deployment of the install, from its replica count up.
    for hpa in objects
        .iter()
        .filter(|o| kind(o) == "HorizontalPodAutoscaler")
    {
        let target = &hpa["spec"]["scaleTargetRef"];
        let w = all
            .iter()
            .find(|w| {
                Some(w.kind) == str_at(target, &["kind"])
                    && Some(w.name) == str_at(target, &["name"])
            })
            .unwrap_or_else(|| panic!("{install}: HPA {} scales nothing", name(hpa)));
        let min = hpa["spec"]["minReplicas"].as_i64().unwrap();
        let max = hpa["spec"]["maxReplicas"].as_i64().unwrap();
        assert!(
            min <= w.replicas && w.replicas <= max,
            "{install}: HPA {}",
            name(hpa)
        );
    }
    tally
}

/// Every file path a call names (flags' values starting with `/`) is on a volume the container
/// mounts: a Secret's file that exists, or a writable volume for what the binary writes.
fn check_paths(
    who: &str,
    call: &Invocation,
    container: &Value,
    volume_files: &BTreeMap<&str, Option<BTreeSet<String>>>,
    tally: &mut Tally,
) {
    let mounts: Vec<(&str, &str, bool)> = container
        .get("volumeMounts")
        .and_then(Value::as_sequence)
        .into_iter()
        .flatten()
        .map(|m| {
            assert!(
                m.get("subPath").is_none(),
                "{who}: a subPath mount never sees updates"
            );
            (
                str_at(m, &["name"]).unwrap(),
                str_at(m, &["mountPath"]).unwrap(),
                m["readOnly"].as_bool().unwrap_or(false),
            )
        })
        .collect();
    for flag in flags(&call.argv) {
        if NOT_PATHS.contains(&flag) {
            continue;
        }
        let Some(path) = flag_value(&call.argv, flag).filter(|v| v.starts_with('/')) else {
            continue;
        };
        let (volume, mount, read_only) = mounts
            .iter()
            .filter(|(_, m, _)| path == *m || path.starts_with(&format!("{m}/")))
            .max_by_key(|(_, m, _)| m.len())
            .unwrap_or_else(|| {
                panic!("{who}: {flag} {path} is on no volume (the root is read-only)")
            });
        let files = volume_files
            .get(volume)
            .unwrap_or_else(|| panic!("{who}: mounts undeclared volume {volume}"));
        match files {
            Some(files) => {
                let file = path[mount.len()..].trim_start_matches('/');
                assert!(
                    files.contains(file),
                    "{who}: {flag} {path}: the Secret volume {volume} holds only {files:?}"
                );
            }
            None if ["--data-dir", "--table-cache"].contains(&flag) => {
                assert!(!read_only, "{who}: {flag} {path} is on a read-only mount")
            }
            None => {}
        }
        tally.mounted_files += 1;
    }
}

#[test]
fn containers_use_flags_ports_files_and_urls_the_binaries_have() {
    let mut helps = Helps::default();
    for install in INSTALLS {
        let objects = rendered(install);
        let t = check_install(install, &objects, &mut helps);
        println!(
            "{install}: {} containers; {} listen ports, {} in-cluster URLs and {} mounted paths agree",
            t.containers, t.ports, t.urls, t.mounted_files
        );
    }
    let checked: BTreeSet<&str> = helps
        .texts
        .iter()
        .filter(|(_, text)| text.is_some())
        .map(|((binary, _), _)| binary.as_str())
        .collect();
    println!(
        "{} flags (as passed, both installs) found in the --help of {checked:?}",
        helps.flags_checked
    );
    for what in &helps.not_checked {
        println!("NOT CHECKED: {what}");
    }
    for binary in ["control-plane", "data-plane", "prefixctl"] {
        assert!(checked.contains(binary), "{binary} runs in the manifests");
    }
}

/// The control plane's container args, in an install.
fn control_plane_args(objects: &[Value]) -> (&str, i64, Vec<String>) {
    let w = workloads(objects)
        .into_iter()
        .find(|w| w.name == "control-plane")
        .expect("a control-plane workload");
    let c = &containers(w.template)[0];
    let mut argv = strings(&c["command"]);
    argv.extend(strings(&c["args"]));
    (w.kind, w.replicas, argv)
}

/// The ports of a NetworkPolicy rule, as written.
fn strings_of_ports(rule: &Value) -> Vec<String> {
    rule["ports"]
        .as_sequence()
        .into_iter()
        .flatten()
        .map(|p| match &p["port"] {
            Value::String(s) => s.clone(),
            other => serde_yaml_ng::to_string(other).unwrap().trim().to_string(),
        })
        .collect()
}

#[test]
fn the_default_install_runs_on_etcd_and_single_node_on_sled() {
    let default = rendered(INSTALLS[0]);
    let (kind_, replicas, args) = control_plane_args(&default);
    assert_eq!((kind_, replicas), ("Deployment", 3));
    assert!(
        flag_value(&args, "--etcd-endpoints").is_some()
            && flag_value(&args, "--data-dir").is_none()
    );
    let etcd = find(&default, "StatefulSet", "etcd").expect("etcd");
    assert_eq!(etcd["spec"]["replicas"].as_i64(), Some(3));
    let pdb = find(&default, "PodDisruptionBudget", "control-plane").expect("a control-plane PDB");
    assert_eq!(pdb["spec"]["minAvailable"].as_i64(), Some(2));
    let data_plane = find(&default, "Deployment", "data-plane").expect("data planes");
    assert_eq!(data_plane["spec"]["replicas"].as_i64(), Some(2));
    let hpa = find(&default, "HorizontalPodAutoscaler", "data-plane").expect("an HPA");
    assert_eq!(str_at(hpa, &["apiVersion"]), Some("autoscaling/v2"));
    let metric = &hpa["spec"]["metrics"][0]["resource"];
    assert_eq!(str_at(metric, &["name"]), Some("cpu"));
    assert_eq!(metric["target"]["averageUtilization"].as_i64(), Some(70));
    assert!(find(&default, "PodDisruptionBudget", "data-plane").is_some());

    let policy = find(&default, "NetworkPolicy", "etcd").expect("etcd is fenced off");
    let client_peers: Vec<&str> = policy["spec"]["ingress"]
        .as_sequence()
        .unwrap()
        .iter()
        .filter(|rule| strings_of_ports(rule).contains(&"client".to_string()))
        .flat_map(|rule| rule["from"].as_sequence().expect("no open client port"))
        .map(|peer| {
            str_at(
                peer,
                &["podSelector", "matchLabels", "app.kubernetes.io/name"],
            )
            .unwrap()
        })
        .collect();
    assert_eq!(
        client_peers,
        ["control-plane", "etcd"],
        "who may use etcd's client port"
    );

    let single = rendered(INSTALLS[1]);
    let (kind_, replicas, args) = control_plane_args(&single);
    assert_eq!((kind_, replicas), ("StatefulSet", 1));
    assert_eq!(
        flag_value(&args, "--data-dir"),
        Some("/var/lib/prefix-router")
    );
    assert!(
        flags(&args).iter().all(|f| !f.starts_with("--etcd")),
        "{args:?}"
    );
    assert!(
        single.iter().all(|o| !name(o).starts_with("etcd")),
        "no etcd in the single-node install"
    );
    let sts = find(&single, "StatefulSet", "control-plane").unwrap();
    assert!(sts["spec"]["volumeClaimTemplates"]
        .as_sequence()
        .is_some_and(|c| !c.is_empty()));
}

#[test]
fn tokens_come_from_the_secret_and_the_committed_secret_holds_none() {
    for install in INSTALLS {
        let objects = rendered(install);
        for w in workloads(&objects) {
            let c = &containers(w.template)[0];
            let mut argv = strings(&c["command"]);
            argv.extend(strings(&c["args"]));
            let (secret_keys, token_flag) = match argv[0].as_str() {
                "control-plane" => {
                    assert!(
                        !argv.iter().any(|a| a == "--insecure"),
                        "{install}: --insecure"
                    );
                    (
                        ["tokens", "reader-token"].as_slice(),
                        "/etc/prefix-router/tokens/tokens",
                    )
                }
                // A data plane gets the reader token only: it can watch, never change routing.
                "data-plane" => (
                    ["reader-token"].as_slice(),
                    "/etc/prefix-router/tokens/reader-token",
                ),
                _ => continue,
            };
            assert_eq!(
                flag_value(&argv, "--auth-token-file"),
                Some(token_flag),
                "{install}: {}",
                w.name
            );
            let mounted: Vec<String> = w.template["spec"]["volumes"]
                .as_sequence()
                .unwrap()
                .iter()
                .filter_map(|v| v.get("secret"))
                .flat_map(|s| s["items"].as_sequence().unwrap())
                .map(|i| i["key"].as_str().unwrap().to_string())
                .collect();
            assert_eq!(mounted, secret_keys, "{install}: {} mounts", w.name);
        }
    }

    // The committed Secret is a placeholder: comments only, and a control plane given it
    // refuses to start, so an unedited install serves nobody rather than everybody.
    let objects = rendered(INSTALLS[0]);
    let secret = find(&objects, "Secret", "prefix-router-tokens").expect("the token Secret");
    assert!(secret.get("data").is_none(), "no hidden base64 data");
    let values = secret["stringData"].as_mapping().unwrap();
    for (key, value) in values {
        for line in value.as_str().unwrap().lines() {
            assert!(
                line.trim().is_empty() || line.trim_start().starts_with('#'),
                "Secret key {key:?} holds a token-like line: commit placeholders only"
            );
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let tokens = dir.path().join("tokens");
    std::fs::write(&tokens, secret["stringData"]["tokens"].as_str().unwrap()).unwrap();
    let data = dir.path().join("data");
    let refused = ChildServer::start(
        "control-plane",
        &[
            "--data-dir",
            data.to_str().unwrap(),
            "--auth-token-file",
            tokens.to_str().unwrap(),
        ],
    );
    let message = refused
        .err()
        .expect("the placeholder must not start a control plane")
        .to_string();
    assert!(message.contains("holds no secret"), "{message}");
}

/// Test tokens standing in for the placeholder Secret when the installs run here.
const TEST_SECRET: [(&str, &str); 2] = [
    ("tokens", "k8s-test-admin admin\nk8s-test-reader reader\n"),
    ("reader-token", "k8s-test-reader\n"),
];

/// One pod of an install, run here as a process: its container ports mapped to loopback ports
/// or unix sockets, its volumes to folders.
struct LocalPod {
    name: String,
    workload: usize,
    /// Where each container port is reached here. Our binaries bind `127.0.0.1:0` and the port
    /// is read from their `listening on` lines once they start; etcd, which cannot bind port 0
    /// and report it, listens on unix sockets named before it starts. No port is picked free
    /// and handed over later, so nothing else can take it in between.
    ports: BTreeMap<u16, Local>,
    dir: std::path::PathBuf,
    child: Option<std::process::Child>,
}

/// Where a container port is reached on this machine.
#[derive(Clone, Debug)]
enum Local {
    Tcp(u16),
    Unix(std::path::PathBuf),
}

/// Whether workload `w` runs etcd (its members listen on unix sockets here).
fn runs_etcd(w: &Workload) -> bool {
    containers(w.template)
        .iter()
        .any(|c| strings(&c["command"]).first().map(String::as_str) == Some("etcd"))
}

/// The stderr line a binary prints once its listen flag `flag` is bound (`NAME listening on
/// ADDR`, `NAME metrics listening on ADDR`).
fn listening_line(binary: &str, flag: &str) -> String {
    match flag {
        "--listen" => format!("{binary} listening on "),
        "--metrics-listen" => format!("{binary} metrics listening on "),
        "--ext-proc-listen" => format!("{binary} ext-proc listening on "),
        other => panic!("{binary}: no line reports where {other} bound"),
    }
}

impl Drop for LocalPod {
    fn drop(&mut self) {
        if let Some(child) = &mut self.child {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The pods of an install on this machine: what a kubelet, kube-proxy and cluster DNS would do,
/// for the objects the manifests use.
struct LocalCluster<'a> {
    workloads: Vec<Workload<'a>>,
    services: BTreeMap<&'a str, &'a Value>,
    pods: Vec<LocalPod>,
    /// The etcd members' sockets, and their working directory: a unix URL's host is a name in
    /// etcd's working directory, so the members share this folder as they share a pod network.
    sockets: std::path::PathBuf,
    _root: tempfile::TempDir,
}

impl<'a> LocalCluster<'a> {
    fn new(objects: &'a [Value]) -> Self {
        let root = tempfile::tempdir().unwrap();
        let workloads = workloads(objects);
        let services = objects
            .iter()
            .filter(|o| kind(o) == "Service")
            .map(|o| (name(o), o))
            .collect();
        let sockets = root.path().join("sockets");
        std::fs::create_dir_all(&sockets).unwrap();
        let mut pods = Vec::new();
        for (index, w) in workloads.iter().enumerate() {
            for i in 0..w.replicas {
                let name = format!("{}-{i}", w.name);
                let mut ports = BTreeMap::new();
                if runs_etcd(w) {
                    for (_, port) in containers(w.template).iter().flat_map(container_ports) {
                        let socket = sockets.join(format!("{name}.{port}:{port}"));
                        ports.insert(port, Local::Unix(socket));
                    }
                }
                let dir = root.path().join(&name);
                std::fs::create_dir_all(&dir).unwrap();
                pods.push(LocalPod {
                    name,
                    workload: index,
                    ports,
                    dir,
                    child: None,
                });
            }
        }
        Self {
            workloads,
            services,
            pods,
            sockets,
            _root: root,
        }
    }

    /// Where `pod`'s container port `port` is reached; it must have bound it already.
    fn port(pod: &LocalPod, port: u16) -> Local {
        pod.ports
            .get(&port)
            .cloned()
            .unwrap_or_else(|| panic!("{}: port {port} is not bound yet", pod.name))
    }

    /// The loopback port behind `host:port` as seen from `pod`: itself, a Service, or a member of
    /// a StatefulSet behind a headless Service.
    fn resolve(&self, pod: &LocalPod, host: &str, port: u16) -> Local {
        if ["0.0.0.0", "127.0.0.1", "localhost"].contains(&host) {
            return Self::port(pod, port);
        }
        let (member, service) = match host.split_once('.') {
            Some((member, service)) => (Some(member), service),
            None => (None, host),
        };
        let svc = self.services[service];
        let spec_port = svc["spec"]["ports"]
            .as_sequence()
            .unwrap()
            .iter()
            .find(|p| p["port"].as_u64() == Some(port as u64))
            .unwrap_or_else(|| panic!("Service {service} has no port {port}"));
        let target = spec_port.get("targetPort").unwrap_or(&spec_port["port"]);
        let target_pod = self
            .pods
            .iter()
            .find(|p| {
                let w = &self.workloads[p.workload];
                selects(
                    &svc["spec"]["selector"],
                    &labels(&w.template["metadata"]["labels"]),
                ) && member.is_none_or(|m| m == p.name)
            })
            .unwrap_or_else(|| panic!("no pod behind {host}"));
        let w = &self.workloads[target_pod.workload];
        let ports: BTreeMap<String, u16> = containers(w.template)
            .iter()
            .flat_map(container_ports)
            .collect();
        Self::port(target_pod, resolve_port(target, &ports).unwrap())
    }

    /// A command line of `pod` as it would run there: `$(VAR)`s expanded, listen addresses
    /// into `127.0.0.1:0`, URLs into the loopback ports or sockets they reach, mounted paths into
    /// the pod's folders, our binaries' names into their paths.
    fn localize(&self, pod: &LocalPod, container: &Value, argv: &[String]) -> Vec<String> {
        let env = self.env(pod, container);
        let mounts: Vec<(String, String)> = container
            .get("volumeMounts")
            .and_then(Value::as_sequence)
            .into_iter()
            .flatten()
            .map(|m| {
                (
                    str_at(m, &["mountPath"]).unwrap().to_string(),
                    str_at(m, &["name"]).unwrap().to_string(),
                )
            })
            .collect();
        let mut out = Vec::new();
        for (i, arg) in argv.iter().enumerate() {
            let mut arg = arg.clone();
            for (var, value) in &env {
                arg = arg.replace(&format!("$({var})"), value);
            }
            if BINARIES.contains(&arg.as_str()) {
                arg = test_support::bin(&arg).display().to_string();
            }
            // URLs, and bare listen addresses.
            let mut localized = String::new();
            let mut rest = arg.as_str();
            while let Some(at) = rest.find("http://") {
                localized.push_str(&rest[..at]);
                rest = &rest[at + 7..];
                let end = rest
                    .find(|c: char| !(c.is_ascii_alphanumeric() || "-.:".contains(c)))
                    .unwrap_or(rest.len());
                let (host, port) = rest[..end].rsplit_once(':').expect("a port");
                match self.resolve(pod, host, port.parse().unwrap()) {
                    Local::Tcp(port) => localized.push_str(&format!("http://127.0.0.1:{port}")),
                    // etcd takes a socket's name in its working directory (the sockets' folder)
                    Local::Unix(socket) if runs_etcd(&self.workloads[pod.workload]) => {
                        let file = socket.file_name().unwrap().to_string_lossy();
                        localized.push_str(&format!("unix://{file}"));
                    }
                    // our binaries an absolute path
                    Local::Unix(socket) => {
                        localized.push_str(&format!("unix://{}", socket.display()))
                    }
                }
                rest = &rest[end..];
            }
            localized.push_str(rest);
            let mut arg = localized;
            if arg.starts_with("0.0.0.0:") {
                arg = "127.0.0.1:0".to_string();
            }
            // Paths on volumes (a flag's value, or `--flag=/path`).
            let flag = if arg.starts_with('/') {
                i.checked_sub(1).map(|j| argv[j].as_str())
            } else {
                arg.split_once("=/").map(|(f, _)| f)
            };
            if !flag.is_some_and(|f| NOT_PATHS.contains(&f)) {
                let (prefix, path) = match arg.split_once("=/") {
                    Some((f, p)) if f.starts_with("--") => (format!("{f}="), format!("/{p}")),
                    _ => (String::new(), arg.clone()),
                };
                if let Some((mount, volume)) = mounts
                    .iter()
                    .filter(|(m, _)| path == *m || path.starts_with(&format!("{m}/")))
                    .max_by_key(|(m, _)| m.len())
                {
                    let local = pod
                        .dir
                        .join(volume)
                        .join(path[mount.len()..].trim_start_matches('/'));
                    arg = format!("{prefix}{}", local.display());
                }
            }
            out.push(arg);
        }
        out
    }

    /// The container's environment in `pod` (`fieldRef: metadata.name` is the pod's name). The
    /// OTLP endpoint is left out: the collector is not part of the install.
    fn env(&self, pod: &LocalPod, container: &Value) -> Vec<(String, String)> {
        container
            .get("env")
            .and_then(Value::as_sequence)
            .into_iter()
            .flatten()
            .filter(|e| str_at(e, &["name"]) != Some("OTEL_EXPORTER_OTLP_ENDPOINT"))
            .map(|e| {
                let value = match str_at(e, &["value"]) {
                    Some(v) => v.to_string(),
                    None => {
                        assert_eq!(
                            str_at(e, &["valueFrom", "fieldRef", "fieldPath"]),
                            Some("metadata.name"),
                            "{e:?}"
                        );
                        pod.name.clone()
                    }
                };
                (str_at(e, &["name"]).unwrap().to_string(), value)
            })
            .collect()
    }

    /// Starts every pod of workload `index`: its volumes as folders (Secret volumes holding the
    /// test tokens), then its container's own command line.
    fn start(&mut self, index: usize) {
        let w = &self.workloads[index];
        let etcd = runs_etcd(w);
        let (template, object) = (w.template, w.object);
        let container = &containers(template)[0];
        let mut argv = strings(&container["command"]);
        argv.extend(strings(&container["args"]));
        for p in 0..self.pods.len() {
            if self.pods[p].workload != index {
                continue;
            }
            let pod = &self.pods[p];
            for volume in template["spec"]
                .get("volumes")
                .and_then(Value::as_sequence)
                .into_iter()
                .flatten()
            {
                let dir = pod.dir.join(str_at(volume, &["name"]).unwrap());
                std::fs::create_dir_all(&dir).unwrap();
                for item in volume["secret"]["items"]
                    .as_sequence()
                    .into_iter()
                    .flatten()
                {
                    let key = str_at(item, &["key"]).unwrap();
                    let (_, value) = TEST_SECRET
                        .iter()
                        .find(|(k, _)| *k == key)
                        .unwrap_or_else(|| panic!("no test value for Secret key {key}"));
                    std::fs::write(dir.join(str_at(item, &["path"]).unwrap()), value).unwrap();
                }
            }
            let claims = object["spec"]["volumeClaimTemplates"].as_sequence();
            for claim in claims.into_iter().flatten() {
                std::fs::create_dir_all(pod.dir.join(name(claim))).unwrap();
            }
            let local = self.localize(pod, container, &argv);
            let log = std::fs::File::create(pod.dir.join("log")).unwrap();
            let child = Command::new(&local[0])
                .args(&local[1..])
                .envs(self.env(pod, container))
                .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
                .current_dir(if etcd { &self.sockets } else { &pod.dir })
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::null())
                .stderr(log)
                .spawn()
                .unwrap_or_else(|e| panic!("{}: {e}", pod.name));
            self.pods[p].child = Some(child);
            if !etcd {
                self.learn_ports(p, &argv);
            }
        }
    }

    /// Reads where pod `p` bound each `0.0.0.0:PORT` of its command line `argv` from its
    /// `listening on` lines (it was given `127.0.0.1:0`).
    fn learn_ports(&mut self, p: usize, argv: &[String]) {
        for (i, arg) in argv.iter().enumerate() {
            let Some(port) = arg.strip_prefix("0.0.0.0:") else {
                continue;
            };
            let line = listening_line(&argv[0], &argv[i - 1]);
            let pod = &mut self.pods[p];
            let log_file = pod.dir.join("log");
            let what = format!("{}'s \"{line}ADDR\" line", pod.name);
            let bound = wait_for_blocking(&what, std::time::Duration::from_secs(30), || {
                let log = std::fs::read_to_string(&log_file).unwrap_or_default();
                // whole lines only: the pod may be writing the last one as it is read (a part
                // of "127.0.0.1:8080" failed to parse, and "127.0.0.1:80" would be another port)
                let written = &log[..log.rfind('\n').map_or(0, |end| end + 1)];
                if let Some(addr) = written.lines().find_map(|l| l.strip_prefix(line.as_str())) {
                    let addr: std::net::SocketAddr = addr
                        .parse()
                        .unwrap_or_else(|e| panic!("{what}: {addr:?}: {e}"));
                    return Some(addr.port());
                }
                if let Some(status) = pod.child.as_mut().unwrap().try_wait().unwrap() {
                    panic!("{} exited ({status}) before {what}: {log}", pod.name);
                }
                None
            });
            self.pods[p]
                .ports
                .insert(port.parse().unwrap(), Local::Tcp(bound));
        }
    }

    fn log(&self, pod: &LocalPod) -> String {
        std::fs::read_to_string(pod.dir.join("log")).unwrap_or_default()
    }

    /// Runs one probe of `pod`'s container once: `Err(why)` when it fails.
    fn probe(&self, pod: &LocalPod, container: &Value, probe: &Value) -> Result<(), String> {
        let ports = container_ports(container);
        let local = |port: &Value| Self::port(pod, resolve_port(port, &ports).unwrap());
        if let Some(get) = probe.get("httpGet") {
            let path = str_at(get, &["path"]).unwrap_or("/");
            match http_get(&local(&get["port"]), path) {
                Some((200..=399, _)) => Ok(()),
                other => Err(format!("GET {path}: {other:?}")),
            }
        } else if let Some(tcp) = probe.get("tcpSocket") {
            match local(&tcp["port"]) {
                Local::Tcp(port) => std::net::TcpStream::connect(("127.0.0.1", port)).map(drop),
                Local::Unix(socket) => std::os::unix::net::UnixStream::connect(socket).map(drop),
            }
            .map_err(|e| format!("connect: {e}"))
        } else {
            let argv = self.localize(pod, container, &strings(&probe["exec"]["command"]));
            let err = pod.dir.join("probe-stderr");
            let mut child = Command::new(&argv[0])
                .args(&argv[1..])
                .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
                .stdout(std::process::Stdio::null())
                .stderr(std::fs::File::create(&err).unwrap())
                .spawn()
                .unwrap();
            let seconds = probe["timeoutSeconds"].as_u64().unwrap_or(1);
            let limit = std::time::Duration::from_secs(seconds);
            let every = std::time::Duration::from_millis(20);
            match poll_blocking(limit, every, || child.try_wait().unwrap()) {
                Some(status) if status.success() => Ok(()),
                Some(status) => Err(format!(
                    "{argv:?}: {status}: {}",
                    std::fs::read_to_string(&err).unwrap_or_default()
                )),
                None => {
                    let _ = child.kill();
                    let _ = child.wait();
                    Err(format!("{argv:?}: no answer in {seconds} s"))
                }
            }
        }
    }

    /// Waits until every pod of workload `index` passes its readiness probe (and has not exited).
    fn wait_ready(&mut self, index: usize, limit: std::time::Duration) {
        let container = &containers(self.workloads[index].template)[0];
        let deadline = std::time::Instant::now() + limit;
        for p in 0..self.pods.len() {
            if self.pods[p].workload != index {
                continue;
            }
            let mut last_failure = String::new();
            let mut exited = None;
            // Every 100 ms: an exec probe starts a process each time.
            let ready = poll_blocking(
                deadline.saturating_duration_since(std::time::Instant::now()),
                std::time::Duration::from_millis(100),
                || {
                    let Err(why) =
                        self.probe(&self.pods[p], container, &container["readinessProbe"])
                    else {
                        return true;
                    };
                    last_failure = why;
                    exited = self.pods[p].child.as_mut().unwrap().try_wait().unwrap();
                    exited.is_some()
                },
            );
            let pod = &self.pods[p];
            assert!(
                ready.is_some() && exited.is_none(),
                "{} is not ready ({}; probe: {last_failure}): {}",
                pod.name,
                exited.map_or("still running".to_string(), |s| s.to_string()),
                self.log(pod)
            );
        }
    }
}

/// `GET path` on a loopback port or a unix socket: status and body.
fn http_get(at: &Local, path: &str) -> Option<(u16, String)> {
    let timeout = Some(std::time::Duration::from_secs(5));
    match at {
        Local::Tcp(port) => {
            let stream = std::net::TcpStream::connect(("127.0.0.1", *port)).ok()?;
            stream.set_read_timeout(timeout).ok()?;
            http_get_on(stream, path)
        }
        Local::Unix(socket) => {
            let stream = std::os::unix::net::UnixStream::connect(socket).ok()?;
            stream.set_read_timeout(timeout).ok()?;
            http_get_on(stream, path)
        }
    }
}

fn http_get_on(
    mut stream: impl std::io::Read + std::io::Write,
    path: &str,
) -> Option<(u16, String)> {
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).ok()?;
    let raw = String::from_utf8_lossy(&raw);
    let status = raw.split(' ').nth(1)?.parse().ok()?;
    let body = raw
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_string();
    Some((status, body))
}

#[test]
fn both_installs_start_from_their_own_command_lines_and_pass_their_probes() {
    for install in INSTALLS {
        let objects = rendered(install);
        let needs_etcd = workloads(&objects).iter().any(runs_etcd);
        if needs_etcd {
            let etcd = Command::new("etcd")
                .arg("--version")
                .output()
                .map_err(|e| format!("no etcd to run the etcd members with ({e})"))
                .map(|_| ());
            if require_tool(&format!("{install} on this machine"), etcd).is_none() {
                continue;
            }
        }
        let mut cluster = LocalCluster::new(&objects);
        // Start workloads once what their command lines name is ready, as a cluster converges.
        let mut started: BTreeSet<usize> = BTreeSet::new();
        while started.len() < cluster.workloads.len() {
            let next = (0..cluster.workloads.len())
                .filter(|i| !started.contains(i))
                .find(|&i| {
                    let w = &cluster.workloads[i];
                    let c = &containers(w.template)[0];
                    let mut argv = strings(&c["command"]);
                    argv.extend(strings(&c["args"]));
                    urls(&argv.join(" ")).iter().all(|(host, _)| {
                        let service = host.rsplit('.').next().unwrap();
                        let Some(svc) = cluster.services.get(service) else {
                            return true; // itself (0.0.0.0, 127.0.0.1)
                        };
                        cluster.workloads.iter().enumerate().all(|(j, other)| {
                            j == i
                                || started.contains(&j)
                                || !selects(
                                    &svc["spec"]["selector"],
                                    &labels(&other.template["metadata"]["labels"]),
                                )
                        })
                    })
                })
                .expect("workloads that wait for each other");
            cluster.start(next);
            cluster.wait_ready(next, std::time::Duration::from_secs(60));
            started.insert(next);
        }
        // Liveness holds too, and Prometheus finds metrics where the annotations say.
        let mut scraped = 0;
        for pod in &cluster.pods {
            let w = &cluster.workloads[pod.workload];
            let container = &containers(w.template)[0];
            if let Some(probe) = container.get("livenessProbe") {
                if let Err(why) = cluster.probe(pod, container, probe) {
                    panic!("{}: liveness: {why}", pod.name);
                }
            }
            let annotations = labels(&w.template["metadata"]["annotations"]);
            let port: u16 = annotations["prometheus.io/port"].parse().unwrap();
            let at = LocalCluster::port(pod, port);
            let (status, body) = http_get(&at, &annotations["prometheus.io/path"])
                .unwrap_or_else(|| panic!("{}: no answer on metrics port {port}", pod.name));
            assert!(
                status == 200 && body.contains("# TYPE"),
                "{}: GET {} on {port}: {status}",
                pod.name,
                annotations["prometheus.io/path"]
            );
            scraped += 1;
        }
        // Nothing was written outside the volumes (the root filesystem is read-only there; the
        // pods ran in their folders, as a container runs in `/`).
        for pod in &cluster.pods {
            let w = &cluster.workloads[pod.workload];
            let mut allowed: BTreeSet<String> = ["log", "probe-stderr"].map(String::from).into();
            for volume in w.template["spec"]["volumes"]
                .as_sequence()
                .into_iter()
                .flatten()
            {
                allowed.insert(str_at(volume, &["name"]).unwrap().to_string());
            }
            let claims = w.object["spec"]["volumeClaimTemplates"].as_sequence();
            allowed.extend(claims.into_iter().flatten().map(|c| name(c).to_string()));
            for entry in std::fs::read_dir(&pod.dir).unwrap() {
                let entry = entry.unwrap().file_name().to_string_lossy().into_owned();
                assert!(
                    allowed.contains(&entry),
                    "{}: wrote {entry} outside its volumes",
                    pod.name
                );
            }
        }
        println!(
            "{install}: {} pods started from their rendered command lines, ready by their own probes, {scraped} scraped",
            cluster.pods.len()
        );
    }
}
