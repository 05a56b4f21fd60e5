//! Logs and traces. Logs go to stderr (text or JSON lines, `RUST_LOG`). Traces are exported over OTLP
//! (HTTP/protobuf) when `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or `OTEL_EXPORTER_OTLP_ENDPOINT` is set, by
//! OpenTelemetry's own SDK and exporter, configured by the standard variables (`OTEL_SERVICE_NAME`, default
//! `idem`; `OTEL_RESOURCE_ATTRIBUTES`; `OTEL_TRACES_SAMPLER` and `OTEL_TRACES_SAMPLER_ARG`;
//! `OTEL_EXPORTER_OTLP_TIMEOUT`, `_HEADERS`). Without an endpoint nothing is installed: no propagator, no
//! OpenTelemetry layer, and idem's debug spans (units of work, publishes, consumers) are never created.
//!
//! Export runs on the batch processor's own thread: a request never waits for it, and a collector that is
//! down or slow costs spans, counted (`idem_trace_spans_{ended,exported,failed}_total`; ended − exported is
//! what was dropped), never an answer.

use std::sync::Arc;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{SdkTracerProvider, SpanData, SpanExporter, SpanProcessor};
use prometheus_client::metrics::counter::Counter;
use tracing_subscriber::Layer as _;
use tracing_subscriber::filter::{EnvFilter, LevelFilter, Targets};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// What the trace export did.
#[derive(Debug, Default)]
pub struct ExportStats {
    /// Spans ended (handed to the batch processor).
    pub ended: Counter,
    /// Spans the collector accepted.
    pub exported: Counter,
    /// Spans in batches the collector refused or did not answer.
    pub failed: Counter,
}

impl ExportStats {
    /// Registers the counters.
    pub fn register(self: &Arc<Self>, registry: &mut prometheus_client::registry::Registry) {
        registry.register(
            "idem_trace_spans_ended",
            "Spans ended and handed to the exporter's queue",
            self.ended.clone(),
        );
        registry.register("idem_trace_spans_exported", "Spans the OTLP collector accepted", self.exported.clone());
        registry.register(
            "idem_trace_spans_failed",
            "Spans in batches the OTLP collector refused or did not answer (dropped)",
            self.failed.clone(),
        );
    }
}

/// The installed logging and tracing; [`Telemetry::shutdown`] flushes the spans still queued.
#[derive(Debug, Default)]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
    /// The export's counters (zero when tracing is off).
    pub stats: Arc<ExportStats>,
}

impl Telemetry {
    /// Whether traces are exported.
    pub fn exporting(&self) -> bool {
        self.provider.is_some()
    }

    /// Flushes and stops the export (bounded by the exporter's timeout).
    pub fn shutdown(&self) {
        if let Some(provider) = &self.provider
            && let Err(e) = provider.shutdown()
        {
            tracing::warn!(error = %e, "trace export did not shut down cleanly");
        }
    }
}

/// The OTLP endpoint configured, if any.
fn endpoint() -> Option<String> {
    ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"]
        .into_iter()
        .find_map(|v| std::env::var(v).ok().filter(|e| !e.trim().is_empty()))
}

/// Installs logging (and tracing when an endpoint is set) for the process. A second call does nothing.
pub fn init(json: bool) -> Telemetry {
    let env_filter = || EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let fmt = if json { fmt.json().flatten_event(true).boxed() } else { fmt.boxed() };
    install(Some(fmt.with_filter(env_filter()).boxed()))
}

/// Installs tracing alone, when an endpoint is set (an operator's command whose output is its own: its
/// re-drives are traced, nothing is logged).
pub fn init_traces_only() -> Telemetry {
    install(None)
}

type Boxed = Box<dyn tracing_subscriber::Layer<tracing_subscriber::Registry> + Send + Sync>;

fn install(fmt: Option<Boxed>) -> Telemetry {
    let stats = Arc::new(ExportStats::default());
    let provider = endpoint().and_then(|_| match provider(stats.clone()) {
        Ok(p) => Some(p),
        Err(e) => {
            // stderr: logging is not installed yet; the service still runs, without traces
            eprintln!("idem: OTLP trace export not started: {e}");
            None
        }
    });
    let otel = provider.as_ref().map(|p| {
        opentelemetry::global::set_text_map_propagator(opentelemetry_sdk::propagation::TraceContextPropagator::new());
        // idem's own debug spans (units of work, publishes, consumers), everything else from info; the
        // consumer runner's own `batch` span stays a log span (its CONSUMER spans, made in `idem_kafka::trace`,
        // continue the messages' traces instead of starting one per batch)
        let targets = Targets::new()
            .with_default(LevelFilter::INFO)
            .with_target("idem", LevelFilter::DEBUG)
            .with_target("idem_kafka::consumer", LevelFilter::OFF);
        // no per-span source location, thread, target or busy/idle timings: each costs allocations or clock
        // reads on every span, and the spans' own attributes say what they are
        tracing_opentelemetry::layer()
            .with_tracer(p.tracer("idem"))
            .with_location(false)
            .with_threads(false)
            .with_target(false)
            .with_tracked_inactivity(false)
            .with_filter(targets)
    });
    let _ = tracing_subscriber::registry().with(fmt).with(otel).try_init();
    Telemetry { provider, stats }
}

fn provider(stats: Arc<ExportStats>) -> Result<SdkTracerProvider, opentelemetry_otlp::ExporterBuildError> {
    // endpoint, headers and timeout come from the OTEL_EXPORTER_OTLP_* variables, read by the exporter
    use opentelemetry_otlp::WithExportConfig as _;
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
        .build()?;
    let mut resource = opentelemetry_sdk::Resource::builder();
    if std::env::var_os("OTEL_SERVICE_NAME").is_none() {
        resource = resource.with_service_name("idem");
    }
    let processor =
        opentelemetry_sdk::trace::BatchSpanProcessor::builder(Counting { inner: exporter, stats: stats.clone() })
            .build();
    Ok(SdkTracerProvider::builder()
        .with_span_processor(Ended { inner: processor, stats })
        .with_resource(resource.build())
        .build())
}

/// Counts what the exporter sent and what it could not.
#[derive(Debug)]
struct Counting<E> {
    inner: E,
    stats: Arc<ExportStats>,
}

impl<E: SpanExporter> SpanExporter for Counting<E> {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let n = batch.len() as u64;
        let result = self.inner.export(batch).await;
        match &result {
            Ok(()) => self.stats.exported.inc_by(n),
            Err(_) => self.stats.failed.inc_by(n),
        };
        result
    }

    fn shutdown_with_timeout(&mut self, timeout: std::time::Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&mut self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &opentelemetry_sdk::Resource) {
        self.inner.set_resource(resource);
    }
}

/// Counts the spans that ended (so ended − exported is what the queue or a failed export dropped).
#[derive(Debug)]
struct Ended<P> {
    inner: P,
    stats: Arc<ExportStats>,
}

impl<P: SpanProcessor> SpanProcessor for Ended<P> {
    fn on_start(&self, span: &mut opentelemetry_sdk::trace::Span, cx: &opentelemetry::Context) {
        self.inner.on_start(span, cx);
    }

    fn on_end(&self, span: SpanData) {
        self.stats.ended.inc();
        self.inner.on_end(span);
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn shutdown_with_timeout(&self, timeout: std::time::Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn set_resource(&mut self, resource: &opentelemetry_sdk::Resource) {
        self.inner.set_resource(resource);
    }
}
