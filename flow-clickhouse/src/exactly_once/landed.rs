//! Pending parts that may have landed under other columns (issue 24, item 2).
//!
//! Without `insert_deduplication_token` (18.16) a resend is recognised only as the bit-identical
//! block of the first attempt. When the table's columns changed while a part was being inserted
//! (an `ADD COLUMN ... DEFAULT 0` racing the INSERT), the part may be stored with the extra column;
//! once the change is reverted, the same part is a different block and a resend lands it twice
//! (65,000 rows for 60,000 ids). Such a part is marked in the state store
//! ([`changed_marker`]), and before it is sent again the replicas of its shard are asked whether
//! its message ids are there ([`presence_queries`], [`decide`]): all of them: it is acknowledged
//! without a resend; none: it is sent; some: the sink stops with the query to run. A sink without
//! `message_id_column` cannot ask, and stops with the check to run by hand ([`no_id_column`]).

use flow_state::SealedBatch;

use crate::delivery::insert::attempt_query_id;
use crate::encode::compress::unframe;
use crate::encode::row_spans::{row_json, RowSpans};
use crate::server::client::{json_u64, quote_ident, quote_literal, quote_table};
use crate::server::session::WriterSession;

/// The sink value marking pending entry `seq` of `partition` as sent while the table's columns
/// changed: it may be in the table under other columns.
pub fn changed_marker(partition: u32, seq: u64) -> String {
    format!("changed/{partition}/{seq}")
}

/// The prefix of every such mark of `partition`.
pub fn changed_prefix(partition: u32) -> String {
    format!("changed/{partition}/")
}

/// How many ids one presence query names: its text stays far below the server's
/// `max_query_size` (256 KiB) even for 20-digit ids.
const IDS_PER_QUERY: usize = 1_000;

/// The values of `column` in the part's rows, sorted; an error names the row that cannot be read.
pub fn part_ids(
    session: &WriterSession,
    batch: &SealedBatch,
    column: &str,
) -> Result<Vec<i128>, String> {
    let rows = unframe(&batch.format, &batch.payload).map_err(|err| err.to_string())?;
    // Read with the plan it was encoded with: one sealed before a widening has the narrower
    // columns.
    let plan = session
        .plan_before_widening(&batch.plan)
        .unwrap_or_else(|| session.plan());
    let columns = plan.encoder.columns();
    let spans = RowSpans::parse(columns, &rows).map_err(|err| err.to_string())?;
    let mut ids = Vec::with_capacity(spans.rows());
    for index in 0..spans.rows() {
        let row = row_json(columns, &rows[spans.bytes(index, index + 1)])
            .map_err(|err| err.to_string())?;
        let value = row.get(column);
        let id = value
            .and_then(|v| v.as_u64().map(i128::from).or(v.as_i64().map(i128::from)))
            .ok_or_else(|| format!("row {index} has no integer `{column}` (value {value:?})"))?;
        ids.push(id);
    }
    ids.sort_unstable();
    Ok(ids)
}

/// The query counting the attempts of the part with `token` a replica is still running
/// ([`attempt_query_id`]): answered as `running`.
pub fn running_attempts_query(token: &str) -> String {
    format!(
        "SELECT count() AS running FROM system.processes WHERE query_id = {}",
        quote_literal(&attempt_query_id(token))
    )
}

/// The queries that count, on one replica, the rows holding the part's `ids` (sorted) and the
/// distinct ids among them: one per [`IDS_PER_QUERY`] ids, each bounded by `BETWEEN` (so the
/// primary key prunes) and, unless its ids are a gapless run, listing them with `IN`. The
/// answers add up: the chunks hold disjoint ids.
pub fn presence_queries(database: &str, table: &str, column: &str, ids: &[i128]) -> Vec<String> {
    let table = quote_table(database, table);
    let column = quote_ident(column);
    ids.chunks(IDS_PER_QUERY)
        .filter_map(|chunk| {
            let (first, last) = (*chunk.first()?, *chunk.last()?);
            let gapless = last - first + 1 == chunk.len() as i128
                && chunk.windows(2).all(|pair| pair[0] != pair[1]);
            let listed = if gapless {
                String::new()
            } else {
                let list: Vec<String> = chunk.iter().map(i128::to_string).collect();
                format!(" AND {column} IN ({})", list.join(", "))
            };
            Some(format!(
                "SELECT count() AS rows, uniqExact({column}) AS distinct_ids FROM {table} WHERE {column} BETWEEN {first} AND {last}{listed}"
            ))
        })
        .collect()
}

