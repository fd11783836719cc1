//! Isolation of workers from the agent and from each other (docs/security.md, "Workers"):
//!
//! - **Environment.** Workers get an explicit environment: the worker contract, the job's
//!   `env`, and only those variables of the agent's own environment that an allow-list
//!   names (`--worker-env`, [`DEFAULT_WORKER_ENV`]). The agent's NATS settings and
//!   credentials ([`withheld_from_workers`]) never pass, whatever the list says.
//! - **Users.** With `--worker-uids FIRST-LAST` each job's workers run under a user id of
//!   their own from that range ([`UidRange::uid_for`]: a hash of the job id, the next free
//!   one on a collision with another job on this host), with that id as group and no
//!   supplementary groups. The job's checkpoint directory is handed to that user before
//!   each start (recursively, never following a link) with mode 0700, so that no other
//!   job reads or overwrites it; its log directory stays the agent's (mode 0700: workers
//!   write their logs through the file descriptor the agent opened). The agent's state
//!   directory is 0700, and `/proc/<agent pid>/environ` is unreadable to other users.
//! - **Cgroups.** With `--worker-cgroup DIR` (a cgroup v2 directory the agent may write,
//!   e.g. systemd's `Delegate=yes`) every worker runs in a cgroup of its own,
//!   `DIR/<host id>/<job>.g<generation>.r<rank>.<start>`, which the shim joins before it starts the
//!   worker. When the worker ends (or is stopped), the agent kills the whole cgroup
//!   (`cgroup.kill`) and removes it before it reports the exit, so processes that left the
//!   worker's process group (`setsid`, daemons) go with it and never outlive their
//!   generation. Cgroups left by an earlier run are killed at start.
//!
//! User ids need an agent running as root (the agent checks at start): a root process that
//! changes to another user id loses every capability, where a non-root agent given
//! `CAP_SETUID` as an ambient capability would hand it on to its workers. A systemd unit
//! can still bound what the root agent may do (`CapabilityBoundingSet=`, docs/deploy.md).

use std::ffi::{OsStr, OsString};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Which variables of the agent's environment workers inherit by default
/// (`--worker-env`): names, or prefixes ending in `*`. The system's (`PATH`, `HOME`,
/// locale, time zone, temporary directory), the GPU stack's (CUDA, NCCL, NVIDIA, cuDNN,
/// cuBLAS, `LD_LIBRARY_PATH`), the numerical libraries' threads, PyTorch's, Hugging Face's
/// caches and offline switches (by name: `HF_*` would pass `HF_TOKEN`, a credential),
/// Python's path and virtual environment, Rust's logging, and `CONVERGE_DATA_DIR`.
pub const DEFAULT_WORKER_ENV: &str = "PATH,HOME,USER,LOGNAME,SHELL,LANG,LANGUAGE,LC_*,TZ,\
TMPDIR,TERM,LD_LIBRARY_PATH,CUDA_*,NCCL_*,NVIDIA_*,CUDNN_*,CUBLAS_*,OMP_*,MKL_*,OPENBLAS_*,\
GLOO_*,TORCH_*,PYTORCH_*,HF_HOME,HF_HUB_CACHE,HF_DATASETS_CACHE,HF_HUB_OFFLINE,\
HF_DATASETS_OFFLINE,TRANSFORMERS_CACHE,TRANSFORMERS_OFFLINE,PYTHONPATH,PYTHONUNBUFFERED,\
PYTHONHASHSEED,VIRTUAL_ENV,RUST_LOG,RUST_BACKTRACE,NO_COLOR,CONVERGE_DATA_DIR";

/// Whether a variable of the agent's environment is withheld from its workers whatever
/// the allow-list says: the NATS connection settings (`CONVERGE_NATS_*`: a URL that may
/// carry a user and password, the user, password, password file, credentials file, nkey
/// seed, TLS key...) and systemd's `CREDENTIALS_DIRECTORY` (where `LoadCredential=` puts
/// the agent's secrets). A job's own `env` may still set these names for itself.
pub fn withheld_from_workers(name: &OsStr) -> bool {
    let name = name.as_encoded_bytes();
    name.starts_with(b"CONVERGE_NATS_") || name == b"CREDENTIALS_DIRECTORY"
}

/// `--worker-env` entries: the variables of the agent's environment workers inherit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnvAllowList(Vec<String>);

impl EnvAllowList {
    /// One entry: a variable name (letters, digits, `_`, not starting with a digit), or a
    /// prefix of one followed by `*`. `Err`: the entry and why it is refused.
    pub fn parse_entry(text: &str) -> Result<String, String> {
        let name = text.strip_suffix('*').unwrap_or(text);
        let valid = name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
            && !name.as_bytes().first().is_some_and(u8::is_ascii_digit)
            && (!name.is_empty() || text == "*");
        if !valid || name.contains('*') {
            return Err(format!(
                "{text:?} is not a variable name or a prefix of one followed by '*'"
            ));
        }
        Ok(text.to_string())
    }

