//! The TLS client of the ClickHouse sinks (`flow_clickhouse::tls::base_client`) against the local
//! cluster: a1's HTTPS port serves a self-signed certificate for 127.0.0.1/localhost whose copy is
//! the cluster CA file ([`tls_ca_cert`]); its HTTP port serves plain HTTP.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::time::Duration;

use flow_clickhouse::testing::{base_client, ConfiguredRootsVerifier, TlsOptions};
use flow_integration::{tls_ca_cert, wait_for_cluster, A1, HOST};
use rustls::client::danger::ServerCertVerifier;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};

const TIMEOUT: Duration = Duration::from_secs(5);

fn https_url() -> String {
    format!("https://{HOST}:{}", A1.https_port)
}

fn http_url() -> String {
    format!("http://{HOST}:{}", A1.http_port)
}

/// TLS enabled, trusting `ca_files`.
fn tls(ca_files: Vec<std::path::PathBuf>) -> TlsOptions {
    TlsOptions {
        enable_tls: true,
        ca_files,
        ..TlsOptions::default()
    }
}

/// Builds the client for `options` (which must succeed) and runs `SELECT 1` at `url`; an error is
/// given with its full chain of sources, for assertions on the cause.
async fn select_one(options: &TlsOptions, url: &str) -> Result<u8, String> {
    let client = base_client(options, TIMEOUT).expect("client");
    client
        .with_url(url)
        .with_validation(false)
        .query("SELECT 1")
        .fetch_one::<u8>()
        .await
        .map_err(|err| error_chain(&err))
}

/// The full chain of sources of an error.
fn error_chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(s) = source {
        text.push_str(" <- ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

#[tokio::test]
async fn https_trusting_the_cluster_ca_file_queries_the_server() {
    wait_for_cluster(Duration::from_secs(120)).unwrap();
    let one = select_one(&tls(vec![tls_ca_cert()]), &https_url())
        .await
        .expect("SELECT 1 over https");
    assert_eq!(one, 1);
}

#[tokio::test]
async fn https_trusting_a_ca_directory_with_the_cluster_ca_queries_the_server() {
    wait_for_cluster(Duration::from_secs(120)).unwrap();
    let ca = tls_ca_cert();
    let options = TlsOptions {
        enable_tls: true,
        ca_directory: ca.parent().map(Path::to_path_buf),
        ..TlsOptions::default()
    };
    let one = select_one(&options, &https_url())
        .await
        .expect("SELECT 1 over https");
    assert_eq!(one, 1);
}

#[tokio::test]
async fn https_with_system_roots_rejects_the_self_signed_server_certificate() {
    wait_for_cluster(Duration::from_secs(120)).unwrap();
    let chain = select_one(&tls(Vec::new()), &https_url())
        .await
        .expect_err("a self-signed server must not be trusted by the system roots");
    println!("system roots error: {chain}");
    assert!(
        chain.to_lowercase().contains("certificate"),
        "expected a certificate error, got: {chain}"
    );
}

#[tokio::test]
async fn https_with_skip_verification_queries_the_self_signed_server() {
    wait_for_cluster(Duration::from_secs(120)).unwrap();
    let options = TlsOptions {
        skip_verification: true,
        ..tls(Vec::new())
    };
    let one = select_one(&options, &https_url())
        .await
        .expect("SELECT 1 over https");
    assert_eq!(one, 1);
}

/// The cluster certificate is self-signed with `CA:TRUE` (`openssl req -x509`), which webpki
/// refuses as a server certificate; the configured-roots verifier accepts it when it is one of the
/// configured files, but only for its own names and only when presented alone.
#[test]
fn pinned_self_signed_certificate_is_accepted_only_for_its_names_and_alone() {
    wait_for_cluster(Duration::from_secs(120)).unwrap();
    let ca = tls_ca_cert();
    let verifier = ConfiguredRootsVerifier::from_options(&tls(vec![ca.clone()]))
        .expect("read CA")
        .expect("configured");
    let cert = CertificateDer::from_pem_file(&ca).expect("the cluster certificate");
    let verify = |name: &str| {
        let name = ServerName::try_from(name.to_owned()).expect("server name");
        verifier.verify_server_cert(&cert, &[], &name, &[], UnixTime::now())
    };
    assert!(verify("localhost").is_ok());
    assert!(verify("127.0.0.1").is_ok());
    assert_eq!(
        verify("clickhouse.example.com").err(),
        Some(rustls::Error::InvalidCertificate(
            rustls::CertificateError::NotValidForName
        ))
    );
    // Presented with an (unrelated) intermediate, the pin does not apply.
    assert!(verifier
        .verify_server_cert(
            &cert,
            std::slice::from_ref(&cert),
            &ServerName::try_from("localhost").expect("server name"),
            &[],
            UnixTime::now(),
        )
        .is_err());
}

#[tokio::test]
async fn plain_http_client_queries_the_http_port() {
    wait_for_cluster(Duration::from_secs(120)).unwrap();
    let one = select_one(&TlsOptions::default(), &http_url())
        .await
        .expect("SELECT 1 over http");
    assert_eq!(one, 1);
}

/// TLS enabled but pointed at the plain port: the client fails, it does not fall back to plain
/// HTTP.
///
/// 18.16 reads the ClientHello as the start of an HTTP request: depending on its random bytes it
/// answers `400 Bad Request` at once (a TLS error here) or waits for the rest of the "request
/// line" until `http_receive_timeout` (1800 s). So each attempt is given 3 s, and a fresh client
/// (a fresh ClientHello) tries again after a silent one: no attempt may get an answer, and one
/// must end in an error.
#[tokio::test]
async fn https_client_fails_on_the_plain_http_port_instead_of_falling_back() {
    wait_for_cluster(Duration::from_secs(120)).unwrap();
    let plain_port_over_https = format!("https://{HOST}:{}", A1.http_port);
    let mut refused = None;
    for _ in 0..10 {
        let attempt = tokio::time::timeout(
            Duration::from_secs(3),
            select_one(&tls(vec![tls_ca_cert()]), &plain_port_over_https),
        )
        .await;
        match attempt {
            Ok(Ok(one)) => {
                panic!("the https client got an answer ({one}) from the plain http port")
            }
            Ok(Err(chain)) => {
                refused = Some(chain);
                break;
            }
            Err(_) => println!("no answer within 3 s: the server waits for an HTTP request line"),
        }
    }
    let chain = refused.expect("an error from the plain http port within 10 attempts");
    println!("refused: {chain}");
}
