//! `auto_add_columns`: stream columns missing from the table are added to it when the session
//! starts (Kafka Connect's `auto.evolve`), on every shard, with the stream type's natural
//! column type ([`crate::encode::chtype::column_type_to_add`]).
//!
//! 18.16 has no `ADD COLUMN IF NOT EXISTS` (measured: a syntax error), and a replicated table
//! takes an `ALTER` on one replica and replays it on the others through ZooKeeper, where the
//! same `ALTER` sent to a second replica would add the column twice. So each shard's first host
//! that answers gets one `ALTER TABLE ... ADD COLUMN` per missing column, and the start waits
//! until every host of the shard shows them (the session then checks the schema is identical
//! on every host, as always). The exactly-once classes refuse the parameter at validation
//! ([`crate::config::params`]): an added column changes the INSERT of batches already sealed.

use std::time::Duration;

use flow_core::StreamSchema;
use tracing::info;

use crate::config::params::SinkParams;
use crate::encode::chtype::column_type_to_add;
use crate::server::classify::ClassifiedError;
use crate::server::client::{quote_ident, quote_table, ShardClients};
use crate::server::columns_guard::{read_columns, ColumnsGuard};

/// How often the start looks whether the replicas of a shard took an added column.
const REPLICA_POLL: Duration = Duration::from_millis(200);

/// Adds `stream`'s columns missing from the table on every shard of `shards` and waits until
/// every host of each shows them (at most `timeout` per host). A shard none of whose hosts
/// answers is left to the session's checks.
pub async fn add_missing_columns(
    shards: &[ShardClients],
    params: &SinkParams,
    stream: &StreamSchema,
    timeout: Duration,
) -> Result<(), ClassifiedError> {
    let sql = ColumnsGuard::system_columns_query(&params.database, &params.table);
    let table = quote_table(&params.database, &params.table);
    for shard in shards {
        let mut first = None;
        for endpoint in &shard.endpoints {
            if let Ok(columns) = read_columns(endpoint, &sql, timeout).await {
                first = Some((endpoint, columns));
                break;
            }
        }
        let Some((endpoint, columns)) = first else {
            continue;
        };
        let missing: Vec<_> = stream
            .columns()
            .iter()
            .filter(|c| !columns.iter().any(|t| t.name == c.name))
            .collect();
        if missing.is_empty() {
            continue;
        }
        for column in &missing {
            let ty = column_type_to_add(&column.ty);
            endpoint
                .execute(
                    &format!(
                        "ALTER TABLE {table} ADD COLUMN {} {ty}",
                        quote_ident(&column.name)
                    ),
                    timeout,
                )
                .await?;
            info!(
                database = %params.database,
                table = %params.table,
                shard = %shard.name,
                host = %endpoint.endpoint,
                column = %column.name,
                column_type = %ty,
                "auto_add_columns: added a stream column missing from the table"
            );
        }
        for replica in &shard.endpoints {
            let deadline = tokio::time::Instant::now() + timeout;
            loop {
                // A host that does not answer is left to the session's late-host checks.
                let Ok(columns) = read_columns(replica, &sql, timeout).await else {
                    break;
                };
                if missing
                    .iter()
                    .all(|m| columns.iter().any(|t| t.name == m.name))
                {
                    break;
                }
                if tokio::time::Instant::now() >= deadline {
                    return Err(ClassifiedError::network(format!(
                        "auto_add_columns: host {} has not taken the columns added on {} within {}; check its replication queue (system.replication_queue)",
                        replica.endpoint,
                        endpoint.endpoint,
                        humantime::format_duration(timeout)
                    )));
                }
                tokio::time::sleep(REPLICA_POLL).await;
            }
        }
    }
    Ok(())
}
