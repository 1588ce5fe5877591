pub mod deliverers;
pub mod sink;
pub mod targets;
pub mod template;
