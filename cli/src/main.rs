//! `converge`: the operator and user command line. Submits and cancels jobs, lists jobs and
//! hosts, manages queues, streams events, runs the live monitor the local cluster uses, and serves the web
//! dashboard.

mod dashboard;
mod monitor;
mod queues;
mod selector;
mod sweeps;
mod tables;
mod text;

use anyhow::{Context as _, bail};
use clap::{Parser, Subcommand};
use converge_bus::{Bus, NatsArgs, Rejects, unix_now};
use converge_common::sweep::{self, Sweep};
use converge_common::{Event, HostTelemetry, JobId, JobSpec, JobStatus, subjects};
use futures::StreamExt;
use std::path::PathBuf;
use std::time::Duration;

/// Converge: quality-driven scheduling of distributed training jobs on shared GPU clusters.
#[derive(Debug, Parser)]
#[command(name = "converge", version)]
struct Cli {
    #[command(flatten)]
    nats: NatsArgs,
    /// Print JSON instead of tables (for scripts).
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Submit a job spec or a sweep file (TOML). A file with a `[sweep]` table is a sweep:
    /// its `[job]` template is expanded into one trial job per combination of the
    /// `[sweep.grid]` values (or per `[[sweep.trials]]` table), named `<sweep id>-<n>`.
    /// Everything is validated first; a bad spec or sweep is refused with the reason and
    /// nothing is written: also a `queue` that does not exist (see `converge queue`; the
    /// `default` queue always exists) and a `[selector]` no known host satisfies.
    Submit {
        /// Path of the job spec or sweep file, e.g. examples/jobs/a9a-logreg.toml or
        /// examples/sweeps/optdigits.toml.
        file: PathBuf,
        /// Override the spec's `id`, or the sweep's id for a sweep file (e.g. to submit the
        /// same file twice).
        #[arg(long)]
        id: Option<String>,
        /// Sweep files only: the most trials the sweep may expand to. A sweep that expands to
        /// more is refused (never truncated), with its number of trials.
        #[arg(long, default_value_t = sweep::DEFAULT_MAX_TRIALS)]
        max_trials: usize,
    },
    /// Serve the web dashboard: hosts (GPUs, utilization, memory, NICs, lost hosts), jobs
    /// (state, placement, generation, batch, throughput), each job's loss curve with the
    /// fitted curve, the prediction ahead and its band, the allocation timeline with the
    /// allocator's reasons, and the queue with estimated starts; updated live. Read-only: it
    /// only reads NATS, with the credentials given, and serves GET requests. Prints
    /// `dashboard: http://ADDR/` once listening; runs until Ctrl-C.
    Dashboard {
        /// Address to serve on (`127.0.0.1:0` picks a free port). Keep it on loopback or
        /// behind your proxy: the page has no login of its own.
        #[arg(long, default_value = "127.0.0.1:8080")]
        listen: std::net::SocketAddr,
        /// Telemetry older than this marks a host lost; use the allocator's --host-timeout.
        #[arg(long, default_value = "15s", value_parser = converge_bus::humantime_duration)]
        host_timeout: Duration,
        /// Ended jobs shown, most recent first.
        #[arg(long, default_value_t = 50)]
        max_ended: usize,
    },
    /// List jobs: queue and priority, phase (with how a completed job ended, or why a
    /// pending job waits: its queue's quota, a deleted queue, a selector no live host
    /// matches), workers, generation, progress, throughput (with a shadow job's background
    /// sync rounds per second and model gap), loss and the predicted loss.
    Jobs {
        /// Also list completed, failed and cancelled jobs.
        #[arg(long, short)]
        all: bool,
        /// Only the trials of this sweep, finished ones included, ranked best first: by
        /// predicted loss (the loss an ended trial's curve predicted it would reach, else the
        /// current prediction), else by current loss.
        #[arg(long, value_name = "SWEEP_ID")]
        sweep: Option<String>,
    },
    /// List hosts: GPUs, utilization, NIC rates and workers, from their latest heartbeat.
    Hosts,
    /// Manage the queues teams share the cluster through: each has a GPU quota it is
    /// guaranteed, a borrowing limit beyond it and a weight in the fair share of idle GPUs.
    /// A job names its queue with `queue = "NAME"` (else it is in `default`).
    Queue {
        #[command(subcommand)]
        action: queues::QueueCommand,
    },
    /// Cancel a job: its workers are stopped and it is marked cancelled.
    Cancel {
        /// The job id.
        id: String,
    },
    /// Stream live events (workers started/exited, allocation changes, jobs finished).
    Watch,
    /// Live view of jobs, refreshed every interval; optionally writes a JSON summary of
    /// the run (loss, generations and GPUs over time per job).
    Monitor {
        /// Refresh interval, e.g. 2s.
        #[arg(long, default_value = "2s", value_parser = converge_bus::humantime_duration)]
        interval: Duration,
        /// Stop after this long, e.g. 5m.
        #[arg(long, value_parser = converge_bus::humantime_duration)]
        duration: Option<Duration>,
        /// Stop once every submitted job has finished and at least this many jobs exist.
        #[arg(long)]
        until_done: Option<usize>,
        /// Write the run summary (JSON) here when stopping.
        #[arg(long)]
        summary: Option<PathBuf>,
        /// Print one line per change (a job submitted, placed, resized, restarted or
        /// finished) and every 30 s a line per running job, instead of redrawing the table:
        /// for scripts and logs; then the final table.
        #[arg(long)]
        no_clear: bool,
        /// Also write the closing verdict line (`6/6 jobs completed in 138 s`) to this file.
        #[arg(long)]
        verdict_file: Option<PathBuf>,
    },
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    converge_bus::init_tracing("warn");
    let cli = Cli::parse();
    match run(cli).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("converge: {e:#}");
            std::process::ExitCode::from(1)
        }
    }
}

