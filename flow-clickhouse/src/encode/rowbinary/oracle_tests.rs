//! The encoder against an independent oracle: the `clickhouse` crate's own serde RowBinary
//! serializer. Each case gives a stream type, a column type and a value twice — as the JSON a
//! source reads (our side: JSON form, packed value, [`RowBinaryEncoder`]) and as the Rust value
//! the crate serializes with its serde mapping (decimals as their fixed-width integers, UUIDs as
//! the `(u64, u64)` pair its `serde::uuid` helper writes, `serde::ipv4`, `Int256`/`UInt256`,
//! `Option` for Nullable, `Vec` for Array, maps as pairs, tuples). The crate's bytes are caught
//! by a local HTTP listener standing in for the server.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, Ipv6Addr};

use clickhouse::types::{Int256, UInt256};
use clickhouse::{Client, Compression, Row};
use flow_core::{push_json_text, Column, MessageBatch, MessageId, StreamSchema};
use proptest::prelude::*;
use serde::Serialize;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpListener;
use tokio::sync::mpsc;

use crate::encode::chtype::{check_mapping, ChType};
use crate::encode::rowbinary::{EncodedColumn, RowBinaryEncoder};

#[derive(Row, Serialize)]
struct One<T> {
    v: T,
}

/// Serves inserts and hands over each request body.
struct Capture {
    url: String,
    bodies: mpsc::UnboundedReceiver<Vec<u8>>,
}

impl Capture {
    async fn start() -> Capture {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (tx, bodies) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let tx = tx.clone();
                tokio::spawn(async move {
                    let mut stream = BufReader::new(stream);
                    // Keep-alive: one connection may carry several requests.
                    while let Some(body) = read_request(&mut stream).await {
                        tx.send(body).unwrap();
                        stream
                            .get_mut()
                            .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
                            .await
                            .unwrap();
                    }
                });
            }
        });
        Capture { url, bodies }
    }

    /// The bytes the crate sends for `rows`.
    async fn bytes<T: Serialize + Send + Sync + 'static>(&mut self, rows: Vec<T>) -> Vec<u8> {
        let client = Client::default()
            .with_url(&self.url)
            .with_compression(Compression::None)
            .with_validation(false);
        let mut insert = client.insert::<One<T>>("t").await.unwrap();
        for v in rows {
            insert.write(&One { v }).await.unwrap();
        }
        insert.end().await.unwrap();
        self.bodies.recv().await.unwrap()
    }
}

async fn read_request(stream: &mut BufReader<tokio::net::TcpStream>) -> Option<Vec<u8>> {
    let mut chunked = false;
    let mut length = 0usize;
    loop {
        let mut line = String::new();
        if stream.read_line(&mut line).await.ok()? == 0 {
            return None;
        }
        let lower = line.trim_end().to_ascii_lowercase();
        if lower.is_empty() {
            break;
        }
        if lower == "transfer-encoding: chunked" {
            chunked = true;
        }
        if let Some(value) = lower.strip_prefix("content-length:") {
            length = value.trim().parse().ok()?;
        }
    }
    let mut body = Vec::new();
    if !chunked {
        body.resize(length, 0);
        stream.read_exact(&mut body).await.ok()?;
        return Some(body);
    }
    loop {
        let mut size = String::new();
        stream.read_line(&mut size).await.ok()?;
        let size = usize::from_str_radix(size.trim(), 16).ok()?;
        let mut chunk = vec![0; size + 2];
        stream.read_exact(&mut chunk).await.ok()?;
        if size == 0 {
            return Some(body);
        }
        body.extend_from_slice(&chunk[..size]);
    }
}