    pub fn new(entries: Vec<String>) -> Self {
        EnvAllowList(entries)
    }

    /// The default list, [`DEFAULT_WORKER_ENV`].
    pub fn default_list() -> Self {
        EnvAllowList(DEFAULT_WORKER_ENV.split(',').map(str::to_string).collect())
    }

    /// Whether workers inherit the agent's variable `name`.
    pub fn allows(&self, name: &OsStr) -> bool {
        if withheld_from_workers(name) {
            return false;
        }
        let name = name.as_encoded_bytes();
        self.0.iter().any(|entry| match entry.strip_suffix('*') {
            Some(prefix) => name.starts_with(prefix.as_bytes()),
            None => name == entry.as_bytes(),
        })
    }

    /// The variables of `env` (the agent's environment) that workers inherit.
    pub fn inherited(
        &self,
        env: impl IntoIterator<Item = (OsString, OsString)>,
    ) -> Vec<(OsString, OsString)> {
        env.into_iter().filter(|(k, _)| self.allows(k)).collect()
    }
}

/// `--worker-uids`: the user ids jobs' workers run under, `FIRST-LAST` inclusive (or one id).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UidRange {
    pub first: u32,
    pub last: u32,
}

impl UidRange {
    /// `FIRST-LAST` or `ID`. `Err`: not numbers, `FIRST > LAST`, or a range holding 0 (root)
    /// or the "nobody" overflow id 65534 / the invalid id 2^32−1.
    pub fn parse(text: &str) -> Result<Self, String> {
        let num = |s: &str| {
            s.trim()
                .parse::<u32>()
                .map_err(|_| format!("{s:?} in --worker-uids {text:?} is not a user id"))
        };
        let (first, last) = match text.split_once('-') {
            Some((a, b)) => (num(a)?, num(b)?),
            None => (num(text)?, num(text)?),
        };
        if first > last {
            return Err(format!("--worker-uids {text:?}: {first} is above {last}"));
        }
        for (bad, what) in [(0, "root"), (65534, "nobody"), (u32::MAX, "the invalid id")] {
            if (first..=last).contains(&bad) {
                return Err(format!(
                    "--worker-uids {text:?} holds {bad} ({what}); give ids no account uses, e.g. 61000-61999"
                ));
            }
        }
        Ok(UidRange { first, last })
    }

    /// How many ids the range holds.
    pub fn count(&self) -> u64 {
        u64::from(self.last - self.first) + 1
    }

    /// The user id of `job`'s workers: `first + FNV-1a(job) mod len`, the same on every
    /// host (so a checkpoint moving between hosts keeps its owner), or the next id up
    /// (wrapping) when `taken` says another job on this host runs under it. `None`: every
    /// id is taken.
    pub fn uid_for(&self, job: &str, taken: impl Fn(u32) -> bool) -> Option<u32> {
        let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
        for b in job.bytes() {
            hash ^= u64::from(b);
            hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
        }
        let len = self.count();
        (0..len)
            .map(|i| self.first + ((hash.wrapping_add(i)) % len) as u32)
            .find(|&uid| !taken(uid))
    }
}

/// Makes `dir` (a job's checkpoint directory) exist and, with `owner`, belong to that user
/// and group id with mode 0700, its contents too. Links are changed themselves, never
/// followed, so that a link a job planted cannot hand it a file outside its directory.
/// `Err`: the directory cannot be made or an entry cannot be changed.
pub fn prepare_checkpoint_dir(dir: &Path, owner: Option<u32>) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let Some(uid) = owner else {
        return Ok(());
    };
    for entry in walkdir::WalkDir::new(dir).follow_links(false) {
        let entry = entry.map_err(std::io::Error::other)?;
        std::os::unix::fs::lchown(entry.path(), Some(uid), Some(uid))?;
    }
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
}

/// Makes a job's log directory exist; when workers run under other users, readable by the
/// agent's user alone (mode 0700).
pub fn prepare_private_dir(dir: &Path, private: bool) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    if private {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
    }
    Ok(())
}

/// Makes the agent's state directory: a new one with mode 0700. An existing directory is
/// left as it is (it may be shared, like `/var/lib`), with a warning when other users may
/// write it; the state file itself is written 0600.
pub fn prepare_state_dir(dir: &Path) -> std::io::Result<()> {
    if dir.is_dir() {
        let mode = std::fs::metadata(dir)?.permissions().mode();
        if mode & 0o022 != 0 {
            tracing::warn!(dir = %dir.display(), mode = format!("{:o}", mode & 0o777), "--state-dir is writable by other users: give the agent a directory of its own (mode 0700)");
        }
        return Ok(());
    }
    prepare_private_dir(dir, true)
}

