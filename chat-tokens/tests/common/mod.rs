//! The tiny ByteLevel BPE fixture (tests/fixtures/tiny, made by tests/fixtures/make_tiny.py), copied
//! into a temporary directory so a test can add or change the files beside it.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

pub fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny")
}

/// A temporary directory holding the fixture's tokenizer.json and, if `with_template`, its
/// chat_template.jinja and tokenizer_config.json.
pub fn model_dir(with_template: bool) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let names: &[&str] = if with_template {
        &[
            "tokenizer.json",
            "chat_template.jinja",
            "tokenizer_config.json",
        ]
    } else {
        &["tokenizer.json"]
    };
    for name in names {
        std::fs::copy(fixture_dir().join(name), dir.path().join(name)).expect("copy the fixture");
    }
    dir
}
