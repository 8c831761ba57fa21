//! A Python virtualenv with pinned packages from the package index, made under
//! the test target's temporary directory and reused by later runs: the official
//! SDKs the tests run against sluice.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// The virtualenv at `dir` with each `(package, version)` of `packages`
/// installed (created, or completed, when missing): its `python`.
///
/// One test at a time makes or completes a virtualenv: tests of one binary that
/// share one (the SDK tests) must not both create it.
///
/// # Panics
/// When `python3 -m venv` or `pip install` fails (the tests need them).
pub(crate) fn venv(dir: &Path, packages: &[(&str, &str)]) -> PathBuf {
    static MAKING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = MAKING
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let python = dir.join("bin/python");
    if !python.exists() {
        let ok = Command::new("python3")
            .args(["-m", "venv"])
            .arg(dir)
            .status()
            .expect("run python3 -m venv");
        assert!(ok.success(), "python3 -m venv failed");
    }
    for (package, version) in packages {
        let module = package.replace('-', "_");
        let probe = format!("import {module}, sys; sys.exit({module}.__version__ != '{version}')");
        let has = Command::new(&python)
            .args(["-c", &probe])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !has {
            let ok = Command::new(dir.join("bin/pip"))
                .args(["install", "-q", "--disable-pip-version-check"])
                .arg(format!("{package}=={version}"))
                .status()
                .expect("run pip");
            assert!(ok.success(), "pip install {package}=={version} failed");
        }
    }
    python
}
