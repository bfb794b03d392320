//! Destinations beyond MQTT (issue 30): a PostgreSQL table per pipeline (`postgres.rs`) and a
//! NATS JetStream stream (`jetstream.rs`), each exactly once *by construction*: a re-sent
//! result changes nothing at the destination.
//!
//! **The guarantee, per destination.**
//! - PostgreSQL: an `upsert` row is written only when its (generation, version) is newer than
//!   the row's, so a re-sent or replayed older version never overwrites a newer one; a
//!   `changelog` row is inserted only if its (source, id) is absent. A batch is one
//!   transaction that also records the sink's settled position; a result is settled when
//!   that transaction commits.
//! - JetStream: every message carries `Nats-Msg-Id: <source>/<id>`; the stream drops a
//!   repeated ID within its duplicate window. A result is settled on the stream's ack (an ack
//!   that says "duplicate" settles too). A re-send after the window (an outage that outlasts
//!   it) is stored again: consumers keep the highest (generation, version) per key.
//!
//! **The mechanism.** Each sink's client runs on a thread of its own with a current-thread
//! tokio runtime ([`SinkThread`]); the event loop hands it batches over a bounded channel
//! ([`SinkThread::try_deliver`] never blocks: a full channel is an answer, not a wait) and
//! hears back through the callback it gave ([`SinkEvent`]): up, down, refusing, and for
//! each batch one [`Verdict`] per result. A sink that is down or refusing answers every
//! batch with [`Verdict::Retry`]: the outbox holds, nothing is dropped.
//!
//! **Rooms.** This module is the only one that names `tokio_postgres` and `async_nats`
//! (`tests/it/layering.rs`); the loop sees [`SinkResult`], [`Verdict`] and [`SinkEvent`].

pub mod jetstream;
pub mod postgres;
pub mod subject;

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;

use crate::config::TlsConfig;
use crate::model::Output;

/// One result on its way to a sink: the outbox entry and the fields its JSON names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SinkResult {
    /// The outbox sequence: a batch settles in this order.
    pub seq: u64,
    /// The stable output ID, `pipeline/key[/window_start]/version`.
    pub id: String,
    pub pipeline: String,
    pub key: String,
    pub window_start: Option<u64>,
    /// 1 when the result names none (results before a pipeline's first new generation).
    pub generation: u32,
    pub version: u64,
    /// The MQTT result topic (before any uplink prefix).
    pub topic: String,
    /// The MQTT result's JSON, byte for byte.
    pub payload: Vec<u8>,
}

/// The fields of a result body a sink needs (`pipeline/engine.rs` writes them).
#[derive(Deserialize)]
struct Body {
    pipeline: String,
    key: String,
    version: u64,
    #[serde(default)]
    generation: Option<u32>,
    #[serde(default)]
    window_start: Option<u64>,
}

impl SinkResult {
    /// Read the key, window, generation and version out of an outbox entry's JSON. An entry
    /// whose body does not say them is a bug upstream, reported as an error.
    pub fn from_output(seq: u64, out: &Output) -> Result<SinkResult, String> {
        Self::from_parts(seq, out.id.clone(), &out.topic, out.payload.clone())
    }

    /// [`SinkResult::from_output`] from an output's parts.
    pub fn from_parts(
        seq: u64,
        id: String,
        topic: &str,
        payload: Vec<u8>,
    ) -> Result<SinkResult, String> {
        let body: Body = serde_json::from_slice(&payload)
            .map_err(|e| format!("result {id} has no readable body: {e}"))?;
        Ok(SinkResult {
            seq,
            id,
            pipeline: body.pipeline,
            key: body.key,
            window_start: body.window_start,
            generation: body.generation.unwrap_or(1),
            version: body.version,
            topic: topic.to_string(),
            payload,
        })
    }
}

/// A sink's answer about one result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The destination holds it (or already held it): the outbox may forget it for this sink.
    Settled,
    /// The destination refused it as data (a value its column cannot hold, a subject over
    /// its limit): a dead letter for this sink, with a reason from docs/pipelines.md.
    DeadLetter {
        reason: &'static str,
        detail: String,
    },
    /// Not known to have arrived: send it again later.
    Retry,
}

