//! Failed authentications, counted per source, answer and window, and
//! written to the audit log as one row each: the count, the first and last
//! time, and the first and last key prefix seen. A flood of bad keys costs
//! a row per window, not one per request.

use std::collections::HashMap;
use std::net::IpAddr;

use chrono::{DateTime, Utc};
use uuid::Uuid;

use crate::audit::AuditRecord;

/// The answer a failure got: its HTTP status and stable code.
pub(super) type Answer = (u16, &'static str);

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Key {
    client: Option<IpAddr>,
    answer: Answer,
    window: i64,
}

#[derive(Debug, Clone)]
struct Window {
    request_id: Uuid,
    first_at: DateTime<Utc>,
    last_at: DateTime<Utc>,
    count: u32,
    first_prefix: Option<String>,
    last_prefix: Option<String>,
}

#[derive(Debug)]
pub(super) struct Tally {
    window_secs: i64,
    /// Windows held at once; past it, failures of new sources count under
    /// no address.
    max_windows: usize,
    open: HashMap<Key, Window>,
}

impl Tally {
    pub(super) fn new(window_secs: u32, max_windows: usize) -> Tally {
        Tally {
            window_secs: i64::from(window_secs.max(1)),
            max_windows,
            open: HashMap::new(),
        }
    }

    fn window_of(&self, at: DateTime<Utc>) -> i64 {
        at.timestamp().div_euclid(self.window_secs)
    }

    /// Counts one failure.
    pub(super) fn add(
        &mut self,
        client: Option<IpAddr>,
        answer: Answer,
        prefix: Option<&str>,
        at: DateTime<Utc>,
    ) {
        let mut key = Key {
            client,
            answer,
            window: self.window_of(at),
        };
        if !self.open.contains_key(&key) && self.open.len() >= self.max_windows {
            key.client = None;
        }
        let w = self.open.entry(key).or_insert_with(|| Window {
            request_id: Uuid::now_v7(),
            first_at: at,
            last_at: at,
            count: 0,
            first_prefix: prefix.map(str::to_owned),
            last_prefix: None,
        });
        w.count = w.count.saturating_add(1);
        w.last_at = at;
        if prefix.is_some() {
            w.last_prefix = prefix.map(str::to_owned);
        }
        if w.first_prefix.is_none() {
            w.first_prefix = prefix.map(str::to_owned);
        }
    }

    /// Takes the windows that have ended by `now` (every window with
    /// `all`), as audit rows.
    pub(super) fn take_closed(&mut self, now: DateTime<Utc>, all: bool) -> Vec<AuditRecord> {
        let current = self.window_of(now);
        let closed: Vec<Key> = self
            .open
            .keys()
            .filter(|k| all || k.window < current)
            .cloned()
            .collect();
        closed
            .into_iter()
            .filter_map(|k| {
                let w = self.open.remove(&k)?;
                Some(row(&k, w))
            })
            .collect()
    }

    /// Puts back a row that could not be queued, to try again.
    pub(super) fn put_back(&mut self, r: AuditRecord) {
        let key = Key {
            client: r.client_addr.as_deref().and_then(|a| a.parse().ok()),
            answer: (
                r.http_status as u16,
                code_of(r.error_code.as_deref().unwrap_or_default()),
            ),
            window: self.window_of(r.received_at),
        };
        self.open.insert(
            key,
            Window {
                request_id: r.request_id,
                first_at: r.received_at,
                last_at: r.completed_at,
                count: u32::try_from(r.occurrences).unwrap_or(1),
                first_prefix: r.api_key_prefix,
                last_prefix: r.last_key_prefix,
            },
        );
    }

    pub(super) fn open_windows(&self) -> usize {
        self.open.len()
    }
}

/// The static code a row carries back (the codes a failure can get).
fn code_of(code: &str) -> &'static str {
    match code {
        super::THROTTLED_CODE => super::THROTTLED_CODE,
        _ => super::UNAUTHENTICATED_CODE,
    }
}

