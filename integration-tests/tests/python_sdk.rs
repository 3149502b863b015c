//! The Python SDK's pytest suite (`sdk/python/tests`) against the built control-plane binary,
//! so the README's `cargo build --workspace --bins && cargo test --workspace` covers it. Skipped
//! (with the reason) when python3, pytest or grpcio are missing, except under CI=true.

#[test]
fn python_sdk_pytest_suite_passes() {
    let test = "python_sdk_pytest_suite_passes";
    let modules = [
        "pytest",
        "grpc",
        "grpc_tools",
        "grpc_reflection",
        "google.protobuf",
    ];
    if test_support::require_tool(test, test_support::python_modules(&modules)).is_none() {
        return;
    }
    let control_plane = test_support::bin("control-plane");
    let bin_dir = control_plane.parent().expect("the binary's directory");
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace root");
    let out = std::process::Command::new("python3")
        .args(["-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider"])
        .arg(repo.join("sdk/python/tests"))
        .env("PREFIX_ROUTER_BIN_DIR", bin_dir)
        .current_dir(repo.join("sdk/python"))
        .output()
        .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    assert!(
        out.status.success(),
        "pytest failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
