//! The verdict, from the application's record, the provider's view and the
//! replicas' logs.
//!
//! Guaranteed, and a violation when broken:
//! - every event the provider saw acknowledged was acted on;
//! - every event was acknowledged before the provider gave up;
//! - no claim (key, attempt) reached the application twice, and no two
//!   attempts of one key were at the application at once;
//! - an event acted on twice had its first effect unrecorded for a reason
//!   outside the proxy's control (below); anything else is a violation.
//!
//! Not guaranteed, and counted apart: the application acted (answered 2xx)
//! but the `done` settle was never written, so after the lease the key was
//! claimed and forwarded again. Two causes exist by design:
//! - *crash*: the replica was SIGKILLed while the application was working
//!   (it finished after the proxy died) or between the application's 2xx and
//!   the settle, counted apart;
//! - *store*: the settle failed (store cut off) and its background retries
//!   were not written before the lease had expired and another delivery had
//!   taken the key over (or before the replica was killed).
//!
//! Assumed, and built into the application: it acts only by answering 2xx
//! within the proxies' `upstream.timeout`; work still running when the proxy
//! gives up on it (504) is not completed later. An application that did
//! complete it would be acted on again by the retry the 504 causes, so
//! `upstream.timeout` must exceed the application's slowest request.

use std::collections::{BTreeMap, HashMap, HashSet};

use super::app::{Record, Verdict};
use super::provider::EventReport;
use super::replicas::ProcessLog;

/// What the replicas' logs say about each (process, key, attempt).
#[derive(Default)]
struct LogIndex {
    answered: HashSet<(String, String, i64)>,
    settle_failed: HashSet<(String, String, i64)>,
    settled_later: HashSet<(String, String, i64)>,
    taken_over: HashSet<(String, String, i64)>,
}

impl LogIndex {
    fn build(logs: &BTreeMap<String, ProcessLog>) -> Self {
        let mut index = Self::default();
        for (tag, log) in logs {
            for line in &log.lines {
                let Ok(event) = serde_json::from_str::<serde_json::Value>(line) else {
                    continue;
                };
                let (Some(key), Some(attempt)) = (event["key"].as_str(), event["attempt"].as_i64())
                else {
                    continue;
                };
                let entry = (tag.clone(), key.to_owned(), attempt);
                let set = match event["message"].as_str().unwrap_or("") {
                    "webhook" => &mut index.answered,
                    m if m.starts_with("settle failed")
                        || m.starts_with("settle still at the database") =>
                    {
                        &mut index.settle_failed
                    }
                    m if m.starts_with("settled in the background") => &mut index.settled_later,
                    m if m.starts_with("claim was taken over") => &mut index.taken_over,
                    _ => continue,
                };
                set.insert(entry);
            }
        }
        index
    }
}

/// Why an event was acted on more than once.
enum Cause {
    /// The replica was killed while the application was still working.
    CrashDuringUpstream,
    /// The replica was killed after the application had answered 2xx,
    /// before the settle was written.
    CrashAfterAnswer,
    Store,
    Unexplained(String),
}

#[derive(Debug, Default)]
pub struct Verdicts {
    pub events: usize,
    pub acknowledged: usize,
    pub acted_on: usize,
    pub effects: usize,
    pub unrecorded_crash_during_upstream: usize,
    pub unrecorded_crash_after_answer: usize,
    pub unrecorded_store: usize,
    /// One line per double effect counted as crash or store.
    pub explained: Vec<String>,
    pub violations: Vec<String>,
}

pub fn check(
    records: &[Record],
    reports: &[EventReport],
    logs: &BTreeMap<String, ProcessLog>,
) -> Verdicts {
    let index = LogIndex::build(logs);
    let mut verdicts = Verdicts {
        events: reports.len(),
        acknowledged: reports.iter().filter(|r| r.acknowledged).count(),
        ..Verdicts::default()
    };
    let violations = &mut verdicts.violations;
    if index.answered.is_empty() {
        // The checker reads the proxies' log messages; renamed ones would
        // leave it blind.
        violations.push("no `webhook` log line was found in the replicas' logs".into());
    }

    let mut by_key: HashMap<&str, Vec<&Record>> = HashMap::new();
    let mut claims_seen = HashSet::new();
    for record in records {
        let (Some(key), Some(attempt)) = (&record.key, record.attempt) else {
            violations.push(format!(
                "a request reached the application without a claim: {record:?}"
            ));
            continue;
        };
        if !claims_seen.insert((key.as_str(), attempt)) {
            violations.push(format!(
                "{key} attempt {attempt} reached the application twice"
            ));
        }
        by_key.entry(key).or_default().push(record);
    }

    for report in reports {
        let requests = by_key.remove(report.key.as_str()).unwrap_or_default();
        check_event(report, requests, &index, logs, &mut verdicts);
    }
    for key in by_key.keys() {
        verdicts
            .violations
            .push(format!("{key} reached the application but was never sent"));
    }
    verdicts
}

