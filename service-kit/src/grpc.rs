//! `grpc.health.v1` and reflection, the same for every service.
use tonic_health::server::HealthReporter;

/// The health service and its reporter. The overall status ("") starts NOT_SERVING; the service
/// flips it with [`set_serving`] when warm-up ends and back when draining.
pub fn health() -> (HealthReporter, tonic_health::pb::health_server::HealthServer<impl tonic_health::pb::health_server::Health>) {
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

/// Reflection (v1) over the vlm.v1 descriptors and the health service's.
pub fn reflection() -> Result<
    tonic_reflection::server::v1::ServerReflectionServer<impl tonic_reflection::server::v1::ServerReflection>,
    tonic_reflection::server::Error,
> {
    tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(vlm_proto::v1::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
}
