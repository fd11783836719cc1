//! The worker shim: `converge-agent worker-shim --stop-grace-ms N [--cgroup-procs FILE]
//! [--uid N] -- <command…>`, a hidden
//! mode of the agent's own binary through which the supervisor starts every worker, so that
//! workers end when their agent dies, however it dies (SIGKILL and OOM included).
//!
//! How: the agent starts the shim as the leader of a new process group, with the read end
//! of a pipe (the *lifeline*) as its stdin; only the agent holds the write end (close-on-exec,
//! so no other child inherits it). The shim starts the worker in its own group, with stdin
//! from /dev/null and its own stdout (the agent's pipe: progress lines reach the agent's
//! parser unchanged) and stderr (the worker's log file), then waits for it. When the agent
//! dies, the kernel closes the write end and the shim reads EOF: it sends SIGTERM to the
//! group (the worker checkpoints as on any stop), SIGKILL after the stop grace, and SIGKILL
//! at once when the worker has exited before (leftover children of the worker).
//!
//! Signals: the agent's SIGTERM and SIGKILL go to the whole group (`killpg`), so they reach
//! the worker and its children directly, as before the shim; nothing is forwarded. The shim
//! blocks SIGTERM, SIGINT and SIGHUP to outlive them while the worker checkpoints. A
//! blocked mask is inherited across `fork` and `exec` (std's `Command` keeps it), so the
//! worker is started through `converge-agent worker-shim --exec -- <command…>`, which
//! unblocks them and `exec`s the command in place (same pid, no extra process; a signal that
//! came in between is delivered then, with its default action). SIGKILL ends the shim with
//! the group, which the agent reads as the worker's SIGKILL.
//!
//! Isolation ([`crate::isolation`]): with `--cgroup-procs` the shim joins the worker's
//! cgroup before it starts the worker (exit 125, nothing started, when it cannot), so the
//! worker and all it starts are in it; with `--uid N` the worker runs under user and group
//! id `N` without supplementary groups (`--exec --uid N` changes them just before the
//! `exec`), while the shim keeps the agent's user, out of the worker's reach.
//!
//! Exit status: the shim exits with the worker's exit code, or dies of the worker's signal
//! (with core dumps off), so the supervisor's exit accounting (success, crash with backoff,
//! stopped) reads the shim exactly as it read the worker. A worker that cannot be started
//! makes the shim exit 127 (126 when it is not executable) after a line in the log file, as
//! a shell does.
//!
//! Why not `PR_SET_PDEATHSIG`: it has to be set in the forked child before `exec`
//! (`pre_exec`, unsafe, which the workspace forbids) or by the shim on itself before
//! exec'ing the worker; either way it fires when the *thread* that forked exits, and the
//! agent is a multi-threaded tokio program whose blocking-pool threads come and go, so
//! workers would die spuriously; it also reaches only the group leader, with one fixed
//! signal (no grace to checkpoint). A pipe's write end is closed by the kernel only when the
//! last holder, the agent process, is gone. The cost is one small process per worker.

use nix::sys::resource::{Resource, setrlimit};
use nix::sys::signal::{SigSet, Signal, killpg, raise};
use nix::unistd::{Pid, getpgrp, getpid, setpgid};
use std::ffi::OsString;
use std::io::Read;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, ExitStatus, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// The first argument that selects the shim mode of `converge-agent`.
pub const SUBCOMMAND: &str = "worker-shim";

/// What the shim is asked to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShimArgs {
    /// Time between SIGTERM and SIGKILL when the agent is gone.
    pub stop_grace: Duration,
    /// The cgroup's `cgroup.procs` the shim joins before it starts the worker
    /// (`--worker-cgroup`), so that every process the worker starts is in it.
    pub cgroup_procs: Option<PathBuf>,
    /// The user (and group) id the worker runs under (`--worker-uids`); the shim itself
    /// keeps the agent's, so the worker cannot signal or trace it.
    pub uid: Option<u32>,
    /// The worker's program and arguments.
    pub command: Vec<OsString>,
}

/// The shim's arguments (after the program name) for `command`.
pub fn shim_args(
    stop_grace: Duration,
    cgroup_procs: Option<&Path>,
    uid: Option<u32>,
    command: &[String],
) -> Vec<OsString> {
    let mut args: Vec<OsString> = vec![
        SUBCOMMAND.into(),
        "--stop-grace-ms".into(),
        stop_grace.as_millis().to_string().into(),
    ];
    if let Some(procs) = cgroup_procs {
        args.extend(["--cgroup-procs".into(), procs.as_os_str().to_owned()]);
    }
    if let Some(uid) = uid {
        args.extend(["--uid".into(), uid.to_string().into()]);
    }
    args.push("--".into());
    args.extend(command.iter().map(OsString::from));
    args
}

