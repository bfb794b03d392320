//! MQTT: the only module that imports rumqttc. A small, blocking-friendly facade for the
//! single-threaded agent loop: received messages and publish acknowledgements come out of one
//! bounded queue, [`Events`]; [`Mqtt::ack`] and [`Mqtt::publish`] never block.
//!
//! Two protocols: the input connection, and the 3.1.1 result connections, are [`Mqtt`]
//! (this file and `worker.rs`); an MQTT 5 result connection is [`Mqtt5`] (`v5/`), whose
//! PUBACK can refuse ([`Event::PubRefused`]). [`Link`] is either, for a result connection
//! chosen by [`Protocol`] ([`Mqtt::start_with_link`]). Files: `binding.rs` (packet ids to
//! output IDs, both protocols), `backoff.rs` (reconnects, both), `events.rs` (the queue),
//! `options.rs` (settings, credentials, TLS), `sys.rs` (the broker's count of dropped
//! messages).
//!
//! # Guarantees
//!
//! - **No message is acknowledged behind the caller's back.** Manual acks: a PUBACK goes out
//!   only for a token passed to [`Mqtt::ack`], in call order (the caller acks in receipt order,
//!   after its fsync, invariant 1).
//! - **A stale ack is dropped, never sent.** An ack for a message received on an earlier
//!   connection, or queued while disconnected, is dropped; the broker redelivers that message
//!   with DUP=1 (persistent session) and the agent dedups it by event ID (invariant 5). Sending
//!   it could acknowledge a different message that reused the packet id.
//! - **Every [`Mqtt::publish`] ends in exactly one [`Event::PubAcked`]** while the process lives
//!   and the module runs, with the caller's `output_id`: packet ids are bound in publish order
//!   and retransmissions do not consume the binding FIFO (see `binding.rs`). If the broker lost
//!   our session, the unacknowledged publishes are re-sent here, in order; a restart loses them
//!   all, which is why the outbox re-sends everything it still holds.
//! - **The broker's own losses are visible.** The connection that subscribes to inputs also
//!   watches mosquitto's count of the messages it dropped (`$SYS`, `sys.rs`) and reports
//!   every value, or why it cannot, as [`Event::BrokerDrops`]; those messages are never
//!   inputs.
//! - **Nothing blocks forever and nothing spins.** [`Mqtt::publish`] refuses when
//!   `publish_inflight` publishes are unacknowledged ([`MqttError::InflightFull`]); the agent
//!   waits for a `PubAcked`. Reconnects use bounded, jittered exponential backoff, which
//!   starts again from its minimum only after a connection stayed up for [`STABLE_AFTER`]
//!   (`backoff.rs`): a broker that drops us right after each CONNACK is retried ever more
//!   slowly, not 13 times a second.
//!
//! # Mechanism
//!
//! One std thread runs a tokio current-thread runtime with two tasks: the rumqttc event loop
//! (polled only there: polling and publishing from one task deadlocks, DESIGN §4), and a pump
//! that moves the caller's queued publishes and acks into rumqttc's request channel with
//! `try_*` calls. The caller never touches rumqttc: it edits a small mutex-guarded queue and
//! wakes the pump. Because both tasks share one thread, nothing reaches rumqttc's request
//! channel between a connection error (when rumqttc drains that channel into its
//! retransmission queue) and the moment we mark the connection down; this is what makes the
//! packet-id binding exact across reconnects.
//!
//! Cost per event (issue 16): the event loop hands the caller all the events of one read
//! burst under one lock, and a waiting caller wakes only for as many as it asked for
//! ([`Want`], `events.rs`), not once per event; the caller's
//! acks and publishes wake the pump only when its queue was empty, and rumqttc's own
//! outgoing window is one larger than `publish_inflight` (`options::rumqttc_inflight`): at
//! rumqttc's limit it stops taking *any* request, so our PUBACKs, stuck behind a full window
//! of our own publishes, piled up while the broker kept sending. Neither acks nor publishes
//! queue behind rumqttc's one-request-per-turn (each flushed on its own: one write per result
//! was the largest single cost per event): the event-loop task writes them to the socket
//! itself between two turns, all queued ones with one flush, publishes through rumqttc's own
//! state so that packet ids, retransmission and binding are what they would have been; the
//! pump puts at most one ack and one publish in the request channel, as doorbells that end an
//! idle turn (`worker::pump_once`, `Worker::write_publishes`).
//!
//! Deadlock freedom: the caller only does non-blocking queue operations; the pump only uses
//! `try_*` and retries after the next event-loop event (every request rumqttc takes produces
//! one); the event loop waits on the caller only when the event queue is full, and then
//! sleeps in 1 ms steps, checking for shutdown. The request channel is sized to
//! `max(channel_capacity, publish_inflight + ingest_batch + 16)`, so in steady state neither
//! publishes nor acks wait for room.