/// Our bytes for JSON values of `stream` written to `column`.
fn ours(stream: &str, column: &str, values: &[String]) -> Vec<u8> {
    let ty = ChType::parse(column);
    let stream_ty = stream.parse().unwrap();
    check_mapping("v", &stream_ty, &ty).unwrap();
    let schema = StreamSchema::new(vec![Column::new("v", stream_ty)]).unwrap();
    let mut batch = MessageBatch::new(schema);
    for (i, json) in values.iter().enumerate() {
        let mut row = batch.start_row(MessageId::new(0, i as u64));
        push_json_text(&mut row, json).unwrap_or_else(|err| panic!("{json}: {err}"));
        row.finish().unwrap();
    }
    let encoder = RowBinaryEncoder::new(vec![EncodedColumn {
        name: "v".to_owned(),
        stream_index: 0,
        ty,
    }]);
    let mut out = Vec::new();
    for row in batch.rows() {
        encoder.encode_row(&row, &mut out).unwrap();
    }
    out
}

/// 10^n - 1 as 32 little-endian bytes, by schoolbook arithmetic on bytes.
fn nines_le(n: usize) -> [u8; 32] {
    let mut out = [0u8; 32];
    for _ in 0..n {
        let mut carry = 9u32;
        for byte in out.iter_mut() {
            let v = u32::from(*byte) * 10 + carry;
            *byte = v as u8;
            carry = v >> 8;
        }
    }
    out
}

fn uuid_pair(text: &str) -> (u64, u64) {
    let bytes = flow_core::parse_uuid(text).unwrap();
    let (high, low) = bytes.split_at(8);
    (
        u64::from_be_bytes(high.try_into().unwrap()),
        u64::from_be_bytes(low.try_into().unwrap()),
    )
}