/// Why a sink cannot deliver now.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SinkError {
    /// Unreachable, connection lost, timed out: try again after a pause.
    #[error("{0}")]
    Down(String),
    /// Reached, but it refuses what Cairn needs (a table that does not fit, a stream that
    /// does not cover the subjects, credentials refused): an operator must act.
    #[error("{0}")]
    Refused(String),
}

/// What a sink thread tells the loop.
#[derive(Debug, Clone, PartialEq)]
pub enum SinkEvent {
    /// Connected and checked; `detail` says what it found (tables; the stream and its
    /// duplicate window, also in `duplicate_window`).
    Up {
        detail: String,
        duplicate_window: Option<Duration>,
    },
    Down {
        reason: String,
    },
    Refusing {
        reason: String,
    },
    /// The answer to one batch: a verdict per result, in the batch's order.
    Answered {
        verdicts: Vec<(u64, Verdict)>,
    },
    /// Worth a journal warning (`name` is its event name).
    Warning {
        name: &'static str,
        message: String,
    },
}

/// A destination as the sink thread drives it: connect (and check), then deliver batches.
pub trait Destination {
    /// Connect if not connected, and check that the destination fits (tables, stream).
    fn connect(&mut self) -> impl Future<Output = Result<String, SinkError>>;
    /// Deliver one batch; `position` is the outbox sequence the sink has settled up to
    /// once this batch is settled. `Err` means nothing in the batch is known to have landed.
    fn deliver(
        &mut self,
        batch: &[SinkResult],
        position: u64,
    ) -> impl Future<Output = Result<Vec<Verdict>, SinkError>>;
    /// The destination's duplicate window, where it has one (JetStream), once connected.
    fn duplicate_window(&self) -> Option<Duration> {
        None
    }
    /// Called while the destination is down, now and then: a chance to say something.
    fn down_for(&mut self, _for: Duration) -> Option<SinkEvent> {
        None
    }
}

/// A batch on its way to a sink thread.
#[derive(Debug)]
pub struct Batch {
    /// The outbox sequence settled once this batch is (the last result's sequence plus one).
    pub position: u64,
    pub results: Vec<SinkResult>,
}

enum Command {
    Deliver(Batch),
}

/// How many batches may wait for a sink thread: the loop sends the next one only after an
/// answer, so two are plenty.
const QUEUE: usize = 4;
/// A batch that has no answer after this long is taken as lost with the connection.
const DELIVER_TIMEOUT: Duration = Duration::from_secs(30);
/// Reconnect backoff: doubles from the first to the second.
const BACKOFF: (Duration, Duration) = (Duration::from_millis(200), Duration::from_secs(5));
/// A refusing destination is checked again this often (an operator may have fixed it).
const REFUSED_RETRY: Duration = Duration::from_secs(10);

/// A sink client on its own thread and runtime.
pub struct SinkThread {
    tx: Option<tokio::sync::mpsc::Sender<Command>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// The callback a sink thread reports through (the loop's event channel, in the agent).
pub type Notify = Arc<dyn Fn(SinkEvent) + Send + Sync>;

impl SinkThread {
    /// Start the thread `cairn-sink-<name>`; it connects at once.
    pub fn spawn<D: Destination + Send + 'static>(
        name: &str,
        dest: D,
        notify: Notify,
    ) -> std::io::Result<SinkThread> {
        let (tx, rx) = tokio::sync::mpsc::channel(QUEUE);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let thread = std::thread::Builder::new()
            .name(format!("cairn-sink-{name}"))
            .spawn(move || runtime.block_on(drive(dest, rx, notify)))?;
        Ok(SinkThread {
            tx: Some(tx),
            thread: Some(thread),
        })
    }

    /// Hand a batch over without waiting: `Err` gives it back when the queue is full or the
    /// thread has gone.
    pub fn try_deliver(&self, batch: Batch) -> Result<(), Batch> {
        let Some(tx) = &self.tx else {
            return Err(batch);
        };
        tx.try_send(Command::Deliver(batch)).map_err(|e| match e {
            tokio::sync::mpsc::error::TrySendError::Full(Command::Deliver(b))
            | tokio::sync::mpsc::error::TrySendError::Closed(Command::Deliver(b)) => b,
        })
    }