/// What one replica holds of a part's ids.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Presence {
    /// Rows holding one of the ids.
    pub rows: u64,
    /// Distinct ids among them.
    pub distinct: u64,
}

impl Presence {
    /// What a replica holding the part exactly once holds: its rows, and its distinct `ids`
    /// (sorted).
    pub fn of_part(ids: &[i128]) -> Presence {
        let distinct = 1 + ids.windows(2).filter(|pair| pair[0] != pair[1]).count();
        Presence {
            rows: ids.len() as u64,
            distinct: if ids.is_empty() { 0 } else { distinct as u64 },
        }
    }

    /// Adds one presence query's answer row (`rows`, `distinct_ids`).
    pub fn add(&mut self, row: &serde_json::Map<String, serde_json::Value>) -> Option<()> {
        self.rows += json_u64(row, "rows")?;
        self.distinct += json_u64(row, "distinct_ids")?;
        Some(())
    }
}

/// One replica's answer: its host and what it holds, or why it could not tell.
pub type ReplicaAnswer = (String, Result<Presence, String>);

/// Whether a part's ids are in the table, from the answers of every replica of its shard.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Every id of the part, once, on `host` (the others receive it by replication).
    Landed { host: String },
    /// No replica holds any of its ids: it is sent.
    Absent,
    /// `host` holds some of its ids, or some of them more than once: the sink stops.
    Partly { host: String, presence: Presence },
    /// No replica holds any id so far, but `host` did not answer: it may hold the part not yet
    /// replicated, so the check is repeated.
    Unanswered { host: String, error: String },
}

/// The decision for a part that a replica holding it once shows as `part` ([`Presence::of_part`];
/// see [`Verdict`]): a partial or doubled presence anywhere stops; else a complete one on any
/// replica means landed; else every replica must answer before the part counts as absent.
pub fn decide(part: Presence, answers: &[ReplicaAnswer]) -> Verdict {
    let answered = || {
        answers
            .iter()
            .filter_map(|(host, answer)| Some((host, *answer.as_ref().ok()?)))
    };
    let complete = |p: &Presence| *p == part;
    if let Some((host, presence)) =
        answered().find(|(_, p)| (p.rows > 0 || p.distinct > 0) && !complete(p))
    {
        return Verdict::Partly {
            host: host.clone(),
            presence,
        };
    }
    if let Some((host, _)) = answered().find(|(_, p)| complete(p)) {
        return Verdict::Landed { host: host.clone() };
    }
    match answers
        .iter()
        .find_map(|(host, answer)| Some((host, answer.as_ref().err()?)))
    {
        Some((host, error)) => Verdict::Unanswered {
            host: host.clone(),
            error: error.clone(),
        },
        None => Verdict::Absent,
    }
}

/// What the sink says when it stops on a part of `batch` whose ids `host` holds in part: the
/// exact query and what to do after it.
pub fn partly_present(
    session: &WriterSession,
    batch: &SealedBatch,
    column: &str,
    ids: &[i128],
    host: &str,
    presence: Presence,
) -> String {
    let queries = presence_queries(&session.database, &session.table, column, ids);
    let query = match queries.as_slice() {
        [one] => one.clone(),
        [first, ..] => format!(
            "{first} (the first of {} such queries, {IDS_PER_QUERY} ids each; add up their answers)",
            queries.len()
        ),
        [] => String::new(),
    };
    format!(
        "the part with token {} ({} rows, ids {}..={} in `{column}`) was sent while the table's columns changed, and {host} holds {} row(s) with {} of its {} ids: it landed in part or more than once, which no single INSERT does. Not sent again. Check on every replica of the shard: `{query}`. Delete the rows of those ids that should not be there (`ALTER TABLE {}.{} DELETE WHERE` the same condition), then restart: a part none of whose ids is in the table is sent whole, and one whose ids are all there exactly once is acknowledged without a resend",
        batch.token,
        batch.rows,
        ids.first().copied().unwrap_or_default(),
        ids.last().copied().unwrap_or_default(),
        presence.rows,
        presence.distinct,
        ids.len(),
        session.database,
        session.table,
    )
}

