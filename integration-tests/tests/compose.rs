//! `docker-compose.yml` agrees with the binaries: every flag a service passes exists in that
//! binary's `--help` (for the `setup` script: in the `prefixctl` subcommand's), every environment
//! variable is one the binary or the OpenTelemetry SDK reads, published ports are ports the
//! service listens on, and `http://service:port` references point at a port that service
//! listens on. Needs the built binaries (`cargo build --workspace --bins`).

use std::collections::{BTreeMap, BTreeSet};

use integration_tests::deploy::{
    flag_value, flags, help, help_has_env, help_has_flag, port_of, repo_file, BINARIES, SDK_ENV,
};
use manifests::strings;
use serde_yaml_ng::Value;

mod manifests;

fn compose() -> Value {
    let text = std::fs::read_to_string(repo_file("docker-compose.yml"))
        .expect("docker-compose.yml at the repository root");
    let mut doc: Value = serde_yaml_ng::from_str(&text).expect("docker-compose.yml is YAML");
    doc.apply_merge().expect("merge keys resolve");
    doc
}

/// `KEY: value` pairs of a service's `environment` (map or `KEY=value` list).
fn environment(service: &Value) -> BTreeMap<String, String> {
    match service.get("environment") {
        None => BTreeMap::new(),
        Some(Value::Mapping(m)) => m
            .iter()
            .map(|(k, v)| {
                let value = match v {
                    Value::String(s) => s.clone(),
                    other => serde_yaml_ng::to_string(other).unwrap().trim().to_string(),
                };
                (k.as_str().unwrap().to_string(), value)
            })
            .collect(),
        Some(list) => strings(list)
            .into_iter()
            .map(|kv| {
                let (k, v) = kv.split_once('=').unwrap_or((&kv, ""));
                (k.to_string(), v.to_string())
            })
            .collect(),
    }
}

/// The `prefixctl` invocations in a shell script: each as its words up to a shell operator.
fn prefixctl_calls(script: &str) -> Vec<Vec<String>> {
    let mut calls = Vec::new();
    for part in script.split("prefixctl").skip(1) {
        let mut words = Vec::new();
        let mut rest = part.trim_start();
        while let Some(c) = rest.chars().next() {
            if "|&;()>".contains(c) {
                break;
            }
            let word: String;
            if c == '\'' {
                let end = rest[1..].find('\'').expect("closed quote") + 1;
                word = rest[1..end].to_string();
                rest = &rest[end + 1..];
            } else {
                let end = rest
                    .find(|c: char| c.is_whitespace() || "|&;()>".contains(c))
                    .unwrap_or(rest.len());
                word = rest[..end].to_string();
                rest = &rest[end..];
            }
            words.push(word);
            rest = rest.trim_start();
        }
        calls.push(words);
    }
    calls
}

