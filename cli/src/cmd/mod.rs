//! One module per subcommand.
pub mod bucket;
pub mod config;
