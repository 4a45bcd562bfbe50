//! Choosing a worker (power of two choices, or rendezvous hashing for prefix affinity) and the
//! rules and budget for retrying on another one.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex};

use rand::Rng;
use tonic::Code;

use crate::pool::Worker;

/// Least outstanding of two random candidates; with a key, the candidate the key hashes highest
/// with (rendezvous hashing: a key keeps its worker while that worker stays, and only the keys of a
/// worker that leaves move).
pub fn pick(candidates: &[Arc<Worker>], affinity_key: Option<u64>, rng: &mut impl Rng) -> Option<Arc<Worker>> {
    match (candidates.len(), affinity_key) {
        (0, _) => None,
        (1, _) => Some(candidates[0].clone()),
        (_, Some(key)) => candidates.iter().max_by_key(|w| score(key, &w.name)).cloned(),
        (n, None) => {
            let first = rng.random_range(0..n);
            let second = (first + rng.random_range(1..n)) % n;
            let (a, b) = (&candidates[first], &candidates[second]);
            Some(if b.load() < a.load() { b.clone() } else { a.clone() })
        }
    }
}

fn score(key: u64, worker: &str) -> u64 {
    let mut hasher = DefaultHasher::new();
    (key, worker).hash(&mut hasher);
    hasher.finish()
}

/// Hash of the first `bytes` bytes of the prompt text, for prefix affinity.
pub fn prefix_key(text: &str, bytes: usize) -> u64 {
    let mut hasher = DefaultHasher::new();
    text.as_bytes()[..text.len().min(bytes)].hash(&mut hasher);
    hasher.finish()
}

/// Worth trying elsewhere, before any message reached the client: the worker could not take it.
pub fn retryable(code: Code) -> bool {
    matches!(code, Code::Unavailable | Code::ResourceExhausted)
}

/// A failure that counts against the worker's breaker (not the client's fault, not load).
pub fn is_worker_failure(code: Code) -> bool {
    matches!(code, Code::Unavailable | Code::Internal | Code::Unknown | Code::DataLoss)
}

/// Each request adds `ratio` tokens (up to `cap`); each retry spends one. Under a storm of
/// failures retries stay a fraction of traffic instead of multiplying it.
pub struct RetryBudget {
    tokens: Mutex<f64>,
    ratio: f64,
    cap: f64,
}

impl RetryBudget {
    pub fn new(ratio: f64) -> Self {
        let cap = (ratio * 100.0).max(10.0);
        Self { tokens: Mutex::new(cap), ratio, cap }
    }

    pub fn deposit(&self) {
        let mut tokens = self.tokens.lock().unwrap();
        *tokens = (*tokens + self.ratio).min(self.cap);
    }

    pub fn try_spend(&self) -> bool {
        let mut tokens = self.tokens.lock().unwrap();
        if *tokens >= 1.0 {
            *tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::Worker;

    fn workers(n: usize) -> Vec<Arc<Worker>> {
        (0..n).map(|i| Arc::new(Worker::fake(&format!("w{i}"), &["m"], true))).collect()
    }

    #[tokio::test]
    async fn power_of_two_prefers_the_less_loaded() {
        let pool = workers(2);
        let _busy = [pool[0].begin(), pool[0].begin()];
        let mut rng = rand::rng();
        for _ in 0..50 {
            assert_eq!(pick(&pool, None, &mut rng).unwrap().name, "w1");
        }
    }

    #[tokio::test]
    async fn spreads_over_idle_workers_and_handles_none_and_one() {
        let pool = workers(4);
        let mut rng = rand::rng();
        let chosen: std::collections::HashSet<_> = (0..200).map(|_| pick(&pool, None, &mut rng).unwrap().name.clone()).collect();
        assert_eq!(chosen.len(), 4);
        assert!(pick(&[], None, &mut rng).is_none());
        assert_eq!(pick(&pool[..1], None, &mut rng).unwrap().name, "w0");
    }

    #[tokio::test]
    async fn prefix_affinity_is_stable_and_moves_only_the_keys_of_a_leaving_worker() {
        let pool = workers(4);
        let mut rng = rand::rng();
        let keys: Vec<u64> = (0..200).map(|i| prefix_key(&format!("system prompt {i} and more"), 16)).collect();
        let before: Vec<String> = keys.iter().map(|k| pick(&pool, Some(*k), &mut rng).unwrap().name.clone()).collect();
        let again: Vec<String> = keys.iter().map(|k| pick(&pool, Some(*k), &mut rng).unwrap().name.clone()).collect();
        assert_eq!(before, again);
        let remaining: Vec<_> = pool.iter().filter(|w| w.name != "w2").cloned().collect();
        for (key, old) in keys.iter().zip(&before) {
            let new = pick(&remaining, Some(*key), &mut rng).unwrap().name.clone();
            if old != "w2" {
                assert_eq!(&new, old, "a key whose worker stayed must not move");
            }
        }
        assert_eq!(prefix_key("abcdef", 3), prefix_key("abcxyz", 3));
    }

    #[test]
    fn retry_rules() {
        assert!(retryable(Code::Unavailable) && retryable(Code::ResourceExhausted));
        for code in [Code::InvalidArgument, Code::NotFound, Code::DeadlineExceeded, Code::Cancelled, Code::Internal] {
            assert!(!retryable(code), "{code:?}");
        }
        assert!(is_worker_failure(Code::Unavailable) && !is_worker_failure(Code::ResourceExhausted));
    }

    #[test]
    fn retry_budget_is_refilled_by_requests() {
        let budget = RetryBudget::new(0.5);
        let mut spent = 0;
        while budget.try_spend() {
            spent += 1;
        }
        assert_eq!(spent, 50);
        budget.deposit();
        assert!(!budget.try_spend());
        budget.deposit();
        assert!(budget.try_spend());
    }
}
