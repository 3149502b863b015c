//! The skip policy. A test that needs something this machine lacks (a tool, root, a Python
//! package) calls [`skip`]: it says so on stderr (`SKIPPED test: reason`) and appends
//! `test: reason` to [`skips_file`], which `scripts/test.sh` empties before a run and prints as one
//! line after it. Under `CI=true` nothing may skip: CI installs everything, so a skip there fails;
//! the one exception is an opt-in test nobody enabled ([`opt_in_skip`]: the real vLLM engine).

use std::io::Write as _;
use std::path::PathBuf;
use std::process::Command;

/// The summary file's name, in the target directory.
pub const SKIPS_FILE: &str = "test-skips.txt";

/// Skips `test` for `reason` (the caller then returns), or panics under `CI=true`.
pub fn skip(test: &str, reason: &str) {
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("{test} is required under CI=true: {reason}");
    }
    eprintln!("SKIPPED {test}: {reason}");
    record(test, reason);
}

/// Skips an opt-in test that was not asked for, even under `CI=true`: says so on stderr
/// (`SKIPPED test: not enabled; to run it: how`) and records it like [`skip`], so the summary of
/// `scripts/test.sh` names it. Only for tests whose dependency CI deliberately does not install
/// (the real vLLM engine: 3 GB); everything else uses [`skip`].
pub fn opt_in_skip(test: &str, how: &str) {
    let reason = format!("not enabled; to run it: {how}");
    eprintln!("SKIPPED {test}: {reason}");
    record(test, &reason);
}

/// The value of `available` when it is `Ok`; otherwise [`skip`]s `test` with its reason and
/// returns `None`.
pub fn require_tool<T>(test: &str, available: Result<T, String>) -> Option<T> {
    available.map_err(|reason| skip(test, &reason)).ok()
}

/// `Ok(())` when `python3` runs and imports every one of `modules`, else why not.
pub fn python_modules(modules: &[&str]) -> Result<(), String> {
    let import = format!("import {}", modules.join(", "));
    match Command::new("python3").args(["-c", &import]).output() {
        Err(e) => Err(format!("python3 is not runnable: {e}")),
        Ok(out) if !out.status.success() => Err(format!(
            "python3 cannot `{import}`: {}",
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .last()
                .unwrap_or("")
        )),
        Ok(_) => Ok(()),
    }
}

/// Where skips are recorded: `test-skips.txt` in `$CARGO_TARGET_DIR` (a relative one is taken
/// from the workspace root, where `scripts/test.sh` runs cargo) or else in the workspace's `target/`.
pub fn skips_file() -> PathBuf {
    // This crate sits at the workspace root, so the root is its manifest directory's parent.
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("test-support is inside the workspace");
    let target =
        std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| "target".into(), PathBuf::from);
    root.join(target).join(SKIPS_FILE)
}

/// Appends `test: reason` as one line. One `write` of the whole line to a file opened with
/// `O_APPEND`, so lines from test binaries running in parallel never interleave.
fn record(test: &str, reason: &str) {
    let reason = reason.split_whitespace().collect::<Vec<_>>().join(" ");
    let line = format!("{test}: {reason}\n");
    let path = skips_file();
    let written = path
        .parent()
        .map_or(Ok(()), std::fs::create_dir_all)
        .and_then(|()| {
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&path)
        })
        .and_then(|mut file| file.write_all(line.as_bytes()));
    if let Err(e) = written {
        eprintln!(
            "cannot record the skip of {test} in {}: {e}",
            path.display()
        );
    }
}
