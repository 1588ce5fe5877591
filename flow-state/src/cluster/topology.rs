//! The pipeline's topology as the cluster records it: `<root>/<pipeline>/topology` (persistent;
//! data `partitions=<N>`), written by the first worker that joins. A state directory refuses a
//! spec with another partition count (`StateStore::claim`); in a cluster the workers' own
//! directories are caches, so the cluster refuses it: a worker with fewer partitions would take
//! partitions of the others' state and read messages they had already written (tried on
//! `acbb5bf`: 484 generator ids twice on both shards).

use zookeeper_client as zk;

use super::error::ClusterError;
use super::paths;
use super::session::Cluster;

impl Cluster {
    /// Records `partitions` as the pipeline's partition count, or checks it against the one
    /// recorded; a different one is refused ([`ClusterError::PartitionsDiffer`]) before the
    /// worker joins the members.
    pub async fn agree_on_partitions(
        &self,
        pipeline: &str,
        partitions: u32,
    ) -> Result<(), ClusterError> {
        paths::check_name("pipeline name", pipeline)?;
        let root = self.url().root();
        self.make_dir(&paths::pipeline_dir(root, pipeline)).await?;
        let path = paths::topology(root, pipeline);
        let ours = format!("partitions={partitions}");
        let options = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
        loop {
            match self.client.create(&path, ours.as_bytes(), &options).await {
                Ok(_) => return Ok(()),
                Err(zk::Error::NodeExists) => match self.client.get_data(&path).await {
                    Ok((data, _)) => return compare(pipeline, &path, &data, partitions),
                    // Deleted since: create it again.
                    Err(zk::Error::NoNode) => {}
                    Err(error) => self.recover("get", &path, error).await?,
                },
                Err(error) => self.recover("create", &path, error).await?,
            }
        }
    }
}

/// The recorded topology `data` against this worker's `partitions`.
fn compare(pipeline: &str, path: &str, data: &[u8], partitions: u32) -> Result<(), ClusterError> {
    let recorded = String::from_utf8_lossy(data).into_owned();
    if recorded == format!("partitions={partitions}") {
        return Ok(());
    }
    Err(ClusterError::PartitionsDiffer {
        pipeline: pipeline.to_owned(),
        path: path.to_owned(),
        recorded,
        partitions,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_same_partition_count_is_accepted_and_a_refusal_shows_both() {
        assert!(compare("orders", "/flow/orders/topology", b"partitions=4", 4).is_ok());
        let refused = compare("orders", "/flow/orders/topology", b"partitions=4", 2);
        assert_eq!(
            refused.map_err(|e| e.to_string()),
            Err("pipeline \"orders\" runs with partitions=4 in this cluster (/flow/orders/topology) \
                 but this worker's spec says partitions: 2; a worker with another partition count \
                 would read what the others have already written. Give every worker the same \
                 `partitions`; to change it, stop every worker, deliver what is pending (`flow-worker \
                 drain --cluster`), and use a new cluster path or pipeline name"
                .to_owned())
        );
    }
}
