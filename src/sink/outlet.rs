//! A thread sink's cursor (PostgreSQL, JetStream): what goes out next, what an answer
//! settles, and what the sink's state is. No IO: the loop hands it the sink thread's
//! [`SinkEvent`]s and the time, and carries out the [`Effect`]s it returns (the shape of
//! `agent/results/cursor.rs` for the MQTT sinks).
//!
//! **Settled.** One batch is on its way at a time. Its answer holds one [`Verdict`] per
//! result, in sequence order; the settled prefix grows over the leading results that are
//! settled or dead letters, and stops at the first `Retry`: the cursor goes back there and
//! everything from there is sent again. A result after the gap that the destination did
//! take is sent again too, which changes nothing at the destination (newer-version upserts,
//! insert-if-absent, `Nats-Msg-Id`), and keeps the rule the MQTT sinks follow: the settled
//! results are exactly the sequences below [`Outlet::settled_below`], so after a restart
//! everything re-sent is, per key, no older than what is settled.
//!
//! **State.** Connecting (at start), up, down or refusing, each with the time it began,
//! for `status`; the destination's own words (`detail`: tables, the duplicate window).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::{SinkEvent, Verdict};

/// What the sink is doing, and since when.
#[derive(Debug, Clone, PartialEq)]
pub enum State {
    Connecting,
    Up,
    Down { reason: String },
    Refusing { reason: String },
}

/// What the loop does after an event.
#[derive(Debug, Clone, PartialEq)]
pub enum Effect {
    /// Every result below this sequence is settled for this sink (durable with the next
    /// checkpoint; entries every sink has settled may go).
    SettledBelow(u64),
    /// A dead letter for this sink.
    DeadLetter {
        seq: u64,
        reason: &'static str,
        detail: String,
    },
    /// A journal line: its level, event name and message.
    Journal {
        level: log::Level,
        name: &'static str,
        message: String,
    },
}

/// One thread sink's cursor and state.
#[derive(Debug)]
pub struct Outlet {
    state: State,
    since: Instant,
    detail: String,
    /// The next sequence to send.
    cursor: u64,
    settled_below: u64,
    /// The batch on its way: the range of the outbox it covers, `[first, end)`, and the
    /// sequences in it that were sent (those routed to this sink), in order.
    inflight: Option<(u64, u64, Vec<u64>)>,
    pub delivered: u64,
    pub dead_letters: u64,
    pub resent: u64,
}

impl Outlet {
    /// A sink that has settled everything below `settled_below` (its durable position).
    pub fn new(settled_below: u64, now: Instant) -> Outlet {
        Outlet {
            state: State::Connecting,
            since: now,
            detail: String::new(),
            cursor: settled_below,
            settled_below,
            inflight: None,
            delivered: 0,
            dead_letters: 0,
            resent: 0,
        }
    }

    pub fn state(&self) -> &State {
        &self.state
    }

    /// How long the sink has been in its state.
    pub fn state_for(&self, now: Instant) -> Duration {
        now.saturating_duration_since(self.since)
    }

    /// What the destination said at connect (tables; the stream's duplicate window).
    pub fn detail(&self) -> &str {
        &self.detail
    }

    pub fn settled_below(&self) -> u64 {
        self.settled_below
    }

    /// Where the next batch starts, if one may go now (up, and none on its way).
    pub fn next_from(&self) -> Option<u64> {
        (self.state == State::Up && self.inflight.is_none()).then_some(self.cursor)
    }

    /// A batch covering `[first, end)` of the outbox, holding `seqs`, was handed to the sink
    /// thread.
    pub fn sent(&mut self, first: u64, end: u64, seqs: Vec<u64>) {
        debug_assert!(first == self.cursor && end > first);
        self.inflight = Some((first, end, seqs));
        self.cursor = end;
    }

    /// The sink thread refused the batch (its queue full): it was never on its way.
    pub fn not_sent(&mut self) {
        if let Some((first, _, _)) = self.inflight.take() {
            self.cursor = first;
        }
    }

