//! What the broker cases read: the generator's rows as the JSON a producer publishes (the same
//! bytes to JetStream and Kafka), and the struct a hand-written consumer decodes them into.

use std::fmt::Write as _;

use flow_core::sources::generator::{fill_payload, row_values};

use super::{PARTITIONS, PAYLOAD_BYTES};

/// The topic or stream holding `rows` rows; partition `p` is JetStream subject `<name>.<p>` or
/// Kafka partition `p`.
pub fn name(rows: u64) -> String {
    format!("bench_{rows}")
}

/// Writes into `json` the generator's row at `offset` of `partition` as one JSON object, the
/// columns in table order. `payload` is scratch space.
pub fn json_row(partition: u32, offset: u64, payload: &mut Vec<u8>, json: &mut String) {
    json_row_of(PARTITIONS, partition, offset, payload, json);
}

/// [`json_row`] for a generator of `partitions` partitions (the scale-out case has 8).
pub fn json_row_of(
    partitions: u32,
    partition: u32,
    offset: u64,
    payload: &mut Vec<u8>,
    json: &mut String,
) {
    let (id, user_id, ts) = row_values(partition, offset, partitions);
    fill_payload(id, PAYLOAD_BYTES, payload);
    json.clear();
    // The payload alphabet is [a-z0-9]: no escaping needed.
    let _ = write!(
        json,
        r#"{{"id":{id},"partition":{partition},"offset":{offset},"user_id":{user_id},"ts":{ts},"payload":"{}"}}"#,
        String::from_utf8_lossy(payload)
    );
}

/// One message as a hand-written consumer decodes it (serde_json, the payload borrowed from the
/// message) and inserts it: the table's columns, `ts` as `DateTime`'s seconds.
#[derive(clickhouse::Row, serde::Serialize, serde::Deserialize)]
pub struct BrokerRow<'a> {
    pub id: u64,
    pub partition: u32,
    pub offset: u64,
    pub user_id: u64,
    pub ts: u32,
    #[serde(borrow)]
    pub payload: &'a str,
}
