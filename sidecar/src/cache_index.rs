//! What each worker's prefix cache holds, from its WorkerControl.CacheEvents stream: the hashes of
//! the blocks it has cached, kept by one task per worker that subscribes, takes the snapshot, then
//! applies each batch in order. A gap in the numbering, a broken stream or a restarted worker starts
//! it over from a new snapshot; meanwhile the view is empty and not live, so routing treats the
//! worker as holding nothing (as load-based routing does), never as holding blocks it evicted.

use std::collections::HashSet;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use crate::pool::Worker;
use crate::proto::worker_control_client::WorkerControlClient;
use crate::proto::{CacheEventBatch, CacheEventsRequest};

/// A block's name: sha256 over its parent's name and its token ids (see the proto).
pub type BlockHash = [u8; 32];

#[derive(Default)]
pub struct CacheView {
    inner: RwLock<View>,
}

#[derive(Default)]
struct View {
    blocks: HashSet<BlockHash>,
    sequence: u64,
    live: bool,
}

impl CacheView {
    /// Applies one batch; false when it does not follow the last one (the view is then cleared and
    /// the caller subscribes again).
    pub fn apply(&self, worker: &str, batch: CacheEventBatch) -> bool {
        let mut view = self.inner.write().unwrap();
        let follows = batch.snapshot || (view.live && batch.sequence == view.sequence + 1);
        if follows {
            if batch.snapshot {
                view.blocks.clear();
                view.live = true;
            }
            for hash in &batch.removed {
                if let Ok(hash) = BlockHash::try_from(hash.as_slice()) {
                    view.blocks.remove(&hash);
                }
            }
            view.blocks.extend(batch.stored.iter().filter_map(|b| BlockHash::try_from(b.hash.as_slice()).ok()));
            view.sequence = batch.sequence;
        } else {
            *view = View::default();
        }
        publish(worker, &view);
        follows
    }

    /// How many leading blocks of a request's chain the worker holds.
    pub fn prefix_blocks(&self, chain: &[BlockHash]) -> usize {
        let view = self.inner.read().unwrap();
        chain.iter().take_while(|hash| view.blocks.contains(*hash)).count()
    }

    /// Forgets everything: the stream is down, so what the worker holds is unknown.
    pub fn reset(&self, worker: &str) {
        let mut view = self.inner.write().unwrap();
        *view = View::default();
        publish(worker, &view);
    }

    pub fn is_live(&self) -> bool {
        self.inner.read().unwrap().live
    }
}

fn publish(worker: &str, view: &View) {
    metrics::gauge!("cyllm_sidecar_prefix_index_blocks", "worker" => worker.to_string()).set(view.blocks.len() as f64);
    metrics::gauge!("cyllm_sidecar_cache_events_live", "worker" => worker.to_string()).set(if view.live { 1.0 } else { 0.0 });
}

/// Follows a worker's cache events for as long as the process runs.
pub async fn follow(worker: Arc<Worker>, max_bytes: usize) {
    let mut control = WorkerControlClient::new(worker.channel.clone()).max_decoding_message_size(max_bytes);
    let mut backoff = Duration::from_millis(250);
    loop {
        if !worker.is_ready() {
            tokio::time::sleep(Duration::from_millis(250)).await; // loading, or gone: no cache to follow
            continue;
        }
        let reason = match follow_once(&worker, &mut control).await {
            Ok(()) => "stream_ended",
            Err(status) if status.code() == tonic::Code::Unimplemented => {
                // An engine without events (vllm, transformers, ...): routed by load. Asked again
                // now and then, in case another engine takes the socket.
                worker.cache.reset(&worker.name);
                tokio::time::sleep(Duration::from_secs(30)).await;
                continue;
            }
            Err(status) if status.code() == tonic::Code::DataLoss => "gap",
            Err(status) if status.code() == tonic::Code::OutOfRange => {
                // Over --cache-event-max-bytes: an operator's limit, so it is said loudly.
                tracing::warn!(worker = %worker.name, %status, "cache events too large; routed by load");
                "too_large"
            }
            Err(status) => {
                tracing::debug!(worker = %worker.name, %status, "cache events stream ended");
                "error"
            }
        };
        // A stream that was followed (or one batch lost) is tried again soon; one that never came
        // up, less and less often.
        backoff = if worker.cache.is_live() || reason == "gap" { Duration::from_millis(250) } else { (backoff * 2).min(Duration::from_secs(5)) };
        worker.cache.reset(&worker.name);
        metrics::counter!("cyllm_sidecar_cache_event_resyncs_total", "worker" => worker.name.clone(), "reason" => reason)
            .increment(1);
        tokio::time::sleep(backoff).await;
    }
}

async fn follow_once(worker: &Worker, control: &mut WorkerControlClient<tonic::transport::Channel>) -> Result<(), tonic::Status> {
    let mut stream = control.cache_events(CacheEventsRequest {}).await?.into_inner();
    while let Some(batch) = stream.message().await? {
        if !worker.cache.apply(&worker.name, batch) {
            return Err(tonic::Status::data_loss("a cache event batch is missing"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::CachedBlock;

    fn batch(sequence: u64, snapshot: bool, stored: &[u8], removed: &[u8]) -> CacheEventBatch {
        CacheEventBatch {
            sequence,
            snapshot,
            block_size: 16,
            stored: stored.iter().map(|&b| CachedBlock { hash: vec![b; 32], ..Default::default() }).collect(),
            removed: removed.iter().map(|&b| vec![b; 32]).collect(),
        }
    }

    #[test]
    fn a_view_follows_snapshot_and_batches_and_drops_everything_on_a_gap() {
        let view = CacheView::default();
        let chain = [[1u8; 32], [2; 32], [3; 32]];
        assert_eq!(view.prefix_blocks(&chain), 0);
        assert!(!view.apply("w0", batch(4, false, &[1], &[])), "nothing before a snapshot");
        assert!(view.apply("w0", batch(4, true, &[1, 2, 9], &[])));
        assert_eq!(view.prefix_blocks(&chain), 2);
        assert!(view.apply("w0", batch(5, false, &[3], &[9])));
        assert_eq!(view.prefix_blocks(&chain), 3);
        assert!(view.apply("w0", batch(6, false, &[], &[2])));
        assert_eq!(view.prefix_blocks(&chain), 1, "a prefix ends at the first block not held");
        assert!(!view.apply("w0", batch(8, false, &[2], &[])), "7 is missing");
        assert_eq!(view.prefix_blocks(&chain), 0);
        assert!(view.apply("w0", batch(8, true, &[1], &[])));
        view.reset("w0");
        assert_eq!(view.prefix_blocks(&chain), 0);
    }
}
