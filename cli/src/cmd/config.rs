//! `vlm config check FILE`.
use clap::Subcommand;
use std::path::PathBuf;
use std::process::ExitCode;
use vlm_config::DeployConfig;

#[derive(Subcommand, Debug)]
pub enum ConfigCommand {
    /// Validate a config file (JSON, YAML or TOML): print the normalized config as JSON on
    /// stdout and warnings on stderr; exit 1 with the reason when it is invalid.
    Check {
        /// The config file.
        file: PathBuf,
    },
}

pub fn run(cmd: ConfigCommand) -> anyhow::Result<ExitCode> {
    match cmd {
        ConfigCommand::Check { file } => match DeployConfig::from_path(&file) {
            Ok(loaded) => {
                for w in &loaded.warnings {
                    eprintln!("warning: {w}");
                }
                println!(
                    "{}",
                    serde_json::to_string_pretty(&loaded.config.to_document())?
                );
                Ok(ExitCode::SUCCESS)
            }
            Err(e) => {
                eprintln!("error: {}: {e}", file.display());
                Ok(ExitCode::FAILURE)
            }
        },
    }
}
