//! `converge-allocator`: the stateless scheduler service. It rebuilds its view of the cluster
//! from NATS, runs `converge-sched`'s scheduling step and writes plans and statuses
//! ([`service`]); only the replica holding the leader lease acts ([`lease`]).

pub mod lease;
pub mod service;
