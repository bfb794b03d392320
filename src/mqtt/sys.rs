//! The broker's own count of the messages it dropped, read from its `$SYS` tree (issue 26).
//!
//! A stock mosquitto queues at most 1,000 messages per client (`max_queued_messages`) and
//! drops the rest while still acknowledging them to their senders: measured, 44,972 of a
//! 60,000-message burst reached the log and nothing in Cairn showed the loss. The broker
//! counts those drops, in `$SYS/broker/publish/messages/dropped`: the input connection
//! subscribes to it and hands every value to the caller as an [`Event::BrokerDrops`].
//!
//! How mosquitto 2.0.11 publishes it (`src/sys_tree.c`): every `sys_interval` seconds
//! (default 10; 0 turns `$SYS` off), *only when the value changed* since its last publish,
//! as a retained message at QoS 2 with a message expiry of 60 s, the first time at start-up
//! (so "0" on a fresh broker). A new subscription therefore gets the current total at once
//! if it changed within the last minute, and nothing otherwise until the next change; a
//! value is the broker's total since it started (it starts again from 0 when the broker
//! restarts). `$SYS/broker/version` is retained without expiry, published once at start-up
//! when `$SYS` is on: it arrives at once on every subscription and says the tree is there.
//!
//! So, on every connection (not only when the broker lost our session: a QoS 0 value
//! published while we were away is not queued for us, and a new subscription is how to get
//! the retained one), the worker subscribes to both topics at QoS 0 (nothing to
//! acknowledge, nothing queued for us while offline), in a SUBSCRIBE of their own. The
//! watch reports:
//! - [`BrokerDrops::Total`] for every value of the dropped count;
//! - [`BrokerDrops::Available`] for the first `$SYS` message of a connection;
//! - [`BrokerDrops::Unavailable`] when the broker refuses either subscription (an ACL
//!   plugin may), or when no `$SYS` message came within [`WAIT`] of the SUBSCRIBE: `$SYS`
//!   off, a broker that is not mosquitto, or an `acl_file` without read access to
//!   `$SYS/broker/#` (mosquitto 2.0.11's file ACL grants every SUBSCRIBE and withholds the
//!   messages at delivery, `security_default.c`: a silence, not a refusal).
//!
//! Never an input: these messages never become [`Event::Message`]. Only a QoS 0 delivery on
//! one of the two topics is taken here. Pipelines subscribe at QoS 1, and mosquitto 2.0
//! sends one copy per matching subscription, so a pipeline that does read `$SYS/#` still
//! gets its own QoS 1 copy as an input.
//!
//! [`Event::BrokerDrops`]: super::Event::BrokerDrops
//! [`Event::Message`]: super::Event::Message

use std::time::{Duration, Instant};

/// The broker's total of dropped messages (mosquitto).
pub const DROPPED_TOPIC: &str = "$SYS/broker/publish/messages/dropped";
/// Retained without expiry by mosquitto whenever `$SYS` is on: the tree is there.
pub const VERSION_TOPIC: &str = "$SYS/broker/version";
/// How long after subscribing the first `$SYS` message may take before the count is called
/// unavailable. The retained version arrives right after the SUBACK, one round trip.
pub const WAIT: Duration = Duration::from_secs(10);

/// Longest payload read as a count (`u64::MAX` has 20 digits); longer is not a count.
const MAX_COUNT_LEN: usize = 32;

/// What the input connection learnt about the broker's count of dropped messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BrokerDrops {
    /// `$SYS/broker/publish/messages/dropped`: messages the broker dropped since it
    /// started, instead of queueing or delivering them (to any client, not only to us).
    /// Lower than the last value: the broker restarted.
    Total(u64),
    /// The broker publishes `$SYS` on this connection (its version, shown as it sent it),
    /// and this came before any count: if no [`BrokerDrops::Total`] follows at once, the
    /// count has been unchanged for over a minute (its retained value expired) and the
    /// next change comes as one. A `Total` says available as well.
    Available { version: String },
    /// The count cannot be watched on this connection; why, and what to check.
    Unavailable { reason: String },
}

/// Turns the broker's totals into increases, for a journal line per increase.
#[derive(Debug, Default, Clone)]
pub struct DropTally {
    last: Option<u64>,
}

