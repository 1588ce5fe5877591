//! Which live member should own which partition: rendezvous (highest-random-weight) hashing.
//!
//! `score(member, partition) = xxh64(partition as u32 LE, seed = xxh64(member id, 0))`; a
//! partition goes to its highest-scoring member that still has room (see `owner_indexes`). Every
//! worker computes the same answer from the same member set; the spread is even (loads differ by
//! at most one), and a join or leave moves the partitions that the joining member takes or the
//! leaving member held, plus a few that the changed capacities shift (8 partitions, 3 -> 4
//! members: 3 move, 2 of them to the new member).

use std::collections::BTreeSet;

use xxhash_rust::xxh64::xxh64;

/// The partitions (of `0..partitions`) that `me` should own among `members`; empty when `me` is
/// not a member.
pub fn assigned(members: &BTreeSet<String>, partitions: u32, me: &str) -> BTreeSet<u32> {
    let Some(mine) = members.iter().position(|member| member == me) else {
        return BTreeSet::new();
    };
    owner_indexes(members, partitions)
        .into_iter()
        .zip(0..)
        .filter(|&(owner, _)| owner == mine)
        .map(|(_, partition)| partition)
        .collect()
}

/// For each partition of `0..partitions` (the index), the member that should own it; empty
/// without members.
pub fn assignment(members: &BTreeSet<String>, partitions: u32) -> Vec<&str> {
    let ids: Vec<&str> = members.iter().map(String::as_str).collect();
    // Every partition gets an owner (the capacities add up to the partition count), so each
    // index is one of `ids`.
    owner_indexes(members, partitions)
        .into_iter()
        .map(|owner| ids[owner])
        .collect()
}

/// For each partition, the index (in id order) of the member that owns it.
///
/// Pure highest-score-wins leaves a few partitions spread unevenly (8 partitions over 3
/// members can fall 5/3/0, and the slowest member bounds the pipeline), so each member has a
/// capacity: `partitions / members`, one more for the first `partitions % members` members to
/// fill up. (member, partition) pairs are taken by score, highest first, and a pair is kept when
/// the partition has no owner yet and the member has room. A partition whose best member is
/// full goes to its next best, so a join or leave moves the partitions it must and, through the
/// changed capacities, only a few more.
fn owner_indexes(members: &BTreeSet<String>, partitions: u32) -> Vec<usize> {
    let seeds: Vec<u64> = members
        .iter()
        .map(|member| xxh64(member.as_bytes(), 0))
        .collect();
    if seeds.is_empty() {
        return Vec::new();
    }
    let mut owner = vec![usize::MAX; partitions as usize];
    let mut pairs: Vec<(u64, usize, u32)> = (0..partitions)
        .flat_map(|partition| {
            let key = partition.to_le_bytes();
            seeds
                .iter()
                .enumerate()
                .map(move |(member, &seed)| (xxh64(&key, seed), member, partition))
        })
        .collect();
    // Highest score first; equal scores go to the smaller id, then the smaller partition.
    pairs.sort_unstable_by(|x, y| y.0.cmp(&x.0).then(x.1.cmp(&y.1)).then(x.2.cmp(&y.2)));
    let count = seeds.len() as u32;
    let (base, mut extra) = (partitions / count, partitions % count);
    let mut load = vec![0u32; seeds.len()];
    for (_, member, partition) in pairs {
        let slot = &mut owner[partition as usize];
        if *slot != usize::MAX {
            continue;
        }
        if load[member] < base || (load[member] == base && extra > 0) {
            if load[member] == base {
                extra -= 1;
            }
            load[member] += 1;
            *slot = member;
        }
    }
    owner
}

#[cfg(test)]
mod tests {
    use super::*;

    fn workers(count: usize) -> BTreeSet<String> {
        (1..=count).map(|i| format!("worker-{i}")).collect()
    }

    /// partition -> owner, for every partition.
    fn owners(members: &BTreeSet<String>, partitions: u32) -> Vec<String> {
        assignment(members, partitions)
            .into_iter()
            .map(str::to_owned)
            .collect()
    }

