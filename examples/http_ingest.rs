//! An HTTP ingest endpoint in front of a pipeline: `POST /events` takes JSON events and answers
//! only once they are committed, so an event answered 200 survives any crash of this process.
//!
//! - The pipeline's source is a `PushSource` registered as class `http_events`: stream `events`
//!   with columns `event_id uint64`, `user_id uint64`, `payload utf8`. The spec file names it
//!   (`source: {class: http_events}`) and chooses the sinks, e.g. `ClickHouseBatchingSink`
//!   (the ClickHouse sink classes are registered next to the builtins).
//! - A request body is one JSON object per line (a single object is one line), each event in
//!   the JSON forms `jsonl_file` reads. Events go to the partition of their `event_id`.
//! - Answers: `200 {"committed": N}` once every event of the request is durable in the outbox
//!   (from then on a crash loses nothing: the next run delivers it); `400 {"error": ...}` for a
//!   line that is not a valid event (the events before it in the request were accepted and are
//!   committed as usual); `503 {"error": ...}` when the pipeline stopped before committing them.
//!   A client resends every event whose request was not answered 200. Events it resends after
//!   a crash that had in fact been committed reach the sinks twice: give events an id the
//!   application assigns (`event_id`) and deduplicate downstream if that matters.
//!
//! Run it with
//! `cargo run -p flow-examples --example http_ingest -- SPEC STATE_DIR [ADDR]` (ADDR defaults to
//! `127.0.0.1:8080`; port 0 picks a free one). It prints `listening on <addr>` once it accepts
//! requests, and stops gracefully on SIGTERM or Ctrl-C.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{anyhow, bail, Context};
use flow::core::{PushError, PushHandle, PushOptions, PushSource, Route};
use flow::{Column, PipelineHandle, PipelineSpec, StartOptions, StreamSchema, StreamType};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tracing::{info, warn};

/// The class name the spec's source names.
const SOURCE_CLASS: &str = "http_events";
/// How long a graceful stop may take before the process gives up waiting.
const STOP_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);
/// The largest request body accepted.
const MAX_BODY_BYTES: usize = 8 << 20;

/// The columns of stream `events`.
fn schema() -> anyhow::Result<Arc<StreamSchema>> {
    Ok(StreamSchema::new(vec![
        Column::new("event_id", StreamType::Uint64),
        Column::new("user_id", StreamType::Uint64),
        Column::new("payload", StreamType::Utf8),
    ])?)
}

/// The one field read before the event is sent: its partition key.
#[derive(serde::Deserialize)]
struct EventKey {
    event_id: u64,
}

pub fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (spec, state, addr) = match args.as_slice() {
        [spec, state] => (spec, state, "127.0.0.1:8080"),
        [spec, state, addr] => (spec, state, addr.as_str()),
        _ => bail!("usage: http_ingest SPEC STATE_DIR [ADDR]"),
    };
    let addr: SocketAddr = addr
        .parse()
        .with_context(|| format!("`{addr}` is not an address"))?;
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(serve(PathBuf::from(spec), PathBuf::from(state), addr))
}

async fn serve(spec: PathBuf, state: PathBuf, addr: SocketAddr) -> anyhow::Result<()> {
    let spec_text = std::fs::read_to_string(&spec)
        .with_context(|| format!("reading the spec {}", spec.display()))?;
    let parsed =
        PipelineSpec::from_yaml(&spec_text).map_err(|err| anyhow!("{}: {err}", spec.display()))?;
    let (source, events) = PushSource::new("events", schema()?, PushOptions::default());
    let mut registry = flow::registry();
    source.register(&mut registry, SOURCE_CLASS);
    let mut pipeline = PipelineHandle::start(parsed, StartOptions::new(state).registry(registry))
        .await
        .map_err(|err| anyhow!("{}: {err}", spec.display()))?;

    let listener = TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {addr}"))?;
    let local = listener.local_addr()?;
    info!(address = %local, "accepting events at http://{local}/events");
    println!("listening on {local}");
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let ended = tokio::select! {
        () = accept(listener, events) => None,
        _ = terminate.recv() => None,
        _ = tokio::signal::ctrl_c() => None,
        // The pipeline ended on its own: it failed.
        report = pipeline.wait() => Some(report),
    };
    let report = match ended {
        Some(report) => report?,
        // Above the spec's default drain timeout (10 s): what is not delivered by then stays in
        // the outbox for the next run.
        None => pipeline.stop(STOP_TIMEOUT).await?,
    };
    info!(messages = report.messages(), "the pipeline stopped");
    Ok(())
}

/// Serves every connection on its own task.
async fn accept(listener: TcpListener, events: PushHandle) {
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(error) => {
                warn!(error = %error, "cannot accept a connection; retrying in 1 s");
                tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                continue;
            }
        };
        let events = events.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |request| {
                let events = events.clone();
                async move { Ok::<_, Infallible>(respond(request, &events).await) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

async fn respond(request: Request<Incoming>, events: &PushHandle) -> Response<Full<Bytes>> {
    if (request.method(), request.uri().path()) != (&Method::POST, "/events") {
        return reply(
            StatusCode::NOT_FOUND,
            "POST your events to /events".to_owned(),
        );
    }
    let body = match Limited::new(request.into_body(), MAX_BODY_BYTES)
        .collect()
        .await
    {
        Ok(body) => body.to_bytes(),
        Err(err) => return reply(StatusCode::BAD_REQUEST, format!("reading the body: {err}")),
    };
    let Ok(text) = std::str::from_utf8(&body) else {
        return reply(StatusCode::BAD_REQUEST, "the body is not UTF-8".to_owned());
    };
    match ingest(text, events).await {
        Ok(committed) => {
            let mut response = Response::new(Full::new(Bytes::from(format!(
                "{{\"committed\":{committed}}}\n"
            ))));
            response.headers_mut().insert(
                hyper::header::CONTENT_TYPE,
                hyper::header::HeaderValue::from_static("application/json"),
            );
            response
        }
        Err((status, reason)) => reply(status, reason),
    }
}

/// Sends every event of `text`, then waits until all are committed; how many there were.
async fn ingest(text: &str, events: &PushHandle) -> Result<usize, (StatusCode, String)> {
    let mut receipts = Vec::new();
    for (index, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let refused = |what: String| {
            let accepted = receipts.len();
            let reason = format!(
                "line {}: {what} (the {accepted} events before it were accepted)",
                index + 1
            );
            (StatusCode::BAD_REQUEST, reason)
        };
        let key: EventKey = serde_json::from_str(line).map_err(|err| refused(err.to_string()))?;
        match events
            .send_json_text(Route::KeyU64(key.event_id), line)
            .await
        {
            Ok(receipt) => receipts.push(receipt),
            Err(err @ (PushError::Stopped { .. } | PushError::Finished)) => {
                return Err((StatusCode::SERVICE_UNAVAILABLE, err.to_string()))
            }
            Err(err) => return Err(refused(err.to_string())),
        }
    }
    for receipt in &receipts {
        receipt
            .committed()
            .await
            .map_err(|err| (StatusCode::SERVICE_UNAVAILABLE, err.to_string()))?;
    }
    Ok(receipts.len())
}

fn reply(status: StatusCode, error: String) -> Response<Full<Bytes>> {
    let body = serde_json::json!({ "error": error }).to_string() + "\n";
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    response
}
