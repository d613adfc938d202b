//! One module per subcommand.
pub mod bucket;
pub mod config;
pub mod inspect;
pub mod make_model;
pub mod plan;
