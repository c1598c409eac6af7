//! The Prometheus page both binaries serve on `/metrics`: the OpenTelemetry SDK with its
//! Prometheus exporter on a registry of its own, exported names as the instruments' names (no
//! unit or `_total` suffix added, no scope labels, no `target_info`), so each page keeps the
//! documented HAPTIC names.

use std::sync::Arc;

use opentelemetry_sdk::metrics::SdkMeterProvider;

/// Renders the metrics page in the Prometheus text format: the binary's exporter, handed to
/// the libraries, which have none of their own.
#[derive(Clone)]
pub struct Exposition(Arc<dyn Fn() -> Result<String, String> + Send + Sync>);

impl Exposition {
    /// Wraps the exporter's encoder; an error is answered 500 with its text.
    pub fn new(render: impl Fn() -> Result<String, String> + Send + Sync + 'static) -> Self {
        Self(Arc::new(render))
    }

    /// The page, or why it could not be rendered.
    pub fn render(&self) -> Result<String, String> {
        (self.0)()
    }
}

impl std::fmt::Debug for Exposition {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Exposition")
    }
}

/// Why the exporter could not start.
#[derive(Debug, thiserror::Error)]
#[error("starting the Prometheus exporter")]
pub struct ExporterError(#[source] opentelemetry_sdk::error::OTelSdkError);

/// The meter provider with its Prometheus exporter, and the page it renders.
pub fn prometheus_exporter() -> Result<(SdkMeterProvider, Exposition), ExporterError> {
    let registry = prometheus::Registry::new();
    let exporter = opentelemetry_prometheus::exporter()
        .with_registry(registry.clone())
        .without_units()
        .without_counter_suffixes()
        .without_target_info()
        .scope_info_enabled(false)
        .build()
        .map_err(ExporterError)?;
    let provider = SdkMeterProvider::builder().with_reader(exporter).build();
    let exposition = Exposition::new(move || {
        prometheus::TextEncoder::new()
            .encode_to_string(&registry.gather())
            .map_err(|error| error.to_string())
    });
    Ok((provider, exposition))
}
