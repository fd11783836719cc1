//! Strays: worker process groups left behind by an earlier run of this agent, found and
//! stopped before the agent starts anything, so that two copies of one rank never run.
//!
//! The supervisor records every worker it starts in a state file
//! (`<--state-dir>/workers-<host>.state`, rewritten atomically on every start and exit):
//! the worker's process group (the pid of its shim, which leads the group), the group
//! leader's start time in clock ticks since boot (`/proc/<pid>/stat`, field 22) and the
//! boot id, plus its job, generation and rank. On start, [`stop_strays`] reads the file and
//! stops (SIGTERM to the group, SIGKILL after the stop grace) every recorded group that is
//! still alive and still ours:
//!
//! - the recorded leader itself, if its pid runs with the recorded start time (a reused pid
//!   has another start time), or
//! - when the leader is gone (its shim was killed too), a member of the group (same process
//!   group id, which Linux does not hand out again while the group has members) started no
//!   earlier than the leader and carrying the worker contract's `CONVERGE_JOB_ID`,
//!   `CONVERGE_GENERATION` and `RANK` of the record, which rules out a later, unrelated
//!   group that happens to have the same id.
//!
//! A state file from another boot lists nothing alive. Workers that left their process group
//! themselves (`setsid`, daemons) are out of reach, as they are for the supervisor's own
//! stops.

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// First line of a state file.
pub const STATE_HEADER: &str = "converge-agent workers v1";

/// One worker the agent started.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recorded {
    pub job: String,
    pub generation: u64,
    pub rank: u32,
    /// Pid of the group leader (the shim), which is also the process group id.
    pub pid: u32,
    /// The leader's start time, clock ticks after boot.
    pub start_ticks: u64,
}

/// The content of a state file.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StateFile {
    /// `/proc/sys/kernel/random/boot_id` when the file was written.
    pub boot_id: String,
    pub workers: Vec<Recorded>,
}

impl StateFile {
    /// The file's text: the header, `boot <id>`, then one `worker <pid> <start ticks> <job>
    /// <generation> <rank>` line per worker.
    pub fn render(&self) -> String {
        let mut s = format!("{STATE_HEADER}\nboot {}\n", self.boot_id);
        for w in &self.workers {
            s.push_str(&format!(
                "worker {} {} {} {} {}\n",
                w.pid, w.start_ticks, w.job, w.generation, w.rank
            ));
        }
        s
    }

    /// Parses [`StateFile::render`]'s text.
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut lines = text.lines();
        if lines.next() != Some(STATE_HEADER) {
            return Err(format!("the first line is not {STATE_HEADER:?}"));
        }
        let mut file = StateFile::default();
        for (n, line) in lines.enumerate() {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let bad = || format!("line {}: cannot read {line:?}", n + 2);
            match fields.as_slice() {
                [] => {}
                ["boot", id] => file.boot_id = (*id).to_string(),
                ["worker", pid, start, job, generation, rank] => {
                    file.workers.push(Recorded {
                        pid: pid.parse().map_err(|_| bad())?,
                        start_ticks: start.parse().map_err(|_| bad())?,
                        job: (*job).to_string(),
                        generation: generation.parse().map_err(|_| bad())?,
                        rank: rank.parse().map_err(|_| bad())?,
                    });
                    if file.workers.last().is_some_and(|w| w.pid <= 1) {
                        return Err(bad());
                    }
                }
                _ => return Err(bad()),
            }
        }
        Ok(file)
    }

    /// Writes the file atomically (a temporary file renamed over it).
    pub fn write(&self, path: &Path) -> std::io::Result<()> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let tmp = path.with_extension("state.tmp");
        // Readable by the agent's user alone (mode 0600), whatever the umask.
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        file.write_all(self.render().as_bytes())?;
        drop(file);
        std::fs::rename(&tmp, path)
    }
}

/// The state file of `host` in `dir`.
pub fn state_path(dir: &Path, host: &str) -> PathBuf {
    dir.join(format!("workers-{host}.state"))
}

/// This boot's id; empty when unreadable (then every record is taken as from this boot).
pub fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// What [`stray_groups`] needs of a process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcStat {
    pub pid: u32,
    /// Process group id.
    pub pgrp: u32,
    /// Clock ticks after boot.
    pub start_ticks: u64,
    /// Exited, not yet reaped.
    pub zombie: bool,
}