    /// (partitions that moved, those of them that moved to or from `member`).
    fn moves(before: &[String], after: &[String], member: &str) -> (usize, usize) {
        let moved: Vec<usize> = (0..before.len())
            .filter(|&p| before[p] != after[p])
            .collect();
        let with = moved
            .iter()
            .filter(|&&p| before[p] == member || after[p] == member)
            .count();
        (moved.len(), with)
    }

    fn loads(members: &BTreeSet<String>, partitions: u32) -> Vec<usize> {
        members
            .iter()
            .map(|id| assigned(members, partitions, id).len())
            .collect()
    }

    #[test]
    fn every_partition_has_exactly_one_owner_and_assigned_agrees_with_assignment() {
        let set = workers(3);
        let all = assignment(&set, 64);
        assert_eq!(all.len(), 64);
        let mut seen = BTreeSet::new();
        for id in &set {
            for p in assigned(&set, 64, id) {
                assert_eq!(all[p as usize], id.as_str());
                assert!(seen.insert(p), "partition {p} assigned twice");
            }
        }
        assert_eq!(seen, (0..64).collect::<BTreeSet<u32>>());
    }

    #[test]
    fn an_uncontended_partition_goes_to_the_highest_score_xxh64_seeded_by_the_member_hash() {
        // One partition: no capacity binds, so the owner is the plain rendezvous winner.
        for first in 0..200 {
            let ids = [
                format!("a{first}"),
                format!("b{first}"),
                format!("c{first}"),
            ];
            let set: BTreeSet<String> = ids.iter().cloned().collect();
            let expected = ids
                .iter()
                .map(|id| {
                    (
                        xxh64(&0u32.to_le_bytes(), xxh64(id.as_bytes(), 0)),
                        id.as_str(),
                    )
                })
                .max_by(|x, y| x.0.cmp(&y.0).then(y.1.cmp(x.1)))
                .map(|(_, id)| id);
            assert_eq!(
                assignment(&set, 1).first().copied(),
                expected,
                "members {ids:?}"
            );
        }
    }

    #[test]
    fn the_spread_is_even() {
        assert_eq!(loads(&workers(3), 8), vec![2, 3, 3]);
        assert_eq!(loads(&workers(4), 8), vec![2, 2, 2, 2]);
        assert_eq!(loads(&workers(3), 1_000), vec![333, 334, 333]);
        for partitions in 1..40 {
            for count in 1..7 {
                let loads = loads(&workers(count), partitions);
                let (min, max) = (loads.iter().min(), loads.iter().max());
                assert!(
                    max.zip(min).is_some_and(|(max, min)| max - min <= 1),
                    "{partitions} partitions over {count} members: {loads:?}"
                );
            }
        }
    }

    #[test]
    fn a_join_moves_the_partitions_the_new_member_takes_and_few_more() {
        let (three, four) = (workers(3), workers(4));
        // 8 partitions: worker-4 takes 2; one more moves between the others (3/3/2 -> 2/2/2/2).
        let (moved, to_new) = moves(&owners(&three, 8), &owners(&four, 8), "worker-4");
        assert_eq!((moved, to_new), (3, 2));
        let (moved, to_new) = moves(&owners(&three, 1_000), &owners(&four, 1_000), "worker-4");
        assert_eq!((moved, to_new), (257, 250));
    }

    #[test]
    fn a_leave_moves_the_partitions_the_leaver_held_and_few_more() {
        let four = workers(4);
        let mut three = four.clone();
        three.remove("worker-1");
        let (moved, from_leaver) = moves(&owners(&four, 8), &owners(&three, 8), "worker-1");
        assert_eq!((moved, from_leaver), (2, 2));
        let (moved, from_leaver) = moves(&owners(&four, 1_000), &owners(&three, 1_000), "worker-1");
        assert_eq!((moved, from_leaver), (263, 250));
    }

    #[test]
    fn no_members_own_nothing_and_a_stranger_is_assigned_nothing() {
        assert!(assignment(&BTreeSet::new(), 8).is_empty());
        assert!(assigned(&workers(1), 8, "worker-2").is_empty());
        assert_eq!(assigned(&workers(1), 4, "worker-1"), (0..4).collect());
    }
}