async fn open(nats: &NatsArgs) -> anyhow::Result<Bus> {
    let mut nats = nats.clone();
    nats.connect_timeout.get_or_insert(Duration::from_secs(5));
    match Bus::connect(&nats, "converge-cli", converge_bus::Setup::OpenOrCreate).await {
        Ok(bus) => Ok(bus),
        Err(e @ converge_bus::BusError::Connect { .. }) => Err(anyhow::Error::new(e)
            .context("is the NATS server running? (set --nats-url or CONVERGE_NATS_URL)")),
        Err(e) => Err(e.into()),
    }
}

/// What `converge submit` read: one job, or the trials of a sweep.
enum Submission {
    Job(Box<JobSpec>),
    Sweep(Sweep),
}

/// Reads and validates the file given to `converge submit`.
fn read_submission(
    file: &std::path::Path,
    id: Option<&str>,
    max_trials: usize,
) -> anyhow::Result<Submission> {
    let text = std::fs::read_to_string(file)
        .with_context(|| format!("cannot read job spec {}", file.display()))?;
    let now = unix_now();
    if sweep::is_sweep_file(&text) {
        let refused = || format!("sweep file {} refused", file.display());
        let mut parsed = sweep::SweepFile::from_toml(&text).with_context(refused)?;
        if let Some(id) = id {
            parsed.id = JobId::new(id).with_context(|| format!("invalid --id {id:?}"))?;
        }
        let mut sweep = parsed.expand(max_trials).with_context(refused)?;
        for t in &mut sweep.trials {
            t.spec.submitted_at = now;
        }
        return Ok(Submission::Sweep(sweep));
    }
    let mut spec = JobSpec::from_toml(&text)
        .with_context(|| format!("job spec {} refused", file.display()))?;
    if let Some(id) = id {
        spec.id = JobId::new(id).with_context(|| format!("invalid --id {id:?}"))?;
    }
    spec.submitted_at = now;
    Ok(Submission::Job(Box::new(spec)))
}