/// Parses `/proc/<pid>/stat`: `pid (comm) state ppid pgrp ...`, start time in field 22.
/// The command name may hold spaces and parentheses, so fields are counted after its last
/// `)`.
pub fn parse_stat(text: &str) -> Option<ProcStat> {
    let open = text.find('(')?;
    let close = text.rfind(')')?;
    let pid = text[..open].trim().parse().ok()?;
    // Fields 3.. (state is field 3).
    let rest: Vec<&str> = text.get(close + 1..)?.split_whitespace().collect();
    Some(ProcStat {
        pid,
        zombie: *rest.first()? == "Z",
        pgrp: rest.get(2)?.parse().ok()?,
        start_ticks: rest.get(19)?.parse().ok()?,
    })
}

/// `/proc/<pid>/stat` of a process, `None` when it does not exist (or cannot be read).
pub fn read_stat(pid: u32) -> Option<ProcStat> {
    parse_stat(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// Whether a NUL-separated environment (`/proc/<pid>/environ`) holds the worker contract's
/// variables of `rec`.
pub fn env_matches(environ: &[u8], rec: &Recorded) -> bool {
    let want = [
        format!("CONVERGE_JOB_ID={}", rec.job),
        format!("CONVERGE_GENERATION={}", rec.generation),
        format!("RANK={}", rec.rank),
    ];
    want.iter()
        .all(|w| environ.split(|&b| b == 0).any(|v| v == w.as_bytes()))
}

/// Whether process `p` belongs to the worker group recorded as `rec` (module docs).
/// `environ` is asked for only when needed.
pub fn is_member(rec: &Recorded, p: &ProcStat, environ: impl FnOnce() -> Option<Vec<u8>>) -> bool {
    if p.zombie || p.pgrp != rec.pid {
        return false;
    }
    if p.pid == rec.pid {
        return p.start_ticks == rec.start_ticks;
    }
    p.start_ticks >= rec.start_ticks && environ().is_some_and(|e| env_matches(&e, rec))
}

/// The recorded groups that still have a member among `procs`, each with its members'
/// pids. `environ(pid)` reads a process's environment.
pub fn stray_groups<'a>(
    file: &'a StateFile,
    current_boot: &str,
    procs: &[ProcStat],
    mut environ: impl FnMut(u32) -> Option<Vec<u8>>,
) -> Vec<(&'a Recorded, Vec<u32>)> {
    if !file.boot_id.is_empty() && !current_boot.is_empty() && file.boot_id != current_boot {
        return Vec::new();
    }
    file.workers
        .iter()
        .filter_map(|rec| {
            let members: Vec<u32> = procs
                .iter()
                .filter(|p| is_member(rec, p, || environ(p.pid)))
                .map(|p| p.pid)
                .collect();
            (!members.is_empty()).then_some((rec, members))
        })
        .collect()
}

/// Every process in `/proc` (those this agent may see).
pub fn scan_proc() -> Vec<ProcStat> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(read_stat)
        .collect()
}

/// Whether a process group has a live (not zombie) member.
fn group_alive(pgid: u32) -> bool {
    scan_proc().iter().any(|p| p.pgrp == pgid && !p.zombie)
}

