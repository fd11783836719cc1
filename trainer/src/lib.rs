//! Converge's reference data-parallel trainer.
//!
//! Ranks train a model on one of the real datasets in `data/` with SGD and momentum,
//! average gradients by ring all-reduce over TCP ([`ring`]) or, with `CONVERGE_NUM_PS=p`,
//! through `p` parameter-server shards ([`ps`], which documents that mode's rank layout,
//! wire protocol, checkpoint and resume) or, with `--shadow`, synchronize in a background
//! thread while training never waits ([`shadow`]: ShadowSync's S-MA, S-BMUF and S-EASGD),
//! print `CONVERGE_PROGRESS` lines, and checkpoint so that a job resumes at any world size
//! and in any mode. See
//! `converge-trainer --help` for the worker contract.

pub mod batch;
pub mod checkpoint;
pub mod cli;
pub mod data;
pub mod model;
pub mod order;
pub mod ps;
pub mod ring;
pub mod shadow;
pub mod train;