/// The signals the shim outlives.
fn shim_signals() -> SigSet {
    let mut set = SigSet::empty();
    for s in [Signal::SIGTERM, Signal::SIGINT, Signal::SIGHUP] {
        set.add(s);
    }
    set
}

/// Parses the arguments after [`SUBCOMMAND`].
pub fn parse_args(args: &[OsString]) -> Result<ShimArgs, String> {
    let mut stop_grace = None;
    let mut cgroup_procs = None;
    let mut uid = None;
    let mut i = 0;
    while i < args.len() {
        match args[i].to_str() {
            Some("--cgroup-procs") => {
                let v = args.get(i + 1).ok_or("--cgroup-procs needs a value")?;
                cgroup_procs = Some(PathBuf::from(v));
                i += 2;
            }
            Some("--uid") => {
                uid = Some(parse_uid(args.get(i + 1))?);
                i += 2;
            }
            Some("--stop-grace-ms") => {
                let v = args
                    .get(i + 1)
                    .and_then(|v| v.to_str())
                    .ok_or("--stop-grace-ms needs a value")?;
                let ms: u64 = v
                    .parse()
                    .map_err(|_| format!("bad --stop-grace-ms {v:?}"))?;
                stop_grace = Some(Duration::from_millis(ms));
                i += 2;
            }
            Some("--") => {
                let command = args[i + 1..].to_vec();
                if command.is_empty() {
                    return Err("no command after --".into());
                }
                return Ok(ShimArgs {
                    stop_grace: stop_grace.ok_or("--stop-grace-ms is missing")?,
                    cgroup_procs,
                    uid,
                    command,
                });
            }
            _ => return Err(format!("unexpected argument {:?}", args[i])),
        }
    }
    Err("no `--` before the command".into())
}

/// A `--uid` value: a user id other than root's.
fn parse_uid(value: Option<&OsString>) -> Result<u32, String> {
    let v = value
        .and_then(|v| v.to_str())
        .ok_or("--uid needs a value")?;
    match v.parse::<u32>() {
        Ok(0) | Err(_) => Err(format!("bad --uid {v:?}: a user id other than 0")),
        Ok(uid) => Ok(uid),
    }
}

fn say(msg: std::fmt::Arguments) {
    eprintln!("converge-agent worker-shim[{}]: {msg}", std::process::id());
}

/// Runs the shim with the arguments after [`SUBCOMMAND`]; returns only with an exit code
/// (it dies of the worker's signal otherwise).
pub fn main(args: Vec<OsString>) -> ExitCode {
    if args.first().is_some_and(|a| a == "--exec") {
        return exec_worker(&args[1..]);
    }
    let args = match parse_args(&args) {
        Ok(a) => a,
        Err(e) => {
            say(format_args!(
                "{e}; usage: converge-agent {SUBCOMMAND} --stop-grace-ms N [--cgroup-procs FILE] [--uid N] -- COMMAND [ARG…] (started by the agent, with its lifeline as stdin)"
            ));
            return ExitCode::from(2);
        }
    };
    // The agent makes the shim a group leader; run by hand, never signal the caller's group.
    if getpgrp() != getpid() {
        let _ = setpgid(Pid::from_raw(0), Pid::from_raw(0));
    }
    let group = getpgrp();
    // Into the worker's cgroup before the worker exists: whatever it starts is in it too.
    // A worker that cannot be confined is not started.
    if let Some(procs) = &args.cgroup_procs
        && let Err(e) = crate::isolation::join(procs)
    {
        say(format_args!(
            "cannot join the worker's cgroup ({}): {e}; the worker is not started",
            procs.display()
        ));
        return ExitCode::from(125);
    }
    // Before any thread starts, so that the lifeline thread blocks them too.
    if let Err(e) = shim_signals().thread_block() {
        say(format_args!("cannot block SIGTERM: {e}"));
    }
    // The worker, through `--exec` (unblocks the signals); this binary, even if replaced.
    let mut exec = Command::new("/proc/self/exe");
    exec.arg0("converge-agent").args([SUBCOMMAND, "--exec"]);
    if let Some(uid) = args.uid {
        exec.args(["--uid".to_string(), uid.to_string()]);
    }
    let mut child = match exec
        .arg("--")
        .args(&args.command)
        .stdin(Stdio::null())
        .spawn()
    {
        Ok(c) => c,
        Err(e) => {
            say(format_args!("cannot start the worker: {e}"));
            return ExitCode::from(127);
        }
    };
    let agent_gone = Arc::new(AtomicBool::new(false));
    {
        let agent_gone = agent_gone.clone();
        let grace = args.stop_grace;
        std::thread::spawn(move || watch_lifeline(group, grace, &agent_gone));
    }
    let status = loop {
        match child.wait() {
            Ok(s) => break s,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                say(format_args!("cannot wait for the worker: {e}"));
                return ExitCode::from(1);
            }
        }
    };
    if agent_gone.load(Ordering::SeqCst) {
        // Nobody reads the status: end what is left of the group, the shim included.
        let _ = killpg(group, Signal::SIGKILL);
    }
    mirror(status)
}

