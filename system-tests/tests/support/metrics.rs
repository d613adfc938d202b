//! Prometheus text scraped and parsed.
use super::http::http;
use std::collections::BTreeMap;

/// `GET /metrics` from `addr`, parsed.
pub fn scrape(addr: &str) -> Metrics {
    let (status, body) = http(addr, "GET", "/metrics", b"");
    assert_eq!(status, 200, "GET http://{addr}/metrics: {body}");
    Metrics::parse(&body)
}

/// Prometheus text exposition: sample name -> [(labels, value)].
#[derive(Debug, Default)]
pub struct Metrics {
    pub samples: BTreeMap<String, Vec<(String, f64)>>,
    pub text: String,
}

impl Metrics {
    pub fn parse(text: &str) -> Metrics {
        let mut samples: BTreeMap<String, Vec<(String, f64)>> = BTreeMap::new();
        for line in text
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
        {
            let (series, value) = match line.rsplit_once(' ') {
                Some(x) => x,
                None => continue,
            };
            let (name, labels) = match series.find('{') {
                Some(i) => (&series[..i], &series[i..]),
                None => (series, ""),
            };
            let value = match value {
                "+Inf" => f64::INFINITY,
                "-Inf" => f64::NEG_INFINITY,
                v => v.parse().unwrap_or(f64::NAN),
            };
            samples
                .entry(name.to_string())
                .or_default()
                .push((labels.to_string(), value));
        }
        Metrics {
            samples,
            text: text.to_string(),
        }
    }

    /// The sample's values summed over its label sets; None when the name is absent.
    pub fn sum(&self, name: &str) -> Option<f64> {
        self.samples
            .get(name)
            .map(|v| v.iter().map(|(_, x)| x).sum())
    }

    /// The value of the sample `name` with exactly `labels` (`{k="v"}`, as exposed).
    pub fn get(&self, name: &str, labels: &str) -> Option<f64> {
        self.samples
            .get(name)?
            .iter()
            .find(|(l, _)| l == labels)
            .map(|(_, v)| *v)
    }

    /// The label sets a sample name has.
    pub fn labels(&self, name: &str) -> Vec<String> {
        self.samples
            .get(name)
            .map(|v| v.iter().map(|(l, _)| l.clone()).collect())
            .unwrap_or_default()
    }
}
