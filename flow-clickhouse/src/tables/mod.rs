pub mod deliverers;
pub mod direct;
pub mod requeued;
pub mod resolver;
pub mod sink;
pub mod subjects;
pub mod targets;
pub mod template;
