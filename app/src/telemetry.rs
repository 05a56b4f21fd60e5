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
use tracing::subscriber::Interest;
use tracing::{Metadata, span};
use tracing_subscriber::Layer as _;
use tracing_subscriber::filter::{EnvFilter, LevelFilter, Targets};
use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::layer::{Context, Filter, SubscriberExt};
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
    let env_filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    install(Some(fmt_layer(json, std::io::stderr, env_filter)))
}

/// Installs tracing alone, when an endpoint is set (an operator's command whose output is its own: its
/// re-drives are traced, nothing is logged).
pub fn init_traces_only() -> Telemetry {
    install(None)
}

type Boxed = Box<dyn tracing_subscriber::Layer<tracing_subscriber::Registry> + Send + Sync>;

/// The log layer: text or JSON lines into `writer`, filtered by `filter`.
fn fmt_layer<W>(json: bool, writer: W, filter: EnvFilter) -> Boxed
where
    W: for<'w> MakeWriter<'w> + Send + Sync + 'static,
{
    let fmt = tracing_subscriber::fmt::layer().with_writer(writer);
    let fmt = if json { fmt.json().flatten_event(true).boxed() } else { fmt.boxed() };
    fmt.with_filter(Uncached(filter)).boxed()
}

/// Where spans go.
enum Export {
    /// Nowhere.
    Off,
    /// To the endpoint the `OTEL_EXPORTER_OTLP_*` variables name.
    FromEnv,
    /// To this endpoint (the full URL spans are posted to).
    #[cfg(test)]
    To(String),
}

fn install(fmt: Option<Boxed>) -> Telemetry {
    let export = if endpoint().is_some() { Export::FromEnv } else { Export::Off };
    let (subscriber, telemetry) = build(fmt, export);
    let _ = subscriber.try_init();
    telemetry
}

/// The subscriber [`init`] installs: the log layer and, when spans are exported, the OpenTelemetry layer, each
/// with its own filter.
///
/// Both filters are wrapped in [`Uncached`]: with per-layer filters, tracing-subscriber carries each filter's
/// verdict from `enabled` to `on_event`/`on_new_span` in a thread-local, and a callsite every filter enables
/// (`Interest::always`) skips `enabled` and reads whatever the previous `enabled` call on that thread left there.
/// Once the OpenTelemetry layer's `idem=debug` raises the maximum level to DEBUG (and `log`'s with it, set by
/// `try_init`'s `LogTracer`), sqlx's `log_enabled!(target: "sqlx::query", Debug)` after every query reaches
/// `Dispatch::enabled`, both filters refuse it, and the next `warn!`/`info!` on the thread was dropped from
/// every layer (tokio-rs/tracing#2519; tokio-rs/tracing#3572 proposes this same cap upstream).
fn build(fmt: Option<Boxed>, export: Export) -> (impl tracing::Subscriber + Send + Sync + 'static, Telemetry) {
    let stats = Arc::new(ExportStats::default());
    let endpoint = match export {
        Export::Off => None,
        Export::FromEnv => Some(None),
        #[cfg(test)]
        Export::To(url) => Some(Some(url)),
    };
    let provider = endpoint.and_then(|endpoint| match provider(stats.clone(), endpoint) {
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
            .with_filter(Uncached(targets))
    });
    let subscriber = tracing_subscriber::registry().with(fmt).with(otel);
    (subscriber, Telemetry { provider, stats })
}

/// A per-layer filter whose callsites are never `Interest::always`, only `sometimes` (or `never`): every span and
/// event then goes through `enabled`, which rewrites every per-layer filter's verdict in tracing-subscriber's
/// thread-local just before the span or event is dispatched, instead of it reading a verdict left over from an
/// earlier `enabled` call (see [`build`]). Costs one filter evaluation per enabled span or event.
struct Uncached<F>(F);

impl<S, F: Filter<S>> Filter<S> for Uncached<F> {
    fn enabled(&self, meta: &Metadata<'_>, cx: &Context<'_, S>) -> bool {
        self.0.enabled(meta, cx)
    }

    fn callsite_enabled(&self, meta: &'static Metadata<'static>) -> Interest {
        let interest = self.0.callsite_enabled(meta);
        if interest.is_always() { Interest::sometimes() } else { interest }
    }

    fn event_enabled(&self, event: &tracing::Event<'_>, cx: &Context<'_, S>) -> bool {
        self.0.event_enabled(event, cx)
    }