mod backoff;
mod binding;
mod events;
mod options;
mod sys;
mod v5;
mod worker;

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::TrySendError;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use rumqttc::AsyncClient;

use crate::config::MqttConfig;
pub use backoff::STABLE_AFTER;
use binding::Publishes;
pub use events::{Events, Want};
pub use sys::{BrokerDrops, DropTally, WAIT as SYS_WAIT};
pub use v5::Mqtt5;

/// Step while the caller's event channel is full ([`Sink::hand_over`]).
const EVENT_FULL_WAIT: Duration = Duration::from_millis(1);

/// Room in rumqttc's request channel beyond one full publish window and one ingest batch of
/// acks (subscribe, disconnect, a few retries).
const REQUEST_CHANNEL_MARGIN: usize = 16;

/// Errors of this module. Connection problems are not errors: they are
/// [`Event::Disconnected`] events and the module keeps reconnecting.
#[derive(Debug, thiserror::Error)]
pub enum MqttError {
    /// A setting cannot work (empty client id, password without user name, ...).
    #[error("MQTT configuration: {0}")]
    Config(String),
    /// A file named in the configuration cannot be read.
    #[error("cannot read MQTT {what} file {}: {source}", path.display())]
    File {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    /// A TLS file was read but is not usable.
    #[error("MQTT TLS {what} file {}: {problem}", path.display())]
    Tls {
        what: &'static str,
        path: PathBuf,
        problem: String,
    },
    /// A subscription filter is not a valid MQTT topic filter.
    #[error("invalid MQTT topic filter {0:?}")]
    InvalidFilter(String),
    /// A publish topic is empty, has wildcards or a NUL, or is too long.
    #[error("invalid MQTT publish topic {0:?}")]
    InvalidTopic(String),
    /// `publish_inflight` publishes await their PUBACK: wait for [`Event::PubAcked`].
    #[error("{limit} publishes are already awaiting their PUBACK")]
    InflightFull { limit: usize },
    /// More acks are queued than the request channel holds: the caller is acking far ahead
    /// of the connection. Retry after the next event.
    #[error("{limit} acks are already queued")]
    AckQueueFull { limit: usize },
    /// The MQTT thread has stopped (the event receiver was dropped).
    #[error("the MQTT thread has stopped")]
    Stopped,
    /// The runtime or thread could not be created.
    #[error("cannot start the MQTT thread: {0}")]
    Start(std::io::Error),
}

/// Identifies one received message for [`Mqtt::ack`]. Opaque, neither `Clone` nor `Copy`:
/// a message is acked once.
#[derive(Debug)]
pub struct AckToken {
    /// The connection the message came on; acks for another connection are dropped.
    epoch: u64,
    pkid: u16,
    qos: u8,
}

impl AckToken {
    /// The connection and the packet id under which the broker holds this message until it
    /// is acknowledged: `None` for QoS 0 (the broker holds nothing) and for a message that
    /// came on an earlier connection (its ack is dropped; the broker sends it again).
    pub fn held_as(&self) -> Option<(u64, u16)> {
        (self.qos > 0 && self.epoch != 0).then_some((self.epoch, self.pkid))
    }
}

/// A message received from the broker.
#[derive(Debug)]
pub struct Incoming {
    pub topic: String,
    pub payload: Vec<u8>,
    pub qos: u8,
    pub retain: bool,
    /// Redelivery after a reconnect: may already be in the log; dedup by event ID, never by
    /// this flag or the packet id.
    pub dup: bool,
    pub token: AckToken,
}

#[derive(Debug)]
pub enum Event {
    /// A CONNACK was accepted. `session_present == false` means the broker kept nothing:
    /// subscriptions were (re)made, and our unacknowledged publishes are being re-sent.
    Connected {
        session_present: bool,
    },
    /// The connection is down, or the first attempt failed. Once per state change, not per
    /// retry; the reason of the latest failure is also logged.
    ///
    /// What the layer above needs to find a publish the broker refuses by dropping the
    /// connection (mosquitto does, for a topic it takes as malformed: issue 27): the broker
    /// handles our publishes in order and drops us at the one it refuses, so that one is the
    /// oldest of `unacked`, on a connection that was up only briefly (`up_for` well under
    /// [`STABLE_AFTER`]: the refusal comes one round trip after the CONNACK, when the
    /// unacknowledged publishes are re-sent). The same output ID at the front of `unacked` of
    /// several such drops in a row, and no other cause, is the sign. The connection itself
    /// keeps re-sending it, with the backoff growing to `reconnect_max` (and, MQTT 5 re-sending
    /// in order, holding back everything after it), until the caller gives it up with
    /// [`Mqtt::abandon`] (or [`Link::abandon`]): nothing here gives up on a publish by itself.
    Disconnected {
        reason: String,
        /// Output IDs of our publishes written on the connection that ended (or re-sent on
        /// it) and not acknowledged, oldest first. Empty when no connection was up (a failed
        /// connect attempt), and when we dropped it on purpose (`Mqtt::reconnect`): then it
        /// was not the broker's doing. They are still ours: each is re-sent on the next
        /// connection and still ends in one outcome event.
        unacked: Vec<String>,
        /// How long the connection that ended was up; `None` when none was.
        up_for: Option<Duration>,
    },
    Message(Incoming),
    /// The broker acknowledged the publish with this output ID (MQTT 5: with a reason code
    /// of 0x00 success or 0x10 no matching subscribers).
    PubAcked {
        output_id: String,
    },
    /// A sink that is not an MQTT connection (issue 30: PostgreSQL, JetStream) refused this
    /// result as data (`reason` a dead-letter reason, e.g. `postgres_rejected`): a dead
    /// letter for that sink, settled there.
    SinkRejected {
        output_id: String,
        reason: &'static str,
        detail: String,
    },
    /// MQTT 5 only ([`Mqtt5`]): the broker refused the publish with this output ID, its
    /// PUBACK carrying a reason code of 0x80 or more (0x87 not authorized: an ACL), or its
    /// CONNACK ruled it out so that it was not sent (0x9A retain not supported, 0x9B QoS not
    /// supported). Not delivered and not settled: the result stays the caller's, to re-send
    /// with backoff (the connection has forgotten it) or to set aside.
    PubRefused {
        output_id: String,
        /// The MQTT 5 reason code.
        code: u8,
        /// Its name in the MQTT 5 specification, for a journal line.
        reason: &'static str,
    },
    /// MQTT 5 only ([`Mqtt5`]): the result with this output ID makes a PUBLISH of `size`
    /// bytes, over the broker's Maximum Packet Size `max` (from its CONNACK). Never sent
    /// (sent, the broker would close the connection, and the re-send on the next one would
    /// loop): answered at once and forgotten. A dead letter for this destination; it cannot
    /// succeed while the broker keeps that maximum.
    TooLarge {
        output_id: String,
        size: usize,
        max: u32,
    },
    /// The input connection's watch of the broker's own count of dropped messages (`sys.rs`):
    /// every value of mosquitto's `$SYS/broker/publish/messages/dropped`, or why it cannot be
    /// watched. Only on a connection that subscribes to inputs; never an input itself.
    BrokerDrops(BrokerDrops),
    /// An event of the uplink connection of [`Mqtt::start_all`] (never itself an
    /// `Uplink`): both connections feed one channel, so the caller waits on one receiver and
    /// neither connection's events wait behind the other's.
    Uplink(Box<Event>),
    /// An event of `[[sink]]` number `n`'s client ([`Mqtt::start_all`]; never itself a
    /// `Sink` or an `Uplink`).
    Sink(u16, Box<Event>),
}

/// Where a connection's thread hands its events: the caller's channel, each event wrapped
/// in [`Event::Uplink`] for the uplink connection.
#[derive(Clone)]
pub(crate) struct Sink {
    tx: events::Sender,
    uplink: bool,
    /// A `[[sink]]` connection: its events wrapped in [`Event::Sink`] with this index.
    tag: Option<u16>,
}

impl Sink {
    fn wrap(&self, event: Event) -> Event {
        if let Some(n) = self.tag {
            Event::Sink(n, Box::new(event))
        } else if self.uplink {
            Event::Uplink(Box::new(event))
        } else {
            event
        }
    }

