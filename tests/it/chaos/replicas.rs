//! The proxy replicas: real binaries on one database, each identified by a
//! tag (`r<slot>g<generation>`) that the provider sends along with every
//! delivery, so the application's record says which process forwarded what.
//! A replica can be SIGKILLed and restarted (as a new process, on new ports);
//! every process's log lines are kept for the checker.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Mutex, RwLock};
use std::time::Instant;

use crate::cli::ProxyProcess;

/// A live replica as the provider sees it.
#[derive(Debug, Clone)]
pub struct Target {
    pub addr: SocketAddr,
    pub tag: String,
}

struct Slot {
    generation: u32,
    process: Option<ProxyProcess>,
}

/// What one process left behind.
pub struct ProcessLog {
    pub lines: Vec<String>,
    /// When the SIGKILL was sent; `None` for a process that was SIGTERMed.
    pub killed_at: Option<Instant>,
}

pub struct Replicas {
    config: String,
    targets: RwLock<Vec<Option<Target>>>,
    slots: Vec<tokio::sync::Mutex<Slot>>,
    logs: Mutex<BTreeMap<String, ProcessLog>>,
}

impl Replicas {
    /// Starts `count` replicas with the same configuration.
    pub async fn start(count: usize, config: String) -> Self {
        let replicas = Self {
            config,
            targets: RwLock::new(vec![None; count]),
            slots: (0..count)
                .map(|_| {
                    tokio::sync::Mutex::new(Slot {
                        generation: 0,
                        process: None,
                    })
                })
                .collect(),
            logs: Mutex::default(),
        };
        for slot in 0..count {
            replicas.launch(slot).await;
        }
        replicas
    }

    /// The replicas currently up.
    pub fn live(&self) -> Vec<Target> {
        self.targets
            .read()
            .unwrap()
            .iter()
            .flatten()
            .cloned()
            .collect()
    }

    /// The slots whose replica is up.
    pub fn live_slots(&self) -> Vec<usize> {
        let targets = self.targets.read().unwrap();
        (0..targets.len())
            .filter(|&i| targets[i].is_some())
            .collect()
    }

    /// Waits until every live replica answers `/readyz`.
    pub async fn wait_ready(&self) {
        for slot in &self.slots {
            if let Some(process) = &slot.lock().await.process {
                process.wait_ready().await;
            }
        }
    }

    async fn launch(&self, index: usize) {
        let mut slot = self.slots[index].lock().await;
        slot.generation += 1;
        let process = ProxyProcess::start(&self.config).await;
        let tag = format!("r{index}g{}", slot.generation);
        self.targets.write().unwrap()[index] = Some(Target {
            addr: process.addr,
            tag,
        });
        slot.process = Some(process);
    }

    /// SIGKILLs the replica in `index`, keeping its logs; false if it was down.
    pub async fn kill(&self, index: usize) -> bool {
        self.stop(index, true).await
    }

    /// Starts a new process in a slot that was stopped.
    pub async fn restart(&self, index: usize) {
        self.launch(index).await;
    }

    /// SIGTERMs the replica in `index` and waits for it to drain and exit,
    /// as a rolling deployment does; false if it was down.
    pub async fn terminate(&self, index: usize) -> bool {
        self.stop(index, false).await
    }

    /// SIGTERMs every live replica and waits for it to exit; returns every
    /// process's log, killed or not.
    pub async fn stop_all(&self) -> BTreeMap<String, ProcessLog> {
        for index in 0..self.slots.len() {
            self.stop(index, false).await;
        }
        std::mem::take(&mut *self.logs.lock().unwrap())
    }

    /// Stops the replica in `index` (SIGKILL or SIGTERM) and keeps its logs;
    /// false if it was down.
    async fn stop(&self, index: usize, kill: bool) -> bool {
        let mut slot = self.slots[index].lock().await;
        let Some(mut process) = slot.process.take() else {
            return false;
        };
        let killed_at = kill.then(Instant::now);
        if kill {
            process.kill().await;
        } else {
            process.terminate();
        }
        let target = self.targets.write().unwrap()[index].take();
        let tag = target.expect("a live slot has a target").tag;
        let lines = process.all_log_lines().await;
        let log = ProcessLog { lines, killed_at };
        self.logs.lock().unwrap().insert(tag, log);
        true
    }
}
