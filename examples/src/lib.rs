//! Examples of embedding flow pipelines; see `embedded_pipeline.rs`.