    fn max_level_hint(&self) -> Option<LevelFilter> {
        self.0.max_level_hint()
    }

    fn on_new_span(&self, attrs: &span::Attributes<'_>, id: &span::Id, cx: Context<'_, S>) {
        self.0.on_new_span(attrs, id, cx);
    }

    fn on_record(&self, id: &span::Id, values: &span::Record<'_>, cx: Context<'_, S>) {
        self.0.on_record(id, values, cx);
    }

    fn on_enter(&self, id: &span::Id, cx: Context<'_, S>) {
        self.0.on_enter(id, cx);
    }

    fn on_exit(&self, id: &span::Id, cx: Context<'_, S>) {
        self.0.on_exit(id, cx);
    }

    fn on_close(&self, id: span::Id, cx: Context<'_, S>) {
        self.0.on_close(id, cx);
    }
}

/// `endpoint`: `None` for the one the variables name.
fn provider(
    stats: Arc<ExportStats>,
    endpoint: Option<String>,
) -> Result<SdkTracerProvider, opentelemetry_otlp::ExporterBuildError> {
    // endpoint, headers and timeout come from the OTEL_EXPORTER_OTLP_* variables, read by the exporter
    use opentelemetry_otlp::WithExportConfig as _;
    let mut exporter =
        opentelemetry_otlp::SpanExporter::builder().with_http().with_protocol(opentelemetry_otlp::Protocol::HttpBinary);
    if let Some(endpoint) = endpoint {
        exporter = exporter.with_endpoint(endpoint);
    }
    let exporter = exporter.build()?;
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

#[cfg(test)]
mod tests {
    use std::io::{BufRead as _, BufReader, Read as _, Write as _};
    use std::net::{TcpListener, TcpStream};
    use std::sync::Mutex;

    use tracing::Instrument as _;
    use tracing::instrument::WithSubscriber as _;

    use super::*;

    /// What the log layer wrote.
    #[derive(Clone, Default)]
    struct Buffer(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Buffer {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().expect("buffer lock").extend_from_slice(bytes);
            Ok(bytes.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// sqlx's query logger, after every query, asks `log::log_enabled!(target: "sqlx::query", Debug)`; `try_init`'s
    /// `LogTracer` turns that into `Dispatch::enabled` with this metadata whenever the maximum level allows DEBUG.
    struct SqlxQueryLog;
    static SQLX_QUERY_LOG: SqlxQueryLog = SqlxQueryLog;
    static SQLX_QUERY_DEBUG: Metadata<'static> = Metadata::new(
        "log event",
        "sqlx::query",
        tracing::Level::DEBUG,
        None,
        None,
        Some("sqlx::query"),
        tracing::field::FieldSet::new(&["message"], tracing::callsite::Identifier(&SQLX_QUERY_LOG)),
        tracing::metadata::Kind::EVENT,
    );

    impl tracing::Callsite for SqlxQueryLog {
        fn set_interest(&self, _: Interest) {}

        fn metadata(&self) -> &Metadata<'_> {
            &SQLX_QUERY_DEBUG
        }
    }

    /// What a sqlx query does to the current dispatcher, through `LogTracer`, which first checks the subscriber's
    /// maximum level (`max`: DEBUG when spans are exported, INFO otherwise).
    fn query(max: LevelFilter) {
        if max >= LevelFilter::DEBUG {
            tracing::dispatcher::get_default(|d| d.enabled(&SQLX_QUERY_DEBUG));
        }
    }

    /// An OTLP/HTTP collector on a local port that answers every request 200.
    fn collector() -> String {
        let listener = TcpListener::bind("127.0.0.1:0").expect("binds a local port");
        let url = format!("http://{}/v1/traces", listener.local_addr().expect("bound"));
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                std::thread::spawn(move || answer(stream));
            }
        });
        url
    }

    fn answer(mut stream: TcpStream) {
        let mut reader = BufReader::new(stream.try_clone().expect("clones the stream"));
        loop {
            let mut length = 0;
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap_or(0) == 0 {
                    return;
                }
                let line = line.trim_end();
                if line.is_empty() {
                    break;
                }
                if let Some((name, value)) = line.split_once(':')
                    && name.eq_ignore_ascii_case("content-length")
                {
                    length = value.trim().parse().expect("a content length");
                }
            }
            let mut body = vec![0; length];
            if reader.read_exact(&mut body).is_err() {
                return;
            }
            let reply = "HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\ncontent-length: 0\r\n\r\n";
            if stream.write_all(reply.as_bytes()).is_err() {
                return;
            }
        }
    }

    /// A local port nothing listens on.
    fn unreachable() -> String {
        let listener = TcpListener::bind("127.0.0.1:0").expect("binds a local port");
        format!("http://{}/v1/traces", listener.local_addr().expect("bound"))
    }

    const TASKS: usize = 8;
    const THREADS: usize = 4;

    /// A request as the service handles one: an HTTP span, an idem debug span, queries, the security warning.
    async fn request(n: usize, max: LevelFilter) {
        let http = tracing::info_span!("request", method = "POST", uri = "/payments");
        async move {
            let unit = tracing::debug_span!("unit_of_work", n);
            async move {
                query(max);
                tokio::task::yield_now().await;
                query(max);
                tracing::warn!(
                    security_event = "provider_payment_id_collision",
                    merchant = %format_args!("merchant_{n}"),
                    other_merchant = %"merchant_other",
                    provider = %"acme",
                    n,
                    "provider payment id already recorded for another merchant"
                );
            }
            .instrument(unit)
            .await;
            query(max);
            tracing::info!(n, status = 409, "request done");
        }
        .instrument(http)
        .await;
    }

    /// Runs startup, requests on tokio tasks and on threads under the subscriber [`init`] installs (the log layer
    /// writing into a buffer), and checks every event was logged, in its request span.
    fn every_event_is_logged(json: bool, export: Export) -> Telemetry {
        let logs = Buffer::default();
        let writer = logs.clone();
        let exporting = !matches!(export, Export::Off);
        let (subscriber, telemetry) =
            build(Some(fmt_layer(json, move || writer.clone(), EnvFilter::new("info"))), export);
        assert_eq!(telemetry.exporting(), exporting);
        let max = tracing::Subscriber::max_level_hint(&subscriber).unwrap_or(LevelFilter::TRACE);
        let dispatch = tracing::Dispatch::new(subscriber);

        tracing::dispatcher::with_default(&dispatch, || {
            query(max);
            tracing::warn!("no synchronous standby: a commit is acknowledged before any replica has it");
        });
        let runtime =
            tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("a runtime");
        runtime.block_on(async {
            let tasks: Vec<_> =
                (0..TASKS).map(|n| tokio::spawn(request(n, max).with_subscriber(dispatch.clone()))).collect();
            for task in tasks {
                task.await.expect("the request task completes");
            }
        });
        let threads: Vec<_> = (TASKS..TASKS + THREADS)
            .map(|n| {
                let dispatch = dispatch.clone();
                std::thread::spawn(move || {
                    tracing::dispatcher::with_default(&dispatch, || {
                        tokio::runtime::Builder::new_current_thread()
                            .build()
                            .expect("a runtime")
                            .block_on(request(n, max));
                    });
                })
            })
            .collect();
        for thread in threads {
            thread.join().expect("the request thread completes");
        }
        tracing::dispatcher::with_default(&dispatch, || telemetry.shutdown());

        let logs = String::from_utf8(logs.0.lock().expect("buffer lock").clone()).expect("utf-8 logs");
        let lines = |what: &str| logs.lines().filter(|l| l.contains(what)).collect::<Vec<_>>();
        let startup = lines("no synchronous standby");
        let collisions = lines("provider_payment_id_collision");
        let done = lines("request done");
        assert_eq!(
            (startup.len(), collisions.len(), done.len()),
            (1, TASKS + THREADS, TASKS + THREADS),
            "(startup warnings, security warnings, info events) logged:\n{logs}"
        );
        for line in collisions.iter().chain(&done) {
            assert!(line.contains("/payments"), "logged outside its request span: {line}");
        }
        telemetry
    }

    #[test]
    fn every_event_is_logged_without_trace_export() {
        every_event_is_logged(false, Export::Off);
        every_event_is_logged(true, Export::Off);
    }

    #[test]
    fn every_event_is_logged_while_exporting_traces_to_a_collector() {
        for json in [false, true] {
            let telemetry = every_event_is_logged(json, Export::To(collector()));
            assert!(telemetry.stats.exported.get() > 0, "no span reached the collector");
            assert_eq!(telemetry.stats.failed.get(), 0);
        }
    }

    #[test]
    fn every_event_is_logged_while_the_trace_collector_is_unreachable() {
        for json in [false, true] {
            let telemetry = every_event_is_logged(json, Export::To(unreachable()));
            assert!(telemetry.stats.failed.get() > 0, "the export did not fail");
        }
    }
}