    /// An event of the sink thread.
    pub fn on_event(&mut self, ev: SinkEvent, now: Instant) -> Vec<Effect> {
        let mut out = Vec::new();
        match ev {
            SinkEvent::Up { detail } => {
                let was = std::mem::replace(&mut self.state, State::Up);
                let message = match was {
                    State::Down { .. } | State::Refusing { .. } => format!(
                        "connected after {}: {detail}",
                        super::human(self.state_for(now))
                    ),
                    _ => format!("connected: {detail}"),
                };
                self.since = now;
                self.detail = detail;
                out.push(Effect::Journal {
                    level: log::Level::Info,
                    name: "sink_connected",
                    message,
                });
            }
            SinkEvent::Down { reason } => {
                if !matches!(self.state, State::Down { .. }) {
                    self.since = now;
                }
                out.push(Effect::Journal {
                    level: log::Level::Warn,
                    name: "sink_down",
                    message: format!("down: {reason}; results wait in the outbox"),
                });
                self.state = State::Down { reason };
            }
            SinkEvent::Refusing { reason } => {
                let changed = !matches!(&self.state, State::Refusing { reason: r } if *r == reason);
                if !matches!(self.state, State::Refusing { .. }) {
                    self.since = now;
                }
                if changed {
                    out.push(Effect::Journal {
                        level: log::Level::Error,
                        name: "sink_refusing",
                        message: format!("refusing: {reason}; results wait in the outbox"),
                    });
                }
                self.state = State::Refusing { reason };
            }
            SinkEvent::Warning { name, message } => out.push(Effect::Journal {
                level: log::Level::Warn,
                name,
                message,
            }),
            SinkEvent::Answered { verdicts } => self.answered(verdicts, &mut out),
        }
        out
    }

    fn answered(&mut self, verdicts: Vec<(u64, Verdict)>, out: &mut Vec<Effect>) {
        let Some((first, end, seqs)) = self.inflight.take() else {
            return;
        };
        let mut by_seq: HashMap<u64, Verdict> = verdicts
            .into_iter()
            .filter(|(s, _)| (first..end).contains(s))
            .collect();
        // No retry: the whole range is settled, the entries not routed here with it.
        let mut below = end;
        for (k, &seq) in seqs.iter().enumerate() {
            // A result the answer does not name is not known to have landed.
            match by_seq.remove(&seq).unwrap_or(Verdict::Retry) {
                Verdict::Retry => {
                    below = seq;
                    self.resent += (seqs.len() - k) as u64;
                    break;
                }
                Verdict::Settled => self.delivered += 1,
                Verdict::DeadLetter { reason, detail } => {
                    self.dead_letters += 1;
                    out.push(Effect::DeadLetter {
                        seq,
                        reason,
                        detail,
                    });
                }
            }
        }
        self.cursor = below;
        if below > self.settled_below {
            self.settled_below = below;
            out.push(Effect::SettledBelow(below));
        }
    }
}

/// The sink kinds that run on a thread of their own.
#[derive(Debug, Clone, PartialEq)]
pub enum ThreadSinkConfig {
    Postgres(super::postgres::PostgresConfig),
    JetStream(super::jetstream::JetStreamConfig),
}

impl ThreadSinkConfig {
    pub fn kind(&self) -> &'static str {
        match self {
            ThreadSinkConfig::Postgres(_) => "postgres",
            ThreadSinkConfig::JetStream(_) => "jetstream",
        }
    }
}

/// A thread sink as the loop owns it: the thread that talks to the destination and the
/// cursor that decides what goes to it. The loop routes the thread's events here
/// ([`ThreadSink::on_event`]), hands it the next outbox entries when
/// [`ThreadSink::next_from`] says so ([`ThreadSink::send`]), and carries out the effects.
pub struct ThreadSink {
    pub name: String,
    pub kind: &'static str,
    outlet: Outlet,
    thread: super::SinkThread,
    /// Most results in one batch (one transaction; one burst of publishes).
    pub batch_max: usize,
}

