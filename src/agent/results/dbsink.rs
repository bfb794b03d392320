//! The sinks whose client runs on a thread of its own (issue 30): PostgreSQL and JetStream
//! (`src/sink/`). To the results room each is an MQTT sink like the others: the same
//! [`super::cursor::Cursor`] over the one outbox, the same settled prefix, the same durable
//! position. Only its connection differs ([`ThreadConn`]): what the cursor sends is gathered
//! into one batch per `send` and handed to the sink's thread, and the thread's answers come
//! back on the loop's event channel as this sink's events:
//!
//! | the sink thread says | the loop gets |
//! |---|---|
//! | up (connected, tables or stream checked) | `Connected`, and a journal line with what it found (`sink_destination`: the tables; the stream's duplicate window) |
//! | down, or some results of a batch not acknowledged | `Disconnected` (no publish named: no strikes): the cursor goes back to the settled prefix and sends again once `Connected` |
//! | refusing (a table that does not fit, a missing stream, credentials refused) | `Disconnected`, and an error line (`sink_destination_refusing`) with the reason |
//! | settled | `PubAcked` for that result |
//! | refused as data | `SinkRejected`: a dead letter for this sink (`Results::set_aside`) |
//! | a warning (the duplicate window outlasted) | a journal line of that name |
//!
//! The thread never blocks the loop: batches go over a bounded channel without waiting, and
//! the thread waits (not the loop) when the event channel is full.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::TrySendError;
use std::sync::{Arc, Mutex};

use crate::mqtt::{Event, MqttError, Sink as EventTx};
use crate::sink::postgres::PipelineTable;
use crate::sink::{Batch, SinkEvent, SinkResult, SinkThread, Verdict};

/// A thread sink's connection as the MQTT sink code drives it.
pub(crate) struct ThreadConn {
    thread: SinkThread,
    /// Results handed to the thread (or gathered for it) and not answered yet.
    inflight: Arc<AtomicUsize>,
    /// Gathered by `publish`, handed over by `flush`.
    pending: Mutex<Vec<SinkResult>>,
    /// The output ID of each sequence on its way, and in how many batches: an answer names
    /// sequences, and after a reconnect a result can be in a batch sent again while the
    /// old one still waits in the thread's queue (to be answered `Retry`).
    ids: Ids,
    /// The destination's duplicate window (JetStream), as it said at its last connect.
    window: Arc<Mutex<Option<std::time::Duration>>>,
}

type Ids = Arc<Mutex<HashMap<u64, (String, usize)>>>;

impl ThreadConn {
    /// Start sink `name`'s thread (its client connects at once), reporting on `tx`.
    pub(crate) fn start(
        name: &str,
        kind: &crate::config::SinkKind,
        pipelines: Vec<PipelineTable>,
        tx: EventTx,
    ) -> Result<ThreadConn, String> {
        use crate::config::SinkKind;
        let inflight = Arc::new(AtomicUsize::new(0));
        let ids: Ids = Arc::default();
        let window: Arc<Mutex<Option<std::time::Duration>>> = Arc::default();
        let notify = notifier(
            name.to_string(),
            tx,
            inflight.clone(),
            ids.clone(),
            window.clone(),
        );
        let thread = match kind {
            SinkKind::Postgres(c) => {
                let pg = crate::sink::postgres::Postgres::new(c.clone(), &pipelines)?;
                SinkThread::spawn(name, pg, notify)
            }
            SinkKind::JetStream(c) => {
                let js = crate::sink::jetstream::JetStream::new(c.clone())?;
                SinkThread::spawn(name, js, notify)
            }
            SinkKind::Mqtt(_) => return Err(format!("sink `{name}` is an MQTT sink")),
        }
        .map_err(|e| format!("start sink `{name}`'s thread: {e}"))?;
        Ok(ThreadConn {
            thread,
            inflight,
            pending: Mutex::new(Vec::new()),
            ids,
            window,
        })
    }

    /// The destination's duplicate window, once known (`status`, `/metrics`).
    pub(crate) fn duplicate_window(&self) -> Option<std::time::Duration> {
        *self.window.lock().expect("window")
    }

    /// Results sent and not answered: the cursor's window counts them.
    pub(crate) fn inflight(&self) -> usize {
        self.inflight.load(Ordering::SeqCst)
    }

