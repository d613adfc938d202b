//! `grpc.health.v1` and reflection, the same for every service.
use tonic_health::server::HealthReporter;

/// The health service and its reporter. The overall status ("") starts NOT_SERVING; the service
/// flips it with [`set_serving`] when warm-up ends and back when draining.
pub fn health() -> (
    HealthReporter,
    tonic_health::pb::health_server::HealthServer<impl tonic_health::pb::health_server::Health>,
) {
    let (reporter, service) = tonic_health::server::health_reporter();
    (reporter, service)
}

/// Sets the overall status and the status of `service_name` (e.g. "vlm.v1.Vision").
pub async fn set_serving(reporter: &HealthReporter, service_name: &str, serving: bool) {
    let status = if serving {
        tonic_health::ServingStatus::Serving
    } else {
        tonic_health::ServingStatus::NotServing
    };
    reporter.set_service_status("", status).await;
    reporter.set_service_status(service_name, status).await;
}

/// Reflection over the vlm.v1 descriptors and the health service's, as v1 and as v1alpha
/// (grpcio's reflection client and older grpcurl builds speak only v1alpha), listing only
/// `services` (the ones this server serves, e.g. "vlm.v1.Vision" and "grpc.health.v1.Health")
/// and reflection itself; every symbol of the descriptors still resolves.
#[allow(clippy::type_complexity)]
pub fn reflection(
    services: &[&str],
) -> Result<
    (
        tonic_reflection::server::v1::ServerReflectionServer<
            impl tonic_reflection::server::v1::ServerReflection,
        >,
        tonic_reflection::server::v1alpha::ServerReflectionServer<
            impl tonic_reflection::server::v1alpha::ServerReflection,
        >,
    ),
    tonic_reflection::server::Error,
> {
    let builder = || {
        let b = tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(vlm_proto::v1::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            .with_service_name(tonic_reflection::pb::v1::server_reflection_server::SERVICE_NAME)
            .with_service_name(
                tonic_reflection::pb::v1alpha::server_reflection_server::SERVICE_NAME,
            );
        services.iter().fold(b, |b, s| b.with_service_name(*s))
    };
    Ok((builder().build_v1()?, builder().build_v1alpha()?))
}

/// The caller's timeout from the `grpc-timeout` header (`<digits><unit>`, unit one of H M S m u
/// n; at most 8 digits, as the gRPC spec says); None when absent or malformed.
pub fn grpc_timeout(metadata: &tonic::metadata::MetadataMap) -> Option<std::time::Duration> {
    parse_grpc_timeout(metadata.get("grpc-timeout")?.to_str().ok()?)
}

/// Parses a `grpc-timeout` header value ("100m", "5S", ...).
pub fn parse_grpc_timeout(v: &str) -> Option<std::time::Duration> {
    use std::time::Duration;
    if v.len() < 2 || v.len() > 9 {
        return None;
    }
    let (digits, unit) = v.split_at(v.len() - 1);
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.saturating_mul(3600)),
        "M" => Duration::from_secs(n.saturating_mul(60)),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn parses_grpc_timeouts() {
        assert_eq!(parse_grpc_timeout("250m"), Some(Duration::from_millis(250)));
        assert_eq!(parse_grpc_timeout("2S"), Some(Duration::from_secs(2)));
        assert_eq!(parse_grpc_timeout("2M"), Some(Duration::from_secs(120)));
        assert_eq!(parse_grpc_timeout("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(parse_grpc_timeout("10x"), None);
        assert_eq!(parse_grpc_timeout("m"), None);
    }
}