impl ThreadSink {
    /// Start the sink's thread; it connects at once. `pipelines` are the pipelines routed to
    /// it (their tables, for PostgreSQL); `settled_below` its durable position.
    pub fn start(
        name: &str,
        cfg: &ThreadSinkConfig,
        pipelines: &[super::postgres::PipelineTable],
        settled_below: u64,
        batch_max: usize,
        notify: super::Notify,
        now: Instant,
    ) -> Result<ThreadSink, String> {
        let thread = match cfg {
            ThreadSinkConfig::Postgres(c) => {
                let pg = super::postgres::Postgres::new(c.clone(), pipelines)?;
                super::SinkThread::spawn(name, pg, notify)
            }
            ThreadSinkConfig::JetStream(c) => {
                let js = super::jetstream::JetStream::new(c.clone())?;
                super::SinkThread::spawn(name, js, notify)
            }
        }
        .map_err(|e| format!("start the thread of sink `{name}`: {e}"))?;
        Ok(ThreadSink {
            name: name.to_string(),
            kind: cfg.kind(),
            outlet: Outlet::new(settled_below, now),
            thread,
            batch_max: batch_max.max(1),
        })
    }

    pub fn outlet(&self) -> &Outlet {
        &self.outlet
    }

    /// Where the next batch starts, if one may go now.
    pub fn next_from(&self) -> Option<u64> {
        self.outlet.next_from()
    }

    /// Hand the thread the next results (from [`ThreadSink::next_from`] on, in sequence
    /// order, at most `batch_max`), with `end` the sequence after the last one looked at (the
    /// batch settles the entries between that are not routed here too). A result body that
    /// does not say its key and version is a bug upstream: an error.
    pub fn send(
        &mut self,
        batch: &[(u64, crate::model::Output)],
        end: u64,
    ) -> Result<Vec<Effect>, String> {
        let Some(first) = self.outlet.next_from() else {
            return Ok(Vec::new());
        };
        if end <= first {
            return Ok(Vec::new());
        }
        let results = batch
            .iter()
            .map(|(seq, out)| super::SinkResult::from_output(*seq, out))
            .collect::<Result<Vec<_>, _>>()?;
        self.outlet
            .sent(first, end, results.iter().map(|r| r.seq).collect());
        let mut effects = Vec::new();
        if results.is_empty() {
            // Nothing in the range for this sink: settled at once.
            self.outlet.answered(Vec::new(), &mut effects);
            return Ok(effects);
        }
        let b = super::Batch {
            position: end,
            results,
        };
        if self.thread.try_deliver(b).is_err() {
            self.outlet.not_sent();
        }
        Ok(effects)
    }

    pub fn on_event(&mut self, ev: SinkEvent, now: Instant) -> Vec<Effect> {
        self.outlet.on_event(ev, now)
    }