fn check_event(
    report: &EventReport,
    mut requests: Vec<&Record>,
    index: &LogIndex,
    logs: &BTreeMap<String, ProcessLog>,
    verdicts: &mut Verdicts,
) {
    let key = &report.key;
    if !report.acknowledged {
        verdicts.violations.push(format!(
            "{key} was never acknowledged before the provider gave up"
        ));
    }
    if report.replays_acknowledged < report.replays {
        verdicts
            .violations
            .push(format!("{key}: a manual replay was never acknowledged"));
    }
    requests.sort_by_key(|record| record.arrived);
    for pair in requests.windows(2) {
        if pair[1].arrived < pair[0].answered && pair[0].verdict != Verdict::Hung {
            verdicts.violations.push(format!(
                "{key}: attempts {:?} and {:?} were at the application at once",
                pair[0].attempt, pair[1].attempt
            ));
        }
    }
    let effects: Vec<&Record> = requests
        .into_iter()
        .filter(|record| record.verdict == Verdict::Effect)
        .collect();
    verdicts.effects += effects.len();
    if effects.is_empty() {
        if report.acknowledged {
            verdicts
                .violations
                .push(format!("{key} was acknowledged but never acted on"));
        }
        return;
    }
    verdicts.acted_on += 1;
    for pair in effects.windows(2) {
        let what = format!(
            "{key} acted on by attempt {:?} via {:?}, then by attempt {:?} via {:?}",
            pair[0].attempt, pair[0].replica, pair[1].attempt, pair[1].replica
        );
        match cause(pair[0], index, logs) {
            Cause::CrashDuringUpstream => {
                verdicts.unrecorded_crash_during_upstream += 1;
                verdicts.explained.push(format!(
                    "{what}: the first replica was killed while the application worked"
                ));
            }
            Cause::CrashAfterAnswer => {
                verdicts.unrecorded_crash_after_answer += 1;
                verdicts.explained.push(format!(
                    "{what}: the first replica was killed between the application's 2xx and its settle"
                ));
            }
            Cause::Store => {
                verdicts.unrecorded_store += 1;
                verdicts.explained.push(format!(
                    "{what}: the first settle could not be written before the lease expired"
                ));
            }
            Cause::Unexplained(why) => verdicts.violations.push(format!(
                "{key} acted on again (attempt {:?} after {:?}): {why}",
                pair[1].attempt, pair[0].attempt
            )),
        }
    }
}

/// Why the effect `first` was not recorded as `done`.
fn cause(first: &Record, index: &LogIndex, logs: &BTreeMap<String, ProcessLog>) -> Cause {
    let Some(tag) = first.replica.clone() else {
        return Cause::Unexplained("no replica tag on the forwarded request".into());
    };
    let entry = (
        tag.clone(),
        first.key.clone().unwrap_or_default(),
        i64::from(first.attempt.unwrap_or(0)),
    );
    let killed_at = logs.get(&tag).and_then(|log| log.killed_at);
    if index.settle_failed.contains(&entry) {
        return if index.settled_later.contains(&entry) {
            Cause::Unexplained(format!("{tag} settled it done in the background"))
        } else {
            Cause::Store
        };
    }
    if index.taken_over.contains(&entry) {
        return Cause::Unexplained(format!(
            "{tag} forwarded it without enough lease left to settle it"
        ));
    }
    if !index.answered.contains(&entry) {
        return match killed_at {
            Some(at) if at < first.answered => Cause::CrashDuringUpstream,
            Some(_) => Cause::CrashAfterAnswer,
            None => Cause::Unexplained(format!(
                "{tag} never answered the delivery and was not killed"
            )),
        };
    }
    Cause::Unexplained(format!("{tag} settled it done"))
}
