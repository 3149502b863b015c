//! The MSRV stated in the workspace's `Cargo.toml` is true of what builds: every workspace crate
//! inherits it (so clippy's `incompatible_msrv` lint holds the code to it), and no locked
//! dependency needs a newer Rust. (`cargo +MSRV check` needs a toolchain download; this reads
//! the `rust-version` each package declares instead, for the packages this platform builds.)

use std::path::Path;
use std::process::Command;

/// `major.minor` of a `rust-version` value.
fn minor_version(v: &str) -> (u32, u32) {
    let mut parts = v.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
    (parts.next().unwrap_or(0), parts.next().unwrap_or(0))
}

#[test]
fn every_crate_states_the_msrv_and_no_locked_dependency_needs_more() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    // The packages this platform builds: a fresh machine has downloaded only those (others', e.g.
    // Windows-only ones, are in the lock file but not on disk, and --offline cannot fetch them).
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let version = Command::new(rustc)
        .arg("-vV")
        .output()
        .expect("rustc -vV runs");
    let version = String::from_utf8_lossy(&version.stdout);
    let host = version
        .lines()
        .find_map(|l| l.strip_prefix("host: "))
        .expect("rustc -vV names the host");
    let out = Command::new(cargo)
        .args(["metadata", "--format-version", "1", "--locked", "--offline"])
        .args(["--filter-platform", host])
        .current_dir(&root)
        .output()
        .expect("cargo metadata runs");
    assert!(
        out.status.success(),
        "cargo metadata: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).expect("metadata is JSON");
    let members: Vec<&str> = meta["workspace_members"]
        .as_array()
        .expect("workspace_members")
        .iter()
        .filter_map(|m| m.as_str())
        .collect();
    let packages = meta["packages"].as_array().expect("packages");
    let rust_version = |p: &serde_json::Value| p["rust_version"].as_str().map(minor_version);
    let mut msrv = None;
    for p in packages
        .iter()
        .filter(|p| members.contains(&p["id"].as_str().unwrap_or("")))
    {
        let name = p["name"].as_str().unwrap_or("?");
        let v = rust_version(p).unwrap_or_else(|| {
            panic!("crate {name} states no rust-version: add `rust-version.workspace = true`")
        });
        assert!(
            msrv.is_none_or(|m| m == v),
            "crate {name}: rust-version {v:?} differs from the workspace's {msrv:?}"
        );
        msrv = Some(v);
    }
    let msrv = msrv.expect("workspace members");
    let newer: Vec<String> = packages
        .iter()
        .filter(|p| rust_version(p).is_some_and(|v| v > msrv))
        .map(|p| {
            format!(
                "{} {} (rust-version {})",
                p["name"].as_str().unwrap_or("?"),
                p["version"].as_str().unwrap_or("?"),
                p["rust_version"].as_str().unwrap_or("?")
            )
        })
        .collect();
    assert!(
        newer.is_empty(),
        "locked dependencies need a newer Rust than the MSRV {}.{}: {newer:?}",
        msrv.0,
        msrv.1
    );
}
