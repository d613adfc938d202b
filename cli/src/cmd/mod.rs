//! One module per subcommand, and `vlm up`'s parts (child, supervise, up_context).
pub mod bucket;
pub mod cache;
pub mod certs;
pub mod child;
pub mod config;
pub mod generate;
pub mod gguf;
pub mod inspect;
pub mod make_model;
pub mod plan;
pub mod quantize;
pub mod supervise;
pub mod up;
pub mod up_context;
