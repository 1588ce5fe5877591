//! The Prometheus endpoint of a pipeline (`flow-worker run --metrics-addr`, the spec's
//! `metrics: { listen }`, [`StartOptions::metrics_listen`](crate::StartOptions::metrics_listen)):
//! `GET /metrics` answers the pipeline's [`Metrics`] in Prometheus text format 0.0.4, over
//! HTTP/1.1 on hyper. The same listener answers the probes of a container platform:
//! `GET /health` is 200 while the process serves at all (liveness), and `GET /ready` is 200 when
//! every sink's session is up and no partition failed, 503 otherwise, its JSON body naming what
//! is not ready ([`Metrics::not_ready`]).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use flow_core::Metrics;
use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tracing::{info, warn};

const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The endpoint could not listen.
#[derive(Debug, thiserror::Error)]
#[error("cannot listen for metrics on {addr} (is the port in use? choose another with --metrics-addr or metrics.listen)")]
pub struct MetricsEndpointError {
    /// The address asked for.
    pub addr: SocketAddr,
    /// Why binding it failed.
    #[source]
    pub source: std::io::Error,
}

/// A running `/metrics` endpoint; it stops serving when dropped.
pub struct MetricsEndpoint {
    local_addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl MetricsEndpoint {
    /// Binds `addr` (failing at once when it cannot: a pipeline asked for metrics must not run
    /// unobserved), then serves every connection on its own task of the current runtime.
    pub async fn serve(
        addr: SocketAddr,
        metrics: Arc<Metrics>,
    ) -> Result<MetricsEndpoint, MetricsEndpointError> {
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|source| MetricsEndpointError { addr, source })?;
        let local_addr = listener.local_addr().unwrap_or(addr);
        info!(address = %local_addr, "serving Prometheus metrics at http://{local_addr}/metrics");
        Ok(MetricsEndpoint {
            local_addr,
            task: tokio::spawn(accept(listener, metrics)),
        })
    }

    /// The address it listens on (the port the system chose for port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }
}

impl Drop for MetricsEndpoint {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn accept(listener: TcpListener, metrics: Arc<Metrics>) {
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(error) => {
                // Out of file descriptors, typically: back off instead of spinning.
                warn!(error = %error, "cannot accept a metrics connection; retrying in 1 s");
                tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                continue;
            }
        };
        let metrics = Arc::clone(&metrics);
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |request| {
                let metrics = Arc::clone(&metrics);
                async move { Ok::<_, Infallible>(respond(&request, &metrics)) }
            });
            // A scraper that hangs up mid-answer is not worth a log line.
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

