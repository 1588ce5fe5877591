//! The RowBinary encoder of the ClickHouse sinks (`flow_clickhouse::rowbinary`) against a real
//! ClickHouse 18.16 (node a1 of the local cluster): what it encodes is what the server stores.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use flow_clickhouse::testing::{check_mapping, ChType};
use flow_clickhouse::testing::{EncodedColumn, RowBinaryEncoder};
use flow_core::{Column, MessageBatch, MessageId, StreamSchema, StreamType, Value};
use flow_integration::{http_request, query_text, unique_name, wait_for_cluster, DropGuard, A1};

fn opt(ty: StreamType) -> StreamType {
    StreamType::Optional(Box::new(ty))
}

/// Every supported column type, at its extremes, nulls and padding included: inserted as
/// `FORMAT RowBinary`, the rows read back exactly as encoded, and the column types as
/// `system.columns` prints them parse to the types the encoder used.
#[test]
fn row_binary_rows_read_back_from_clickhouse_as_encoded() {
    wait_for_cluster(Duration::from_secs(120)).unwrap();
    let port = A1.http_port;
    let name = unique_name("rb_check");
    let table = format!("default.{name}");
    // (name, table type, stream type)
    let columns: Vec<(&str, &str, StreamType)> = vec![
        ("i8", "Int8", StreamType::Int8),
        ("i16", "Int16", StreamType::Int16),
        ("i32", "Int32", StreamType::Int32),
        ("i64", "Int64", StreamType::Int64),
        ("u8", "UInt8", StreamType::Uint8),
        ("u16", "UInt16", StreamType::Uint16),
        ("u32", "UInt32", StreamType::Uint32),
        ("u64", "UInt64", StreamType::Uint64),
        ("f32", "Float32", StreamType::Float),
        ("f64", "Float64", StreamType::Double),
        ("s", "String", StreamType::Utf8),
        ("fs", "FixedString(4)", StreamType::String),
        ("lc", "LowCardinality(String)", StreamType::Utf8),
        (
            "lcn",
            "LowCardinality(Nullable(String))",
            opt(StreamType::Utf8),
        ),
        ("d", "Date", StreamType::Date),
        ("dt", "DateTime('UTC')", StreamType::Datetime),
        ("ni", "Nullable(Int32)", opt(StreamType::Int32)),
        ("nfs", "Nullable(FixedString(3))", opt(StreamType::String)),
        ("ns", "Nullable(String)", StreamType::String),
    ];
    let long = "L".repeat(200);
    let rows: Vec<Vec<Value<'_>>> = vec![
        vec![
            Value::Int(-128),
            Value::Int(-32768),
            Value::Int(-2_147_483_648),
            Value::Int(i64::MIN),
            Value::Uint(255),
            Value::Uint(65535),
            Value::Uint(4_294_967_295),
            Value::Uint(u64::MAX),
            Value::Float(1.5),
            Value::Float(-2.25),
            Value::Bytes("héllo".as_bytes()),
            Value::Bytes(b"ab"),
            Value::Bytes(b"red"),
            Value::Null,
            Value::Uint(19_000),
            Value::Uint(1_700_000_000),
            Value::Null,
            Value::Null,
            Value::Bytes(long.as_bytes()),
        ],
        vec![
            Value::Int(127),
            Value::Int(32767),
            Value::Int(2_147_483_647),
            Value::Int(i64::MAX),
            Value::Uint(0),
            Value::Uint(0),
            Value::Uint(0),
            Value::Uint(0),
            Value::Float(0.0),
            Value::Float(1e300),
            Value::Bytes(b""),
            Value::Bytes(b"abcd"),
            Value::Bytes(b""),
            Value::Bytes(b"x"),
            Value::Uint(65_535),
            Value::Uint(u32::MAX.into()),
            Value::Int(-7),
            Value::Bytes(b"xyz"),
            Value::Bytes(b"tab\there"),
        ],
    ];
    let schema = StreamSchema::new(
        columns
            .iter()
            .map(|(name, _, ty)| Column::new(*name, ty.clone()))
            .collect(),
    )
    .unwrap();
    let mut batch = MessageBatch::new(schema);
    for (offset, values) in rows.iter().enumerate() {
        let mut writer = batch.start_row(MessageId::new(0, offset as u64));
        for value in values {
            writer.push(*value).unwrap();
        }
        writer.finish().unwrap();
    }
    let plan: Vec<EncodedColumn> = columns
        .iter()
        .enumerate()
        .map(|(i, (name, ty, stream))| {
            let ty = ChType::parse(ty);
            check_mapping(name, stream, &ty).unwrap();
            EncodedColumn {
                name: (*name).to_owned(),
                stream_index: i,
                ty,
            }
        })
        .collect();
    let encoder = RowBinaryEncoder::new(plan);
    let mut body = Vec::new();
    for row in batch.rows() {
        encoder.encode_row(&row, &mut body).unwrap();
    }

    let ddl: Vec<String> = columns
        .iter()
        .map(|(name, ty, _)| format!("{name} {ty}"))
        .collect();
    let mut tables = DropGuard::default();
    // 18.16 creates LowCardinality columns only with this setting, which goes in the URL.
    let created = http_request(
        port,
        "POST",
        "/?allow_experimental_low_cardinality_type=1",
        &[],
        format!(
            "CREATE TABLE {table} ({}) ENGINE = MergeTree ORDER BY tuple()",
            ddl.join(", ")
        )
        .as_bytes(),
    )
    .unwrap();
    assert_eq!(created.status, 200, "{}", created.text());
    tables.tables.push((port, table.clone()));

    let mut insert = format!(
        "INSERT INTO {table} ({}) FORMAT RowBinary\n",
        encoder.column_names().join(", ")
    )
    .into_bytes();
    insert.extend_from_slice(&body);
    let inserted = http_request(port, "POST", "/", &[], &insert).unwrap();
    assert_eq!(inserted.status, 200, "{}", inserted.text());
    // Dates and datetimes as their stored numbers (18.16 cannot print dates past 2105), and
    // once as text to show the days / seconds meaning.
    let select: Vec<String> = encoder
        .column_names()
        .into_iter()
        .map(|name| match name.as_str() {
            "d" => "toUInt16(d)".to_owned(),
            "dt" => "toUInt32(dt)".to_owned(),
            _ => name,
        })
        .collect();
    let got = query_text(
        port,
        &format!(
            "SELECT {} FROM {table} ORDER BY i8 FORMAT TabSeparated",
            select.join(", ")
        ),
    )
    .unwrap();
    let dates = query_text(
        port,
        &format!("SELECT d, dt FROM {table} WHERE i8 = -128 FORMAT TabSeparated"),
    )
    .unwrap();
    let types = query_text(
        port,
        &format!(
            "SELECT type FROM system.columns WHERE database = 'default' AND table = '{name}' \
             FORMAT TabSeparatedRaw"
        ),
    )
    .unwrap();
    println!("types: {types}");
    println!("rows:\n{got}");
    println!("dates: {dates}");
    let expected = format!(
        "-128\t-32768\t-2147483648\t-9223372036854775808\t255\t65535\t4294967295\t\
         18446744073709551615\t1.5\t-2.25\th\u{e9}llo\tab\\0\\0\tred\t\\N\t19000\t\
         1700000000\t\\N\t\\N\t{long}\n\
         127\t32767\t2147483647\t9223372036854775807\t0\t0\t0\t0\t0\t1e300\t\tabcd\t\tx\t\
         65535\t4294967295\t-7\txyz\ttab\\there\n"
    );
    assert_eq!(got, expected);
    // The types as system.columns prints them parse to what the encoder used.
    let parsed: Vec<ChType> = types.lines().map(ChType::parse).collect();
    let planned: Vec<ChType> = encoder.columns().iter().map(|c| c.ty.clone()).collect();
    assert_eq!(parsed, planned);
    assert_eq!(dates, "2022-01-08\t2023-11-14 22:13:20\n");
}