/// Stops the worker groups listed in `path` that are still alive (module docs): SIGTERM,
/// then SIGKILL to those left after `grace`. Returns how many groups it stopped. A missing
/// file means nothing to stop; an unreadable one is reported and skipped.
pub async fn stop_strays(path: &Path, grace: Duration) -> usize {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return 0,
        Err(e) => {
            tracing::error!(path = %path.display(), "cannot read the worker state file: {e}; workers of an earlier run, if any, are not stopped");
            return 0;
        }
    };
    let file = match StateFile::parse(&text) {
        Ok(f) => f,
        Err(e) => {
            tracing::error!(path = %path.display(), "bad worker state file: {e}; workers of an earlier run, if any, are not stopped");
            return 0;
        }
    };
    let boot = boot_id();
    let procs = scan_proc();
    let strays: Vec<(Recorded, Vec<u32>)> = stray_groups(&file, &boot, &procs, |pid| {
        std::fs::read(format!("/proc/{pid}/environ")).ok()
    })
    .into_iter()
    .map(|(r, m)| (r.clone(), m))
    .collect();
    if strays.is_empty() {
        if !file.workers.is_empty() {
            tracing::info!(
                recorded = file.workers.len(),
                "no worker of an earlier run of this agent is left"
            );
        }
        return 0;
    }
    for (rec, members) in &strays {
        tracing::warn!(
            job = %rec.job, generation = rec.generation, rank = rec.rank, pgid = rec.pid,
            processes = ?members,
            "stray worker of an earlier run of this agent: SIGTERM to its process group"
        );
        if let Err(e) = killpg(Pid::from_raw(rec.pid as i32), Signal::SIGTERM) {
            tracing::warn!(pgid = rec.pid, "killpg SIGTERM: {e}");
        }
    }
    let deadline = Instant::now() + grace;
    let alive = |strays: &[(Recorded, Vec<u32>)]| -> Vec<u32> {
        strays
            .iter()
            .map(|(r, _)| r.pid)
            .filter(|&g| group_alive(g))
            .collect()
    };
    let mut left = alive(&strays);
    while !left.is_empty() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
        left = alive(&strays);
    }
    if !left.is_empty() {
        tracing::warn!(groups = ?left, ?grace, "stray workers ignored SIGTERM for the grace period: SIGKILL");
        for &g in &left {
            let _ = killpg(Pid::from_raw(g as i32), Signal::SIGKILL);
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while !left.is_empty() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
            left = alive(&strays);
        }
        if !left.is_empty() {
            tracing::error!(groups = ?left, "stray workers survived SIGKILL (uninterruptible sleep?)");
        }
    }
    tracing::info!(
        stopped = strays.len(),
        "stray workers of an earlier run stopped"
    );
    strays.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(pid: u32, start: u64) -> Recorded {
        Recorded {
            job: "mnist".into(),
            generation: 3,
            rank: 1,
            pid,
            start_ticks: start,
        }
    }

    fn pstat(pid: u32, pgrp: u32, start: u64) -> ProcStat {
        ProcStat {
            pid,
            pgrp,
            start_ticks: start,
            zombie: false,
        }
    }

    const ENV: &[u8] = b"PATH=/bin\0CONVERGE_JOB_ID=mnist\0CONVERGE_GENERATION=3\0RANK=1\0";

    /// The variables a stray is recognized by are ones the agent sets on every worker
    /// (the contract's table, `converge_common::contract`).
    #[test]
    fn strays_are_recognized_by_variables_every_worker_gets() {
        use converge_common::contract::{When, get};
        let r = rec(1, 1);
        assert!(env_matches(ENV, &r));
        for var in ENV.split(|&b| b == 0).filter(|v| !v.is_empty()) {
            let name = std::str::from_utf8(var).unwrap().split('=').next().unwrap();
            if name == "PATH" {
                continue;
            }
            assert_eq!(get(name).map(|v| v.when), Some(When::Always), "{name}");
            // Without it, no match.
            let without: Vec<u8> = ENV
                .split(|&b| b == 0)
                .filter(|v| *v != var)
                .flat_map(|v| v.iter().copied().chain([0]))
                .collect();
            assert!(!env_matches(&without, &r), "{name}");
        }
    }

    #[test]
    fn state_files_round_trip_and_bad_ones_are_refused() {
        let f = StateFile {
            boot_id: "0d5c-boot".into(),
            workers: vec![rec(4321, 99_000), rec(77, 5)],
        };
        let text = f.render();
        assert!(text.starts_with(
            "converge-agent workers v1\nboot 0d5c-boot\nworker 4321 99000 mnist 3 1\n"
        ));
        assert_eq!(StateFile::parse(&text).unwrap(), f);
        assert_eq!(
            StateFile::parse(&format!("{STATE_HEADER}\n")).unwrap(),
            StateFile::default()
        );
        for bad in [
            "",
            "converge-agent workers v2\n",
            "converge-agent workers v1\nworker 12 x mnist 3 1\n",
            "converge-agent workers v1\nworker 12 5 mnist 3\n",
            "converge-agent workers v1\nworker 1 5 mnist 3 1\n",
            "converge-agent workers v1\nwhat\n",
        ] {
            assert!(StateFile::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn stat_lines_parse_with_odd_command_names() {
        let line = "4321 (sh (x) y) S 1 4321 4321 0 -1 4194560 120 0 0 0 0 0 0 0 20 0 1 0 99000 2400000 200 18446744073709551615 1 1 0 0 0 0 0 0 65536 0 0 0 17 1 0 0 0 0 0";
        assert_eq!(
            parse_stat(line),
            Some(ProcStat {
                pid: 4321,
                pgrp: 4321,
                start_ticks: 99_000,
                zombie: false
            })
        );
        let zombie = line.replacen(") S ", ") Z ", 1);
        assert!(parse_stat(&zombie).unwrap().zombie);
        assert_eq!(parse_stat("12 (x) S 1"), None);
        // This process's own line.
        let me = read_stat(std::process::id()).unwrap();
        assert_eq!(me.pid, std::process::id());
        assert!(me.start_ticks > 0 && !me.zombie);
    }

    #[test]
    fn the_recorded_leader_matches_only_with_its_start_time() {
        let r = rec(4321, 99_000);
        let no_env =
            || -> Option<Vec<u8>> { panic!("the leader is matched without its environment") };
        assert!(is_member(&r, &pstat(4321, 4321, 99_000), no_env));
        // The pid was reused by another process.
        assert!(!is_member(&r, &pstat(4321, 4321, 99_500), no_env));
        // Zombies are not alive.
        let mut z = pstat(4321, 4321, 99_000);
        z.zombie = true;
        assert!(!is_member(&r, &z, no_env));
    }

    #[test]
    fn members_of_a_leaderless_group_need_the_records_environment() {
        let r = rec(4321, 99_000);
        let env = || Some(ENV.to_vec());
        // The shim is gone; its worker is left in the group.
        assert!(is_member(&r, &pstat(4400, 4321, 99_010), env));
        // Another group, or started before the shim: not ours.
        assert!(!is_member(&r, &pstat(4400, 4400, 99_010), env));
        assert!(!is_member(&r, &pstat(4400, 4321, 98_000), env));
        // A later group with the same id and another job's (or no) environment.
        for other in [
            &b"CONVERGE_JOB_ID=mnist\0CONVERGE_GENERATION=4\0RANK=1\0"[..],
            b"CONVERGE_JOB_ID=mnist2\0CONVERGE_GENERATION=3\0RANK=1\0",
            b"CONVERGE_JOB_ID=mnist\0CONVERGE_GENERATION=3\0RANK=10\0",
            b"HOME=/root\0",
        ] {
            assert!(!is_member(&r, &pstat(4400, 4321, 99_010), || Some(
                other.to_vec()
            )));
        }
        assert!(!is_member(&r, &pstat(4400, 4321, 99_010), || None));
    }

    #[test]
    fn stray_groups_lists_live_recorded_groups_of_this_boot() {
        let file = StateFile {
            boot_id: "b1".into(),
            workers: vec![rec(100, 50), rec(200, 60), rec(300, 70)],
        };
        let procs = [
            pstat(100, 100, 50),  // leader alive
            pstat(101, 100, 51),  // its worker
            pstat(250, 200, 65),  // leaderless group 200: a worker
            pstat(300, 300, 999), // pid 300 reused
            pstat(400, 400, 10),
        ];
        let got = stray_groups(&file, "b1", &procs, |_| Some(ENV.to_vec()));
        let got: Vec<(u32, Vec<u32>)> = got.into_iter().map(|(r, m)| (r.pid, m)).collect();
        assert_eq!(got, vec![(100, vec![100, 101]), (200, vec![250])]);
        // Another boot: nothing of the file can be alive.
        assert!(stray_groups(&file, "b2", &procs, |_| Some(ENV.to_vec())).is_empty());
    }

    #[test]
    fn state_files_are_written_atomically() {
        let dir = std::env::temp_dir().join(format!("converge-strays-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = state_path(&dir, "n1");
        assert!(path.ends_with("workers-n1.state"));
        let f = StateFile {
            boot_id: boot_id(),
            workers: vec![rec(4321, 1)],
        };
        f.write(&path).unwrap();
        assert_eq!(
            StateFile::parse(&std::fs::read_to_string(&path).unwrap()).unwrap(),
            f
        );
        assert!(!path.with_extension("state.tmp").exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
