//! `vlm certs`: a CA and one certificate for trying the internal APIs' mutual TLS without a
//! PKI (on a cluster, cert-manager issues them: deploy/k8s/components/internal-mtls).
use clap::Args;
use std::path::PathBuf;
use vlm_service_kit::internal_tls::dev_certs::{loopback_names, write_dev_certs};

#[derive(Args, Debug)]
pub struct CertsArgs {
    /// Directory to write `ca.crt`, `tls.crt` and `tls.key` (mode 0600) into.
    #[arg(long)]
    out: PathBuf,
    /// Names the certificate carries besides localhost, 127.0.0.1 and ::1 (DNS names or IP
    /// addresses; repeatable or comma-separated): the hosts the services dial each other by.
    #[arg(long = "name", value_delimiter = ',')]
    names: Vec<String>,
}

pub fn run(args: CertsArgs) -> anyhow::Result<()> {
    let mut names = loopback_names();
    names.extend(args.names.into_iter().filter(|n| !n.is_empty()));
    let files = write_dev_certs(&args.out, &names)?;
    println!(
        "wrote a new CA and a certificate for {}; give every service\n  \
         --internal-tls-cert {} --internal-tls-key {} --internal-tls-ca {}",
        names.join(", "),
        files.cert.display(),
        files.key.display(),
        files.ca.display()
    );
    Ok(())
}
