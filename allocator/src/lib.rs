pub mod fit;
pub mod history;
pub mod placement;
pub mod policy;
pub mod schedule;
pub mod service;