    /// Stop the thread: a batch under way is finished or abandoned (its results were not
    /// answered, so they stay in the outbox).
    pub fn shutdown(&mut self) {
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for SinkThread {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn all_retry(batch: &Batch) -> Vec<(u64, Verdict)> {
    batch
        .results
        .iter()
        .map(|r| (r.seq, Verdict::Retry))
        .collect()
}

/// The thread's life: connect (with backoff), then deliver batches until the connection
/// fails; batches that arrive while it is not up are answered `Retry` at once.
async fn drive<D: Destination>(
    mut dest: D,
    mut rx: tokio::sync::mpsc::Receiver<Command>,
    notify: Notify,
) {
    let mut backoff = BACKOFF.0;
    let mut down_since: Option<tokio::time::Instant> = None;
    let mut last_state: Option<bool> = None;
    loop {
        let connected = tokio::time::timeout(DELIVER_TIMEOUT, dest.connect())
            .await
            .unwrap_or_else(|_| Err(SinkError::Down("connect timed out".into())));
        let pause = match connected {
            Ok(detail) => {
                backoff = BACKOFF.0;
                last_state = Some(true);
                notify(SinkEvent::Up {
                    detail: detail.clone(),
                    duplicate_window: dest.duplicate_window(),
                });
                // Serve until the connection fails or the loop hangs up.
                loop {
                    let Some(Command::Deliver(batch)) = rx.recv().await else {
                        return;
                    };
                    let answer = tokio::time::timeout(
                        DELIVER_TIMEOUT,
                        dest.deliver(&batch.results, batch.position),
                    )
                    .await
                    .unwrap_or_else(|_| Err(SinkError::Down("delivery timed out".into())));
                    match answer {
                        Ok(v) => {
                            let retry = v.iter().filter(|v| **v == Verdict::Retry).count();
                            let verdicts = batch.results.iter().map(|r| r.seq).zip(v).collect();
                            notify(SinkEvent::Answered { verdicts });
                            if retry > 0 {
                                // Still connected, but some results did not land: the loop
                                // sends again from the first of them, as after a reconnect.
                                notify(SinkEvent::Down {
                                    reason: format!("{retry} results not acknowledged"),
                                });
                                notify(SinkEvent::Up {
                                    detail: detail.clone(),
                                    duplicate_window: dest.duplicate_window(),
                                });
                            }
                        }
                        Err(e) => {
                            notify(SinkEvent::Answered {
                                verdicts: all_retry(&batch),
                            });
                            report(&notify, &e, &mut last_state, true);
                            break;
                        }
                    }
                }
                down_since = Some(tokio::time::Instant::now());
                BACKOFF.0
            }
            Err(e) => {
                report(&notify, &e, &mut last_state, false);
                let since = *down_since.get_or_insert_with(tokio::time::Instant::now);
                if let Some(ev) = dest.down_for(since.elapsed()) {
                    notify(ev);
                }
                let pause = match e {
                    SinkError::Refused(_) => REFUSED_RETRY,
                    SinkError::Down(_) => backoff,
                };
                backoff = (backoff * 2).min(BACKOFF.1);
                pause
            }
        };
        // Pause, answering what arrives meanwhile: not now.
        let until = tokio::time::Instant::now() + pause;
        loop {
            match tokio::time::timeout_at(until, rx.recv()).await {
                Err(_) => break,
                Ok(None) => return,
                Ok(Some(Command::Deliver(batch))) => notify(SinkEvent::Answered {
                    verdicts: all_retry(&batch),
                }),
            }
        }
    }
}

/// Tell the loop the sink is down or refusing, once per change (a refusal every time: its
/// reason may have changed).
fn report(notify: &Notify, e: &SinkError, last: &mut Option<bool>, was_up: bool) {
    match e {
        SinkError::Down(reason) => {
            if was_up || *last != Some(false) {
                notify(SinkEvent::Down {
                    reason: reason.clone(),
                });
            }
            *last = Some(false);
        }
        SinkError::Refused(reason) => {
            notify(SinkEvent::Refusing {
                reason: reason.clone(),
            });
            *last = None;
        }
    }
}

/// A rustls client configuration from `tls = { ca_file, cert_file, key_file }`, as the MQTT
/// connections read it.
pub(crate) fn tls_client_config(tls: &TlsConfig) -> Result<rustls::ClientConfig, String> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    // An error only says a provider is installed already.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let certs = |what: &str, path: &Path| -> Result<Vec<CertificateDer<'static>>, String> {
        let certs: Vec<_> = CertificateDer::pem_file_iter(path)
            .map_err(|e| format!("{what} {}: {e}", path.display()))?
            .collect::<Result<_, _>>()
            .map_err(|e| format!("{what} {}: {e}", path.display()))?;
        if certs.is_empty() {
            return Err(format!(
                "{what} {}: no PEM certificate in it",
                path.display()
            ));
        }
        Ok(certs)
    };
    let mut roots = rustls::RootCertStore::empty();
    for c in certs("tls.ca_file", &tls.ca_file)? {
        roots
            .add(c)
            .map_err(|e| format!("tls.ca_file {}: {e}", tls.ca_file.display()))?;
    }
    let builder = rustls::ClientConfig::builder().with_root_certificates(roots);
    match (&tls.cert_file, &tls.key_file) {
        (None, None) => Ok(builder.with_no_client_auth()),
        (Some(cert), Some(key)) => {
            let chain = certs("tls.cert_file", cert)?;
            let key = PrivateKeyDer::from_pem_file(key)
                .map_err(|e| format!("tls.key_file {}: {e}", key.display()))?;
            builder
                .with_client_auth_cert(chain, key)
                .map_err(|e| format!("tls.key_file: {e}"))
        }
        _ => Err("tls.cert_file and tls.key_file go together: set both or neither".into()),
    }
}

/// `source`: this box's identity in every row and message ID: 1 to 64 of `A-Z a-z 0-9 _ - .`.
/// No `/`: a message ID is `source/id`, and an ID starts with a pipeline name, so a `/` in
/// the source would let two boxes' IDs meet (`a/b` + `p/1/1` and `a` + `b/p/1/1`).
pub fn check_source(source: &str) -> Result<(), String> {
    let ok = (1..=64).contains(&source.len())
        && source
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "`{}` is not 1 to 64 of A-Z a-z 0-9 _ - . (it goes into every row and message ID)",
            source.escape_debug()
        ))
    }
}