    /// A hand-over for sink `n`'s client on the same channel as this one: its events come
    /// as [`Event::Sink`]`(n, ..)`. For sink kinds whose client is not an MQTT connection
    /// (issue 30): they report each entry's outcome as `PubAcked`, `PubRefused` or
    /// `TooLarge`, and their link as `Connected` and `Disconnected`.
    pub(crate) fn for_sink(&self, n: u16) -> Sink {
        Sink {
            tx: self.tx.clone(),
            uplink: false,
            tag: Some(n),
        }
    }

    /// Queue one event; a refused one comes back unwrapped.
    pub(crate) fn try_send(&self, event: Event) -> Result<(), TrySendError<Event>> {
        let unwrap = |e: Event| match e {
            Event::Uplink(inner) | Event::Sink(_, inner) => *inner,
            other => other,
        };
        let uplink = self.uplink || self.tag.is_some();
        self.tx.try_send(self.wrap(event)).map_err(|e| match e {
            TrySendError::Full(e) if uplink => TrySendError::Full(unwrap(e)),
            TrySendError::Disconnected(e) if uplink => TrySendError::Disconnected(unwrap(e)),
            e => e,
        })
    }

    /// Queue as many of `batch` as fit, in order, under one lock; `Err` when the caller's
    /// receiver is gone.
    pub(crate) fn send_some(&self, batch: &mut VecDeque<Event>) -> Result<(), ()> {
        self.tx.send_some(batch, |e| self.wrap(e))
    }