impl DropTally {
    /// Messages dropped since the last total seen: `None` for the first total (drops from
    /// before we watched, or not ours to judge) and for a total that did not rise. A lower
    /// total means the broker restarted: the increase is then the whole new total.
    pub fn increase(&mut self, total: u64) -> Option<u64> {
        let increase = match self.last {
            None => 0,
            Some(last) if total < last => total,
            Some(last) => total - last,
        };
        let first = self.last.is_none();
        self.last = Some(total);
        (!first && increase > 0).then_some(increase)
    }
}

/// The watch for one connection after another: a pure rule, no IO; the worker feeds it.
#[derive(Debug, Default)]
pub(crate) struct SysWatch {
    /// The connection it is watching (the worker's epoch); 0 while down.
    epoch: u64,
    /// When to call the count unavailable if no `$SYS` message came by then.
    deadline: Option<Instant>,
    /// A `$SYS` message came on this connection.
    seen: bool,
    /// `Unavailable` was reported for this connection.
    given_up: bool,
}

impl SysWatch {
    /// The filters to subscribe to, at QoS 0.
    pub(crate) fn filters() -> [&'static str; 2] {
        [DROPPED_TOPIC, VERSION_TOPIC]
    }

    /// Subscribed on connection `epoch` at `now`: `$SYS` is expected by `now + WAIT`.
    pub(crate) fn subscribed(&mut self, epoch: u64, now: Instant) {
        *self = SysWatch {
            epoch,
            deadline: now.checked_add(WAIT),
            ..SysWatch::default()
        };
    }

    /// The connection is gone: nothing is expected until the next subscription.
    pub(crate) fn down(&mut self) {
        *self = SysWatch::default();
    }

    /// The broker answered the SUBSCRIBE; `refused` names a filter it refused.
    pub(crate) fn suback(&mut self, refused: Option<&str>) -> Option<BrokerDrops> {
        let filter = refused?;
        self.deadline = None;
        self.given_up = true;
        Some(BrokerDrops::Unavailable {
            reason: format!(
                "the broker refused the subscription to {filter} (check its ACL: the agent's \
                 user needs read access to $SYS/broker/#)"
            ),
        })
    }

    /// Whether a delivery is ours (a QoS 0 copy on one of our topics) rather than an input.
    pub(crate) fn takes(topic: &str, qos0: bool) -> bool {
        qos0 && (topic == DROPPED_TOPIC || topic == VERSION_TOPIC)
    }

    /// A message [`Self::takes`] accepted. Returns what to report, in order.
    pub(crate) fn on_message(&mut self, topic: &str, payload: &[u8]) -> Vec<BrokerDrops> {
        let mut out = Vec::new();
        let first = !self.seen;
        self.seen = true;
        self.deadline = None;
        if topic == DROPPED_TOPIC {
            match parse_count(payload) {
                Some(total) => {
                    self.given_up = false;
                    out.push(BrokerDrops::Total(total));
                }
                None => {
                    self.given_up = true;
                    out.push(BrokerDrops::Unavailable {
                        reason: format!(
                            "the broker's {DROPPED_TOPIC} is not a count: \"{}\"",
                            crate::text::Shown(&String::from_utf8_lossy(
                                &payload[..payload.len().min(MAX_COUNT_LEN)]
                            ))
                        ),
                    });
                }
            }
        } else if first {
            self.given_up = false;
            let version = String::from_utf8_lossy(&payload[..payload.len().min(128)]);
            out.push(BrokerDrops::Available {
                version: crate::text::Shown(&version).to_string(),
            });
        }
        out
    }

    /// When to call [`Self::tick`], if anything is awaited.
    pub(crate) fn deadline(&self) -> Option<Instant> {
        self.deadline
    }

    /// Time has passed on connection `epoch`: `Unavailable` once its deadline is past with
    /// no `$SYS` message.
    pub(crate) fn tick(&mut self, epoch: u64, now: Instant) -> Option<BrokerDrops> {
        let deadline = self.deadline?;
        if epoch != self.epoch || now < deadline || self.seen || self.given_up {
            return None;
        }
        self.deadline = None;
        self.given_up = true;
        Some(BrokerDrops::Unavailable {
            reason: format!(
                "no $SYS message within {WAIT:?} of subscribing to {DROPPED_TOPIC}: the broker \
                 does not publish $SYS (mosquitto: sys_interval 0), its ACL hides it, or it is \
                 not mosquitto"
            ),
        })
    }
}

