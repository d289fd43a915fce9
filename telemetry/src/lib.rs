//! Logs and traces, the same way in every lorafleet process.
//!
//! - Logs are structured: one JSON object per line on stderr by default
//!   (`LORAFLEET_LOG_FORMAT=text` for humans), filtered by `RUST_LOG`
//!   (default `info`). Stdout stays free for the lines tools parse.
//! - Every process has an OpenTelemetry tracer, so spans carry W3C trace and
//!   span ids and a request keeps one trace id across gateway and worker.
//!   Spans are exported over OTLP/gRPC only when `OTEL_EXPORTER_OTLP_ENDPOINT`
//!   (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set.
//! - Trace context crosses process boundaries as W3C `traceparent` and
//!   `tracestate` strings ([`inject`], [`set_parent`]).

use std::collections::HashMap;

use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::{TraceContextExt, TracerProvider as _};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// The environment variable that picks the log format.
pub const LOG_FORMAT_ENV: &str = "LORAFLEET_LOG_FORMAT";

/// Keeps the tracer alive; dropping it flushes spans not yet exported.
#[derive(Debug)]
pub struct Telemetry {
    provider: SdkTracerProvider,
    exporting: bool,
}

impl Telemetry {
    /// Whether spans leave the process over OTLP.
    pub fn exporting(&self) -> bool {
        self.exporting
    }
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if self.exporting {
            let _ = self.provider.force_flush();
        }
        let _ = self.provider.shutdown();
    }
}

/// A setting (an environment variable) that telemetry could not use.
#[derive(Debug, thiserror::Error)]
#[error("{setting}: {reason}")]
pub struct SetupError {
    pub setting: &'static str,
    pub reason: String,
}

impl SetupError {
    fn new(setting: &'static str, reason: impl Into<String>) -> SetupError {
        SetupError {
            setting,
            reason: reason.into(),
        }
    }
}

/// Installs the global subscriber and tracer for `service`. Call it once, from
/// inside the Tokio runtime (the OTLP exporter spawns its connection there).
pub fn init(service: &'static str) -> Result<Telemetry, SetupError> {
    let json = match std::env::var(LOG_FORMAT_ENV) {
        Err(_) => true,
        Ok(v) if v == "json" => true,
        Ok(v) if v == "text" => false,
        Ok(v) => {
            return Err(SetupError::new(
                LOG_FORMAT_ENV,
                format!("{v:?} is not \"json\" or \"text\""),
            ));
        }
    };
    let filter = match std::env::var("RUST_LOG") {
        Ok(v) if !v.is_empty() => EnvFilter::try_new(&v)
            .map_err(|e| SetupError::new("RUST_LOG", format!("{v:?} is not a filter: {e}")))?,
        _ => EnvFilter::new("info"),
    };
    let endpoint_set = [
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    ]
    .iter()
    .any(|k| std::env::var(k).is_ok_and(|v| !v.is_empty()));
    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name(service)
        .build();
    let mut builder = SdkTracerProvider::builder().with_resource(resource);
    if endpoint_set {
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .build()
            .map_err(|e| {
                SetupError::new(
                    "OTEL_EXPORTER_OTLP_ENDPOINT",
                    format!("the OTLP exporter: {e}"),
                )
            })?;
        builder = builder.with_batch_exporter(exporter);
    }
    let provider = builder.build();
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    let otel = tracing_opentelemetry::layer().with_tracer(provider.tracer(service));
    let registry = tracing_subscriber::registry().with(filter).with(otel);
    let installed = if json {
        registry
            .with(
                tracing_subscriber::fmt::layer()
                    .json()
                    .with_current_span(true)
                    .with_span_list(false)
                    .with_writer(std::io::stderr),
            )
            .try_init()
    } else {
        registry
            .with(tracing_subscriber::fmt::layer().with_writer(std::io::stderr))
            .try_init()
    };
    installed.map_err(|e| {
        SetupError::new(
            "tracing",
            format!("a global subscriber is already installed: {e}"),
        )
    })?;
    Ok(Telemetry {
        provider,
        exporting: endpoint_set,
    })
}

/// W3C trace context of `span`, to send with an outgoing call:
/// `(traceparent, tracestate)`. Empty strings when the span is disabled.
pub fn inject(span: &tracing::Span) -> (String, String) {
    let mut carrier = HashMap::new();
    TraceContextPropagator::new().inject_context(&span.context(), &mut carrier);
    (
        carrier.remove("traceparent").unwrap_or_default(),
        carrier.remove("tracestate").unwrap_or_default(),
    )
}

/// Makes `span` a child of the remote context in `traceparent`. Returns false,
/// leaving the span a new root, when `traceparent` is empty or malformed.
pub fn set_parent(span: &tracing::Span, traceparent: &str, tracestate: &str) -> bool {
    let carrier = W3cCarrier {
        traceparent,
        tracestate,
    };
    let cx = TraceContextPropagator::new().extract(&carrier);
    if !cx.span().span_context().is_valid() {
        return false;
    }
    let _ = span.set_parent(cx);
    true
}

/// The trace id of `span` in hex, or None when it has none (no subscriber).
pub fn trace_id(span: &tracing::Span) -> Option<String> {
    let cx = span.context();
    let sc = cx.span().span_context().clone();
    sc.is_valid().then(|| sc.trace_id().to_string())
}

struct W3cCarrier<'a> {
    traceparent: &'a str,
    tracestate: &'a str,
}

impl Extractor for W3cCarrier<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        let v = match key {
            "traceparent" => self.traceparent,
            "tracestate" => self.tracestate,
            _ => return None,
        };
        (!v.is_empty()).then_some(v)
    }

    fn keys(&self) -> Vec<&str> {
        vec!["traceparent", "tracestate"]
    }
}