    /// Queue one event from a task other than the connection's event loop, waiting while
    /// the caller's queue is full; `Err` when the caller's receiver is gone.
    pub(crate) async fn deliver(&self, mut event: Event) -> Result<(), ()> {
        loop {
            match self.try_send(event) {
                Ok(()) => return Ok(()),
                Err(TrySendError::Disconnected(_)) => return Err(()),
                Err(TrySendError::Full(back)) => {
                    event = back;
                    tokio::time::sleep(EVENT_FULL_WAIT).await;
                }
            }
        }
    }

    /// Hands `batch` to the caller in order, under one lock as far as there is room, waiting
    /// while its queue is full: that is the backpressure, the connection's thread stops
    /// reading from the broker meanwhile. Gives up when `stop` is set (the rest goes with
    /// the caller's queue) and sets it when the caller's receiver is gone. Leaves `batch`
    /// empty.
    pub(crate) async fn hand_over(&self, batch: &mut VecDeque<Event>, stop: &AtomicBool) {
        while !batch.is_empty() {
            if self.send_some(batch).is_err() {
                log::debug!("event receiver dropped: stopping the connection's thread");
                stop.store(true, Ordering::SeqCst);
                break;
            }
            if batch.is_empty() || stop.load(Ordering::SeqCst) {
                break;
            }
            tokio::time::sleep(EVENT_FULL_WAIT).await;
        }
        batch.clear();
    }
}

/// State shared between the caller and the MQTT thread.
struct Inner {
    queues: Mutex<Queues>,
    /// Wakes the pump task (new publish or ack).
    wake: tokio::sync::Notify,
    /// Wakes the event-loop task to look at `stop`.
    stop_wake: tokio::sync::Notify,
    stop: AtomicBool,
    /// Give back the thread's allocation cache ([`Mqtt::rest`]).
    rest: AtomicBool,
    /// Drop the connection and connect again (keeping the session), once the queued acks
    /// are written: see [`Mqtt::reconnect`].
    reconnect: AtomicBool,
    /// Wakes the event-loop task to look at `reconnect`.
    reconnect_wake: tokio::sync::Notify,
}

struct Queues {
    pubs: Publishes,
    /// Output IDs given up by the caller ([`Mqtt::abandon`]) that rumqttc may still hold:
    /// taken out of it when the connection is next down.
    abandoned: Vec<String>,
    acks: VecDeque<AckToken>,
    /// Epoch of the live connection, `None` while down.
    live: Option<u64>,
    /// Acks in rumqttc's request channel, not yet written (at most one: see
    /// `worker::pump_once`).
    channel_acks: usize,
    /// How acks have been leaving, for the stall watch (`worker::watch_acks`).
    ack_watch: worker::AckWatch,
    /// The thread has ended.
    stopped: bool,
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, Queues> {
        // A panic while holding this lock is a bug in this module; the queues are still
        // structurally sound, so keep going rather than poison every later call.
        self.queues.lock().unwrap_or_else(|e| e.into_inner())
    }
}

pub struct Mqtt {
    inner: Arc<Inner>,
    thread: Option<JoinHandle<()>>,
    publish_limit: usize,
    ack_limit: usize,
}

impl Mqtt {
    /// Validates the configuration, reads the password and TLS files, and starts the MQTT
    /// thread, which connects (and reconnects) in the background. `publish_inflight` bounds
    /// our unacknowledged publishes (rumqttc's inflight window and [`Mqtt::publish`]'s limit).
    pub fn start(
        cfg: &MqttConfig,
        subscriptions: Vec<String>,
        publish_inflight: u16,
    ) -> Result<(Mqtt, Events), MqttError> {
        let (events_tx, events_rx) = events::queue(cfg.channel_capacity);
        let sink = Sink {
            tx: events_tx,
            uplink: false,
            tag: None,
        };
        let mqtt = Mqtt::start_on(cfg, subscriptions, publish_inflight, sink)?;
        Ok((mqtt, events_rx))
    }