/// A decimal count as mosquitto writes it (`%lu`), surrounding whitespace allowed.
fn parse_count(payload: &[u8]) -> Option<u64> {
    if payload.len() > MAX_COUNT_LEN {
        return None;
    }
    std::str::from_utf8(payload).ok()?.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_count_is_reported_and_the_version_says_available_once_per_connection() {
        let t0 = Instant::now();
        let mut w = SysWatch::default();
        w.subscribed(1, t0);
        assert_eq!(w.suback(None), None);
        assert_eq!(
            w.on_message(VERSION_TOPIC, b"mosquitto version 2.0.11"),
            [BrokerDrops::Available {
                version: "mosquitto version 2.0.11".into()
            }]
        );
        assert_eq!(
            w.on_message(DROPPED_TOPIC, b"2000"),
            [BrokerDrops::Total(2000)]
        );
        assert_eq!(w.on_message(VERSION_TOPIC, b"again"), []);
        assert_eq!(w.tick(1, t0 + WAIT * 2), None, "it came: no deadline");
        // A new connection: the retained version again, and the count if it is retained.
        w.down();
        w.subscribed(2, t0);
        assert_eq!(
            w.on_message(DROPPED_TOPIC, b" 2001\n"),
            [BrokerDrops::Total(2001)]
        );
        assert_eq!(
            w.on_message(VERSION_TOPIC, b"v").len(),
            0,
            "not the first message"
        );
    }

    #[test]
    fn silence_past_the_wait_or_a_refused_subscription_is_unavailable_once() {
        let t0 = Instant::now();
        let mut w = SysWatch::default();
        w.subscribed(3, t0);
        assert_eq!(w.tick(3, t0 + WAIT / 2), None);
        assert_eq!(w.tick(2, t0 + WAIT), None, "another connection's timer");
        assert!(matches!(
            w.tick(3, t0 + WAIT),
            Some(BrokerDrops::Unavailable { .. })
        ));
        assert_eq!(w.tick(3, t0 + WAIT * 3), None, "once");
        // A late message makes it available again.
        assert_eq!(w.on_message(DROPPED_TOPIC, b"5"), [BrokerDrops::Total(5)]);

        w.subscribed(4, t0);
        let Some(BrokerDrops::Unavailable { reason }) = w.suback(Some(DROPPED_TOPIC)) else {
            panic!("a refusal is unavailable");
        };
        assert!(reason.contains("ACL"), "{reason}");
        assert_eq!(w.tick(4, t0 + WAIT), None, "once");
        w.down();
        assert_eq!(w.tick(4, t0 + WAIT), None, "nothing expected while down");
    }

    #[test]
    fn a_payload_that_is_not_a_count_is_reported_escaped_and_never_panics() {
        let mut w = SysWatch::default();
        w.subscribed(1, Instant::now());
        for bad in [
            &b""[..],
            b"-1",
            b"18446744073709551616",
            b"12abc",
            b"\xff\xfe",
            b"1\n\x1b[2J",
            &[b'9'; 4096],
        ] {
            let out = w.on_message(DROPPED_TOPIC, bad);
            let [BrokerDrops::Unavailable { reason }] = out.as_slice() else {
                panic!("{bad:?} gave {out:?}");
            };
            assert!(
                !reason.contains('\n') && !reason.contains('\x1b'),
                "{reason}"
            );
            assert!(reason.len() < 300, "bounded: {}", reason.len());
        }
        assert_eq!(
            w.on_message(DROPPED_TOPIC, b"18446744073709551615"),
            [BrokerDrops::Total(u64::MAX)]
        );
    }

    #[test]
    fn only_a_qos0_copy_on_our_two_topics_is_taken_from_the_inputs() {
        assert!(SysWatch::takes(DROPPED_TOPIC, true));
        assert!(SysWatch::takes(VERSION_TOPIC, true));
        assert!(
            !SysWatch::takes(DROPPED_TOPIC, false),
            "a pipeline's QoS 1 copy"
        );
        assert!(!SysWatch::takes("$SYS/broker/uptime", true));
        assert!(!SysWatch::takes("sensors/1", true));
    }

    #[test]
    fn the_tally_reports_increases_after_the_first_total_and_survives_a_broker_restart() {
        let mut t = DropTally::default();
        assert_eq!(t.increase(500), None, "the first total is the baseline");
        assert_eq!(t.increase(500), None);
        assert_eq!(t.increase(2500), Some(2000));
        assert_eq!(
            t.increase(30),
            Some(30),
            "restarted broker: counts from 0 again"
        );
        assert_eq!(t.increase(u64::MAX), Some(u64::MAX - 30));
    }
}
