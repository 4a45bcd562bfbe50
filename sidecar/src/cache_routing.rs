//! cache-aware routing: a request goes to the worker where prefilling it and the requests ahead of
//! it costs least: the prompt tokens it does not hold, plus --cache-load-tokens for each request it
//! has outstanding. So a worker holding a long prefix is chosen over idle ones while what it saves
//! outweighs its queue, and a hot prefix spills to another worker, which then holds it too. A
//! worker holding at least --cache-min-match of the request's blocks but much busier than the least
//! busy one is never chosen for its cache (then load decides). A request no worker holds enough of
//! goes to its home: the worker its block at the --cache-min-match point hashes highest with
//! (rendezvous), so requests that would hit each other's cache (a shared system prompt arriving
//! cold at several at once) start on one worker instead of each filling its own, while requests
//! sharing only a short head spread. The request's block names come from one worker
//! (WorkerControl.PrefixHashes: its own chat template and tokenizer, so they are the names its
//! cache uses); what each worker holds, from the index (cache_index.rs).

use std::sync::Arc;
use std::time::Duration;

use crate::cache_index::BlockHash;
use crate::config::Args;
use crate::pool::Worker;
use crate::routing::pick;
use crate::proto::worker_control_client::WorkerControlClient;
use crate::proto::PredictRequest;

/// A worker slower than this to name the blocks costs the request its cache-aware choice, not time.
const NAMING_TIMEOUT: Duration = Duration::from_millis(250);

#[derive(Clone, Copy)]
pub struct CachePolicy {
    min_match: f64,
    balance_abs: u64,
    balance_ratio: f64,
    load_tokens: u64,
}

impl CachePolicy {
    pub fn from_args(args: &Args) -> Self {
        Self {
            min_match: args.cache_min_match,
            balance_abs: args.cache_balance_abs,
            balance_ratio: args.cache_balance_ratio,
            load_tokens: args.cache_load_tokens,
        }
    }

    /// The worker to try first and why; None leaves the choice to load. Counted by reason.
    pub async fn choose(&self, candidates: &[Arc<Worker>], request: &PredictRequest) -> Option<Arc<Worker>> {
        let (choice, reason, tokens) = self.decide(candidates, request).await;
        metrics::counter!("cyllm_sidecar_routing_decisions_total", "reason" => reason).increment(1);
        metrics::counter!("cyllm_sidecar_predicted_prefix_hit_tokens_total").increment(tokens);
        choice
    }

    async fn decide(&self, candidates: &[Arc<Worker>], request: &PredictRequest) -> (Option<Arc<Worker>>, &'static str, u64) {
        let Some(namer) = candidates.iter().filter(|w| w.cache.is_live()).min_by_key(|w| w.load()) else {
            return (None, "no_index", 0);
        };
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
        self.place(candidates, &chain, reply.block_size)
    }