    /// As [`Mqtt::start`], plus a publish-only result connection speaking `protocol`: the
    /// input connection, the result connection ([`Link`]) and the one event channel, the
    /// result connection's events wrapped in [`Event::Uplink`]. An MQTT 5 link adds
    /// [`Event::PubRefused`] and [`Event::TooLarge`] to the outcomes.
    pub fn start_with_link(
        cfg: &MqttConfig,
        subscriptions: Vec<String>,
        link: &MqttConfig,
        protocol: Protocol,
        publish_inflight: u16,
    ) -> Result<(Mqtt, Link, Events), MqttError> {
        let (events_tx, events_rx) = events::queue(cfg.channel_capacity);
        let up = Sink {
            tx: events_tx.clone(),
            uplink: true,
            tag: None,
        };
        let up = match protocol {
            Protocol::V311 => Link::V311(Mqtt::start_on(link, Vec::new(), publish_inflight, up)?),
            Protocol::V5 => Link::V5(Mqtt5::start_on(link, publish_inflight, up)?),
        };
        let sink = Sink {
            tx: events_tx,
            uplink: false,
            tag: None,
        };
        let input = Mqtt::start_on(cfg, subscriptions, publish_inflight, sink)?;
        Ok((input, up, events_rx))
    }

    /// The input connection, the uplink if given, and one result connection per
    /// `sinks` entry (`Event::Sink(i, ..)` for the `i`th), all on one event channel; also
    /// a hand-over other sink clients can report through ([`Sink::for_sink`]).
    #[allow(clippy::type_complexity)]
    pub(crate) fn start_all(
        cfg: &MqttConfig,
        subscriptions: Vec<String>,
        uplink: Option<&MqttConfig>,
        sinks: &[Option<(&MqttConfig, Protocol)>],
        publish_inflight: u16,
    ) -> Result<(Mqtt, Option<Mqtt>, Vec<Option<Link>>, Events, Sink), MqttError> {
        let (events_tx, events_rx) = events::queue(cfg.channel_capacity);
        let base = Sink {
            tx: events_tx,
            uplink: false,
            tag: None,
        };
        let up = match uplink {
            Some(u) => {
                let tx = Sink {
                    uplink: true,
                    ..base.clone()
                };
                Some(Mqtt::start_on(u, Vec::new(), publish_inflight, tx)?)
            }
            None => None,
        };
        let mut links = Vec::with_capacity(sinks.len());
        for (i, s) in sinks.iter().enumerate() {
            let Some((link, protocol)) = s else {
                links.push(None);
                continue;
            };
            let tx = base.for_sink(u16::try_from(i).unwrap_or(u16::MAX));
            links.push(Some(match protocol {
                Protocol::V311 => {
                    Link::V311(Mqtt::start_on(link, Vec::new(), publish_inflight, tx)?)
                }
                Protocol::V5 => Link::V5(Mqtt5::start_on(link, publish_inflight, tx)?),
            }));
        }
        let input = Mqtt::start_on(cfg, subscriptions, publish_inflight, base.clone())?;
        Ok((input, up, links, events_rx, base))
    }

