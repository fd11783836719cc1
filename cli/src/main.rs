//! `converge`: the operator and user command line. Submits and cancels jobs, lists jobs and
//! hosts, streams events, and runs the live monitor the local cluster uses.

mod monitor;
mod tables;

use anyhow::{Context as _, bail};
use clap::{Parser, Subcommand};
use converge_bus::{Bus, NatsArgs, Rejects, unix_now};
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
    /// Submit a job spec (TOML). The spec is validated first; a bad spec is refused with
    /// the reason and nothing is written.
    Submit {
        /// Path of the job spec, e.g. examples/jobs/a9a-logreg.toml.
        file: PathBuf,
        /// Override the spec's `id` (e.g. to submit the same spec twice).
        #[arg(long)]
        id: Option<String>,
    },
    /// List jobs: phase, workers, generation, progress, loss and the predicted loss.
    Jobs {
        /// Also list completed, failed and cancelled jobs.
        #[arg(long, short)]
        all: bool,
    },
    /// List hosts: GPUs, utilization, NIC rates and workers, from their latest heartbeat.
    Hosts,
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
        /// Do not clear the screen between refreshes.
        #[arg(long)]
        no_clear: bool,
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

async fn run(cli: Cli) -> anyhow::Result<()> {
    // Validate input before touching the network.
    let spec = match &cli.command {
        Command::Submit { file, id } => {
            let text = std::fs::read_to_string(file)
                .with_context(|| format!("cannot read job spec {}", file.display()))?;
            let mut spec = JobSpec::from_toml(&text)
                .with_context(|| format!("job spec {} refused", file.display()))?;
            if let Some(id) = id {
                spec.id = JobId::new(id.clone()).with_context(|| format!("invalid --id {id:?}"))?;
            }
            spec.submitted_at = unix_now();
            Some(spec)
        }
        _ => None,
    };
    let bus = open(&cli.nats).await?;
    match cli.command {
        Command::Submit { .. } => {
            let spec = spec.expect("parsed above");
            let bytes = converge_common::messages::encode(&spec);
            match bus.jobs.create(spec.id.as_str(), bytes.into()).await {
                Ok(_) => {}
                Err(e) if e.kind() == async_nats::jetstream::kv::CreateErrorKind::AlreadyExists => {
                    bail!(
                        "job {} already exists; choose another id (or pass --id)",
                        spec.id
                    )
                }
                Err(e) => return Err(e).context("cannot store the job spec"),
            }
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
        Command::Jobs { all } => {
            let (specs, statuses) = load_jobs(&bus).await?;
            let rows: Vec<(&JobSpec, Option<&JobStatus>)> = specs
                .iter()
                .map(|s| (s, statuses.iter().find(|st| st.job == s.id)))
                .filter(|(_, st)| all || st.is_none_or(|st| !st.phase.is_terminal()))
                .collect();
            if cli.json {
                let out: Vec<_> = rows
                    .iter()
                    .map(|(spec, st)| {
                        serde_json::json!({
                            "spec": spec,
                            "status": st,
                            "batch_mode": tables::batch_mode(spec, *st),
                        })
                    })
                    .collect();
                println!("{}", serde_json::to_string_pretty(&out)?);
            } else {
                println!("{}", tables::jobs(&rows, unix_now()));
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
                println!("{}", tables::hosts(&hosts, unix_now()));
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
                    converge_common::messages::encode(&spec).into(),
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
                    println!(
                        "{} {:<20} {}",
                        tables::clock(event.time),
                        event.source,
                        event.message
                    );
                }
            }
        }
        Command::Monitor {
            interval,
            duration,
            until_done,
            summary,
            no_clear,
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
                },
            )
            .await?;
        }
    }
    Ok(())
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
