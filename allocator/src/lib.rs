pub mod fit;
pub mod history;
pub mod placement;
pub mod policies;
pub mod policy;
pub mod schedule;
pub mod service;
pub mod sim;