    fn start_on(
        cfg: &MqttConfig,
        subscriptions: Vec<String>,
        publish_inflight: u16,
        events: Sink,
    ) -> Result<Mqtt, MqttError> {
        for filter in &subscriptions {
            if !rumqttc::valid_filter(filter) || filter.contains('\0') {
                return Err(MqttError::InvalidFilter(filter.clone()));
            }
        }
        let opts = options::build(cfg, publish_inflight)?;
        let request_capacity = cfg
            .channel_capacity
            .max(publish_inflight as usize + cfg.ingest_batch + REQUEST_CHANNEL_MARGIN);
        let (client, eventloop) = AsyncClient::new(opts, request_capacity);

        let inner = Arc::new(Inner {
            queues: Mutex::new(Queues {
                pubs: Publishes::default(),
                abandoned: Vec::new(),
                acks: VecDeque::new(),
                live: None,
                channel_acks: 0,
                ack_watch: worker::AckWatch::default(),
                stopped: false,
            }),
            wake: tokio::sync::Notify::new(),
            stop_wake: tokio::sync::Notify::new(),
            stop: AtomicBool::new(false),
            rest: AtomicBool::new(false),
            reconnect: AtomicBool::new(false),
            reconnect_wake: tokio::sync::Notify::new(),
        });
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .enable_time()
            .build()
            .map_err(MqttError::Start)?;
        let name = if events.uplink { "uplink" } else { "mqtt" };
        // The connection that reads inputs also watches the broker's drops of them.
        let watch_sys = !subscriptions.is_empty();
        let worker = worker::Worker::new(
            cfg,
            eventloop,
            client,
            inner.clone(),
            events,
            subscriptions,
            watch_sys,
        );
        let thread = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                // Every event passes through this thread (`crate::alloc`).
                crate::alloc::cache_this_thread(true);
                runtime.block_on(worker.run())
            })
            .map_err(MqttError::Start)?;

