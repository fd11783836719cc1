//! `converge-allocator`: the stateless scheduler service. It rebuilds its view of the cluster
//! from NATS, runs `converge-sched`'s scheduling step and writes plans and statuses
//! ([`service`]); only the replica holding the leader lease acts ([`lease`]); progress is
//! taken only from the hosts a job is placed on ([`reporters`]); shadow jobs' sync figures
//! reach their statuses through [`shadow`]. Inside the crate, [`service`]'s main loop draws on
//! `config` (its command line), `followers` (the KV watchers), `progress` (the progress
//! stream's follower), `writes` (what the leader writes and re-reads) and `service_metrics`.

mod config;
mod followers;
pub mod lease;
mod progress;
pub mod reporters;
pub mod service;
mod service_metrics;
pub mod shadow;
#[cfg(test)]
mod test_support;
mod writes;