/// The cgroup of one worker, `<root>/<job>.g<generation>.r<rank>.<start>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerCgroup {
    pub path: PathBuf,
}

/// Checks that `root` (`--worker-cgroup`) is a cgroup v2 directory the agent can make
/// cgroups in (making it when its parent is one). `Err`: what is wrong, for the operator.
pub fn check_cgroup_root(root: &Path) -> Result<(), String> {
    if !root.exists()
        && let Some(parent) = root.parent()
        && parent.join("cgroup.procs").exists()
    {
        std::fs::create_dir(root).map_err(|e| format!("cannot make {}: {e}", root.display()))?;
    }
    if !root.join("cgroup.procs").exists() {
        return Err(format!(
            "--worker-cgroup {} is not a cgroup v2 directory (no cgroup.procs); give one the agent may write, e.g. its own cgroup under systemd's Delegate=yes",
            root.display()
        ));
    }
    let probe = root.join(format!(".probe-{}", std::process::id()));
    std::fs::create_dir(&probe)
        .and_then(|()| std::fs::remove_dir(&probe))
        .map_err(|e| format!("cannot make cgroups in {}: {e}", root.display()))
}

impl WorkerCgroup {
    /// Makes the cgroup of one start of a worker (`start` counts the agent's starts, so
    /// the name is new; cgroups of earlier runs are gone, [`remove_stray_cgroups`]).
    /// `Err`: it cannot be made, or it exists.
    pub fn create(
        root: &Path,
        job: &str,
        generation: u64,
        rank: u32,
        start: u64,
    ) -> std::io::Result<Self> {
        let cg = WorkerCgroup {
            path: root.join(format!("{job}.g{generation}.r{rank}.{start}")),
        };
        std::fs::create_dir(&cg.path)?;
        Ok(cg)
    }

    /// The file a process writes `0` to in order to join the cgroup.
    pub fn procs_file(&self) -> PathBuf {
        self.path.join("cgroup.procs")
    }

    /// The processes in the cgroup now.
    pub fn pids(&self) -> std::io::Result<Vec<u32>> {
        Ok(std::fs::read_to_string(self.procs_file())?
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect())
    }

    /// SIGKILLs every process in the cgroup: `cgroup.kill` (Linux 5.14), else each process
    /// listed in `cgroup.procs`. Returns how many processes it held.
    pub fn kill(&self) -> std::io::Result<usize> {
        let held = self.pids()?.len();
        if held == 0 {
            return Ok(0);
        }
        match std::fs::write(self.path.join("cgroup.kill"), "1") {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                for pid in self.pids()? {
                    let _ = nix::sys::signal::kill(
                        nix::unistd::Pid::from_raw(pid as i32),
                        nix::sys::signal::Signal::SIGKILL,
                    );
                }
            }
            Err(e) => return Err(e),
        }
        Ok(held)
    }

    /// Kills the cgroup's processes, waits (up to `wait`) until none is left and removes
    /// it. Returns how many processes it held. `Err`: it could not be killed or removed
    /// (processes still in it after `wait`: `TimedOut`).
    pub async fn kill_and_remove(&self, wait: Duration) -> std::io::Result<usize> {
        let held = self.kill()?;
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            // Killing again catches a process forked while the first kill ran.
            if self.pids()?.is_empty() {
                break;
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("processes left in {}", self.path.display()),
                ));
            }
            let _ = self.kill();
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        std::fs::remove_dir(&self.path)?;
        Ok(held)
    }
}

/// Kills and removes every worker cgroup under `root` (left by an earlier run of the agent
/// whose workers' escaped processes outlived it). Returns how many processes they held.
pub async fn remove_stray_cgroups(root: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(root) else {
        return 0;
    };
    let mut killed = 0;
    for entry in entries.flatten() {
        if !entry.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        let cg = WorkerCgroup { path: entry.path() };
        match cg.kill_and_remove(Duration::from_secs(5)).await {
            Ok(n) => {
                if n > 0 {
                    tracing::warn!(cgroup = %cg.path.display(), processes = n, "killed the processes a worker of an earlier run left behind");
                }
                killed += n;
            }
            Err(e) => {
                tracing::error!(cgroup = %cg.path.display(), "cannot remove a stray worker cgroup: {e}")
            }
        }
    }
    killed
}

/// Writes `0` to a cgroup's `cgroup.procs`: the calling process joins it (the shim, before
/// it starts the worker, so that everything the worker starts is in it too).
pub fn join(procs_file: &Path) -> std::io::Result<()> {
    std::fs::write(procs_file, "0")
}