        Ok(Mqtt {
            inner,
            thread: Some(thread),
            publish_limit: publish_inflight as usize,
            ack_limit: request_capacity,
        })
    }

    /// Queues the PUBACK for a received message. Call in receipt order. Returns at once; the
    /// ack is dropped if the connection it belongs to is gone (the broker redelivers).
    pub fn ack(&self, token: AckToken) -> Result<(), MqttError> {
        if token.qos == 0 {
            return Ok(()); // QoS 0 has nothing to acknowledge
        }
        let mut q = self.inner.lock();
        if q.stopped {
            return Err(MqttError::Stopped);
        }
        if q.acks.len() >= self.ack_limit {
            return Err(MqttError::AckQueueFull {
                limit: self.ack_limit,
            });
        }
        // One wake per burst: a non-empty queue means the pump has a wake-up pending, or it
        // left these for lack of room and retries after the next event-loop event anyway.
        let wake = q.acks.is_empty();
        q.acks.push_back(token);
        drop(q);
        if wake {
            self.inner.wake.notify_one();
        }
        Ok(())
    }

    /// How many more acks [`Mqtt::ack`] takes now without [`MqttError::AckQueueFull`].
    pub fn ack_room(&self) -> usize {
        self.ack_limit.saturating_sub(self.inner.lock().acks.len())
    }

    /// Queues a QoS 1 publish; its [`Event::PubAcked`] carries `output_id`. Returns at once:
    /// [`MqttError::InflightFull`] when `publish_inflight` publishes await their PUBACK.
    /// Publishes go out in call order, also across a lost session.
    pub fn publish(
        &self,
        output_id: String,
        topic: &str,
        payload: Vec<u8>,
        retain: bool,
    ) -> Result<(), MqttError> {
        let mut q = self.inner.lock();
        admit_publish(topic, q.stopped, q.pubs.len(), self.publish_limit)?;
        let wake = q.pubs.next_to_hand().is_none(); // as in `ack`
        q.pubs.accept(output_id, topic.to_owned(), payload, retain);
        drop(q);
        if wake {
            self.inner.wake.notify_one();
        }
        Ok(())
    }

    /// Gives up a publish for good: the caller has set it aside (a dead letter for this
    /// destination, say a publish the broker keeps refusing by dropping the connection: see
    /// [`Event::Disconnected`]). Queued, it goes at once; handed to rumqttc (written, or
    /// waiting in its queue for the next connection), it goes the next time the connection
    /// is down, before the next connect attempt, so it is never sent again. No outcome
    /// event follows for it, except a PUBACK already on its way: the caller ignores an
    /// output ID it no longer holds. [`Mqtt::inflight`] drops by one once it is gone.
    pub fn abandon(&self, output_id: &str) {
        let q = &mut *self.inner.lock();
        give_up(&mut q.pubs, &mut q.abandoned, output_id);
    }

    /// Once the acks queued so far are written, drop the connection and connect again at
    /// once, keeping the session: the broker then re-sends every message we have not
    /// acknowledged (MQTT 3.1.1 re-sends only on a new connection). For inputs the agent let
    /// go under backpressure. A no-op while disconnected: the next connection does it anyway.
    pub(crate) fn reconnect(&self) {
        self.inner.reconnect.store(true, Ordering::SeqCst);
        self.inner.reconnect_wake.notify_one();
    }

    /// The caller is idle: the MQTT thread gives back the memory its allocation cache holds
    /// (`crate::alloc`), soon, between two events.
    pub fn rest(&self) {
        self.inner.rest.store(true, Ordering::SeqCst);
        self.inner.wake.notify_one();
    }

    /// Our publishes not yet acknowledged (queued, on the wire, or being re-sent after a lost
    /// session). A lost session does not lower it: those publishes are re-sent and each still
    /// ends in one `PubAcked`.
    pub fn inflight(&self) -> usize {
        self.inner.lock().pubs.len()
    }

    /// Sends DISCONNECT if connected (after the acks already queued), waits up to a second for
    /// it to go out, and joins the thread. Unacknowledged publishes are abandoned: the outbox
    /// still has them.
    pub fn shutdown(self) {
        drop(self);
    }
}

impl Drop for Mqtt {
    fn drop(&mut self) {
        self.inner.stop.store(true, Ordering::SeqCst);
        self.inner.stop_wake.notify_one();
        self.inner.wake.notify_one();
        if let Some(thread) = self.thread.take()
            && thread.join().is_err()
        {
            crate::event!(error, "mqtt_thread_panicked"; "the MQTT thread panicked");
        }
    }
}

/// Which MQTT a result connection speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// MQTT 3.1.1: a PUBACK cannot refuse (a broker's ACL acknowledges and drops).
    V311,
    /// MQTT 5: a PUBACK carries a reason code ([`Event::PubRefused`]).
    V5,
}

/// A publish-only result connection of either protocol, with the one API the agent uses
/// for its uplink. Its events come as [`Event::Uplink`].
pub enum Link {
    V311(Mqtt),
    V5(Mqtt5),
}

impl Link {
    /// [`Mqtt::publish`] or [`Mqtt5::publish`].
    pub fn publish(
        &self,
        output_id: String,
        topic: &str,
        payload: Vec<u8>,
        retain: bool,
    ) -> Result<(), MqttError> {
        match self {
            Link::V311(m) => m.publish(output_id, topic, payload, retain),
            Link::V5(m) => m.publish(output_id, topic, payload, retain),
        }
    }