#[test]
fn compose_services_use_flags_ports_and_variables_the_binaries_have() {
    let doc = compose();
    let services = doc
        .get("services")
        .and_then(Value::as_mapping)
        .expect("services");
    let dockerfile = std::fs::read_to_string(repo_file("Dockerfile")).unwrap();

    // What each service listens on (container side), from its flags.
    let mut listens: BTreeMap<String, BTreeSet<u16>> = BTreeMap::new();
    let mut checked = BTreeSet::new();
    for (name, service) in services {
        let name = name.as_str().unwrap().to_string();
        let image = service
            .get("image")
            .and_then(Value::as_str)
            .unwrap_or_default();
        let env = environment(service);
        let ports = service.get("ports").map(strings).unwrap_or_default();
        if !image.starts_with("prefix-router") {
            // A third-party image (Jaeger): only its published ports are known.
            let published = ports.iter().map(|p| port_of(p)).collect();
            listens.insert(name, published);
            continue;
        }
        let entrypoint = strings(service.get("entrypoint").expect("an entrypoint"));
        let command = service.get("command").map(strings).unwrap_or_default();
        let binary = entrypoint[0].as_str();

        if BINARIES.contains(&binary) {
            assert!(
                dockerfile.contains(&format!("release/{binary}")),
                "the Dockerfile does not ship {binary}"
            );
            let text = help(binary, &[]);
            for flag in flags(&command) {
                assert!(
                    help_has_flag(&text, flag),
                    "service {name}: {binary} has no flag {flag}:\n{text}"
                );
            }
            for var in env.keys() {
                assert!(
                    SDK_ENV.contains(&var.as_str()) || help_has_env(&text, var),
                    "service {name}: {binary} reads no environment variable {var}"
                );
            }
            let mut own = BTreeSet::new();
            for flag in ["--listen", "--metrics-listen"] {
                if let Some(addr) = flag_value(&command, flag) {
                    own.insert(port_of(addr));
                }
            }
            assert!(!own.is_empty(), "service {name}: no --listen");
            for p in &ports {
                let container = port_of(p);
                assert!(
                    own.contains(&container),
                    "service {name} publishes {p} but listens on {own:?}"
                );
            }
            listens.insert(name.clone(), own);
            checked.insert(binary.to_string());
        } else {
            // A shell script of prefixctl calls (`setup`).
            assert_eq!(
                entrypoint,
                ["sh", "-c"],
                "service {name}: unknown entrypoint {entrypoint:?}"
            );
            let script = command.join(" ");
            let calls = prefixctl_calls(&script);
            assert!(!calls.is_empty(), "service {name} runs no prefixctl");
            for call in calls {
                let subcommand: Vec<&str> = call
                    .iter()
                    .take_while(|w| !w.starts_with('-'))
                    .map(String::as_str)
                    .collect();
                let text = help("prefixctl", &subcommand);
                for flag in flags(&call) {
                    assert!(
                        help_has_flag(&text, flag),
                        "service {name}: prefixctl {subcommand:?} has no flag {flag}"
                    );
                }
                for var in env.keys() {
                    assert!(
                        SDK_ENV.contains(&var.as_str()) || help_has_env(&text, var),
                        "service {name}: prefixctl reads no environment variable {var}"
                    );
                }
            }
            checked.insert("prefixctl".to_string());
        }
    }
    assert_eq!(
        checked.len(),
        BINARIES.len(),
        "every binary is used: {checked:?}"
    );

    // `http://service:port` anywhere in a service (flags, variables, scripts) names a port that
    // service listens on.
    let text = std::fs::read_to_string(repo_file("docker-compose.yml")).unwrap();
    let mut references = 0;
    for part in text.split("http://").skip(1) {
        let end = part
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '-' || c == ':' || c == '.'))
            .unwrap_or(part.len());
        let Some((host, port)) = part[..end].split_once(':') else {
            continue;
        };
        let Some(target) = listens.get(host) else {
            continue;
        };
        let port: u16 = port.parse().unwrap();
        assert!(
            target.contains(&port),
            "http://{host}:{port}: {host} listens on {target:?}"
        );
        references += 1;
    }
    assert!(
        references >= 10,
        "the control plane, Jaeger and the engines are referenced by URL ({references})"
    );
}

#[test]
fn the_setup_script_parser_splits_prefixctl_calls() {
    let calls = prefixctl_calls(
        "prefixctl a b --x 1 >/dev/null 2>&1 || prefixctl c --y '[{\"k\": 1}]' && (prefixctl d)",
    );
    assert_eq!(calls[0], ["a", "b", "--x", "1"]);
    assert_eq!(calls[1], ["c", "--y", "[{\"k\": 1}]"]);
    assert_eq!(calls[2], ["d"]);
}