#[derive(Serialize)]
struct Ip4(#[serde(with = "clickhouse::serde::ipv4")] Ipv4Addr);

macro_rules! oracle {
    ($capture:expr, $stream:expr, $column:expr, [$($json:expr),+ $(,)?], [$($value:expr),+ $(,)?]) => {{
        let json: Vec<String> = vec![$($json.to_string()),+];
        let expected = $capture.bytes(vec![$($value),+]).await;
        assert_eq!(
            ours($stream, $column, &json),
            expected,
            "{} -> {} for {:?}",
            $stream,
            $column,
            json
        );
    }};
}

#[tokio::test]
async fn every_type_and_nesting_encodes_as_the_clickhouse_crate_does() {
    let mut c = Capture::start().await;
    let u256_max = "115792089237316195423570985008687907853269984665640564039457584007913129639935";
    let i256_min = "-57896044618658097711785492504343953926634992332820282019728792003956564819968";
    let i256_max = "57896044618658097711785492504343953926634992332820282019728792003956564819967";
    oracle!(
        c,
        "int128",
        "Int128",
        [format!("\"{}\"", i128::MIN), format!("{}", i128::MAX), "0"],
        [i128::MIN, i128::MAX, 0i128]
    );
    oracle!(
        c,
        "uint128",
        "UInt128",
        [format!("{}", u128::MAX), "\"0\""],
        [u128::MAX, 0u128]
    );
    oracle!(
        c,
        "int256",
        "Int256",
        [format!("\"{i256_min}\""), format!("\"{i256_max}\""), "-1"],
        [
            Int256::from_le_bytes({
                let mut b = [0u8; 32];
                b[31] = 0x80;
                b
            }),
            Int256::from_le_bytes({
                let mut b = [0xffu8; 32];
                b[31] = 0x7f;
                b
            }),
            Int256::from(-1i64)
        ]
    );
    oracle!(
        c,
        "uint256",
        "UInt256",
        [format!("\"{u256_max}\""), "7"],
        [UInt256::from_le_bytes([0xff; 32]), UInt256::from(7u64)]
    );
    oracle!(
        c,
        "decimal(9,2)",
        "Decimal(9, 2)",
        ["\"-9999999.99\"", "9999999.99", "0.1"],
        [-999_999_999i32, 999_999_999i32, 10i32]
    );
    oracle!(
        c,
        "decimal(9,2)",
        "Decimal(18, 4)",
        ["1.5", "\"-0.01\""],
        [15_000i64, -100i64]
    );
    oracle!(
        c,
        "decimal(38,10)",
        "Decimal(38, 10)",
        [
            "\"9999999999999999999999999999.9999999999\"",
            "\"-0.0000000001\""
        ],
        [10i128.pow(38) - 1, -1i128]
    );
    oracle!(
        c,
        "decimal(76,0)",
        "Decimal(76, 0)",
        [format!("\"{}\"", "9".repeat(76))],
        [Int256::from_le_bytes(nines_le(76))]
    );
    let uuid = "01234567-89ab-cdef-0123-456789abcdef";
    oracle!(
        c,
        "uuid",
        "UUID",
        [
            format!("\"{uuid}\""),
            "\"00000000-0000-0000-0000-000000000000\"",
            "\"ffffffff-ffff-ffff-ffff-ffffffffffff\""
        ],
        [uuid_pair(uuid), (0u64, 0u64), (u64::MAX, u64::MAX)]
    );
    oracle!(
        c,
        "utf8",
        "UUID",
        [format!("\"{uuid}\"")],
        [uuid_pair(uuid)]
    );
    oracle!(
        c,
        "optional<uuid>",
        "Nullable(UUID)",
        ["null", format!("\"{uuid}\"")],
        [None, Some(uuid_pair(uuid))]
    );
    oracle!(
        c,
        "ipv4",
        "IPv4",
        ["\"255.255.255.255\"", "\"0.0.0.0\"", "\"10.1.2.3\""],
        [
            Ip4(Ipv4Addr::BROADCAST),
            Ip4(Ipv4Addr::UNSPECIFIED),
            Ip4(Ipv4Addr::new(10, 1, 2, 3))
        ]
    );
    oracle!(
        c,
        "utf8",
        "IPv4",
        ["\"10.1.2.3\""],
        [Ip4(Ipv4Addr::new(10, 1, 2, 3))]
    );
    oracle!(
        c,
        "ipv6",
        "IPv6",
        ["\"2001:db8::1\"", "\"::\"", "\"10.1.2.3\""],
        [
            "2001:db8::1".parse::<Ipv6Addr>().unwrap(),
            Ipv6Addr::UNSPECIFIED,
            Ipv4Addr::new(10, 1, 2, 3).to_ipv6_mapped()
        ]
    );
    oracle!(
        c,
        "ipv4",
        "IPv6",
        ["\"10.1.2.3\""],
        [Ipv4Addr::new(10, 1, 2, 3).to_ipv6_mapped()]
    );
    oracle!(
        c,
        "ipv6",
        "FixedString(16)",
        ["\"2001:db8::1\""],
        ["2001:db8::1".parse::<Ipv6Addr>().unwrap().octets()]
    );
    oracle!(
        c,
        "utf8",
        "Enum8('a' = 1, 'b' = -128, 'c' = 127)",
        ["\"b\"", "\"c\"", "\"a\""],
        [-128i8, 127i8, 1i8]
    );
    oracle!(c, "int8", "Enum8('a' = 1, 'b' = -128)", ["-128"], [-128i8]);
    oracle!(
        c,
        "string",
        "Enum16('x' = -32768, 'y' = 32767)",
        ["\"y\"", "\"x\""],
        [32767i16, -32768i16]
    );
    oracle!(
        c,
        "date32",
        "Date32",
        ["\"1900-01-01\"", "\"2299-12-31\"", "0"],
        [-25_567i32, 120_529i32, 0i32]
    );
    oracle!(c, "date", "Date32", ["65535"], [65_535i32]);
    oracle!(
        c,
        "timestamp",
        "DateTime64(6)",
        ["\"2023-11-14T22:13:20.123456Z\"", "-1"],
        [1_700_000_000_123_456i64, -1i64]
    );
    oracle!(
        c,
        "timestamp",
        "DateTime64(3)",
        ["\"2299-12-31T23:59:59.999Z\"", "\"1900-01-01T00:00:00Z\""],
        [10_413_791_999_999i64, -2_208_988_800_000i64]
    );
    oracle!(c, "timestamp", "DateTime64(9)", ["1"], [1_000i64]);
    oracle!(
        c,
        "datetime",
        "DateTime64(0)",
        ["4294967295"],
        [4_294_967_295i64]
    );
    oracle!(c, "boolean", "Bool", ["true", "false"], [true, false]);
    oracle!(
        c,
        "float",
        "Float32",
        ["\"nan\"", "\"-inf\"", "3.4028234663852886e38", "-0.0"],
        [f32::NAN, f32::NEG_INFINITY, f32::MAX, -0.0f32]
    );
    oracle!(
        c,
        "double",
        "Float64",
        ["\"nan\"", "\"inf\"", "5e-324"],
        [f64::NAN, f64::INFINITY, 5e-324f64]
    );
    oracle!(
        c,
        "list<optional<decimal(18,4)>>",
        "Array(Nullable(Decimal(18, 4)))",
        [
            "[null, \"1.2345\", null, \"-99999999999999.9999\"]",
            "[]",
            "[null]"
        ],
        [
            vec![
                None,
                Some(12_345i64),
                None,
                Some(-999_999_999_999_999_999i64)
            ],
            vec![],
            vec![None]
        ]
    );
    oracle!(
        c,
        "list<decimal(18,4)>",
        "Array(Nullable(Decimal(18, 4)))",
        ["[\"1\"]"],
        [vec![Some(10_000i64)]]
    );
    oracle!(
        c,
        "list<list<optional<int8>>>",
        "Array(Array(Nullable(Int8)))",
        ["[[null], [], [1, -128]]", "[]"],
        [
            vec![vec![None], vec![], vec![Some(1i8), Some(-128)]],
            vec![]
        ]
    );
    oracle!(
        c,
        "list<string>",
        "Array(String)",
        ["[\"\", \"ab\"]"],
        [vec![String::new(), "ab".to_owned()]]
    );
    oracle!(
        c,
        "list<utf8>",
        "Array(LowCardinality(Nullable(String)))",
        ["[\"x\"]"],
        [vec![Some("x".to_owned())]]
    );
    oracle!(
        c,
        "dict<utf8,list<uint32>>",
        "Map(String, Array(UInt32))",
        ["{}", "{\"a\": [1, 4294967295], \"b\": []}"],
        [
            BTreeMap::new(),
            BTreeMap::from([
                ("a".to_owned(), vec![1u32, u32::MAX]),
                ("b".to_owned(), vec![])
            ])
        ]
    );
    oracle!(
        c,
        "dict<uint64,optional<int128>>",
        "Map(UInt64, Nullable(Int128))",
        ["[[18446744073709551615, null], [0, \"-1\"]]", "[]"],
        [vec![(u64::MAX, None), (0u64, Some(-1i128))], vec![]]
    );
    oracle!(
        c,
        "tuple<uint8,optional<utf8>,list<int8>>",
        "Tuple(UInt8, Nullable(String), Array(Int8))",
        ["[255, null, []]", "[0, \"z\", [127]]"],
        [
            (255u8, None, vec![]),
            (0u8, Some("z".to_owned()), vec![127i8])
        ]
    );
    oracle!(
        c,
        "list<tuple<uuid,optional<ipv6>>>",
        "Array(Tuple(UUID, Nullable(IPv6)))",
        [format!("[[\"{uuid}\", null], [\"{uuid}\", \"::1\"]]")],
        [vec![
            (uuid_pair(uuid), None),
            (uuid_pair(uuid), Some(Ipv6Addr::LOCALHOST))
        ]]
    );
    oracle!(
        c,
        "optional<decimal(9,2)>",
        "Nullable(Decimal(9, 2))",
        ["null", "\"1\""],
        [None, Some(100i32)]
    );
    oracle!(
        c,
        "optional<utf8>",
        "LowCardinality(Nullable(String))",
        ["null", "\"x\""],
        [None, Some("x".to_owned())]
    );
    oracle!(
        c,
        "uint32",
        "LowCardinality(UInt32)",
        ["4294967295"],
        [u32::MAX]
    );
    oracle!(
        c,
        "uuid",
        "FixedString(16)",
        [format!("\"{uuid}\"")],
        [flow_core::parse_uuid(uuid).unwrap()]
    );
}

/// `value / 10^scale` as decimal text.
fn decimal_text(value: i64, scale: u32) -> String {
    let sign = if value < 0 { "-" } else { "" };
    let magnitude = value.unsigned_abs();
    let unit = 10u64.pow(scale);
    format!(
        "\"{sign}{}.{:0width$}\"",
        magnitude / unit,
        magnitude % unit,
        width = scale as usize
    )
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn generated_wide_integers_and_uuids_match_the_crate(
        ints in proptest::collection::vec(any::<i128>(), 1..8),
        uints in proptest::collection::vec(any::<u128>(), 1..8),
        uuids in proptest::collection::vec(any::<[u8; 16]>(), 1..8),
    ) {
        runtime().block_on(async {
            let mut c = Capture::start().await;
            let json: Vec<String> = ints.iter().map(|v| format!("\"{v}\"")).collect();
            prop_assert_eq!(ours("int128", "Int128", &json), c.bytes(ints.clone()).await);
            let json: Vec<String> = uints.iter().map(|v| v.to_string()).collect();
            prop_assert_eq!(ours("uint128", "UInt128", &json), c.bytes(uints.clone()).await);
            let texts: Vec<String> = uuids.iter().map(|b| {
                let mut text = String::new();
                flow_core::write_uuid(b, &mut text);
                text
            }).collect();
            let json: Vec<String> = texts.iter().map(|t| format!("\"{t}\"")).collect();
            let pairs: Vec<(u64, u64)> = texts.iter().map(|t| uuid_pair(t)).collect();
            prop_assert_eq!(ours("uuid", "UUID", &json), c.bytes(pairs).await);
            Ok(())
        })?;
    }

    #[test]
    fn generated_nested_decimals_maps_and_timestamps_match_the_crate(
        lists in proptest::collection::vec(
            proptest::collection::vec(proptest::option::of(-999_999_999i64..=999_999_999), 0..6),
            1..6,
        ),
        maps in proptest::collection::vec(
            proptest::collection::btree_map("[a-z]{0,3}", proptest::collection::vec(any::<u32>(), 0..4), 0..4),
            1..6,
        ),
        stamps in proptest::collection::vec(-2_208_988_800_000_000i64..=10_413_791_999_999_999, 1..8),
    ) {
        runtime().block_on(async {
            let mut c = Capture::start().await;
            let json: Vec<String> = lists.iter().map(|list| {
                let items: Vec<String> = list.iter().map(|v| v.map_or("null".to_owned(), |v| decimal_text(v, 4))).collect();
                format!("[{}]", items.join(","))
            }).collect();
            // decimal(9,4) written to Decimal(18, 6): the scale grows by two digits.
            let scaled: Vec<Vec<Option<i64>>> = lists.iter().map(|l| l.iter().map(|v| v.map(|v| v * 100)).collect()).collect();
            prop_assert_eq!(
                ours("list<optional<decimal(9,4)>>", "Array(Nullable(Decimal(18, 6)))", &json),
                c.bytes(scaled).await
            );
            let json: Vec<String> = maps.iter().map(|m| serde_json::to_string(m).unwrap()).collect();
            prop_assert_eq!(
                ours("dict<utf8,list<uint32>>", "Map(String, Array(UInt32))", &json),
                c.bytes(maps.clone()).await
            );
            let json: Vec<String> = stamps.iter().map(|v| v.to_string()).collect();
            prop_assert_eq!(ours("timestamp", "DateTime64(6)", &json), c.bytes(stamps.clone()).await);
            Ok(())
        })?;
    }
}