    /// Publishes without an outcome yet.
    pub fn inflight(&self) -> usize {
        match self {
            Link::V311(m) => m.inflight(),
            Link::V5(m) => m.inflight(),
        }
    }

    /// The caller is idle: give back the thread's allocation cache.
    pub fn rest(&self) {
        match self {
            Link::V311(m) => m.rest(),
            Link::V5(m) => m.rest(),
        }
    }

    /// [`Mqtt::abandon`] or [`Mqtt5::abandon`].
    pub fn abandon(&self, output_id: &str) {
        match self {
            Link::V311(m) => m.abandon(output_id),
            Link::V5(m) => m.abandon(output_id),
        }
    }

    /// Acknowledge a message that came on the link anyway (a 3.1.1 session kept from a
    /// config that subscribed on it). An MQTT 5 link never hands one out.
    pub fn ack(&self, token: AckToken) -> Result<(), MqttError> {
        match self {
            Link::V311(m) => m.ack(token),
            Link::V5(_) => Ok(()),
        }
    }

    pub fn protocol(&self) -> Protocol {
        match self {
            Link::V311(_) => Protocol::V311,
            Link::V5(_) => Protocol::V5,
        }
    }

    /// Disconnects and joins the connection's thread.
    pub fn shutdown(self) {
        match self {
            Link::V311(m) => m.shutdown(),
            Link::V5(m) => m.shutdown(),
        }
    }
}

/// Whether a connection takes one more publish, the same for both protocols: a topic we may
/// publish to (not empty, no wildcards, no NUL, at most 65,535 bytes), its thread still
/// running, and fewer than `limit` publishes `waiting` for their outcome.
fn admit_publish(
    topic: &str,
    stopped: bool,
    waiting: usize,
    limit: usize,
) -> Result<(), MqttError> {
    let valid =
        !topic.is_empty() && topic.len() <= u16::MAX as usize && !topic.contains(['+', '#', '\0']);
    if !valid {
        return Err(MqttError::InvalidTopic(topic.to_owned()));
    }
    if stopped {
        return Err(MqttError::Stopped);
    }
    if waiting >= limit {
        return Err(MqttError::InflightFull { limit });
    }
    Ok(())
}

/// Waits out the delay before a worker's next connect attempt, or until shutdown wakes it
/// (both workers, after [`backoff::Reconnects::poll_failed`]).
async fn wait_or_stop(delay: Duration, stop_wake: &tokio::sync::Notify) {
    tokio::select! {
        _ = tokio::time::sleep(delay) => {}
        _ = stop_wake.notified() => {}
    }
}

/// Gives up a publish, the same for both protocols: only queued, it goes at once; else it
/// is noted (once) in `abandoned`, for the worker to take out of rumqttc.
fn give_up(pubs: &mut Publishes, abandoned: &mut Vec<String>, output_id: &str) {
    if !pubs.remove_queued(output_id) && !abandoned.iter().any(|id| id == output_id) {
        abandoned.push(output_id.to_owned());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_publish_is_refused_for_its_topic_then_a_stopped_thread_then_a_full_window() {
        let long = "a".repeat(usize::from(u16::MAX) + 1);
        for bad in ["", "a/+", "a/#", "a\0b", long.as_str()] {
            let refused = admit_publish(bad, true, 9, 1);
            assert!(
                matches!(refused, Err(MqttError::InvalidTopic(_))),
                "{refused:?}"
            );
        }
        let refused = admit_publish("a/b", true, 9, 1);
        assert!(matches!(refused, Err(MqttError::Stopped)), "{refused:?}");
        let refused = admit_publish("a/b", false, 2, 2);
        assert!(
            matches!(refused, Err(MqttError::InflightFull { limit: 2 })),
            "{refused:?}"
        );
        assert!(admit_publish("a/b", false, 1, 2).is_ok());
        assert!(
            admit_publish(&long[1..], false, 0, 1).is_ok(),
            "65,535 bytes"
        );
    }
}
