//! Telling a protocol mismatch from an unreachable server: a sink with TLS pointed at a plain HTTP
//! port, or a plain HTTP sink pointed at an HTTPS port, never gets an answer it understands. Both
//! would otherwise be retried forever as "not reachable"; they are refused instead, saying which
//! side speaks what.

use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::ServerName;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The refusal when the sink speaks TLS and the server answered in plain text.
pub const TLS_TO_PLAIN: &str = "the sink connects with TLS (enable_tls: true), but this port speaks plain HTTP: point the sink at the server's HTTPS port (https_port), or set enable_tls: false";

/// The refusal when the sink speaks plain HTTP and the server expects TLS.
pub const PLAIN_TO_TLS: &str = "the sink connects with plain HTTP, but this port speaks TLS (HTTPS): set enable_tls: true (with tls_ca_files or tls_ca_directory for its certificate), or point the sink at the server's plain HTTP port (http_port)";

/// Whether `err` is rustls refusing the first bytes of the server's answer as not being a TLS
/// record: a plain HTTP server answered the ClientHello.
pub fn tls_met_plain_text(err: &(dyn std::error::Error + 'static)) -> bool {
    let mut current = Some(err);
    while let Some(err) = current {
        if let Some(rustls_error) = err.downcast_ref::<rustls::Error>() {
            if matches!(
                rustls_error,
                rustls::Error::InvalidMessage(rustls::InvalidMessage::InvalidContentType)
            ) {
                return true;
            }
        }
        // An I/O error's `source` skips the error it wraps; look at that one too.
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            if let Some(inner) = io.get_ref() {
                if tls_met_plain_text(inner) {
                    return true;
                }
            }
        }
        current = err.source();
    }
    false
}

/// How long [`speaks_tls`] waits for the answer of a port that is up: a TLS server answers a
/// ClientHello at once.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// Whether `host:port` answers a TLS ClientHello with a TLS record (a handshake or an alert):
/// asked only after a plain HTTP request to it failed, to tell an HTTPS port from a dead one.
pub async fn speaks_tls(host: &str, port: u16, timeout: Duration) -> bool {
    tokio::time::timeout(timeout, answers_client_hello(host, port))
        .await
        .unwrap_or(false)
}

async fn answers_client_hello(host: &str, port: u16) -> bool {
    let Some(hello) = client_hello() else {
        return false;
    };
    let Ok(mut stream) = tokio::net::TcpStream::connect((host, port)).await else {
        return false;
    };
    if stream.write_all(&hello).await.is_err() {
        return false;
    }
    let mut header = [0u8; 3];
    if stream.read_exact(&mut header).await.is_err() {
        return false;
    }
    is_tls_record(&header)
}

/// Whether `host:port` answers a plain HTTP request with an HTTP status line: asked of the port
/// of a TLS sink, to tell a plain HTTP port from an HTTPS one (which answers plain text with a
/// TLS alert, or not at all).
pub async fn speaks_plain_http(host: &str, port: u16, timeout: Duration) -> bool {
    tokio::time::timeout(timeout, answers_plain_request(host, port))
        .await
        .unwrap_or(false)
}

async fn answers_plain_request(host: &str, port: u16) -> bool {
    let Ok(mut stream) = tokio::net::TcpStream::connect((host, port)).await else {
        return false;
    };
    let request = format!("GET /ping HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
    if stream.write_all(request.as_bytes()).await.is_err() {
        return false;
    }
    let mut status = [0u8; 5];
    if stream.read_exact(&mut status).await.is_err() {
        return false;
    }
    &status == b"HTTP/"
}

/// A TLS record starts with its content type (21 alert, 22 handshake) and version 3.x.
fn is_tls_record(header: &[u8; 3]) -> bool {
    matches!(header[0], 21 | 22) && header[1] == 3 && header[2] <= 4
}

/// The bytes of a ClientHello, as any TLS client would send first.
fn client_hello() -> Option<Vec<u8>> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .ok()?
        .with_root_certificates(rustls::RootCertStore::empty())
        .with_no_client_auth();
    let name = ServerName::try_from("localhost").ok()?;
    let mut connection = rustls::ClientConnection::new(Arc::new(config), name).ok()?;
    let mut hello = Vec::new();
    connection.write_tls(&mut hello).ok()?;
    Some(hello)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rustls_content_type_error_inside_io_errors_is_tls_against_plain_http() {
        let rustls_error =
            rustls::Error::InvalidMessage(rustls::InvalidMessage::InvalidContentType);
        let inner = std::io::Error::new(std::io::ErrorKind::InvalidData, rustls_error);
        let outer = std::io::Error::other(inner);
        assert!(tls_met_plain_text(&outer));
        let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        assert!(!tls_met_plain_text(&refused));
    }

    #[test]
    fn tls_records_are_recognised_by_their_header() {
        assert!(is_tls_record(&[22, 3, 3]));
        assert!(is_tls_record(&[21, 3, 1]));
        assert!(!is_tls_record(b"HTT"));
        assert!(client_hello().is_some_and(|hello| hello.first() == Some(&22)));
    }

    /// A listener that reads one request and answers `answer`; returns its port.
    async fn answering(answer: &'static [u8]) -> u16 {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let port = listener.local_addr().map(|a| a.port()).unwrap_or_default();
        tokio::spawn(async move {
            if let Ok((mut socket, _)) = listener.accept().await {
                let mut buffer = [0u8; 512];
                let _ = socket.read(&mut buffer).await;
                let _ = socket.write_all(answer).await;
            }
        });
        port
    }

    #[tokio::test]
    async fn a_port_answering_a_status_line_speaks_plain_http_and_a_tls_alert_does_not() {
        let plain = answering(b"HTTP/1.1 200 OK\r\n\r\nOk.\n").await;
        assert!(speaks_plain_http("127.0.0.1", plain, Duration::from_secs(2)).await);
        let tls = answering(&[21, 3, 3, 0, 2, 2, 70]).await;
        assert!(!speaks_plain_http("127.0.0.1", tls, Duration::from_secs(2)).await);
    }

    #[tokio::test]
    async fn a_plain_listener_does_not_speak_tls() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let port = listener.local_addr().map(|a| a.port()).unwrap_or_default();
        tokio::spawn(async move {
            if let Ok((mut socket, _)) = listener.accept().await {
                let mut buffer = [0u8; 512];
                let _ = socket.read(&mut buffer).await;
                let _ = socket.write_all(b"HTTP/1.0 400 Bad Request\r\n\r\n").await;
            }
        });
        assert!(!speaks_tls("127.0.0.1", port, Duration::from_secs(2)).await);
    }
}
