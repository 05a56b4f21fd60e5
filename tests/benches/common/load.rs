//! The lean HTTP load generator the HTTP benchmarks share: keep-alive HTTP/1.1 clients on one thread.

use std::time::{Duration, Instant};

use super::{API_KEY, Summary};

/// Where a phase sends its charges: `POST {path}` on `addr` with `Authorization: Bearer` (idem) and, per
/// client, the cookies of its session (the axum-idempotent peer caches only within a session).
#[derive(Clone, Debug)]
pub struct Target {
    pub addr: String,
    pub bearer: Option<String>,
    /// One `Cookie` header value per client (client `w` uses `cookies[w % len]`); empty: none.
    pub cookies: Vec<String>,
}

impl Target {
    /// idem's service at `base` (`http://host:port`), authenticated with the benchmark's API key.
    pub fn idem(base: &str) -> Self {
        Self { addr: base.trim_start_matches("http://").to_owned(), bearer: Some(API_KEY.to_owned()), cookies: vec![] }
    }
}

/// One slice of a phase: latencies of successful requests, failures, time, and up to 2,000 requests sent
/// per client.
pub struct Slice {
    pub latencies: Vec<Duration>,
    pub errors: usize,
    pub elapsed: Duration,
    pub sent: Vec<(String, String)>,
}

impl Slice {
    pub fn summary(self, name: &str) -> Summary {
        Summary::from_latencies(name, self.latencies, self.errors, self.elapsed)
    }
}

/// [`phase_on`] against idem's service at `base`.
pub async fn phase<F>(base: &str, concurrency: usize, duration: Duration, make: F) -> Slice
where
    F: Fn(usize, usize) -> (String, String) + 'static,
{
    phase_on(&Target::idem(base), concurrency, duration, make).await
}

/// `concurrency` workers sending `make(worker, i)` = (idempotency key, body) charges until `duration`
/// elapses; a charge succeeded when it was answered 201.
///
/// Each worker owns one keep-alive HTTP/1.1 connection (hyper's connection API, driven in the worker's own
/// task: no pool, no connection task) and the whole generator runs on one thread. The generator shares the
/// two cores with what it measures, so every microsecond it spends is taken from the service; the
/// benchmarks print its CPU per charge.
pub async fn phase_on<F>(target: &Target, concurrency: usize, duration: Duration, make: F) -> Slice
where
    F: Fn(usize, usize) -> (String, String) + 'static,
{
    let make = std::rc::Rc::new(make);
    let start = Instant::now();
    let deadline = start + duration;
    let local = tokio::task::LocalSet::new();
    let mut tasks = Vec::new();
    for w in 0..concurrency {
        let (make, target) = (make.clone(), target.clone());
        tasks.push(local.spawn_local(async move { worker(&target, w, deadline, &*make).await }));
    }
    let (mut latencies, mut errors, mut sent) = (Vec::new(), 0, Vec::new());
    local
        .run_until(async {
            for t in tasks {
                let (l, e, s) = t.await.unwrap_or_default();
                latencies.extend(l);
                errors += e;
                sent.extend(s);
            }
        })
        .await;
    Slice { latencies, errors, elapsed: start.elapsed(), sent }
}

/// One client of [`phase_on`]: latencies of successful charges, failures, and up to 2,000 requests it sent.
async fn worker(
    target: &Target,
    w: usize,
    deadline: Instant,
    make: &dyn Fn(usize, usize) -> (String, String),
) -> (Vec<Duration>, usize, Vec<(String, String)>) {
    use http_body_util::{BodyExt, Full};
    let (mut lat, mut errors, mut sent) = (Vec::new(), 0usize, Vec::new());
    let addr = target.addr.as_str();
    let Ok(stream) = tokio::net::TcpStream::connect(addr).await else { return (lat, 1, sent) };
    let _ = stream.set_nodelay(true);
    let Ok((mut sender, conn)) =
        hyper::client::conn::http1::handshake::<_, Full<bytes::Bytes>>(hyper_util::rt::TokioIo::new(stream)).await
    else {
        return (lat, 1, sent);
    };
    let auth = target.bearer.as_ref().map(|k| format!("Bearer {k}"));
    let cookie = (!target.cookies.is_empty()).then(|| target.cookies[w % target.cookies.len()].clone());
    let requests = async {
        let mut i = 0;
        while Instant::now() < deadline {
            let (key, body) = make(w, i);
            i += 1;
            let t = Instant::now();
            let mut req = http::Request::post("/payments")
                .header(http::header::HOST, addr)
                .header("idempotency-key", &key)
                .header(http::header::CONTENT_TYPE, "application/json");
            if let Some(auth) = &auth {
                req = req.header(http::header::AUTHORIZATION, auth);
            }
            if let Some(cookie) = &cookie {
                req = req.header(http::header::COOKIE, cookie);
            }
            let Ok(req) = req.body(Full::new(bytes::Bytes::from(body.clone()))) else { break };
            let ok = match sender.send_request(req).await {
                Ok(r) => r.status().as_u16() == 201 && r.into_body().collect().await.is_ok(),
                Err(_) => false,
            };
            if ok {
                lat.push(t.elapsed());
                if sent.len() < 2000 {
                    sent.push((key, body));
                }
            } else {
                errors += 1;
                if sender.ready().await.is_err() {
                    break; // the connection is gone; the rest of the phase counts as nothing sent
                }
            }
        }
        drop(sender);
    };
    let _ = tokio::join!(conn, requests);
    (lat, errors, sent)
}
