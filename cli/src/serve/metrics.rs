//! Prometheus metrics, rendered by hand (a handful of counters, gauges and two histograms).

use std::fmt::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

#[derive(Default)]
pub struct Counter(AtomicU64);

impl Counter {
    pub fn inc(&self) {
        self.add(1);
    }
    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }
    fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

#[derive(Default)]
pub struct Gauge(AtomicU64);

impl Gauge {
    pub fn set(&self, v: u64) {
        self.0.store(v, Ordering::Relaxed);
    }
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// A histogram over fixed buckets (seconds).
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<AtomicU64>,
    sum_us: AtomicU64,
    count: AtomicU64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: bounds.iter().map(|_| AtomicU64::new(0)).collect(),
            sum_us: AtomicU64::new(0),
            count: AtomicU64::new(0),
        }
    }

    pub fn observe(&self, secs: f64) {
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            if secs <= *b {
                c.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.sum_us.fetch_add((secs * 1e6) as u64, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {}", c.load(Ordering::Relaxed));
        }
        let n = self.count.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {n}");
        let _ = writeln!(out, "{name}_sum {}", self.sum_us.load(Ordering::Relaxed) as f64 / 1e6);
        let _ = writeln!(out, "{name}_count {n}");
    }
}

const LATENCY: &[f64] = &[0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];

/// Everything `/metrics` reports.
pub struct Metrics {
    pub ok: Counter,
    pub client_errors: Counter,
    pub rejected: Counter,
    pub server_errors: Counter,
    pub cancelled: Counter,
    pub prompt_tokens: Counter,
    pub completion_tokens: Counter,
    pub prompt_cache_hit_tokens: Counter,
    pub preemptions: Counter,
    pub queue_depth: Gauge,
    pub rows_in_use: Gauge,
    pub rows_total: Gauge,
    pub kv_tokens_in_use: Gauge,
    pub kv_tokens_capacity: Gauge,
    pub kv_blocks_in_use: Gauge,
    pub kv_blocks_cached: Gauge,
    pub weights_version: Gauge,
    pub update_waiting: Gauge,
    pub time_to_first_token: Histogram,
    pub time_per_output_token: Histogram,
    pub healthy: AtomicBool,
    pub last_error: Mutex<Option<String>>,
}

impl Metrics {
    /// Count a request that ended in an error of `status`: refused (429, 503), the client's
    /// (other 4xx) or the server's.
    pub fn count_error(&self, status: axum::http::StatusCode) {
        match status.as_u16() {
            429 | 503 => self.rejected.inc(),
            400..=499 => self.client_errors.inc(),
            _ => self.server_errors.inc(),
        }
    }

    pub fn new(rows: usize, max_len: usize) -> Self {
        let m = Metrics {
            ok: Counter::default(),
            client_errors: Counter::default(),
            rejected: Counter::default(),
            server_errors: Counter::default(),
            cancelled: Counter::default(),
            prompt_tokens: Counter::default(),
            completion_tokens: Counter::default(),
            prompt_cache_hit_tokens: Counter::default(),
            preemptions: Counter::default(),
            queue_depth: Gauge::default(),
            rows_in_use: Gauge::default(),
            rows_total: Gauge::default(),
            kv_tokens_in_use: Gauge::default(),
            kv_tokens_capacity: Gauge::default(),
            kv_blocks_in_use: Gauge::default(),
            kv_blocks_cached: Gauge::default(),
            weights_version: Gauge::default(),
            update_waiting: Gauge::default(),
            time_to_first_token: Histogram::new(LATENCY),
            time_per_output_token: Histogram::new(LATENCY),
            healthy: AtomicBool::new(true),
            last_error: Mutex::new(None),
        };
        m.rows_total.set(rows as u64);
        m.kv_tokens_capacity.set((rows * max_len) as u64);
        m
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut o = String::new();
        let _ =
            writeln!(o, "# HELP kvdecode_requests_total Requests by outcome.\n# TYPE kvdecode_requests_total counter");
        for (outcome, c) in [
            ("ok", &self.ok),
            ("client_error", &self.client_errors),
            ("rejected", &self.rejected),
            ("server_error", &self.server_errors),
        ] {
            let _ = writeln!(o, "kvdecode_requests_total{{outcome=\"{outcome}\"}} {}", c.get());
        }
        let counters = [
            (
                "kvdecode_generations_cancelled_total",
                "Generations stopped early (client gone, stop string).",
                &self.cancelled,
            ),
            ("kvdecode_prompt_tokens_total", "Prompt tokens of accepted requests.", &self.prompt_tokens),
            ("kvdecode_completion_tokens_total", "Tokens generated.", &self.completion_tokens),
            (
                "kvdecode_prompt_cache_hit_tokens_total",
                "Prompt tokens found in the prompt cache (not computed again).",
                &self.prompt_cache_hit_tokens,
            ),
            (
                "kvdecode_preemptions_total",
                "Generations preempted to free K/V blocks (resumed by recomputation).",
                &self.preemptions,
            ),
        ];
        for (name, help, c) in counters {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}", c.get());
        }
        let gauges = [
            ("kvdecode_queue_depth", "Generations waiting for a row.", &self.queue_depth),
            ("kvdecode_rows_in_use", "Cache rows holding a generation.", &self.rows_in_use),
            ("kvdecode_rows", "Cache rows.", &self.rows_total),
            (
                "kvdecode_kv_tokens_in_use",
                "Tokens stored in the K/V cache for running generations.",
                &self.kv_tokens_in_use,
            ),
            ("kvdecode_kv_tokens_capacity", "Tokens the K/V cache holds in all.", &self.kv_tokens_capacity),
            ("kvdecode_kv_blocks_in_use", "Global K/V blocks held by running generations.", &self.kv_blocks_in_use),
            ("kvdecode_kv_blocks_cached", "Global K/V blocks kept by the prompt cache.", &self.kv_blocks_cached),
            (
                "kvdecode_weights_version",
                "The weights version (0 at start, plus one per update).",
                &self.weights_version,
            ),
            (
                "kvdecode_update_waiting",
                "1 while new weights wait for the requests in flight (POST /v1/weights, mode wait).",
                &self.update_waiting,
            ),
        ];
        for (name, help, g) in gauges {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {}", g.get());
        }
        self.time_to_first_token.render(
            &mut o,
            "kvdecode_time_to_first_token_seconds",
            "From receiving a request to its first generated token.",
        );
        self.time_per_output_token.render(
            &mut o,
            "kvdecode_time_per_output_token_seconds",
            "Between consecutive generated tokens of one choice.",
        );
        o
    }
}
