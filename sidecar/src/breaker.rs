//! A circuit breaker per worker: consecutive failures open it, a cooldown lets one probe through.

use std::sync::Mutex;
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy, PartialEq)]
enum State {
    Closed { failures: u32 },
    Open { until: Instant },
    HalfOpen { probing: bool },
}

#[derive(Debug)]
pub struct Breaker {
    state: Mutex<State>,
    threshold: u32,
    cooldown: Duration,
}

impl Breaker {
    pub fn new(threshold: u32, cooldown: Duration) -> Self {
        Self { state: Mutex::new(State::Closed { failures: 0 }), threshold: threshold.max(1), cooldown }
    }

    /// Whether a request may go to this worker now; in half-open state only one probe at a time.
    pub fn allow(&self, now: Instant) -> bool {
        let mut state = self.state.lock().unwrap();
        match *state {
            State::Closed { .. } => true,
            State::Open { until } if now >= until => {
                *state = State::HalfOpen { probing: true };
                true
            }
            State::Open { .. } => false,
            State::HalfOpen { probing: false } => {
                *state = State::HalfOpen { probing: true };
                true
            }
            State::HalfOpen { probing: true } => false,
        }
    }

    /// Whether `allow` could say yes now, without taking the probe.
    pub fn is_available(&self, now: Instant) -> bool {
        match *self.state.lock().unwrap() {
            State::Closed { .. } | State::HalfOpen { probing: false } => true,
            State::Open { until } => now >= until,
            State::HalfOpen { probing: true } => false,
        }
    }

    pub fn record_success(&self) {
        *self.state.lock().unwrap() = State::Closed { failures: 0 };
    }

    pub fn record_failure(&self, now: Instant) {
        let mut state = self.state.lock().unwrap();
        *state = match *state {
            State::Closed { failures } if failures + 1 < self.threshold => State::Closed { failures: failures + 1 },
            _ => State::Open { until: now + self.cooldown },
        };
    }

    /// 0 closed, 1 open, 2 half-open (the cyllm_sidecar_breaker_state gauge).
    pub fn state_code(&self) -> f64 {
        match *self.state.lock().unwrap() {
            State::Closed { .. } => 0.0,
            State::Open { .. } => 1.0,
            State::HalfOpen { .. } => 2.0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_after_threshold_then_half_opens_for_one_probe() {
        let breaker = Breaker::new(3, Duration::from_secs(5));
        let t0 = Instant::now();
        for _ in 0..2 {
            breaker.record_failure(t0);
            assert!(breaker.allow(t0));
        }
        breaker.record_failure(t0);
        assert!(!breaker.allow(t0), "open after 3 consecutive failures");
        assert_eq!(breaker.state_code(), 1.0);
        let later = t0 + Duration::from_secs(6);
        assert!(breaker.is_available(later));
        assert!(breaker.allow(later), "one probe after the cooldown");
        assert!(!breaker.allow(later), "only one probe at a time");
        breaker.record_failure(later);
        assert!(!breaker.allow(later + Duration::from_secs(1)), "a failed probe opens it again");
        let much_later = later + Duration::from_secs(10);
        assert!(breaker.allow(much_later));
        breaker.record_success();
        assert!(breaker.allow(much_later) && breaker.allow(much_later));
        assert_eq!(breaker.state_code(), 0.0);
    }

    #[test]
    fn a_success_resets_the_count() {
        let breaker = Breaker::new(2, Duration::from_secs(5));
        let now = Instant::now();
        breaker.record_failure(now);
        breaker.record_success();
        breaker.record_failure(now);
        assert!(breaker.allow(now));
    }
}