fn respond(request: &Request<Incoming>, metrics: &Metrics) -> Response<Full<Bytes>> {
    let reply = |status: StatusCode, content_type: &str, body: String| {
        let mut response = Response::new(Full::new(Bytes::from(body)));
        *response.status_mut() = status;
        if let Ok(value) = hyper::header::HeaderValue::from_str(content_type) {
            response
                .headers_mut()
                .insert(hyper::header::CONTENT_TYPE, value);
        }
        response
    };
    let text = "text/plain; charset=utf-8";
    let json = "application/json";
    match (request.method(), request.uri().path()) {
        (&Method::GET, "/health") => {
            reply(StatusCode::OK, json, "{\"status\":\"alive\"}\n".to_owned())
        }
        (&Method::GET, "/ready") => {
            let not_ready = metrics.not_ready();
            let status = if not_ready.is_empty() {
                StatusCode::OK
            } else {
                StatusCode::SERVICE_UNAVAILABLE
            };
            let body = serde_json::json!({ "ready": not_ready.is_empty(), "not_ready": not_ready });
            reply(status, json, format!("{body}\n"))
        }
        (_, "/health" | "/ready") => reply(
            StatusCode::METHOD_NOT_ALLOWED,
            text,
            format!("GET {}\n", request.uri().path()),
        ),
        (&Method::GET, "/metrics") => match metrics.encode() {
            Ok(body) => reply(StatusCode::OK, CONTENT_TYPE, body),
            Err(error) => reply(
                StatusCode::INTERNAL_SERVER_ERROR,
                text,
                format!("encoding the metrics failed: {error}\n"),
            ),
        },
        (_, "/metrics") => reply(
            StatusCode::METHOD_NOT_ALLOWED,
            text,
            "GET /metrics\n".to_owned(),
        ),
        _ => reply(
            StatusCode::NOT_FOUND,
            text,
            "flow serves Prometheus metrics at /metrics, and probes at /health and /ready\n"
                .to_owned(),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

    async fn get(addr: SocketAddr, path: &str) -> Result<String> {
        let mut stream = tokio::net::TcpStream::connect(addr).await?;
        let request = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await?;
        let mut answer = String::new();
        stream.read_to_string(&mut answer).await?;
        Ok(answer)
    }

    #[tokio::test]
    async fn get_metrics_answers_prometheus_text_and_other_paths_404() -> Result<()> {
        let metrics = Metrics::new();
        metrics.applied("p", 0, &[flow_core::SourceCount::Messages.addition(3)]);
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let task = MetricsEndpoint {
            local_addr: addr,
            task: tokio::spawn(accept(listener, metrics)),
        };
        let answer = get(addr, "/metrics").await?;
        assert!(answer.starts_with("HTTP/1.1 200 OK\r\n"), "{answer}");
        assert!(
            answer.contains(&format!("content-type: {CONTENT_TYPE}\r\n")),
            "{answer}"
        );
        assert!(
            answer.contains("\nflow_source_messages_total{pipeline=\"p\",partition=\"0\"} 3\n"),
            "{answer}"
        );
        let other = get(addr, "/").await?;
        assert!(other.starts_with("HTTP/1.1 404 Not Found\r\n"), "{other}");
        drop(task);
        Ok(())
    }

    #[tokio::test]
    async fn a_port_in_use_is_refused_with_what_to_do() -> Result<()> {
        let taken = std::net::TcpListener::bind("127.0.0.1:0")?;
        let err = MetricsEndpoint::serve(taken.local_addr()?, Metrics::new())
            .await
            .err();
        let text = err.map(|e| e.to_string()).unwrap_or_default();
        assert!(
            text.starts_with("cannot listen for metrics on 127.0.0.1:"),
            "{text}"
        );
        assert!(
            text.contains("choose another with --metrics-addr"),
            "{text}"
        );
        Ok(())
    }

    struct Shard(std::sync::Mutex<Vec<String>>);

    impl flow_core::Readiness for Shard {
        fn not_ready(&self) -> Vec<String> {
            self.0.lock().map(|v| v.clone()).unwrap_or_default()
        }
    }

    /// `/health` is 200 whatever the sinks; `/ready` is 503 naming each thing not ready, and 200
    /// once nothing is; a failed partition makes it 503 for good.
    #[tokio::test]
    async fn health_is_always_200_and_ready_names_what_is_not_ready() -> Result<()> {
        let metrics = Metrics::new();
        let shard = Arc::new(Shard(std::sync::Mutex::new(vec![
            "shard `b`: down".to_owned()
        ])));
        let probe: Arc<dyn flow_core::Readiness> = shard.clone();
        metrics.register_readiness("p/out".to_owned(), Arc::downgrade(&probe));
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let _task = MetricsEndpoint {
            local_addr: addr,
            task: tokio::spawn(accept(listener, Arc::clone(&metrics))),
        };
        let body = |answer: &str| answer.split("\r\n\r\n").nth(1).unwrap_or("").to_owned();

        let health = get(addr, "/health").await?;
        assert!(health.starts_with("HTTP/1.1 200 OK\r\n"), "{health}");
        assert!(
            health.contains("content-type: application/json\r\n"),
            "{health}"
        );
        assert_eq!(body(&health), "{\"status\":\"alive\"}\n");

        let unready = get(addr, "/ready").await?;
        assert!(
            unready.starts_with("HTTP/1.1 503 Service Unavailable\r\n"),
            "{unready}"
        );
        assert_eq!(
            body(&unready),
            "{\"not_ready\":[{\"component\":\"p/out\",\"reason\":\"shard `b`: down\"}],\"ready\":false}\n"
        );

        if let Ok(mut reasons) = shard.0.lock() {
            reasons.clear();
        }
        let ready = get(addr, "/ready").await?;
        assert!(ready.starts_with("HTTP/1.1 200 OK\r\n"), "{ready}");
        assert_eq!(body(&ready), "{\"not_ready\":[],\"ready\":true}\n");

        metrics.partition_failed("p", 1, "sink `out` gave up".to_owned());
        let failed = get(addr, "/ready").await?;
        assert!(
            failed.starts_with("HTTP/1.1 503 Service Unavailable\r\n"),
            "{failed}"
        );
        assert_eq!(
            body(&failed),
            "{\"not_ready\":[{\"component\":\"p/partition 1\",\"reason\":\"the partition failed: sink `out` gave up\"}],\"ready\":false}\n"
        );
        let health = get(addr, "/health").await?;
        assert!(health.starts_with("HTTP/1.1 200 OK\r\n"), "{health}");

        // A sink gone (its probe dropped) is no longer asked.
        drop(probe);
        drop(shard);
        assert_eq!(metrics.not_ready().len(), 1);
        Ok(())
    }
}