/// `--exec [--uid N] -- <command…>`: unblocks the shim's signals and becomes the worker,
/// under user and group id `N` without supplementary groups when given.
fn exec_worker(args: &[OsString]) -> ExitCode {
    let (uid, args) = match args {
        [flag, value, rest @ ..] if flag == "--uid" => match parse_uid(Some(value)) {
            Ok(uid) => (Some(uid), rest),
            Err(e) => {
                say(format_args!("{e}"));
                return ExitCode::from(2);
            }
        },
        _ => (None, args),
    };
    let (program, rest) = match args {
        [dash, program, rest @ ..] if dash == "--" => (program, rest),
        _ => {
            say(format_args!("--exec needs -- COMMAND"));
            return ExitCode::from(2);
        }
    };
    let _ = shim_signals().thread_unblock();
    let mut cmd = Command::new(program);
    cmd.args(rest);
    if let Some(uid) = uid {
        // std drops the supplementary groups when root changes the user id.
        cmd.uid(uid).gid(uid);
    }
    let e = cmd.exec();
    say(format_args!("cannot start {program:?}: {e}"));
    ExitCode::from(if e.kind() == std::io::ErrorKind::PermissionDenied {
        126
    } else {
        127
    })
}

/// Waits for EOF on stdin (the agent's end of the lifeline closed), then stops the group.
fn watch_lifeline(group: Pid, grace: Duration, agent_gone: &AtomicBool) {
    let mut stdin = std::io::stdin().lock();
    let mut buf = [0u8; 64];
    loop {
        match stdin.read(&mut buf) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => {
                say(format_args!(
                    "lifeline unreadable ({e}): taken as the agent gone"
                ));
                break;
            }
        }
    }
    agent_gone.store(true, Ordering::SeqCst);
    say(format_args!(
        "the agent is gone: SIGTERM to the worker's process group {group}, SIGKILL in {grace:?}"
    ));
    let _ = killpg(group, Signal::SIGTERM);
    std::thread::sleep(grace);
    say(format_args!("grace over: SIGKILL to process group {group}"));
    let _ = killpg(group, Signal::SIGKILL);
}

/// Ends the shim the way the worker ended: its exit code, or its signal.
fn mirror(status: ExitStatus) -> ExitCode {
    if let Some(code) = status.code() {
        return ExitCode::from(code.clamp(0, 255) as u8);
    }
    if let Some(sig) = status.signal() {
        if let Ok(s) = Signal::try_from(sig) {
            // Die of the same signal without leaving a core file of the shim.
            let _ = setrlimit(Resource::RLIMIT_CORE, 0, 0);
            let mut one = SigSet::empty();
            one.add(s);
            let _ = one.thread_unblock();
            let _ = raise(s);
        }
        // A signal whose default action does not end a process (SIGPIPE is ignored by Rust
        // programs): the shell's convention.
        return ExitCode::from((128 + sig).clamp(0, 255) as u8);
    }
    ExitCode::from(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_round_trip() {
        let cmd = vec![
            "python3".to_string(),
            "-u".into(),
            "train.py".into(),
            "--".into(),
        ];
        let args = shim_args(Duration::from_millis(2500), None, None, &cmd);
        assert_eq!(args[0], SUBCOMMAND);
        let parsed = parse_args(&args[1..]).unwrap();
        assert_eq!(parsed.stop_grace, Duration::from_millis(2500));
        assert_eq!((parsed.cgroup_procs, parsed.uid), (None, None));
        let procs = Path::new("/sys/fs/cgroup/w/j.g1.r0.3/cgroup.procs");
        let args = shim_args(Duration::from_secs(1), Some(procs), Some(61000), &cmd);
        let parsed = parse_args(&args[1..]).unwrap();
        assert_eq!(parsed.cgroup_procs.as_deref(), Some(procs));
        assert_eq!(parsed.uid, Some(61000));
        assert_eq!(
            parsed.command,
            cmd.iter().map(OsString::from).collect::<Vec<_>>()
        );
    }

    #[test]
    fn bad_arguments_are_refused() {
        let os = |v: &[&str]| v.iter().map(OsString::from).collect::<Vec<_>>();
        for bad in [
            &[][..],
            &["--", "sleep"],
            &["--stop-grace-ms", "10"],
            &["--stop-grace-ms", "10", "--"],
            &["--stop-grace-ms", "x", "--", "sleep"],
            &["--stop-grace-ms"],
            &["sleep", "1"],
            &["--stop-grace-ms", "10", "--uid", "0", "--", "sleep"],
            &["--stop-grace-ms", "10", "--uid", "x", "--", "sleep"],
            &["--stop-grace-ms", "10", "--cgroup-procs"],
        ] {
            assert!(parse_args(&os(bad)).is_err(), "{bad:?}");
        }
    }
}
