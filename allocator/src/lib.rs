//! `converge-allocator`: the stateless scheduler service. It rebuilds its view of the cluster
//! from NATS, runs `converge-sched`'s scheduling step and writes plans and statuses
//! ([`service`]); only the replica holding the leader lease acts ([`lease`]); progress is
//! taken only from the hosts a job is placed on ([`reporters`]); shadow jobs' sync figures
//! reach their statuses through [`shadow`].

pub mod lease;
pub mod reporters;
pub mod service;
pub mod shadow;
