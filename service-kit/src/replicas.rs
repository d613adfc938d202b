//! Where a service finds the replicas of another: a fixed `host:port` list or a DNS name
//! (a Kubernetes headless Service) re-resolved as pods come and go.

/// Where replicas come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplicaSource {
    /// Fixed `host:port` list.
    Static(Vec<String>),
    /// `dns:///name:port`: every address the name resolves to, re-resolved periodically.
    Dns { host: String, port: u16 },
}

impl ReplicaSource {
    /// Parses `host:port,host:port` or `dns:///name:port`.
    pub fn parse(s: &str) -> Result<Self, String> {
        let s = s.trim();
        if let Some(rest) = s
            .strip_prefix("dns:///")
            .or_else(|| s.strip_prefix("dns://"))
        {
            let (host, port) = rest
                .rsplit_once(':')
                .ok_or_else(|| format!("{s:?}: expected dns:///name:port"))?;
            let port = port
                .parse()
                .map_err(|_| format!("{s:?}: port {port:?} is not a number"))?;
            return Ok(ReplicaSource::Dns {
                host: host.to_string(),
                port,
            });
        }
        let list: Vec<String> = s
            .split(',')
            .map(|a| a.trim().trim_start_matches("http://").to_string())
            .filter(|a| !a.is_empty())
            .collect();
        if list.is_empty() {
            return Err("the replica list is empty".into());
        }
        if let Some(bad) = list.iter().find(|a| !a.contains(':')) {
            return Err(format!("{bad:?}: expected host:port"));
        }
        Ok(ReplicaSource::Static(list))
    }

    /// The current addresses (`host:port`): the list, or what the name resolves to now
    /// (empty when the lookup fails).
    pub async fn resolve(&self) -> Vec<String> {
        match self {
            ReplicaSource::Static(list) => list.clone(),
            ReplicaSource::Dns { host, port } => {
                match tokio::net::lookup_host((host.as_str(), *port)).await {
                    Ok(addrs) => {
                        let mut v: Vec<String> = addrs.map(|a| a.to_string()).collect();
                        v.sort();
                        v.dedup();
                        v
                    }
                    Err(e) => {
                        tracing::warn!(host, port, error = %e, "replica DNS lookup failed; keeping the last list");
                        Vec::new()
                    }
                }
            }
        }
    }
}

impl std::fmt::Display for ReplicaSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReplicaSource::Static(list) => write!(f, "{}", list.join(",")),
            ReplicaSource::Dns { host, port } => write!(f, "dns:///{host}:{port}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_sources() {
        assert_eq!(
            ReplicaSource::parse("a:1, http://b:2").unwrap(),
            ReplicaSource::Static(vec!["a:1".into(), "b:2".into()])
        );
        assert_eq!(
            ReplicaSource::parse("dns:///lm.ns.svc:50052").unwrap(),
            ReplicaSource::Dns {
                host: "lm.ns.svc".into(),
                port: 50052
            }
        );
        assert!(ReplicaSource::parse("").is_err());
        assert!(ReplicaSource::parse("nohost").is_err());
    }

    #[tokio::test]
    async fn dns_source_resolves_every_address() {
        let addrs = ReplicaSource::parse("dns:///localhost:7")
            .unwrap()
            .resolve()
            .await;
        assert!(
            addrs.iter().any(|a| a == "127.0.0.1:7" || a == "[::1]:7"),
            "{addrs:?}"
        );
    }
}