    /// Gather one result for the next batch.
    pub(crate) fn publish(
        &self,
        seq: u64,
        id: String,
        topic: &str,
        payload: Vec<u8>,
    ) -> Result<(), MqttError> {
        // The engine wrote the body: one without key and version is a bug, said loudly.
        let r =
            SinkResult::from_parts(seq, id.clone(), topic, payload).map_err(MqttError::Config)?;
        self.ids
            .lock()
            .expect("ids")
            .entry(seq)
            .or_insert((id, 0))
            .1 += 1;
        self.pending.lock().expect("pending").push(r);
        self.inflight.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }

    /// Hand what was gathered to the thread, as one batch. If its queue is full the batch
    /// waits here for the next call (the cursor counts it as on its way either way).
    pub(crate) fn flush(&self) {
        let mut pending = self.pending.lock().expect("pending");
        if pending.is_empty() {
            return;
        }
        let results = std::mem::take(&mut *pending);
        let position = results.last().map_or(0, |r| r.seq.saturating_add(1));
        if let Err(back) = self.thread.try_deliver(Batch { position, results }) {
            *pending = back.results;
        }
    }

    pub(crate) fn shutdown(&mut self) {
        self.thread.shutdown();
    }
}

/// The thread's reports turned into this sink's events on the loop's channel.
fn notifier(
    name: String,
    tx: EventTx,
    inflight: Arc<AtomicUsize>,
    ids: Ids,
    window: Arc<Mutex<Option<std::time::Duration>>>,
) -> crate::sink::Notify {
    let tx = Mutex::new(tx);
    let send = move |ev: Event| {
        let tx = tx.lock().expect("sink events");
        let mut ev = ev;
        // The thread waits for room, never the loop.
        loop {
            match tx.try_send(ev) {
                Ok(()) => return,
                Err(TrySendError::Full(back)) => {
                    ev = back;
                    std::thread::sleep(std::time::Duration::from_millis(2));
                }
                Err(TrySendError::Disconnected(_)) => return,
            }
        }
    };
    Arc::new(move |ev: SinkEvent| {
        let sink = name.as_str();
        match ev {
            SinkEvent::Up {
                detail,
                duplicate_window,
            } => {
                *window.lock().expect("window") = duplicate_window;
                crate::event!(info, "sink_destination", sink = sink;
                    "sink `{sink}`: {detail}");
                send(Event::Connected {
                    session_present: false,
                });
            }
            SinkEvent::Down { reason } => {
                inflight.store(0, Ordering::SeqCst);
                send(Event::Disconnected {
                    reason,
                    unacked: Vec::new(),
                    up_for: None,
                });
            }
            SinkEvent::Refusing { reason } => {
                inflight.store(0, Ordering::SeqCst);
                crate::event!(error, "sink_destination_refusing", sink = sink;
                    "sink `{sink}` refuses: {reason}; results wait in the outbox, and it is \
                     checked again every 10 s");
                send(Event::Disconnected {
                    reason: format!("refusing: {reason}"),
                    unacked: Vec::new(),
                    up_for: None,
                });
            }
            SinkEvent::Answered { verdicts } => {
                let _ = inflight.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                    Some(n.saturating_sub(verdicts.len()))
                });
                for (seq, v) in verdicts {
                    let output_id = {
                        let mut ids = ids.lock().expect("ids");
                        let Some((id, n)) = ids.get_mut(&seq) else {
                            continue;
                        };
                        *n -= 1;
                        let id = id.clone();
                        if *n == 0 {
                            ids.remove(&seq);
                        }
                        id
                    };
                    match v {
                        Verdict::Settled => send(Event::PubAcked { output_id }),
                        Verdict::DeadLetter { reason, detail } => send(Event::SinkRejected {
                            output_id,
                            reason,
                            detail,
                        }),
                        // Sent again after the `Disconnected` that follows.
                        Verdict::Retry => {}
                    }
                }
            }
            SinkEvent::Warning {
                name: event,
                message,
            } => match event {
                "jetstream_outage_outlasted_duplicate_window" => {
                    crate::event!(warn, "jetstream_outage_outlasted_duplicate_window", sink = sink;
                        "sink `{sink}`: {message}");
                }
                _ => crate::event!(warn, "sink_warning", sink = sink; "sink `{sink}`: {message}"),
            },
        }
    })
}
