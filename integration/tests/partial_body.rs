//! Why every batch is sent as one frame: ClickHouse 18.16 commits the rows it has parsed when the
//! client's connection closes cleanly in the middle of an INSERT body (what a killed worker's
//! kernel does). A plain RowBinary body cut at a row boundary lands as a partial block; a framed
//! body cut anywhere fails its frame checks and lands nothing.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::time::Duration;

use flow_clickhouse::testing::seal;
use flow_clickhouse::Codec;
use flow_integration::{query_u64, unique_name, wait_for_cluster, ReplicatedTable, A1, SHARD_A};

/// `count` rows of a single UInt64 column in RowBinary.
fn rows(count: u64) -> Vec<u8> {
    (0..count).flat_map(|id| id.to_le_bytes()).collect()
}

/// POSTs the first `sent` bytes of a `body.len()`-byte INSERT body, then closes the write side
/// cleanly (FIN, no reset) and reads whatever the server answers.
fn cut_insert(table: &str, query_params: &str, body: &[u8], sent: usize) -> String {
    let mut stream = TcpStream::connect(("127.0.0.1", A1.http_port)).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let query = format!("INSERT INTO default.{table} (id) FORMAT RowBinary");
    let encoded: String = query
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'.' | b'_' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect();
    let head = format!(
        "POST /?query={encoded}{query_params} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).unwrap();
    stream.write_all(&body[..sent]).unwrap();
    stream.flush().unwrap();
    stream.shutdown(Shutdown::Write).unwrap();
    let mut answer = String::new();
    let _ = stream.read_to_string(&mut answer);
    answer
}

#[test]
fn a_cut_plain_body_commits_a_prefix_but_a_cut_frame_commits_nothing() {
    wait_for_cluster(Duration::from_secs(120)).unwrap();
    let name = unique_name("partial_body");
    let table = ReplicatedTable::create("default", &name, "id UInt64", "id", &SHARD_A).unwrap();
    let body = rows(10_000);

    // Plain RowBinary cut at a row boundary: the server keeps the first 4,000 rows.
    cut_insert(&name, "", &body, 4_000 * 8);
    let plain = query_u64(
        A1.http_port,
        &format!("SELECT count() FROM {}", table.qualified()),
    )
    .unwrap();
    assert_eq!(
        plain, 4_000,
        "18.16 commits the parsed prefix of a cleanly closed body"
    );

    // The same rows framed as the sinks send them, cut anywhere: nothing lands.
    for codec in [Codec::Lz4, Codec::None] {
        let (_, framed) = seal(codec, &rows(10_000));
        for cut in [framed.len() / 3, framed.len() - 1] {
            cut_insert(&name, "&decompress=1", &framed, cut);
            let count = query_u64(
                A1.http_port,
                &format!("SELECT count() FROM {}", table.qualified()),
            )
            .unwrap();
            assert_eq!(
                count,
                4_000,
                "a cut {codec:?} frame ({cut} of {} bytes) landed rows",
                framed.len()
            );
        }
    }

    // The whole frame lands every row (the 4,000 already there are a different block).
    let (_, framed) = seal(Codec::Lz4, &rows(10_000));
    let answer = cut_insert(&name, "&decompress=1", &framed, framed.len());
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let count = query_u64(
        A1.http_port,
        &format!("SELECT count() FROM {}", table.qualified()),
    )
    .unwrap();
    assert_eq!(count, 14_000);
}