/// Whether this process may start workers under other users and hand them files: its
/// effective user is root.
pub fn can_change_users() -> bool {
    nix::unistd::geteuid().is_root()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_agents_nats_settings_are_withheld_from_workers() {
        let all = EnvAllowList::new(vec!["*".into()]);
        for name in [
            "CONVERGE_NATS_URL",
            "CONVERGE_NATS_PASSWORD",
            "CONVERGE_NATS_PASSWORD_FILE",
            "CONVERGE_NATS_CREDS",
            "CONVERGE_NATS_NKEY",
            "CONVERGE_NATS_TLS_KEY",
            "CREDENTIALS_DIRECTORY",
        ] {
            assert!(withheld_from_workers(OsStr::new(name)), "{name}");
            assert!(!all.allows(OsStr::new(name)), "{name}");
        }
        for name in ["PATH", "CONVERGE_DATA_DIR", "NATS", "CONVERGE_NAT"] {
            assert!(!withheld_from_workers(OsStr::new(name)), "{name}");
            assert!(all.allows(OsStr::new(name)), "{name}");
        }
    }

    #[test]
    fn the_allow_list_passes_names_and_prefixes_only() {
        let list = EnvAllowList::default_list();
        for name in [
            "PATH",
            "LC_ALL",
            "CUDA_HOME",
            "NCCL_SOCKET_IFNAME",
            "CONVERGE_DATA_DIR",
            "HF_HOME",
        ] {
            assert!(list.allows(OsStr::new(name)), "{name}");
        }
        for name in [
            "AWS_SECRET_ACCESS_KEY",
            "HF_TOKEN",
            "HUGGING_FACE_HUB_TOKEN",
            "PATHX",
            "CONVERGE_NATS_URL",
            "CONVERGE_AGENT_LABELS",
            "GITHUB_TOKEN",
        ] {
            assert!(!list.allows(OsStr::new(name)), "{name}");
        }
        let env = [
            ("PATH", "/bin"),
            ("SECRET", "x"),
            ("CONVERGE_NATS_USER", "agent"),
        ]
        .map(|(k, v)| (OsString::from(k), OsString::from(v)));
        assert_eq!(
            list.inherited(env),
            vec![(OsString::from("PATH"), OsString::from("/bin"))]
        );
        for entry in DEFAULT_WORKER_ENV.split(',') {
            assert_eq!(EnvAllowList::parse_entry(entry).as_deref(), Ok(entry));
        }
        for bad in ["", "A-B", "1X", "A*B", "**", "A B", "X=1"] {
            assert!(EnvAllowList::parse_entry(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn uid_ranges_refuse_root_and_pick_a_stable_free_id() {
        let r = UidRange::parse("61000-61999").unwrap();
        assert_eq!(r.count(), 1000);
        assert_eq!(UidRange::parse("61000").unwrap().count(), 1);
        for bad in ["0-10", "x", "10-5", "65000-66000", "", "5-"] {
            assert!(UidRange::parse(bad).is_err(), "{bad}");
        }
        let a = r.uid_for("job-a", |_| false).unwrap();
        assert!((61000..=61999).contains(&a));
        assert_eq!(
            r.uid_for("job-a", |_| false),
            Some(a),
            "the same on every host"
        );
        let b = r.uid_for("job-a", |u| u == a).unwrap();
        assert_ne!(a, b);
        assert!((61000..=61999).contains(&b));
        assert_eq!(r.uid_for("job-a", |_| true), None);
        let one = UidRange::parse("61000").unwrap();
        assert_eq!(one.uid_for("anything", |_| false), Some(61000));
    }

    #[test]
    fn a_checkpoint_dir_is_handed_over_without_following_links() {
        if !can_change_users() {
            // Only root may hand files to other users; the integration test runs as root.
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        let outside = tmp.path().join("outside");
        std::fs::write(&outside, "the agent's").unwrap();
        let dir = tmp.path().join("job");
        std::fs::create_dir(&dir).unwrap();
        std::fs::write(dir.join("ckpt"), "weights").unwrap();
        std::os::unix::fs::symlink(&outside, dir.join("link")).unwrap();
        prepare_checkpoint_dir(&dir, Some(61234)).unwrap();
        use std::os::unix::fs::MetadataExt;
        assert_eq!(std::fs::metadata(&dir).unwrap().uid(), 61234);
        assert_eq!(std::fs::metadata(&dir).unwrap().mode() & 0o777, 0o700);
        assert_eq!(std::fs::metadata(dir.join("ckpt")).unwrap().uid(), 61234);
        assert_eq!(
            std::fs::symlink_metadata(dir.join("link")).unwrap().uid(),
            61234
        );
        assert_eq!(
            std::fs::metadata(&outside).unwrap().uid(),
            0,
            "the link's target"
        );
    }
}