/// Refuses specs whose `[selector]` no known host satisfies (see [`selector::refusal`]);
/// reads the hosts only when a spec has a selector.
async fn check_selectors<'a>(
    bus: &Bus,
    specs: impl IntoIterator<Item = &'a JobSpec>,
) -> anyhow::Result<()> {
    let specs: Vec<&JobSpec> = specs
        .into_iter()
        .filter(|s| !s.selector.is_empty())
        .collect();
    if specs.is_empty() {
        return Ok(());
    }
    let rejects = Rejects::default();
    let hosts: Vec<HostTelemetry> = bus
        .load_all::<HostTelemetry>(&bus.hosts, &rejects)
        .await
        .context("cannot read the hosts' labels")?
        .into_values()
        .map(|(t, _)| t)
        .collect();
    for spec in specs {
        if let Some(why) = selector::refusal(spec, &hosts) {
            bail!("job spec {} refused: {why}", spec.id);
        }
    }
    Ok(())
}

/// Stores a new job spec; refuses an id already taken.
async fn create_job(bus: &Bus, spec: &JobSpec) -> anyhow::Result<()> {
    let bytes = converge_common::codec::encode(spec);
    match bus.jobs.create(spec.id.as_str(), bytes.into()).await {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == async_nats::jetstream::kv::CreateErrorKind::AlreadyExists => {
            bail!(
                "job {} already exists; choose another id (or pass --id)",
                spec.id
            )
        }
        Err(e) if e.to_string().contains("maximum bytes exceeded") => bail!(
            "cannot store job {}: KV bucket {} is full ({} MiB; the specs of finished jobs \
             are kept, see docs/deploy.md, \"Storage\"): nothing was written",
            spec.id,
            subjects::BUCKET_JOBS,
            subjects::bucket_bounds(subjects::BUCKET_JOBS).max_bytes / (1024 * 1024)
        ),
        Err(e) => Err(e).context("cannot store the job spec"),
    }
}