/// What the sink says when it stops on such a part without `message_id_column`: the check to run
/// by hand and what to do after it.
pub fn no_id_column(session: &WriterSession, batch: &SealedBatch, partition: u32) -> String {
    let shard = if batch.shard.is_empty() {
        String::new()
    } else {
        format!(" of shard `{}`", batch.shard)
    };
    format!(
        "the part with token {} ({} rows, messages {partition}-{}..{partition}-{}) was sent while the table's columns changed, so it may be in the table under other columns, where a resend would not be recognised as a replay and would land it twice. The sink cannot check this: `message_id_column` is not set. Check on every replica{shard}: `SELECT count(), uniqExact(ID), min(ID), max(ID) FROM {}.{} WHERE ID BETWEEN <its first id> AND <its last id>`, with ID the column that carries the message id. Then set `message_id_column: ID` in the sink's parameters and restart: the sink runs this check itself, acknowledges the part if all its ids are there, sends it if none is, and stops with the query if some are",
        batch.token,
        batch.rows,
        batch.first_offset,
        batch.last_offset,
        session.database,
        session.table,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const PART: Presence = Presence {
        rows: 500,
        distinct: 500,
    };

    #[test]
    fn a_part_counts_its_rows_and_distinct_ids() {
        assert_eq!(
            Presence::of_part(&[1, 2, 2, 5]),
            Presence {
                rows: 4,
                distinct: 3
            }
        );
        assert_eq!(Presence::of_part(&[]), Presence::default());
    }

    fn answer(host: &str, rows: u64, distinct: u64) -> ReplicaAnswer {
        (host.to_owned(), Ok(Presence { rows, distinct }))
    }

    fn silent(host: &str) -> ReplicaAnswer {
        (host.to_owned(), Err("connection refused".to_owned()))
    }

    #[test]
    fn all_ids_present_once_on_a_replica_is_landed_even_while_the_other_lags() {
        assert_eq!(
            decide(PART, &[answer("a1", 500, 500), answer("a2", 500, 500)]),
            Verdict::Landed { host: "a1".into() }
        );
        assert_eq!(
            decide(PART, &[answer("a1", 0, 0), answer("a2", 500, 500)]),
            Verdict::Landed { host: "a2".into() }
        );
        // A replica that cannot answer does not matter once another holds every id.
        assert_eq!(
            decide(PART, &[silent("a1"), answer("a2", 500, 500)]),
            Verdict::Landed { host: "a2".into() }
        );
    }

    #[test]
    fn no_id_on_any_replica_is_absent_but_only_when_every_replica_answered() {
        assert_eq!(
            decide(PART, &[answer("a1", 0, 0), answer("a2", 0, 0)]),
            Verdict::Absent
        );
        assert_eq!(
            decide(PART, &[answer("a1", 0, 0), silent("a2")]),
            Verdict::Unanswered {
                host: "a2".into(),
                error: "connection refused".into()
            }
        );
    }

    #[test]
    fn some_ids_or_ids_twice_is_partly_and_wins_over_a_complete_replica() {
        assert_eq!(
            decide(PART, &[answer("a1", 0, 0), answer("a2", 200, 200)]),
            Verdict::Partly {
                host: "a2".into(),
                presence: Presence {
                    rows: 200,
                    distinct: 200
                }
            }
        );
        // Every id, but 100 of them twice: already doubled, not "landed".
        assert_eq!(
            decide(PART, &[answer("a1", 600, 500)]),
            Verdict::Partly {
                host: "a1".into(),
                presence: Presence {
                    rows: 600,
                    distinct: 500
                }
            }
        );
        assert!(matches!(
            decide(PART, &[answer("a1", 500, 500), answer("a2", 10, 10)]),
            Verdict::Partly { .. }
        ));
    }

    #[test]
    fn a_gapless_run_is_one_between_and_scattered_ids_are_listed_in_chunks() {
        let run: Vec<i128> = (100..600).collect();
        assert_eq!(
            presence_queries("default", "events", "id", &run),
            ["SELECT count() AS rows, uniqExact(`id`) AS distinct_ids FROM `default`.`events` WHERE `id` BETWEEN 100 AND 599"]
        );
        let strided: Vec<i128> = (0..3).map(|i| i * 2 + 1).collect();
        assert_eq!(
            presence_queries("default", "events", "id", &strided),
            ["SELECT count() AS rows, uniqExact(`id`) AS distinct_ids FROM `default`.`events` WHERE `id` BETWEEN 1 AND 5 AND `id` IN (1, 3, 5)"]
        );
        let many: Vec<i128> = (0..2_500).map(|i| i * 3).collect();
        let queries = presence_queries("default", "events", "id", &many);
        assert_eq!(queries.len(), 3);
        assert!(queries[2].contains("BETWEEN 6000 AND 7497 AND `id` IN (6000, 6003,"));
        assert!(queries.iter().all(|q| q.len() < 64 * 1024));
    }
}