/// A duration as a person reads it: `2m`, `90s`, `250ms`.
pub(crate) fn human(d: Duration) -> String {
    let ms = d.as_millis();
    if ms % 60_000 == 0 && ms > 0 {
        format!("{}m", ms / 60_000)
    } else if ms % 1000 == 0 {
        format!("{}s", ms / 1000)
    } else {
        format!("{ms}ms")
    }
}

/// A secret from a file (`password_file`, `token_file`): its first line.
pub(crate) fn read_secret(key: &str, path: &PathBuf) -> Result<String, String> {
    let text =
        std::fs::read_to_string(path).map_err(|e| format!("{key} {}: {e}", path.display()))?;
    Ok(text.lines().next().unwrap_or("").to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_result_reads_its_key_window_generation_and_version_from_its_json() {
        let out = Output {
            id: "p/k/60000/3".into(),
            topic: "t/k".into(),
            payload: br#"{"count":1,"generation":2,"id":"p/k/60000/3","key":"k","pipeline":"p","value":1,"version":3,"window_end":120000,"window_start":60000}"#.to_vec(),
            retain: false,
            latest_only: true,
        };
        let r = SinkResult::from_output(9, &out).unwrap();
        assert_eq!(
            (
                r.seq,
                r.key.as_str(),
                r.window_start,
                r.generation,
                r.version
            ),
            (9, "k", Some(60000), 2, 3)
        );
        let plain = Output {
            payload: br#"{"count":1,"id":"p/k/1","key":"k","pipeline":"p","version":1}"#.to_vec(),
            ..out.clone()
        };
        let r = SinkResult::from_output(0, &plain).unwrap();
        assert_eq!((r.window_start, r.generation), (None, 1));
        let broken = Output {
            payload: b"{".to_vec(),
            ..out
        };
        assert!(SinkResult::from_output(0, &broken).is_err());
    }
}