    /// The choice for a request whose blocks are `chain`: (worker, reason, predicted hit tokens).
    fn place(&self, candidates: &[Arc<Worker>], chain: &[BlockHash], block_size: u32) -> (Option<Arc<Worker>>, &'static str, u64) {
        let least = candidates.iter().map(|w| w.load()).min().unwrap_or(0);
        let balanced = |w: &Worker| {
            let load = w.load();
            load <= least + self.balance_abs || (load as f64) <= least as f64 * self.balance_ratio
        };
        let enough = ((self.min_match * chain.len() as f64).ceil() as usize).clamp(1, chain.len());
        // Each worker's cached prefix of the request, looked up once.
        let held: Vec<usize> =
            candidates.iter().map(|w| if w.cache.is_live() { w.cache.prefix_blocks(chain) } else { 0 }).collect();
        let workers = 0..candidates.len();
        if let Some(holder) = workers.clone().filter(|&i| held[i] >= enough)
            .max_by_key(|&i| (held[i], std::cmp::Reverse(candidates[i].load()))) {
            if !balanced(&candidates[holder]) {
                return (None, "imbalance", 0);
            }
            // Cheapest: the tokens it must prefill, plus its queue priced in tokens.
            let cost = |i: usize| (chain.len() - held[i]) as u64 * u64::from(block_size) + candidates[i].load() * self.load_tokens;
            let cheapest = workers.min_by_key(|&i| (cost(i), std::cmp::Reverse(held[i]))).unwrap_or(holder);
            let worker = Some(candidates[cheapest].clone());
            return if held[cheapest] >= enough {
                (worker, "cache_hit", held[cheapest] as u64 * u64::from(block_size))
            } else {
                (worker, "spill", 0)
            };
        }
        let home_key = u64::from_le_bytes(chain[enough - 1][..8].try_into().unwrap());
        let home = pick(candidates, Some(home_key), &mut rand::rng()).filter(|w| balanced(w));
        let reason = if home.is_some() { "cache_miss" } else { "imbalance" };
        (home, reason, 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::{CacheEventBatch, CachedBlock};

    fn held(worker: &Worker, blocks: &[BlockHash]) {
        let stored = blocks.iter().map(|b| CachedBlock { hash: b.to_vec(), ..Default::default() }).collect();
        worker.cache.apply(&worker.name, CacheEventBatch { sequence: 1, snapshot: true, block_size: 16, stored, removed: vec![] });
    }

    #[tokio::test]
    async fn a_cold_request_goes_home_and_requests_sharing_its_middle_block_go_with_it() {
        let policy = CachePolicy { min_match: 0.5, balance_abs: 8, balance_ratio: 1.5, load_tokens: 8 };
        let workers: Vec<Arc<Worker>> = (0..4).map(|i| Arc::new(Worker::fake(&format!("w{i}"), &["m"], true))).collect();
        for w in &workers {
            held(w, &[]);
        }
        // Two requests sharing their first 3 of 4 blocks (a system prompt): one home.
        let a: Vec<BlockHash> = vec![[1; 32], [2; 32], [3; 32], [4; 32]];
        let b: Vec<BlockHash> = vec![[1; 32], [2; 32], [3; 32], [5; 32]];
        let (home_a, reason, _) = policy.place(&workers, &a, 16);
        let (home_b, _, _) = policy.place(&workers, &b, 16);
        assert_eq!(reason, "cache_miss");
        let home = home_a.unwrap();
        assert_eq!(home.name, home_b.unwrap().name);
        // Requests sharing only their first block spread over the workers.
        let homes: std::collections::HashSet<String> = (10..40u8)
            .map(|x| policy.place(&workers, &[[1; 32], [x; 32], [x; 32], [x; 32]], 16).0.unwrap().name.clone())
            .collect();
        assert!(homes.len() >= 3, "{homes:?}");
        // Once a worker holds enough of it, the request goes there, whatever its home.
        let holder = workers.iter().find(|w| w.name != home.name).unwrap();
        held(holder, &a[..1]);
        assert_eq!(policy.place(&workers, &a, 16).0.unwrap().name, home.name, "1 of 4 blocks is not enough");
        held(holder, &a[..2]);
        let (chosen, reason, tokens) = policy.place(&workers, &a, 16);
        assert_eq!((chosen.unwrap().name.as_str(), reason, tokens), (holder.name.as_str(), "cache_hit", 32));
        // A worker whose event stream is down holds nothing as far as routing knows.
        holder.cache.reset(&holder.name);
        let (chosen, reason, _) = policy.place(&workers, &a, 16);
        assert_eq!((chosen.unwrap().name.as_str(), reason), (home.name.as_str(), "cache_miss"));
        held(holder, &a[..2]);
        // While the 32 tokens it saves outweigh its queue (8 tokens a request): not with 5 requests
        // more than an idle worker, which is then chosen; nor ever when it is much busier than the rest.
        let busy: Vec<_> = (0..4).map(|_| holder.begin()).collect();
        assert_eq!(policy.place(&workers, &a, 16).1, "cache_hit");
        let _busy: Vec<_> = (0..1).map(|_| holder.begin()).chain(busy).collect();
        let (chosen, reason, _) = policy.place(&workers, &a, 16);
        assert_eq!(reason, "spill");
        assert_eq!(chosen.unwrap().load(), 0);
        let policy = CachePolicy { load_tokens: 0, ..policy };
        assert_eq!(policy.place(&workers, &a, 16).1, "cache_hit");
        let _more: Vec<_> = (0..4).map(|_| holder.begin()).collect();
        assert_eq!(policy.place(&workers, &a, 16).1, "imbalance");
        let _busy_home: Vec<_> = (0..9).map(|_| home.begin()).collect();
        let (chosen, reason, _) = policy.place(&workers, &b, 16);
        assert!(chosen.is_none() && reason == "imbalance");
    }
}