/// Submits every trial of a sweep, after checking that none of its ids (nor the sweep id)
/// is taken.
async fn submit_sweep(bus: &Bus, sweep: &Sweep, json: bool) -> anyhow::Result<()> {
    let (existing, _) = load_jobs(bus).await?;
    sweep::check_unused(sweep, &existing)?;
    queues::check_submitted(bus, sweep.trials.iter().map(|t| &t.spec)).await?;
    check_selectors(bus, sweep.trials.iter().map(|t| &t.spec)).await?;
    for (i, t) in sweep.trials.iter().enumerate() {
        if let Err(e) = create_job(bus, &t.spec).await {
            let written: Vec<&str> = sweep.trials[..i]
                .iter()
                .map(|t| t.spec.id.as_str())
                .collect();
            return Err(e.context(format!(
                "sweep {} stopped after {i} of {} trials (submitted: {}; cancel them or submit the rest with another --id)",
                sweep.id,
                sweep.trials.len(),
                if written.is_empty() { "none".into() } else { written.join(", ") }
            )));
        }
    }
    if json {
        let trials: Vec<_> = sweep
            .trials
            .iter()
            .map(|t| {
                let params: serde_json::Map<String, serde_json::Value> = t
                    .params
                    .iter()
                    .map(|(k, v)| (k.clone(), v.clone().into()))
                    .collect();
                serde_json::json!({ "job": t.spec.id, "params": params })
            })
            .collect();
        println!(
            "{}",
            serde_json::json!({ "sweep": sweep.id, "trials": trials })
        );
    } else {
        println!(
            "submitted sweep {}: {} trials",
            sweep.id,
            sweep.trials.len()
        );
        for t in &sweep.trials {
            println!("  {}  {}", t.spec.id, sweep::describe(&t.params));
        }
        println!("ranked: converge jobs --sweep {}", sweep.id);
    }
    Ok(())
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    // Validate input before touching the network.
    let submission = match &cli.command {
        Command::Submit {
            file,
            id,
            max_trials,
        } => Some(read_submission(file, id.as_deref(), *max_trials)?),
        _ => None,
    };
    let sweep_id = match &cli.command {
        Command::Jobs {
            sweep: Some(id), ..
        } => Some(JobId::new(id.clone()).with_context(|| format!("invalid sweep id {id:?}"))?),
        _ => None,
    };
    let queue_cmd = match &cli.command {
        Command::Queue { action } => Some(queues::check(action, unix_now())?),
        _ => None,
    };
    let bus = open(&cli.nats).await?;
    match cli.command {
        Command::Queue { .. } => {
            let cmd = queue_cmd.expect("checked above");
            queues::run(&bus, cmd, cli.json, unix_now()).await?;
        }
        Command::Submit { .. } => {
            let spec = match submission.expect("parsed above") {
                Submission::Job(spec) => *spec,
                Submission::Sweep(sweep) => return submit_sweep(&bus, &sweep, cli.json).await,
            };
            queues::check_submitted(&bus, [&spec]).await?;
            check_selectors(&bus, [&spec]).await?;
            create_job(&bus, &spec).await?;
            if cli.json {
                println!("{}", serde_json::to_string(&spec)?);
            } else {
                println!(
                    "submitted job {} ({}-{} workers x {} GPU)",
                    spec.id,
                    spec.min_workers,
                    spec.max_workers(),
                    spec.gpus_per_worker
                );
            }
        }
        Command::Jobs { .. } if sweep_id.is_some() => {
            let id = sweep_id.expect("checked");
            let (specs, statuses) = load_jobs(&bus).await?;
            let rows = sweeps::rank(&id, &specs, &statuses);
            if rows.is_empty() {
                bail!("no sweep {id}: no job is a trial of it");
            }
            if cli.json {
                println!("{}", serde_json::to_string_pretty(&sweeps::json(&rows))?);
            } else {
                println!("sweep {id}, {}", sweeps::basis(&rows).describe());
                println!("{}", text::terminal_safe(&sweeps::table(&rows).to_string()));
            }
        }
        Command::Jobs { all, .. } => {
            let (specs, statuses) = load_jobs(&bus).await?;
            let rows: Vec<(&JobSpec, Option<&JobStatus>)> = specs
                .iter()
                .map(|s| (s, statuses.iter().find(|st| st.job == s.id)))
                .filter(|(_, st)| all || st.is_none_or(|st| !st.phase.is_terminal()))
                .collect();
            let now = unix_now();
            let queue = queue_estimates(&bus, &specs, &statuses, now).await?;
            let ctx = queue_context(&bus, rows.iter().map(|(s, _)| *s)).await?;
            if cli.json {
                let out: Vec<_> = rows
                    .iter()
                    .map(|(spec, st)| {
                        serde_json::json!({
                            "spec": spec,
                            "status": st,
                            "batch_mode": tables::batch_mode(spec, *st),
                            "queue": queue.get(&spec.id),
                            "queue_name": spec.queue_name(),
                            "queue_exists": ctx.as_ref().is_none_or(|c| c.exists(spec)),
                            "waiting": ctx.as_ref().and_then(|c| c.waiting(spec, *st)),
                            "priority": spec.priority,
                        })
                    })
                    .collect();
                println!("{}", serde_json::to_string_pretty(&out)?);
            } else {
                let table = tables::jobs(&rows, now, &queue, ctx.as_ref()).to_string();
                println!("{}", text::terminal_safe(&table));
                let hidden = specs.len() - rows.len();
                if let Some(line) = tables::hidden_jobs_note(hidden) {
                    println!("{line}");
                }
            }
        }
        Command::Hosts => {
            let rejects = Rejects::default();
            let hosts: Vec<HostTelemetry> = bus
                .load_all::<HostTelemetry>(&bus.hosts, &rejects)
                .await?
                .into_values()
                .map(|(t, _)| t)
                .collect();
            if cli.json {
                println!("{}", serde_json::to_string_pretty(&hosts)?);
            } else {
                let table = tables::hosts(&hosts, unix_now()).to_string();
                println!("{}", text::terminal_safe(&table));
                if let Some(types) = tables::gpus_by_type(&hosts) {
                    println!("{}", text::terminal_safe(&format!("GPUs by type: {types}")));
                }
            }
        }
        Command::Cancel { id } => {
            let id = JobId::new(id.clone()).with_context(|| format!("invalid job id {id:?}"))?;
            let Some((mut spec, revision)) = bus.get::<JobSpec>(&bus.jobs, id.as_str()).await?
            else {
                bail!("no job {id}");
            };
            if spec.cancelled {
                println!("job {id} was already cancelled");
                return Ok(());
            }
            spec.cancelled = true;
            bus.jobs
                .update(
                    id.as_str(),
                    converge_common::codec::encode(&spec).into(),
                    revision,
                )
                .await
                .context("the job changed while cancelling; try again")?;
            println!("cancelling job {id}: its workers will be stopped");
        }
        Command::Watch => {
            let mut sub = bus.client.subscribe(subjects::EVENTS_ALL).await?;
            let rejects = Rejects::default();
            eprintln!("watching {} (Ctrl-C to stop)", subjects::EVENTS_ALL);
            while let Some(msg) = sub.next().await {
                let Some(event) = rejects.decode::<Event>(msg.subject.as_str(), "", &msg.payload)
                else {
                    continue;
                };
                if cli.json {
                    println!("{}", serde_json::to_string(&event)?);
                } else {
                    let line = format!(
                        "{} {:<20} {}",
                        text::clock(event.time),
                        event.source,
                        event.message
                    );
                    println!("{}", text::terminal_safe(&line));
                }
            }
        }
        Command::Dashboard {
            listen,
            host_timeout,
            max_ended,
        } => {
            dashboard::run(
                &bus,
                dashboard::Options {
                    listen,
                    host_timeout,
                    max_ended,
                },
            )
            .await?;
        }
        Command::Monitor {
            interval,
            duration,
            until_done,
            summary,
            no_clear,
            verdict_file,
        } => {
            monitor::run(
                &bus,
                monitor::Options {
                    interval,
                    duration,
                    until_done,
                    summary,
                    clear: !no_clear,
                    json: cli.json,
                    verdict_file,
                },
            )
            .await?;
        }
    }
    Ok(())
}

