//! API keys: `Authorization: Bearer KEY` on HTTP, `authorization` metadata on gRPC. No keys
//! configured = no authentication.
use crate::error::GatewayError;
use std::sync::Arc;

#[derive(Debug, Clone, Default)]
pub struct ApiKeys {
    keys: Arc<Vec<String>>,
}

impl ApiKeys {
    pub fn new(keys: Vec<String>) -> Self {
        ApiKeys {
            keys: Arc::new(
                keys.into_iter()
                    .map(|k| k.trim().to_string())
                    .filter(|k| !k.is_empty())
                    .collect(),
            ),
        }
    }

    /// Keys from a file (one per line, `#` comments) and/or a single key.
    pub fn load(file: Option<&std::path::Path>, key: Option<String>) -> std::io::Result<Self> {
        let mut keys = Vec::new();
        if let Some(p) = file {
            for line in std::fs::read_to_string(p)?.lines() {
                let l = line.trim();
                if !l.is_empty() && !l.starts_with('#') {
                    keys.push(l.to_string());
                }
            }
        }
        keys.extend(key);
        Ok(Self::new(keys))
    }

    pub fn enabled(&self) -> bool {
        !self.keys.is_empty()
    }

    /// Checks an `authorization` header value.
    pub fn check(&self, header: Option<&str>) -> Result<(), GatewayError> {
        if !self.enabled() {
            return Ok(());
        }
        let Some(h) = header else {
            return Err(GatewayError::Unauthenticated(
                "missing `authorization: Bearer <key>`".into(),
            ));
        };
        let token = h
            .strip_prefix("Bearer ")
            .or_else(|| h.strip_prefix("bearer "))
            .unwrap_or(h)
            .trim();
        if self
            .keys
            .iter()
            .any(|k| constant_time_eq(k.as_bytes(), token.as_bytes()))
        {
            Ok(())
        } else {
            Err(GatewayError::Unauthenticated(
                "the API key is not valid".into(),
            ))
        }
    }

    /// A tonic interceptor for the Gateway service.
    pub fn interceptor(&self) -> impl tonic::service::Interceptor + Clone {
        let keys = self.clone();
        move |req: tonic::Request<()>| -> Result<tonic::Request<()>, tonic::Status> {
            let h = req
                .metadata()
                .get("authorization")
                .and_then(|v| v.to_str().ok());
            keys.check(h).map_err(tonic::Status::from)?;
            Ok(req)
        }
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_keys() {
        let k = ApiKeys::new(vec!["s3cret".into()]);
        assert!(k.check(Some("Bearer s3cret")).is_ok());
        assert!(k.check(Some("Bearer nope")).is_err());
        assert!(k.check(None).unwrap_err().to_string().contains("Bearer"));
        assert!(ApiKeys::default().check(None).is_ok());
    }
}
