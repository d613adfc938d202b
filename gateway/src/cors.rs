//! CORS for the HTTP API, off unless origins are configured (`--cors-allow-origin`): then a
//! browser app on an allowed origin can call it. A preflight (`OPTIONS` with
//! `Access-Control-Request-Method`) from an allowed origin is answered 204 with the methods and
//! the requested headers allowed; every response to an allowed origin carries
//! `Access-Control-Allow-Origin` (errors included, so the app can read them) and exposes
//! `Retry-After`. Requests from other origins are served as without CORS (a preflight is a
//! 405), so the browser keeps their answers from the page.
use axum::extract::Request;
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

/// How long a browser may cache a preflight's answer, in seconds.
const MAX_AGE_SECS: u32 = 600;

/// The origins allowed to call the API from a browser; none (CORS off) by default.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CorsOrigins {
    /// `scheme://host[:port]`, as browsers send `Origin`.
    origins: Vec<String>,
    /// `*`: every origin.
    any: bool,
}

/// A `--cors-allow-origin` value that is not an origin.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "--cors-allow-origin {origin:?} is not an origin: expected * or scheme://host[:port] \
     (http or https, no path), e.g. https://app.example.com"
)]
pub struct BadOrigin {
    pub origin: String,
}

impl CorsOrigins {
    /// Parses the configured origins (`*` for any); an empty list is CORS off.
    pub fn parse<S: AsRef<str>>(list: &[S]) -> Result<CorsOrigins, BadOrigin> {
        let mut out = CorsOrigins::default();
        for raw in list {
            let o = raw.as_ref().trim();
            if o.is_empty() {
                continue;
            }
            if o == "*" {
                out.any = true;
                continue;
            }
            let o = o.trim_end_matches('/');
            let bad = || BadOrigin {
                origin: raw.as_ref().to_string(),
            };
            let rest = o
                .strip_prefix("https://")
                .or_else(|| o.strip_prefix("http://"))
                .ok_or_else(bad)?;
            if rest.is_empty() || rest.contains(['/', '?', '#', ' ']) {
                return Err(bad());
            }
            out.origins.push(o.to_ascii_lowercase());
        }
        Ok(out)
    }

    /// Whether CORS is on.
    pub fn enabled(&self) -> bool {
        self.any || !self.origins.is_empty()
    }

    /// The configured origins, for the startup log (`*` first when any origin is allowed).
    pub fn shown(&self) -> Vec<String> {
        let any = self.any.then(|| "*".to_string());
        any.into_iter()
            .chain(self.origins.iter().cloned())
            .collect()
    }

    /// The `Access-Control-Allow-Origin` value for a request's `Origin`, when allowed.
    fn allow(&self, headers: &HeaderMap) -> Option<HeaderValue> {
        let origin = headers.get(header::ORIGIN)?;
        if self.any {
            return Some(HeaderValue::from_static("*"));
        }
        let o = origin.to_str().ok()?.to_ascii_lowercase();
        self.origins.contains(&o).then(|| origin.clone())
    }

    /// `router` with CORS when origins are configured; unchanged when not.
    pub fn apply(&self, router: axum::Router) -> axum::Router {
        if !self.enabled() {
            return router;
        }
        let cors = self.clone();
        router.layer(axum::middleware::from_fn(
            move |req: Request, next: Next| {
                let cors = cors.clone();
                async move { cors.handle(req, next).await }
            },
        ))
    }

    async fn handle(&self, req: Request, next: Next) -> Response {
        let allowed = self.allow(req.headers());
        let preflight = req.method() == Method::OPTIONS
            && req
                .headers()
                .contains_key(header::ACCESS_CONTROL_REQUEST_METHOD);
        let mut resp = match (&allowed, preflight) {
            (Some(_), true) => {
                let mut r = StatusCode::NO_CONTENT.into_response();
                let h = r.headers_mut();
                h.insert(
                    header::ACCESS_CONTROL_ALLOW_METHODS,
                    HeaderValue::from_static("GET, POST, OPTIONS"),
                );
                if let Some(asked) = req.headers().get(header::ACCESS_CONTROL_REQUEST_HEADERS) {
                    h.insert(header::ACCESS_CONTROL_ALLOW_HEADERS, asked.clone());
                }
                h.insert(
                    header::ACCESS_CONTROL_MAX_AGE,
                    HeaderValue::from(MAX_AGE_SECS),
                );
                r
            }
            _ => next.run(req).await,
        };
        let h = resp.headers_mut();
        if !self.any {
            // The answer depends on the Origin: caches must keep them apart.
            h.append(header::VARY, HeaderValue::from_static("origin"));
        }
        if let Some(origin) = allowed {
            h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin);
            h.insert(
                header::ACCESS_CONTROL_EXPOSE_HEADERS,
                HeaderValue::from_static("retry-after"),
            );
        }
        resp
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn origins_parse_and_match() {
        let c = CorsOrigins::parse(&["https://App.example.com/", "http://localhost:3000"]).unwrap();
        assert!(c.enabled());
        let mut h = HeaderMap::new();
        h.insert(
            header::ORIGIN,
            HeaderValue::from_static("https://app.example.com"),
        );
        assert_eq!(
            c.allow(&h),
            Some(HeaderValue::from_static("https://app.example.com"))
        );
        h.insert(
            header::ORIGIN,
            HeaderValue::from_static("https://evil.example"),
        );
        assert_eq!(c.allow(&h), None);
        assert!(!CorsOrigins::parse::<&str>(&[]).unwrap().enabled());
        let any = CorsOrigins::parse(&["*"]).unwrap();
        assert_eq!(any.allow(&h), Some(HeaderValue::from_static("*")));
        for bad in [
            "app.example.com",
            "https://a.example/path",
            "ftp://x",
            "https://",
        ] {
            assert_eq!(CorsOrigins::parse(&[bad]).unwrap_err().origin, bad, "{bad}");
        }
    }
}
