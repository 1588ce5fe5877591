//! Checks that the local cluster (`scripts/cluster.sh up`) behaves as the rest of the tests assume.
//! These tests fail, not skip, when the cluster is not running.

use std::time::Duration;

use anyhow::Result;
use flow_integration::*;

const COLUMNS: &str = "id UInt64, payload String";

#[test]
fn every_node_has_its_macros() -> Result<()> {
    require_cluster()?;
    for node in NODES {
        let macros = query_text(
            node.http_port,
            "SELECT macro, substitution FROM system.macros ORDER BY macro FORMAT TSV",
        )?;
        assert_eq!(
            macros,
            format!("replica\t{}\nshard\t{}\n", node.name, node.shard),
            "macros of {}",
            node.name
        );
    }
    Ok(())
}

#[test]
fn replicates_within_a_shard() -> Result<()> {
    require_cluster()?;
    let name = unique_name("it_repl");
    let t = ReplicatedTable::create("default", &name, COLUMNS, "id", &SHARD_A)?;
    exec(
        A1.http_port,
        &format!(
            "INSERT INTO {} VALUES (1, 'x'), (2, 'y'), (3, 'z')",
            t.qualified()
        ),
    )?;
    sync_replica(A2.http_port, &t.qualified())?;
    assert_eq!(
        query_u64(
            A2.http_port,
            &format!("SELECT count() FROM {}", t.qualified())
        )?,
        3
    );
    assert_eq!(
        query_text(
            A2.http_port,
            &format!("SELECT id, payload FROM {} ORDER BY id", t.qualified())
        )?,
        "1\tx\n2\ty\n3\tz\n"
    );
    // And the other way round.
    exec(
        A2.http_port,
        &format!("INSERT INTO {} VALUES (4, 'w')", t.qualified()),
    )?;
    sync_replica(A1.http_port, &t.qualified())?;
    assert_eq!(
        query_u64(
            A1.http_port,
            &format!("SELECT count() FROM {}", t.qualified())
        )?,
        4
    );
    Ok(())
}

#[test]
fn shards_are_independent() -> Result<()> {
    require_cluster()?;
    let name = unique_name("it_shards");
    // Same zk path pattern everywhere; `{shard}` expands to a or b.
    let t = ReplicatedTable::create("default", &name, COLUMNS, "id", &NODES)?;
    let q = t.qualified();
    exec(
        A1.http_port,
        &format!("INSERT INTO {q} SELECT number, 'a' FROM numbers(10)"),
    )?;
    exec(
        B1.http_port,
        &format!("INSERT INTO {q} SELECT number + 100, 'b' FROM numbers(7)"),
    )?;
    for node in NODES {
        sync_replica(node.http_port, &q)?;
    }
    for node in SHARD_A {
        assert_eq!(
            query_u64(node.http_port, &format!("SELECT count() FROM {q}"))?,
            10,
            "{}",
            node.name
        );
        assert_eq!(
            query_u64(
                node.http_port,
                &format!("SELECT count() FROM {q} WHERE payload = 'b'")
            )?,
            0,
            "{} sees shard b's rows",
            node.name
        );
    }
    for node in SHARD_B {
        assert_eq!(
            query_u64(node.http_port, &format!("SELECT count() FROM {q}"))?,
            7,
            "{}",
            node.name
        );
    }
    let paths = query_text(
        A1.http_port,
        &format!("SELECT zookeeper_path FROM system.replicas WHERE table = '{name}'"),
    )?;
    assert_eq!(paths.trim(), format!("/clickhouse/tables/a/default.{name}"));
    Ok(())
}

#[test]
fn identical_block_is_deduplicated() -> Result<()> {
    require_cluster()?;
    let name = unique_name("it_dedup");
    let t = ReplicatedTable::create("default", &name, COLUMNS, "id", &SHARD_A)?;
    let q = t.qualified();
    let block = "1\tone\n2\ttwo\n3\tthree\n";
    let insert = format!("INSERT INTO {q} (id, payload) FORMAT TabSeparated");
    insert_formatted(A1.http_port, &insert, block.as_bytes())?;
    insert_formatted(A1.http_port, &insert, block.as_bytes())?;
    // Through the other replica too: deduplication is per table, in ZooKeeper.
    insert_formatted(A2.http_port, &insert, block.as_bytes())?;
    for node in SHARD_A {
        sync_replica(node.http_port, &q)?;
        assert_eq!(
            query_u64(node.http_port, &format!("SELECT count() FROM {q}"))?,
            3,
            "{}",
            node.name
        );
    }
    // A different block is not deduplicated.
    insert_formatted(A1.http_port, &insert, b"4\tfour\n")?;
    sync_replica(A2.http_port, &q)?;
    assert_eq!(
        query_u64(A2.http_port, &format!("SELECT count() FROM {q}"))?,
        4
    );
    Ok(())
}

#[test]
fn distributed_table_spans_both_shards() -> Result<()> {
    require_cluster()?;
    let name = unique_name("it_dist");
    let t = ReplicatedTable::create("default", &name, COLUMNS, "id", &NODES)?;
    let dist = format!("{name}_all");
    exec(
        A1.http_port,
        &format!("CREATE TABLE default.{dist} AS {} ENGINE = Distributed({CLUSTER_NAME}, default, {name}, id)", t.qualified()),
    )?;
    let counted = (|| -> Result<u64> {
        exec(
            A1.http_port,
            &format!(
                "INSERT INTO {} SELECT number, 'a' FROM numbers(5)",
                t.qualified()
            ),
        )?;
        exec(
            B2.http_port,
            &format!(
                "INSERT INTO {} SELECT number + 5, 'b' FROM numbers(6)",
                t.qualified()
            ),
        )?;
        // The Distributed table reads one replica per shard (any of them): let all catch up first.
        for node in NODES {
            sync_replica(node.http_port, &t.qualified())?;
        }
        query_u64(A1.http_port, &format!("SELECT count() FROM default.{dist}"))
    })();
    exec(
        A1.http_port,
        &format!("DROP TABLE IF EXISTS default.{dist}"),
    )?;
    assert_eq!(counted?, 11);
    Ok(())
}

#[test]
fn users_and_passwords() -> Result<()> {
    require_cluster()?;
    let ok = query_raw_as(A1.http_port, SECRET_USER, SECRET_PASSWORD, "SELECT 1")?;
    assert_eq!((ok.status, ok.text().as_str()), (200, "1\n"));
    let bad = query_raw_as(A1.http_port, SECRET_USER, "wrong", "SELECT 1")?;
    assert_ne!(bad.status, 200);
    assert_eq!(bad.error_code(), Some(193), "{}", bad.text());
    Ok(())
}

#[test]
fn missing_table_is_code_60() -> Result<()> {
    require_cluster()?;
    let reply = query_raw(
        B1.http_port,
        &format!("SELECT * FROM default.{}", unique_name("nope")),
    )?;
    assert_eq!(reply.status, 404);
    assert_eq!(reply.error_code(), Some(60));
    Ok(())
}

#[test]
fn status_reports_every_node_running() -> Result<()> {
    require_cluster()?;
    let status = cluster_sh(&["status"])?;
    for node in ["zk", "a1", "a2", "b1", "b2"] {
        let line = status
            .lines()
            .find(|l| l.split_whitespace().next() == Some(node))
            .unwrap_or_else(|| panic!("no line for {node} in:\n{status}"));
        assert!(line.contains("running"), "{line}");
    }
    // Waiting helper sanity check.
    wait_until(Duration::from_secs(5), || Ok(cluster_available()))?;
    Ok(())
}