#[test]
fn prometheus_scrapes_every_server_and_grafana_loads_the_dashboard() {
    let doc = compose();
    let services = doc
        .get("services")
        .and_then(Value::as_mapping)
        .expect("services");
    // Every file or folder a service mounts from the repository exists.
    for (name, service) in services {
        for volume in service.get("volumes").map(strings).unwrap_or_default() {
            if let Some(source) = volume.strip_prefix("./") {
                let source = source.split(':').next().unwrap();
                assert!(
                    repo_file(source).exists(),
                    "service {name:?} mounts ./{source}, which does not exist"
                );
            }
        }
    }
    // What Prometheus must scrape: each server's metrics address (service:port).
    let mut expected = BTreeSet::new();
    for (name, service) in services {
        let entrypoint = service.get("entrypoint").map(strings).unwrap_or_default();
        let command = service.get("command").map(strings).unwrap_or_default();
        let flag = match entrypoint.first().map(String::as_str) {
            Some("control-plane") => "--metrics-listen",
            Some("data-plane" | "engine-sim") => "--listen",
            _ => continue,
        };
        let addr = flag_value(&command, flag).expect("a metrics address");
        expected.insert(format!("{}:{}", name.as_str().unwrap(), port_of(addr)));
    }
    let prom: Value = serde_yaml_ng::from_str(
        &std::fs::read_to_string(repo_file("deploy/prometheus/prometheus.yml")).unwrap(),
    )
    .expect("prometheus.yml is YAML");
    let mut scraped = BTreeSet::new();
    for job in prom["scrape_configs"]
        .as_sequence()
        .expect("scrape_configs")
    {
        for config in job["static_configs"].as_sequence().expect("static_configs") {
            scraped.extend(strings(&config["targets"]));
        }
    }
    assert_eq!(scraped, expected, "Prometheus scrapes exactly the servers");

    // Grafana: its datasource is the compose Prometheus, under the uid the dashboard names, and
    // the dashboards provider reads the folder the dashboard is mounted in.
    let datasources: Value = serde_yaml_ng::from_str(
        &std::fs::read_to_string(repo_file(
            "deploy/grafana/provisioning/datasources/prometheus.yaml",
        ))
        .unwrap(),
    )
    .unwrap();
    let source = &datasources["datasources"][0];
    let prometheus_ports = strings(&services["prometheus"]["ports"]);
    assert_eq!(source["url"].as_str(), Some("http://prometheus:9090"));
    assert!(prometheus_ports.iter().any(|p| port_of(p) == 9090));
    let dashboard: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(repo_file("deploy/grafana/prefix-router.json")).unwrap(),
    )
    .unwrap();
    for panel in dashboard["panels"].as_array().unwrap() {
        assert_eq!(
            panel["datasource"]["uid"].as_str(),
            source["uid"].as_str(),
            "panel {}",
            panel["title"]
        );
    }
    let providers: Value = serde_yaml_ng::from_str(
        &std::fs::read_to_string(repo_file(
            "deploy/grafana/provisioning/dashboards/prefix-router.yaml",
        ))
        .unwrap(),
    )
    .unwrap();
    let folder = providers["providers"][0]["options"]["path"]
        .as_str()
        .unwrap();
    let mounts = strings(&services["grafana"]["volumes"]);
    assert!(
        mounts
            .iter()
            .any(|m| m.starts_with("./deploy/grafana/prefix-router.json:")
                && m.contains(&format!(":{folder}/"))),
        "grafana mounts the dashboard into {folder}: {mounts:?}"
    );
}

#[test]
fn the_exposed_control_plane_needs_a_token_and_every_token_is_a_secret() {
    let doc = compose();
    let services = doc["services"].as_mapping().expect("services");
    let declared = doc
        .get("secrets")
        .and_then(Value::as_mapping)
        .expect("top-level secrets");
    let mut uses = 0;
    for (name, service) in services {
        let name = name.as_str().unwrap();
        let command = service.get("command").map(strings).unwrap_or_default();
        let entrypoint = service.get("entrypoint").map(strings).unwrap_or_default();
        let mounted = service.get("secrets").map(strings).unwrap_or_default();
        if entrypoint.first().map(String::as_str) == Some("control-plane") {
            assert!(
                flag_value(&command, "--auth-token-file").is_some(),
                "{name}: the control plane listens on {:?} without --auth-token-file",
                flag_value(&command, "--listen")
            );
            assert!(
                !command.iter().any(|a| a == "--insecure"),
                "{name}: --insecure"
            );
        }
        if entrypoint.first().map(String::as_str) == Some("data-plane") {
            assert!(
                flag_value(&command, "--auth-token-file").is_some(),
                "{name}: a data plane without a token for its watch"
            );
        }
        let env = environment(service);
        let paths = flag_value(&command, "--auth-token-file")
            .map(str::to_string)
            .into_iter()
            .chain(env.get("PREFIX_ROUTER_TOKEN_FILE").cloned());
        for path in paths {
            let secret = path
                .strip_prefix("/run/secrets/")
                .unwrap_or_else(|| panic!("{name}: token {path} is not a docker secret"));
            assert!(
                mounted.iter().any(|m| m == secret),
                "{name}: secret {secret} is not mounted"
            );
            let file = declared
                .get(secret)
                .and_then(|s| s.get("file"))
                .and_then(Value::as_str)
                .unwrap_or_else(|| panic!("secret {secret} has no file"));
            assert!(
                file.starts_with("./deploy/compose/"),
                "secret {secret} comes from {file}"
            );
            uses += 1;
        }
    }
    assert!(
        uses >= 4,
        "control plane, two data planes and setup use the token ({uses})"
    );
    // The token file itself is never committed.
    let ignore = std::fs::read_to_string(repo_file("deploy/compose/.gitignore")).unwrap();
    assert!(
        ignore.lines().any(|l| l.trim() == "admin-token"),
        "{ignore}"
    );
}