fn row(k: &Key, w: Window) -> AuditRecord {
    let mut r = AuditRecord::refused(w.request_id, w.first_at);
    r.completed_at = w.last_at;
    r.http_status = k.answer.0 as i16;
    r.error_code = Some(k.answer.1.to_owned());
    r.client_addr = k.client.map(|c| c.to_string());
    r.occurrences = i32::try_from(w.count).unwrap_or(i32::MAX);
    r.api_key_prefix = w.first_prefix;
    r.last_key_prefix = w.last_prefix;
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sources::{THROTTLED_CODE, UNAUTHENTICATED_CODE};

    fn at(secs: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_800_000_000 + secs, 0).unwrap()
    }

    #[test]
    fn one_row_per_source_answer_and_window() {
        let mut t = Tally::new(60, 100);
        let a: IpAddr = "203.0.113.9".parse().unwrap();
        let b: IpAddr = "198.51.100.1".parse().unwrap();
        let unauth = (401, UNAUTHENTICATED_CODE);
        let throttled = (429, THROTTLED_CODE);
        for i in 0..500 {
            t.add(Some(a), unauth, Some(&format!("lf_k{i}")), at(i % 50));
        }
        t.add(Some(a), throttled, None, at(51));
        t.add(Some(b), unauth, None, at(52));
        t.add(Some(b), unauth, Some("lf_x"), at(53));
        assert!(
            t.take_closed(at(59), false).is_empty(),
            "the window is open"
        );
        let mut rows = t.take_closed(at(60), false);
        rows.sort_by_key(|r| (r.client_addr.clone(), r.http_status));
        assert_eq!(rows.len(), 3);
        let r = &rows[1];
        assert_eq!(r.client_addr.as_deref(), Some("203.0.113.9"));
        assert_eq!((r.http_status, r.occurrences), (401, 500));
        assert_eq!(r.api_key_prefix.as_deref(), Some("lf_k0"));
        assert_eq!(r.last_key_prefix.as_deref(), Some("lf_k499"));
        assert_eq!((r.received_at, r.completed_at), (at(0), at(49)));
        assert_eq!(rows[2].http_status, 429);
        assert_eq!(rows[2].error_code.as_deref(), Some(THROTTLED_CODE));
        assert_eq!(rows[0].api_key_prefix.as_deref(), Some("lf_x"));
        assert_eq!(t.open_windows(), 0);
    }

    #[test]
    fn a_row_put_back_keeps_its_count_and_id() {
        let mut t = Tally::new(60, 100);
        let a: IpAddr = "203.0.113.9".parse().unwrap();
        t.add(Some(a), (429, THROTTLED_CODE), Some("lf_a"), at(1));
        t.add(Some(a), (429, THROTTLED_CODE), Some("lf_b"), at(2));
        let rows = t.take_closed(at(0), true);
        let id = rows[0].request_id;
        t.put_back(rows.into_iter().next().unwrap());
        t.add(Some(a), (429, THROTTLED_CODE), None, at(3));
        let rows = t.take_closed(at(61), false);
        assert_eq!(rows.len(), 1);
        assert_eq!((rows[0].request_id, rows[0].occurrences), (id, 3));
        assert_eq!(rows[0].error_code.as_deref(), Some(THROTTLED_CODE));
        assert_eq!(rows[0].last_key_prefix.as_deref(), Some("lf_b"));
    }

    #[test]
    fn past_its_bound_new_sources_count_under_no_address() {
        let mut t = Tally::new(60, 2);
        for i in 0..10 {
            let ip: IpAddr = format!("198.51.100.{i}").parse().unwrap();
            t.add(Some(ip), (401, UNAUTHENTICATED_CODE), None, at(1));
        }
        let rows = t.take_closed(at(60), false);
        let total: i32 = rows.iter().map(|r| r.occurrences).sum();
        assert_eq!(total, 10, "nothing is lost");
        assert!(rows.len() <= 3, "{}", rows.len());
        assert!(rows.iter().any(|r| r.client_addr.is_none()));
    }
}