    pub fn shutdown(&mut self) {
        self.thread.shutdown();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn up(o: &mut Outlet, t: Instant) {
        o.on_event(
            SinkEvent::Up {
                detail: "stream R (R3), duplicate window 2m".into(),
            },
            t,
        );
    }

    #[test]
    fn a_batch_settles_its_prefix_up_to_the_first_retry_and_the_cursor_goes_back_there() {
        let t = Instant::now();
        let mut o = Outlet::new(10, t);
        assert_eq!(o.next_from(), None, "not before it is up");
        up(&mut o, t);
        assert_eq!(o.next_from(), Some(10));
        o.sent(10, 15, (10..15).collect());
        assert_eq!(o.next_from(), None, "one batch at a time");
        let dead = Verdict::DeadLetter {
            reason: "postgres_rejected",
            detail: "NUL".into(),
        };
        let fx = o.on_event(
            SinkEvent::Answered {
                verdicts: vec![
                    (10, Verdict::Settled),
                    (11, dead),
                    (12, Verdict::Retry),
                    (13, Verdict::Settled),
                    (14, Verdict::Retry),
                ],
            },
            t,
        );
        assert_eq!(
            fx,
            vec![
                Effect::DeadLetter {
                    seq: 11,
                    reason: "postgres_rejected",
                    detail: "NUL".into()
                },
                Effect::SettledBelow(12)
            ]
        );
        assert_eq!(o.next_from(), Some(12), "13 goes again with 12");
        assert_eq!((o.delivered, o.dead_letters, o.resent), (1, 1, 3));
        o.sent(12, 15, (12..15).collect());
        o.on_event(
            SinkEvent::Answered {
                verdicts: (12..15).map(|s| (s, Verdict::Settled)).collect(),
            },
            t,
        );
        assert_eq!(o.settled_below(), 15);
    }

    #[test]
    fn down_and_refusing_hold_the_cursor_and_say_so_once_with_their_start() {
        let t = Instant::now();
        let mut o = Outlet::new(0, t);
        up(&mut o, t);
        o.sent(0, 4, (0..4).collect());
        let fx = o.on_event(
            SinkEvent::Answered {
                verdicts: (0..4).map(|s| (s, Verdict::Retry)).collect(),
            },
            t,
        );
        assert!(fx.is_empty(), "{fx:?}");
        let t1 = t + Duration::from_secs(5);
        o.on_event(
            SinkEvent::Down {
                reason: "connection closed".into(),
            },
            t1,
        );
        assert_eq!(o.next_from(), None);
        let r = SinkEvent::Refusing {
            reason: "table does not fit".into(),
        };
        assert_eq!(o.on_event(r.clone(), t1).len(), 1);
        assert!(
            o.on_event(r, t1 + Duration::from_secs(10)).is_empty(),
            "said once"
        );
        assert_eq!(
            o.state_for(t1 + Duration::from_secs(10)),
            Duration::from_secs(10)
        );
        let fx = o.on_event(
            SinkEvent::Up {
                detail: "tables".into(),
            },
            t1 + Duration::from_secs(60),
        );
        assert!(
            matches!(&fx[0], Effect::Journal { name: "sink_connected", message, .. } if message.starts_with("connected after 1m")),
            "{fx:?}"
        );
        assert_eq!(o.next_from(), Some(0), "everything goes again");
    }

    #[test]
    fn an_answer_that_names_other_sequences_settles_nothing_it_should_not() {
        let t = Instant::now();
        let mut o = Outlet::new(0, t);
        up(&mut o, t);
        // Outbox entries 0..6, of which 0, 2 and 5 are routed here.
        o.sent(0, 6, vec![0, 2, 5]);
        o.on_event(
            SinkEvent::Answered {
                verdicts: vec![
                    (0, Verdict::Settled),
                    (2, Verdict::Settled),
                    (7, Verdict::Settled),
                ],
            },
            t,
        );
        assert_eq!(
            (o.settled_below(), o.next_from()),
            (5, Some(5)),
            "5 was not answered: it goes again, and 3 and 4 are not this sink's"
        );
        o.sent(5, 9, vec![5]);
        o.on_event(
            SinkEvent::Answered {
                verdicts: vec![(5, Verdict::Settled)],
            },
            t,
        );
        assert_eq!(
            o.settled_below(),
            9,
            "the range is settled past its last result"
        );
        o.sent(9, 12, vec![]);
        o.on_event(SinkEvent::Answered { verdicts: vec![] }, t);
        assert_eq!(o.settled_below(), 12, "a range with nothing for this sink");
        // An answer with no batch on its way (after a restart of the thread) is ignored.
        assert!(
            o.on_event(
                SinkEvent::Answered {
                    verdicts: vec![(1, Verdict::Settled)]
                },
                t
            )
            .is_empty()
        );
    }
}
