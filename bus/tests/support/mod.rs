//! What the bus's integration tests share.

use std::path::PathBuf;
use std::process::{Command, Stdio};

/// The nats-server to run: `NATS_SERVER_BIN`, else one on `PATH`; `None` (the test skips,
/// saying so) when there is none, unless `CONVERGE_REQUIRE_NATS=1`, which makes it fail.
pub fn nats_server_bin() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("NATS_SERVER_BIN") {
        return Some(PathBuf::from(p));
    }
    let found = Command::new("nats-server")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if found {
        Some(PathBuf::from("nats-server"))
    } else if std::env::var("CONVERGE_REQUIRE_NATS").as_deref() == Ok("1") {
        panic!("nats-server not found (PATH or NATS_SERVER_BIN) and CONVERGE_REQUIRE_NATS=1");
    } else {
        eprintln!("skipped: nats-server not found (set NATS_SERVER_BIN)");
        None
    }
}