/// The queues and their statuses, read only when one of `specs` names a queue other than
/// `default` (`None` otherwise).
async fn queue_context<'a>(
    bus: &Bus,
    mut specs: impl Iterator<Item = &'a JobSpec>,
) -> anyhow::Result<Option<queues::Context>> {
    if !specs.any(|s| s.queue_name() != converge_common::DEFAULT_QUEUE) {
        return Ok(None);
    }
    Ok(Some(queues::Context::load(bus).await?))
}

/// Telemetry older than this marks a host lost (the allocator's default `--host-timeout`).
pub(crate) const HOST_TIMEOUT_S: f64 = 15.0;

/// Queue positions and estimated starts of the pending jobs on the live hosts' GPUs
/// (`converge_sched::outlook`: submission order, running jobs ending at their target or
/// after as much again as done, no arrivals).
pub(crate) async fn queue_estimates(
    bus: &Bus,
    specs: &[JobSpec],
    statuses: &[JobStatus],
    now: f64,
) -> anyhow::Result<std::collections::BTreeMap<JobId, converge_sched::outlook::QueueEntry>> {
    let rejects = Rejects::default();
    let live_gpus: u32 = bus
        .load_all::<HostTelemetry>(&bus.hosts, &rejects)
        .await?
        .into_values()
        .filter(|(t, _)| now - t.time <= HOST_TIMEOUT_S)
        .map(|(t, _)| t.gpus.len() as u32)
        .sum();
    let specs = specs.iter().map(|s| (s.id.clone(), s.clone())).collect();
    let statuses = statuses
        .iter()
        .map(|s| (s.job.clone(), s.clone()))
        .collect();
    Ok(
        converge_sched::outlook::queue_estimates(&specs, &statuses, live_gpus, now)
            .into_iter()
            .map(|e| (e.job.clone(), e))
            .collect(),
    )
}

/// Job specs and statuses, each sorted by submission time.
pub(crate) async fn load_jobs(bus: &Bus) -> anyhow::Result<(Vec<JobSpec>, Vec<JobStatus>)> {
    let rejects = Rejects::default();
    let mut specs: Vec<JobSpec> = bus
        .load_all::<JobSpec>(&bus.jobs, &rejects)
        .await?
        .into_values()
        .map(|(s, _)| s)
        .collect();
    specs.sort_by(|a, b| {
        a.submitted_at
            .total_cmp(&b.submitted_at)
            .then(a.id.cmp(&b.id))
    });
    let statuses: Vec<JobStatus> = bus
        .load_all::<JobStatus>(&bus.status, &rejects)
        .await?
        .into_values()
        .map(|(s, _)| s)
        .collect();
    Ok((specs, statuses))
}
