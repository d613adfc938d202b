//! A shared token on the internal APIs (`vlm.v1.Vision`, `vlm.v1.Lm`), for clusters without
//! mTLS between the services: callers send `authorization: Bearer <token>`, servers refuse
//! calls without it (UNAUTHENTICATED). Health and reflection stay open for probes.
//!
//! The token is a file (a mounted Kubernetes Secret) re-read when it changes, so it rotates
//! without restarts; the previous token stays valid for [`ROTATION_GRACE`], as the kubelet
//! updates the Secret in each pod at a different moment.
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tonic::metadata::{MetadataMap, MetadataValue};
use tonic::{Request, Status};

/// How long the token a file held before its change is still accepted.
pub const ROTATION_GRACE: Duration = Duration::from_secs(300);
/// The file is looked at again at most this often.
const RECHECK: Duration = Duration::from_secs(1);

#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    #[error("internal token file {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("internal token file {0} is empty")]
    Empty(PathBuf),
}

#[derive(Debug)]
struct State {
    token: String,
    checked: Instant,
    /// The token before the last change, and when it stops being accepted.
    previous: Option<(String, Instant)>,
}

/// The shared token, from its file.
#[derive(Debug)]
pub struct InternalToken {
    path: PathBuf,
    state: Mutex<State>,
}

fn read(path: &Path) -> Result<String, TokenError> {
    let io = |source| TokenError::Io {
        path: path.to_path_buf(),
        source,
    };
    let text = std::fs::read_to_string(path).map_err(io)?;
    let token = text.trim().to_string();
    if token.is_empty() {
        return Err(TokenError::Empty(path.to_path_buf()));
    }
    Ok(token)
}

impl InternalToken {
    /// Reads the token from `path` (surrounding whitespace dropped); an empty file is refused.
    pub fn from_file(path: &Path) -> Result<Arc<Self>, TokenError> {
        let token = read(path)?;
        Ok(Arc::new(InternalToken {
            path: path.to_path_buf(),
            state: Mutex::new(State {
                token,
                checked: Instant::now(),
                previous: None,
            }),
        }))
    }

    /// The state, the file re-read at most every second (a failed read keeps the last token).
    fn fresh(&self) -> std::sync::MutexGuard<'_, State> {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if s.checked.elapsed() >= RECHECK {
            s.checked = Instant::now();
            match read(&self.path) {
                Ok(token) if token != s.token => {
                    let old = std::mem::replace(&mut s.token, token);
                    s.previous = Some((old, Instant::now() + ROTATION_GRACE));
                    tracing::info!(path = %self.path.display(), "internal token rotated");
                }
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "keeping the last internal token"),
            }
        }
        s
    }

    /// Adds `authorization: Bearer <token>` to an outgoing call.
    pub fn attach<T>(&self, req: &mut Request<T>) {
        let token = self.fresh().token.clone();
        if let Ok(v) = MetadataValue::try_from(format!("Bearer {token}")) {
            req.metadata_mut().insert("authorization", v);
        }
    }

    /// Whether `metadata` carries the token (or the previous one, within its grace).
    pub fn check(&self, metadata: &MetadataMap) -> Result<(), Status> {
        let given = metadata
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .ok_or_else(|| {
                Status::unauthenticated(
                    "this internal API needs the shared token (authorization: Bearer ...; \
                     --internal-token-file)",
                )
            })?;
        let s = self.fresh();
        let previous_ok = s
            .previous
            .as_ref()
            .is_some_and(|(p, until)| Instant::now() < *until && same(p, given));
        if same(&s.token, given) || previous_ok {
            Ok(())
        } else {
            Err(Status::unauthenticated(
                "wrong internal token (--internal-token-file)",
            ))
        }
    }
}

/// Constant-time equality (no early exit on the first differing byte).
fn same(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The server-side check as a tonic interceptor; `None` lets every call through.
pub fn interceptor(
    token: Option<Arc<InternalToken>>,
) -> impl FnMut(Request<()>) -> Result<Request<()>, Status> + Clone {
    move |req: Request<()>| match &token {
        Some(t) => t.check(req.metadata()).map(|()| req),
        None => Ok(req),
    }
}

/// Attaches `token` (when set) to an outgoing call.
pub fn attach<T>(token: Option<&InternalToken>, req: &mut Request<T>) {
    if let Some(t) = token {
        t.attach(req);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checks_rotates_and_keeps_the_previous_token_for_a_while() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        std::fs::write(&path, "s3cret\n").unwrap();
        let t = InternalToken::from_file(&path).unwrap();
        let mut req = Request::new(());
        t.attach(&mut req);
        assert!(t.check(req.metadata()).is_ok());
        assert_eq!(
            t.check(&MetadataMap::new()).unwrap_err().code(),
            tonic::Code::Unauthenticated
        );
        let mut wrong = Request::new(());
        wrong
            .metadata_mut()
            .insert("authorization", "Bearer s3creT".parse().unwrap());
        assert!(t.check(wrong.metadata()).is_err());

        // Rotation: the new token works at once, the old one for the grace period.
        std::fs::write(&path, "n3w").unwrap();
        t.state.lock().unwrap().checked -= RECHECK;
        let mut new = Request::new(());
        new.metadata_mut()
            .insert("authorization", "Bearer n3w".parse().unwrap());
        assert!(t.check(new.metadata()).is_ok());
        assert!(
            t.check(req.metadata()).is_ok(),
            "the previous token within its grace"
        );
        t.state.lock().unwrap().previous.as_mut().unwrap().1 = Instant::now();
        assert!(
            t.check(req.metadata()).is_err(),
            "the previous token after its grace"
        );

        std::fs::write(&path, "  ").unwrap();
        assert!(matches!(
            InternalToken::from_file(&path),
            Err(TokenError::Empty(_))
        ));
    }
}
