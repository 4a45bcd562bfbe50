//! cache-aware routing: a request goes to the worker whose prefix cache holds the longest prefix
//! of it, unless that worker is much busier than the least busy one (then load decides, as it does
//! when no worker holds enough of it). The request's block names come from one worker
//! (WorkerControl.PrefixHashes: its own chat template and tokenizer, so they are the names its
//! cache uses); what each worker holds, from the index (cache_index.rs).

use std::sync::Arc;
use std::time::Duration;

use crate::cache_index::BlockHash;
use crate::config::Args;
use crate::pool::Worker;
use crate::proto::worker_control_client::WorkerControlClient;
use crate::proto::PredictRequest;

/// A worker slower than this to name the blocks costs the request its cache-aware choice, not time.
const NAMING_TIMEOUT: Duration = Duration::from_millis(250);

#[derive(Clone, Copy)]
pub struct CachePolicy {
    min_match: f64,
    balance_abs: u64,
    balance_ratio: f64,
}

impl CachePolicy {
    pub fn from_args(args: &Args) -> Self {
        Self { min_match: args.cache_min_match, balance_abs: args.cache_balance_abs, balance_ratio: args.cache_balance_ratio }
    }

    /// The worker to try first and why; None leaves the choice to load. Counted by reason.
    pub async fn choose(&self, candidates: &[Arc<Worker>], request: &PredictRequest) -> Option<Arc<Worker>> {
        let (choice, reason, tokens) = self.decide(candidates, request).await;
        metrics::counter!("cyllm_sidecar_routing_decisions_total", "reason" => reason).increment(1);
        metrics::counter!("cyllm_sidecar_predicted_prefix_hit_tokens_total").increment(tokens);
        choice
    }

    async fn decide(&self, candidates: &[Arc<Worker>], request: &PredictRequest) -> (Option<Arc<Worker>>, &'static str, u64) {
        let followed: Vec<&Arc<Worker>> = candidates.iter().filter(|w| w.cache.is_live()).collect();
        let Some(namer) = followed.iter().min_by_key(|w| w.load()) else { return (None, "no_index", 0) };
        if !request.adapter.is_empty() {
            return (None, "adapter", 0);
        }
        let mut control = WorkerControlClient::new(namer.channel.clone());
        let reply = match tokio::time::timeout(NAMING_TIMEOUT, control.prefix_hashes(request.clone())).await {
            Ok(Ok(reply)) => reply.into_inner(),
            _ => return (None, "no_names", 0),
        };
        let chain: Vec<BlockHash> = reply.hashes.iter().filter_map(|h| BlockHash::try_from(h.as_slice()).ok()).collect();
        if chain.is_empty() {
            return (None, "short_prompt", 0);
        }
        let least = candidates.iter().map(|w| w.load()).min().unwrap_or(0);
        let balanced = |w: &Worker| {
            let load = w.load();
            load <= least + self.balance_abs || (load as f64) <= least as f64 * self.balance_ratio
        };
        let best = followed.iter().map(|w| (w.cache.prefix_blocks(&chain), *w)).filter(|(held, _)| *held > 0)
            .max_by_key(|(held, w)| (*held, std::cmp::Reverse(w.load())));
        match best {
            Some((held, worker)) if (held as f64) >= self.min_match * chain.len() as f64 => {
                if balanced(worker) {
                    (Some(worker.clone()), "cache_hit", held as u64 * u64::from(reply.block_size))
                } else {
                    (None, "imbalance", 0)
                }
            }
            _ => (None, "cache_miss", 0),
        }
    }
}
